"""A lab's install cell, as a student on Colab runs it, against a site laid out like the built book.

The book's build writes vramlab's wheel at `_static/wheels/` (book/_ext/vramlab_live.py); each
released lab's first cell installs `vramlab[labs]` from there first, then from the package index,
then stops with one message. Here: the wheel built as the book build builds it, a directory laid out
like the built site and a package index, both served on localhost (http.server in a thread), and the
released notebook's own install cell run in a fresh virtual environment pointed at that site by
VRAMLAB_SITE. The package index (PIP_INDEX_URL) holds stand-ins for the labs' dependencies (torch,
transformers, ...: empty wheels at the lowest version pyproject.toml allows), so pip resolves the
extras exactly as on Colab without downloading torch; nothing beyond localhost is reached (the
repository fallback is refused by GIT_ALLOW_PROTOCOL=file)."""

from __future__ import annotations

import base64
import functools
import hashlib
import http.server
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # notebooks, processes, a browser or a book build

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tools = _load("labtools_install", ROOT / "labs" / "tools.py")
live = _load("vramlab_live_install", ROOT / "book" / "_ext" / "vramlab_live.py")
VERSION = tools.project()["version"]
LAB = "lab07_checkpointing"  # any released lab: they share the cell (test_every_lab_has_the_cell)


def install_cell(lab: str) -> str:
    nb = json.loads((ROOT / "labs" / "release" / lab / f"{lab}.ipynb").read_text())
    cells = ["".join(c["source"]) if isinstance(c["source"], list) else c["source"]
             for c in nb["cells"] if c["cell_type"] == "code"]
    (cell,) = [c for c in cells if tools.BEGIN in c]
    # the cell's install part, as it runs first in the cell (what follows imports torch and vramlab)
    return cell[:cell.index(tools.END) + len(tools.END)] + "\n"


def _record(files: dict[str, bytes]) -> bytes:
    lines = [f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},{len(d)}"
             for p, d in files.items()]
    return ("\n".join(lines) + "\n").encode()


