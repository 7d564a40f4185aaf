"""Sphinx extension: package vramlab's pure-Python modules for the book's live calculators, and
tidy what the theme stack puts on every page.

At the end of an HTML build it writes `_static/vendor/vramlab-<version>-<hash>.zip` (what the browser
runs, straight from src/, so it always matches the code that rendered the page: the pure folder's
modules and presets, and the pure modules of `vramlab.present` the page calls, `calculators` (with its
chapters' `calc_*`) and `svg`; nothing of `measure`, `grading`, the widgets, the figures or the CLI)
and `_static/vramlab-live.json` naming it; book/_static/live-worker.mjs unpacks it into Pyodide.
The hash in the name keeps a reader's browser from using a stale cached copy.

It also writes the whole package, as the wheel pip installs, at a stable address:
`_static/wheels/vramlab-<version>-py3-none-any.whl`, with `_static/wheels/index.html` linking it (a
page pip's `--find-links` reads). The labs' install cell (labs/tools.py `install_block`) installs
`vramlab[labs] @ <book>/_static/wheels/vramlab-<version>-py3-none-any.whl` first: the book's own site
serves the version its notebooks were released with, before any release reaches the package index;
pip takes the extras (torch, transformers, ...) from the index. `build_wheel` is what the tests use.

Kernels: the notebooks run in kernels that talk to the build over IPC sockets in Jupyter's private
runtime folder, not over TCP on localhost (ipykernel warns, for every notebook, that TCP without
CurveZMQ keys is unencrypted): `ipc_kernels` makes the notebook execution myst-nb uses start them so.

Tidying (each was a console error or a visible defect in the built book):
- sphinx-thebe's inline configuration was added twice ("THEBE_JS_URL has already been declared")
  and points at a CDN; the book has no Thebe (its launch buttons open Colab): drop its assets;
- pydata-sphinx-theme read an empty colour mode ("Got invalid theme mode"): default to light;
- the theme's header repeated the sidebar's search box: no persistent header search;
- Colab launch buttons on the chapters' pages pointed at .md files Colab cannot open.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
import zipfile
from html import escape
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "vramlab"


# what runs in the reader's browser (Pyodide): pure Python only (tests/test_layers.py checks each)
BROWSER = ("*.py", "presets/*.json", "present/__init__.py", "present/calculators.py", "present/calc_*.py",
           "present/svg.py")


def browser_files() -> list[Path]:
    return sorted({p for pattern in BROWSER for p in SRC.glob(pattern) if p.name != "__main__.py"})


def archive() -> tuple[bytes, str]:
    buf = io.BytesIO()
    files = browser_files()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for p in files:
            info = zipfile.ZipInfo(f"vramlab/{p.relative_to(SRC).as_posix()}", date_time=(2026, 1, 1, 0, 0, 0))
            z.writestr(info, p.read_bytes(), zipfile.ZIP_DEFLATED)  # fixed dates: same code, same bytes
    version = re.search(r'__version__ = "([^"]+)"', (SRC / "__init__.py").read_text()).group(1)
    return buf.getvalue(), version


WHEELS = "_static/wheels"  # under the built site: a stable address (labs/tools.py's install cell names it)
SOURCE_DATE_EPOCH = "1767225600"  # 2026-01-01: the wheel's file dates, so the same code gives the same bytes


def wheel_name(version: str) -> str:
    return f"vramlab-{version}-py3-none-any.whl"


def build_wheel(dest: Path) -> Path:
    """Build vramlab's wheel (the whole package, with its metadata and extras, as pip installs it)
    into `dest` and return its path. Built from a copy of the sources, so the checkout gets no
    build/ or egg-info; with the build environment's setuptools (offline), else pip's isolated build."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    root = SRC.parents[1]
    env = {**os.environ, "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH}
    with tempfile.TemporaryDirectory(prefix="vramlab-wheel-") as tmp:
        for name in ("pyproject.toml", "README.md", "LICENSE"):
            shutil.copy2(root / name, Path(tmp) / name)
        shutil.copytree(root / "src", Path(tmp) / "src", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        out = Path(tmp) / "dist"
        errors = []
        for isolation in (["--no-build-isolation"], []):
            r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", *isolation, "-w", str(out), tmp],
                               capture_output=True, text=True, env=env)
            if r.returncode == 0:
                break
            errors.append((r.stderr.strip().splitlines() or ["?"])[-1])
        else:
            raise RuntimeError(f"vramlab_live: cannot build vramlab's wheel: {'; '.join(errors)}")
        (built,) = out.glob("vramlab-*.whl")
        target = dest / built.name
        shutil.copyfile(built, target)
    return target


def publish_wheel(outdir: Path, wheel: Path | None = None) -> Path:
    """Put the wheel (built now, unless given) at `<outdir>/_static/wheels/`, with an index page that
    links it with its sha256 (pip's --find-links reads it; a browser shows it). Returns its path."""
    folder = Path(outdir) / WHEELS
    folder.mkdir(parents=True, exist_ok=True)
    if wheel is None:
        wheel = build_wheel(folder)
    elif wheel.parent.resolve() != folder.resolve():
        wheel = Path(shutil.copyfile(wheel, folder / wheel.name))
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    link = f'<a href="{escape(wheel.name)}#sha256={digest}">{escape(wheel.name)}</a>'
    (folder / "index.html").write_text(
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>vramlab wheels</title></head>\n<body>\n'
        "<p>vramlab as pip installs it, the version this book was built with: "
        f"<code>pip install 'vramlab[labs] @ URL-of-the-wheel'</code></p>\n{link}\n</body></html>\n")
    return wheel


def ipc_kernels() -> bool:
    """Make the notebook execution myst-nb uses (jupyter-cache's `executenb`, nbclient's NotebookClient)
    start each kernel on IPC transport: sockets beside its connection file in Jupyter's runtime folder
    (private to the user), so ipykernel does not warn that TCP without encryption is in use. Returns
    whether it could (an unknown myst-nb/jupyter-cache layout: False, and the kernels use TCP)."""
    try:
        import jupyter_cache.executors.utils as executors
        from jupyter_client.manager import AsyncKernelManager
        from jupyter_core.paths import jupyter_runtime_dir
        from traitlets import default
    except ImportError:
        return False
    run = getattr(executors, "executenb", None)
    if run is None or not callable(run):
        return False
    if getattr(run, "vramlab_ipc", False):
        return True

    class IPCKernelManager(AsyncKernelManager):
        @default("transport")
        def _ipc_transport(self) -> str:
            return "ipc"

        @default("connection_file")
        def _private_connection_file(self) -> str:
            # the IPC sockets are named after it (<file>-ipc-<n>): a short name keeps them within the
            # 107 bytes a Unix socket's path may have
            runtime = jupyter_runtime_dir()
            if len(runtime) > 80:  # a long home folder: a private folder of our own instead
                runtime = tempfile.mkdtemp(prefix="vl-kernel-")
            os.makedirs(runtime, mode=0o700, exist_ok=True)
            return os.path.join(runtime, f"kernel-{uuid.uuid4().hex[:12]}.json")

    @functools.wraps(run)
    def executenb(nb, *args, **kwargs):
        if kwargs.get("km") is None:
            kwargs.setdefault("kernel_manager_class", IPCKernelManager)
        return run(nb, *args, **kwargs)

    executenb.vramlab_ipc = True
    executors.executenb = executenb
    return True


def _write(app, exception) -> None:
    if exception is not None or app.builder.format != "html":
        return
    data, version = archive()
    name = f"vendor/vramlab-{version}-{hashlib.sha256(data).hexdigest()[:12]}.zip"
    static = Path(app.outdir) / "_static"
    (static / name).parent.mkdir(parents=True, exist_ok=True)
    (static / name).write_bytes(data)
    (static / "vramlab-live.json").write_text(json.dumps({"archive": name, "version": version}) + "\n")
    publish_wheel(Path(app.outdir))  # what the labs' install cell fetches first
    # the root index.html is a bare redirect (sphinx-external-toc): without an icon the browser asks
    # for /favicon.ico (a 404), and a real icon's request is cut off by the redirect (ERR_ABORTED):
    # an empty inline icon asks for nothing
    index = Path(app.outdir) / "index.html"
    if index.exists() and "http-equiv=\"Refresh\"" in index.read_text() and "rel=\"icon\"" not in index.read_text():
        index.write_text('<link rel="icon" href="data:," />\n' + index.read_text())


def _theme(app, config) -> None:
    config.html_context.setdefault("default_mode", "light")  # pydata-sphinx-theme reads it from the context
    config.html_theme_options["navbar_persistent"] = []


def _no_thebe(app, pagename, templatename, context, doctree) -> None:
    def keep(asset) -> bool:
        text = f"{getattr(asset, 'filename', asset)} {getattr(asset, 'attributes', {}).get('body', '')}"
        return "thebe" not in text.lower()

    for key in ("script_files", "css_files"):
        if key in context:
            context[key] = [a for a in context[key] if keep(a)]


def _no_launch_for_markdown(app, pagename, templatename, context, doctree) -> None:
    """The chapters are MyST Markdown: Colab cannot open a .md file, so their pages get no launch
    button (the labs' pages, generated .ipynb files, keep theirs)."""
    if str(context.get("sourcename", "")).endswith((".md", ".md.txt")) and "header_buttons" in context:
        context["header_buttons"] = [b for b in context["header_buttons"] if b.get("label") != "launch-buttons"]


def setup(app):
    ipc_kernels()
    app.connect("config-inited", _theme)
    app.connect("html-page-context", _no_thebe)
    app.connect("html-page-context", _no_launch_for_markdown, priority=900)  # after the theme adds them
    app.connect("build-finished", _write)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
