"""Release and grade the labs.

The instructor sources are MyST Markdown (labs/source/<lab>/<lab>.md) with nbgrader cell metadata.

    python labs/tools.py sync               # the install cells and _config.yml's repository, from pyproject.toml
    python labs/tools.py release            # regenerate labs/release/ (commit the result)
    python labs/tools.py check              # fail if either is stale
    python labs/tools.py grade NOTEBOOK.ipynb [--lab lab01_where_memory_goes]

`release` and `grade` are the light path: nbgrader's own preprocessors, run without its database
(generate_assignment's chain minus SaveCells and the header; autograde's minus SaveAutoGrades).
With a real nbgrader course (this folder is one: nbgrader_config.py), instructors run
`nbgrader generate_assignment LAB` and `nbgrader autograde LAB` from labs/ after `python
labs/tools.py sources`, which writes the .ipynb sources nbgrader reads.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import os
import re
import sys
from pathlib import Path

import nbformat

LABS = Path(__file__).resolve().parent
ROOT = LABS.parent
SOURCE, RELEASE = LABS / "source", LABS / "release"
KERNEL = {"display_name": "Python 3", "language": "python", "name": "python3"}
BEGIN, END = "# --- install: generated from pyproject.toml by `python labs/tools.py sync`", "# --- end install ---"


def project() -> dict:
    """The package's name, version and URLs, from their one place: pyproject.toml (and the version
    from vramlab.__version__, which pyproject reads too)."""
    import tomllib

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    version = re.search(r'__version__ = "([^"]+)"', (ROOT / "src" / "vramlab" / "__init__.py").read_text()).group(1)
    return {"name": meta["name"], "version": version, "urls": meta["urls"]}


def install_block() -> str:
    """The labs' install cell: the released version from the package index, else the same tag from
    the repository, else one clear message (never a pip traceback)."""
    p = project()
    name, version, repo = p["name"], p["version"], p["urls"]["Repository"]
    return "\n".join([
        f"{BEGIN}; do not edit ---",
        "import importlib.util",
        "import subprocess",
        "import sys",
        "",
        f'if importlib.util.find_spec("{name}") is None:  # Colab, or any fresh environment',
        "    def _pip(spec: str) -> bool:",
        '        print(f"installing {spec} ...")',
        '        return subprocess.run([sys.executable, "-m", "pip", "install", "-q", spec]).returncode == 0',
        "",
        f'    if not (_pip("{name}[labs]=={version}") or _pip("{name}[labs] @ git+{repo}@v{version}")):',
        f'        raise SystemExit("Could not install {name} {version}, from the package index or from {repo}. "',
        f'                         "Check that this notebook can reach the internet, or install it yourself: "',
        f'                         "pip install \'{name}[labs]=={version}\'")',
        END,
    ])


def sync(*, write: bool = True) -> list[str]:
    """Derive from pyproject.toml what repeats it: each lab's install block and the book's repository
    block. Returns the files that were (write=False: would be) changed."""
    changed = []
    block = install_block()
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    for lab in labs():
        path = SOURCE / lab / f"{lab}.md"
        text = path.read_text()
        new = pattern.sub(lambda m: block, text)
        if new != text:
            changed.append(str(path.relative_to(ROOT)))
            if write:
                path.write_text(new)
    config = ROOT / "_config.yml"
    text = config.read_text()
    new = re.sub(r"(repository:\n  url: )\S+", lambda m: m.group(1) + project()["urls"]["Repository"], text)
    if new != text:
        changed.append("_config.yml")
        if write:
            config.write_text(new)
    return changed


def labs() -> list[str]:
    return sorted(p.name for p in SOURCE.iterdir() if (p / f"{p.name}.md").exists())


def source_notebook(lab: str) -> nbformat.NotebookNode:
    """The instructor notebook, from its MyST source, with stable cell ids (jupytext would make
    random ones, so every regeneration would differ)."""
    import jupytext

    nb = jupytext.read(SOURCE / lab / f"{lab}.md")
    nb.metadata = {"kernelspec": KERNEL, "language_info": {"name": "python"}}
    for i, cell in enumerate(nb.cells):
        gid = cell.metadata.get("nbgrader", {}).get("grade_id")
        cell.id = gid or f"cell-{i:03d}-{hashlib.sha1(cell.source.encode()).hexdigest()[:8]}"
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nbformat.validate(nb)
    return nb


def _run(preprocessors, nb: nbformat.NotebookNode, resources: dict | None = None) -> nbformat.NotebookNode:
    resources = resources or {}
    for pp in preprocessors:
        nb, resources = pp.preprocess(nb, resources)
    return nb


def student_notebook(lab: str) -> nbformat.NotebookNode:
    """nbgrader generate_assignment's preprocessors, without the database: solutions replaced by
    `raise NotImplementedError()`, hidden tests removed, checksums and locks set."""
    from nbgrader.preprocessors import (CheckCellMetadata, ClearHiddenTests, ClearMarkScheme, ClearOutput,
                                        ClearSolutions, ComputeChecksums, LockCells)

    nb = source_notebook(lab)
    chain = [LockCells(), ClearSolutions(), ClearOutput(), CheckCellMetadata(), ComputeChecksums(),
             ClearHiddenTests(), ClearMarkScheme(), ComputeChecksums(), CheckCellMetadata()]
    nb = _run(chain, nb)
    nb.metadata = {"kernelspec": KERNEL, "language_info": {"name": "python"}}
    return nb


def release(lab: str, dest: Path = RELEASE) -> Path:
    out = dest / lab / f"{lab}.ipynb"
    out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(student_notebook(lab), out)
    return out


def write_sources() -> None:
    """The .ipynb instructor sources that real nbgrader reads (ignored by git)."""
    for lab in labs():
        nbformat.write(source_notebook(lab), SOURCE / lab / f"{lab}.ipynb")


def grade(submission: nbformat.NotebookNode, lab: str, *, timeout: int = 600, env: dict | None = None,
          executed: list | None = None) -> dict:
    """Autograde a submission: restore every test cell from the instructor source (hidden tests
    included, whatever the student did to them), execute, and score each graded cell: full points
    when it raises nothing. Returns {grade_id: (points earned, points possible, error or None)};
    the executed notebook is appended to `executed` when given."""
    from nbclient import NotebookClient

    src = {c.metadata["nbgrader"]["grade_id"]: c for c in source_notebook(lab).cells
           if c.metadata.get("nbgrader", {}).get("grade")}
    nb = copy.deepcopy(submission)
    for cell in nb.cells:
        gid = cell.metadata.get("nbgrader", {}).get("grade_id")
        if gid in src and not src[gid].metadata["nbgrader"].get("solution"):
            cell.source = src[gid].source
            cell.metadata = copy.deepcopy(src[gid].metadata)
    old_env = dict(os.environ)
    os.environ.update(env or {})
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                       resources={"metadata": {"path": str(SOURCE / lab)}}).execute()
    finally:
        os.environ.clear()
        os.environ.update(old_env)
    if executed is not None:
        executed.append(nb)
    scores = {}
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("grade") and not meta.get("solution"):
            # nbgrader's rule (utils.determine_grade): an error, or anything written to stderr, fails
            errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"
                      or (o.get("output_type") == "stream" and o.get("name") == "stderr")]
            err = None
            if errors:
                e = errors[0]
                err = f"{e['ename']}: {e['evalue']}" if e["output_type"] == "error" else f"stderr: {e['text'][:300]}"
            scores[meta["grade_id"]] = (0 if errors else meta["points"], meta["points"], err)
    return scores


def total(scores: dict) -> tuple[int, int]:
    """(points earned, points possible) of a `grade` result."""
    return sum(s[0] for s in scores.values()), sum(s[1] for s in scores.values())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("release")
    sub.add_parser("sync", help="derive the labs' install cell and _config.yml's repository from pyproject.toml")
    sub.add_parser("check")
    sub.add_parser("sources")
    r = sub.add_parser("record", help="run a lab's instructor version and store its results in labs/results/")
    r.add_argument("lab")
    g = sub.add_parser("grade")
    g.add_argument("notebook", type=Path)
    g.add_argument("--lab", default=None)
    args = p.parse_args(argv)
    if args.cmd == "sync":
        changed = sync()
        print("\n".join(f"wrote {c}" for c in changed) or "everything derived from pyproject.toml is current")
    elif args.cmd == "release":
        for lab in labs():
            print(f"wrote {release(lab).relative_to(LABS.parent)}")
    elif args.cmd == "sources":
        write_sources()
    elif args.cmd == "record":
        out = LABS / "results" / f"{args.lab}.json"
        scores = grade(source_notebook(args.lab), args.lab, env={
            "VRAMLAB_RESULTS": str(out), "VRAMLAB_COMMAND": f"python labs/tools.py record {args.lab}"})
        print(f"wrote {out.relative_to(LABS.parent)}; instructor score {'/'.join(map(str, total(scores)))}")
    elif args.cmd == "check":
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            stale = [lab for lab in labs()
                     if release(lab, Path(tmp)).read_bytes() != (RELEASE / lab / f"{lab}.ipynb").read_bytes()]
        drift = sync(write=False)
        if drift:
            print(f"{', '.join(drift)} no longer match pyproject.toml: run python labs/tools.py sync, then release")
            return 1
        if stale:
            print(f"labs/release is stale for {', '.join(stale)}: run python labs/tools.py release")
            return 1
        print("labs/release is up to date, and the install cells and _config.yml match pyproject.toml")
    else:
        lab = args.lab or args.notebook.stem
        scores = grade(nbformat.read(args.notebook, as_version=4), lab)
        for gid, (got, possible, err) in scores.items():
            print(f"{gid:12s}{got:>3}/{possible}  {err or 'ok'}")
        print(f"total {'/'.join(map(str, total(scores)))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
