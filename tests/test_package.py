"""vramlab as students get it: a wheel and sdist with full metadata, installed into a fresh virtual
environment (CPU torch from the package index, no checkout on the path), runs a released student
notebook end to end; the labs' install cell is derived from pyproject.toml and fails with one clear
message when it cannot install."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # notebooks, processes, a browser or a book build

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("tools", ROOT / "labs" / "tools.py")
tools = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tools)
# what the fresh environment gets besides the wheel: the CPU torch and what a Jupyter kernel needs
CLEAN = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
STACK = ["torch==2.13.0", "transformers==5.23.0", "nbclient==0.11.0", "nbformat==5.11.1", "ipykernel==7.4.0",
         "matplotlib==3.11.2"]


@pytest.fixture(scope="module")
def dist(tmp_path_factory, checkout_lock) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    with checkout_lock():  # building from the checkout rewrites src/vramlab.egg-info
        subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(out)], cwd=ROOT, check=True)
        code = f"from setuptools import build_meta as b; print(b.build_sdist({str(out)!r}))"
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True)
    return {"wheel": next(out.glob("*.whl")), "sdist": next(out.glob("*.tar.gz"))}


def test_wheel_and_sdist_metadata(dist):
    p = tools.project()
    with zipfile.ZipFile(dist["wheel"]) as z:
        meta = z.read(f"vramlab-{p['version']}.dist-info/METADATA").decode()
        names = z.namelist()
    assert f"Version: {p['version']}" in meta and "License-Expression: MIT" in meta
    for label, url in p["urls"].items():
        assert f"Project-URL: {label}, {url}" in meta
    assert "Provides-Extra: torch" in meta and "Provides-Extra: labs" in meta
    assert "vramlab/presets/gpt2.json" in names and "vramlab/present/calculators.py" in names
    assert "vramlab/measure/zero.py" in names and "vramlab/grading/__init__.py" in names
    assert any(n.endswith("licenses/LICENSE") for n in names)
    with tarfile.open(dist["sdist"]) as t:
        sdist = t.getnames()
    assert any(n.endswith("/LICENSE") for n in sdist) and any(n.endswith("presets/gpt2.json") for n in sdist)


def test_install_cell_and_config_derive_from_pyproject():
    p = tools.project()
    block = tools.install_block()
    assert f'"vramlab[labs]=={p["version"]}"' in block and f'git+{p["urls"]["Repository"]}@v{p["version"]}' in block
    assert tools.sync(write=False) == []  # every lab's setup cell and _config.yml say what pyproject.toml says
    for lab in tools.labs():
        assert block in (ROOT / "labs" / "source" / lab / f"{lab}.md").read_text()
    assert f"url: {p['urls']['Repository']}" in (ROOT / "_config.yml").read_text()


def test_install_cell_fails_with_one_clear_message(tmp_path):
    """No index and no repository reachable: one line that says what to do, no pip traceback."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
    bare = tmp_path / "bare" / "bin" / "python"
    env = {**CLEAN, "PIP_NO_INDEX": "1", "GIT_ALLOW_PROTOCOL": "file", "GIT_TERMINAL_PROMPT": "0"}
    r = subprocess.run([str(bare), "-c", tools.install_block()], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=120)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("Could not install vramlab") and "pip install 'vramlab[labs]==" in last
    assert "Traceback" not in r.stderr


def test_released_lab_runs_from_the_wheel_in_a_fresh_venv(dist, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", *STACK, str(dist["wheel"])], capture_output=True,
                       text=True, timeout=900, env=CLEAN)
    assert r.returncode == 0, r.stderr[-2000:]
    lab = "lab01_where_memory_goes"
    work = tmp_path / "student"
    work.mkdir()
    (work / f"{lab}.ipynb").write_bytes((ROOT / "labs" / "release" / lab / f"{lab}.ipynb").read_bytes())
    runner = f"""
import json, os, sys, tempfile, nbformat
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
import vramlab
nb = nbformat.read("{lab}.ipynb", as_version=4)
nb.cells.append(nbformat.v4.new_code_cell("import vramlab, sys; print('KERNEL', vramlab.__file__, sys.executable)"))
km = KernelManager(kernel_name="python3", transport="ipc", connection_file=os.path.join(tempfile.mkdtemp(), "kernel.json"))
NotebookClient(nb, km=km, timeout=600, kernel_name="python3", allow_errors=True).execute()
errors = [o["ename"] for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
print(json.dumps({{"errors": errors, "text": text, "vramlab": vramlab.__file__, "path": sys.path}}))
"""
    r = subprocess.run([str(py), "-c", runner], capture_output=True, text=True, cwd=work, env=CLEAN, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["vramlab"].startswith(str(venv)), out["vramlab"]  # the wheel, not the checkout
    kernel = next(line for line in out["text"].splitlines() if line.startswith("KERNEL"))
    assert kernel.split()[1].startswith(str(venv)) and kernel.split()[2].startswith(str(venv)), kernel
    assert not any(str(ROOT) in p for p in out["path"])
    assert out["errors"] and set(out["errors"]) == {"NotImplementedError"}  # only the student's stubs
    assert "installing" not in out["text"]  # vramlab was there: the install cell did nothing
    assert "No GPU found" in out["text"] and "largest batch that fits" in out["text"]


def test_github_workflows_are_valid():
    """tests on push, the strict book build and Pages deploy, and PyPI trusted publishing on a tag:
    checked against GitHub's workflow schema (vendored by check-jsonschema; no network)."""
    import shutil

    workflows = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
    assert [w.stem for w in workflows] == ["book", "publish", "tests"]
    exe = shutil.which("check-jsonschema", path=str(Path(sys.executable).parent))
    assert exe, "check-jsonschema is installed by requirements.txt"
    r = subprocess.run([exe, "--builtin-schema", "vendor.github-workflows", *map(str, workflows)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    publish = (ROOT / ".github" / "workflows" / "publish.yml").read_text()
    assert "id-token: write" in publish and "pypa/gh-action-pypi-publish" in publish and 'tags: ["v*"]' in publish
    book = (ROOT / ".github" / "workflows" / "book.yml").read_text()
    assert "jupyter-book build . -W --keep-going" in book and "actions/deploy-pages" in book
