"""Sphinx extension: package vramlab's pure-Python modules for the book's live calculators, and
tidy what the theme stack puts on every page.

At the end of an HTML build it writes `_static/vendor/vramlab-<version>-<hash>.zip` (what the browser
runs, straight from src/, so it always matches the code that rendered the page: the pure folder's
modules and presets, and the two pure modules of `vramlab.present` the page calls, `calculators` and
`svg`; nothing of `measure`, `grading`, the widgets, the figures or the CLI)
and `_static/vramlab-live.json` naming it; book/_static/live-worker.mjs unpacks it into Pyodide.
The hash in the name keeps a reader's browser from using a stale cached copy.

Tidying (each was a console error or a visible defect in the built book):
- sphinx-thebe's inline configuration was added twice ("THEBE_JS_URL has already been declared")
  and points at a CDN; the book has no Thebe (its launch buttons open Colab): drop its assets;
- pydata-sphinx-theme read an empty colour mode ("Got invalid theme mode"): default to light;
- the theme's header repeated the sidebar's search box: no persistent header search;
- Colab launch buttons on the chapters' pages pointed at .md files Colab cannot open.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import zipfile
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "vramlab"


# what runs in the reader's browser (Pyodide): pure Python only (tests/test_layers.py checks each)
BROWSER = ("*.py", "presets/*.json", "present/__init__.py", "present/calculators.py", "present/svg.py")


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


def _write(app, exception) -> None:
    if exception is not None or app.builder.format != "html":
        return
    data, version = archive()
    name = f"vendor/vramlab-{version}-{hashlib.sha256(data).hexdigest()[:12]}.zip"
    static = Path(app.outdir) / "_static"
    (static / name).parent.mkdir(parents=True, exist_ok=True)
    (static / name).write_bytes(data)
    (static / "vramlab-live.json").write_text(json.dumps({"archive": name, "version": version}) + "\n")
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
    app.connect("config-inited", _theme)
    app.connect("html-page-context", _no_thebe)
    app.connect("html-page-context", _no_launch_for_markdown, priority=900)  # after the theme adds them
    app.connect("build-finished", _write)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
