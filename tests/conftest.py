import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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
