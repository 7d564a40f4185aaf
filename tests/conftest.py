import contextlib
import fcntl
import hashlib
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# Files whose tests share an expensive module- or session-scoped fixture (a built book, a built wheel, a
# virtual environment, live gloo runs): under pytest-xdist (`-n 2 --dist loadgroup`, the README's command) each
# such group runs on one worker, so the fixture is made once; every other test goes to whichever worker is free.
GROUPS = {"test_book.py": "book", "test_browser.py": "book", "test_package.py": "package",
          "test_lab_install.py": "lab_install", "test_expert_parallel.py": "expert_parallel"}


# The files whose tests each take a minute or more (notebooks run end to end, graded submissions): run first, so
# that two workers end together rather than one waiting for the other's last long test.
LONG_FIRST = ("test_labs.py", "test_grading_attacks.py")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        group = GROUPS.get(item.path.name) if item.path.parent == ROOT / "tests" else None
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: item.path.name not in LONG_FIRST)  # stable: the order within each part is kept


@contextlib.contextmanager
def _checkout_lock(shared: bool = False):
    """One reader-writer lock per checkout, across the test processes (pytest-xdist's workers). Writers hold it
    alone: the tests that write into the checkout's labs/ or src/ (a wheel built from it rewrites
    src/vramlab.egg-info; a stray lab folder; a probe file). Readers share it: the tests that grade (without a
    sandbox the grader fingerprints labs/, src/ and the packages and voids the grading when a file changes under
    it; in the sandbox a stray folder in labs/release would still be read)."""
    lock = Path(tempfile.gettempdir()) / f"vramlab-checkout-{hashlib.sha256(str(ROOT).encode()).hexdigest()[:16]}.lock"
    with open(lock, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def checkout_lock():
    """`with checkout_lock():` -- see _checkout_lock. Not for the files in GRADING (their tests hold it already)."""
    return _checkout_lock


# The files whose tests grade: each of their tests holds the checkout lock for as long as it runs, alone when it is
# marked `writes_checkout`, shared otherwise. (A test holds one lock, never two: taking the lock alone while
# holding it shared would wait for itself.)
GRADING = ("test_labs.py", "test_grading_attacks.py")


@pytest.fixture(autouse=True)
def _checkout_access(request):
    if request.node.path.name not in GRADING:
        yield
        return
    with _checkout_lock(shared=request.node.get_closest_marker("writes_checkout") is None):
        yield


@pytest.fixture(autouse=True)
def _quiet():
    # transformers and MemTracker warn about things that do not matter to memory tests
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture
def assert_pure_python():
    """Runs `code` in a fresh interpreter and fails if it loaded torch, numpy, matplotlib or ipywidgets
    (calculators and pure modules must run in the browser, under Pyodide)."""
    def check(code: str) -> None:
        probe = (f"{code}\nimport sys; bad = [m for m in ('torch', 'matplotlib', 'ipywidgets', 'numpy') "
                 "if m in sys.modules]; assert not bad, bad")
        r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    return check


@pytest.fixture(scope="session")
def built_book(tmp_path_factory):
    """The book, built strict and offline once per test session: (html folder, build log)."""
    out = tmp_path_factory.mktemp("book")
    subprocess.run([sys.executable, str(ROOT / "book" / "fetch_vendor.py")], check=True, cwd=ROOT)
    jb = shutil.which("jupyter-book", path=str(Path(sys.executable).parent)) or "jupyter-book"
    r = subprocess.run([jb, "build", ".", "-W", "--keep-going", "--path-output", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=1200)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-5000:]
    return out / "_build" / "html", log