def stand_in_wheel(folder: Path, name: str, version: str) -> Path:
    """An empty package `name` at `version`: what the index serves instead of torch and co."""
    dist = re.sub(r"[-_.]+", "_", name).lower()
    info = f"{dist}-{version}.dist-info"
    files = {f"{dist}/__init__.py": f"__version__ = {version!r}\n".encode(),
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: vramlab-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, d in files.items():
            z.writestr(p, d)
        z.writestr(f"{info}/RECORD", _record(files) + f"{info}/RECORD,,\n".encode())
    return path


def dependencies(wheel: Path) -> dict[str, str]:
    """{name: lowest version allowed} of every Requires-Dist of the wheel but vramlab's own extras."""
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(f"vramlab-{VERSION}.dist-info/METADATA").decode()
    deps = {}
    for line in re.findall(r"^Requires-Dist: (.+)$", meta, re.M):
        m = re.match(r"([A-Za-z0-9_.-]+)\s*(?:\[[^]]*\])?\s*(?:\(?\s*(?:>=|==|~=)\s*([0-9][^,;)\s]*))?", line)
        if m and m.group(1).lower() != "vramlab":
            deps[m.group(1).lower()] = deps.get(m.group(1).lower()) or m.group(2) or "1.0"
    return deps


def serve_index(index: Path, wheels: list[Path]) -> None:
    """A PEP 503 simple index at `index`: one page per project, linking its wheels."""
    by_name: dict[str, list[Path]] = {}
    for w in wheels:
        by_name.setdefault(re.sub(r"[-_.]+", "-", w.name.split("-")[0]).lower(), []).append(w)
    for name, files in by_name.items():
        (index / name).mkdir(parents=True, exist_ok=True)
        links = "".join(f'<a href="{w.name}">{w.name}</a>\n' for w in files)
        for w in files:
            (index / name / w.name).write_bytes(w.read_bytes())
        (index / name / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")


class _Quiet(http.server.SimpleHTTPRequestHandler):
    requests: list[str] = []

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        _Quiet.requests.append(self.path)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """{'url': the server, 'site': the built-site folder, ...}: the wheel as the book build writes it
    under site/, stand-ins for the dependencies under index/ (and vramlab's wheel under full-index/)."""
    root = tmp_path_factory.mktemp("served")
    site = root / "site"
    wheel = live.publish_wheel(site)  # builds it, as the book's build-finished hook does
    assert wheel == site / tools.WHEEL_PATH.format(name="vramlab", version=VERSION)
    stand_ins = [stand_in_wheel(root, n, v) for n, v in dependencies(wheel).items()]
    serve_index(root / "index", stand_ins)
    serve_index(root / "full-index", [*stand_ins, wheel])
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield {"url": f"http://127.0.0.1:{server.server_address[1]}", "site": site, "wheel": wheel,
           "deps": dependencies(wheel)}
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A fresh virtual environment with pip and nothing else (the checkout is not on its path)."""
    path = tmp_path_factory.mktemp("venv") / "v"
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=300)
    return path / "bin" / "python"


def _env(index: str, site: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PIP_") and k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, "PIP_INDEX_URL": index, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_CACHE_DIR": "1",
            "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_RETRIES": "0", "VRAMLAB_SITE": site,
            "GIT_ALLOW_PROTOCOL": "file", "GIT_TERMINAL_PROMPT": "0"}


def _fresh(py: Path, env: dict, deps) -> None:
    """Nothing of a previous test's install: vramlab and the stand-ins uninstalled."""
    subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", "vramlab", *deps], env=env, capture_output=True,
                   timeout=300)


def _installed(py: Path, env: dict, cwd: Path) -> dict:
    code = ("import importlib.metadata as m, json, vramlab; print(json.dumps({'version': vramlab.__version__, "
            "'file': vramlab.__file__, 'dists': {d.metadata['Name'].lower(): d.version for d in m.distributions()}}))")
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, env=env, cwd=cwd, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_every_lab_has_the_cell_and_the_book_writes_the_wheel_where_it_looks():
    for lab in tools.labs():
        assert install_cell(lab).strip().endswith(tools.install_block()), lab
    site = tools.project()["urls"]["Documentation"].rstrip("/")
    assert f'"VRAMLAB_SITE", "{site}"' in tools.install_block()
    assert tools.WHEEL_PATH.format(name="vramlab", version=VERSION) == f"{live.WHEELS}/{live.wheel_name(VERSION)}"


def test_install_cell_installs_the_books_wheel_and_the_extras_from_the_index(served, venv, tmp_path):
    env = _env(f"{served['url']}/index/", f"{served['url']}/site/")
    _fresh(venv, env, served["deps"])
    _Quiet.requests.clear()
    r = subprocess.run([str(venv), "-c", install_cell(LAB)], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stdout.count("installing") == 1, r.stdout  # the first way worked: the book's wheel
    assert f"/site/{tools.WHEEL_PATH.format(name='vramlab', version=VERSION)}" in _Quiet.requests
    got = _installed(venv, env, tmp_path)
    assert got["version"] == VERSION and got["file"].startswith(str(venv.parents[1])), got
    assert got["dists"]["vramlab"] == VERSION
    # the labs' dependencies came from the package index, through the extras [labs] -> [torch]
    for name in ("torch", "transformers", "peft", "matplotlib", "ipywidgets"):
        assert name in served["deps"] and got["dists"].get(name) == served["deps"][name], (name, got["dists"])
    # the cell again: vramlab is there, so it installs nothing
    r = subprocess.run([str(venv), "-c", install_cell(LAB)], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=120)
    assert r.returncode == 0 and "installing" not in r.stdout, r.stdout + r.stderr


def test_without_the_books_wheel_the_package_index_and_then_one_message(served, venv, tmp_path):
    missing = f"{served['url']}/nowhere"  # a site without the wheel (404)
    env = _env(f"{served['url']}/full-index/", missing)
    _fresh(venv, env, served["deps"])
    r = subprocess.run([str(venv), "-c", install_cell(LAB)], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stdout.count("installing") == 2 and f"vramlab[labs]=={VERSION}" in r.stdout, r.stdout
    assert _installed(venv, env, tmp_path)["version"] == VERSION

    env = _env(f"{served['url']}/index/", missing)  # neither has it (and the repository is refused)
    _fresh(venv, env, served["deps"])
    r = subprocess.run([str(venv), "-c", install_cell(LAB)], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=300)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"Could not install vramlab {VERSION} from {missing}, the package index"), last
    assert f"pip install 'vramlab[labs]=={VERSION}'" in last and live.wheel_name(VERSION) in last
    assert "Traceback" not in r.stderr
