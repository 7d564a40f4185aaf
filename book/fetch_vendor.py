"""Put the book's browser assets under book/_static/vendor/ so the built HTML loads nothing from a
CDN: MathJax 3 (formulas) and Pyodide (Python in the browser, for the live calculators; a page
fetches it only when a reader first changes a calculator's control).

They come from the npm registry as package tarballs (`npm pack`), pinned below, and are not
committed (book/_static/vendor/ is ignored). Run before `jupyter-book build`; a second run with
the files present does nothing.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VENDOR = Path(__file__).resolve().parent / "_static" / "vendor"
PACKAGES = {"mathjax": "3.2.2", "pyodide": "314.0.7"}
# (package, path inside the tarball, destination under vendor/); a trailing "/" copies a folder
FILES = [
    ("mathjax", "package/es5/tex-chtml.js", "mathjax/tex-chtml.js"),
    ("mathjax", "package/es5/output/chtml/fonts/woff-v2/", "mathjax/output/chtml/fonts/woff-v2/"),
    # the five files a browser needs (13.5 MB, 6.4 MB gzipped); no .js among them: Jupyter Book adds
    # every *.js under _static to every page as a classic script
    *(("pyodide", f"package/{f}", f"pyodide/{f}") for f in
      ("pyodide.mjs", "pyodide.asm.mjs", "pyodide.asm.wasm", "python_stdlib.zip", "pyodide-lock.json")),
]
STAMP = VENDOR / "VERSIONS.txt"


def _stamp_text() -> str:
    return "".join(f"{name}@{version}\n" for name, version in PACKAGES.items())


def fetch() -> None:
    if STAMP.exists() and STAMP.read_text() == _stamp_text() and all((VENDOR / d).exists() for _, _, d in FILES):
        print(f"vendor assets present in {VENDOR}")
        return
    npm = shutil.which("npm")
    if npm is None:
        sys.exit("fetch_vendor: npm is needed to fetch MathJax and Pyodide (apt-get install npm)")
    if VENDOR.exists():
        shutil.rmtree(VENDOR)
    VENDOR.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        tarballs = {}
        for name, version in PACKAGES.items():
            print(f"fetching {name}@{version} from the npm registry", flush=True)
            out = subprocess.run([npm, "pack", f"{name}@{version}", "--silent"], cwd=tmp, capture_output=True,
                                 text=True, timeout=300)
            if out.returncode != 0:
                sys.exit(f"fetch_vendor: npm pack {name}@{version} failed:\n{out.stderr.strip()}")
            tarballs[name] = Path(tmp) / out.stdout.strip().splitlines()[-1]
        for name, src, dest in FILES:
            with tarfile.open(tarballs[name]) as tar:
                members = [m for m in tar.getmembers() if m.isfile() and
                           (m.name.startswith(src) if src.endswith("/") else m.name == src)]
                if not members:
                    sys.exit(f"fetch_vendor: {src} not found in {name}")
                for m in members:
                    target = VENDOR / dest / m.name[len(src):] if src.endswith("/") else VENDOR / dest
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with tar.extractfile(m) as f:
                        target.write_bytes(f.read())
    STAMP.write_text(_stamp_text())
    print(f"vendor assets written to {VENDOR}")


if __name__ == "__main__":
    fetch()
