"""Release and grade the labs.

The instructor sources are MyST Markdown (labs/source/<lab>/<lab>.md) with nbgrader cell metadata.

    python labs/tools.py sync               # the install cells and _config.yml's repository, from pyproject.toml
    python labs/tools.py release            # regenerate labs/release/ (commit the result)
    python labs/tools.py check              # fail if either is stale
    python labs/tools.py grade NOTEBOOK.ipynb... [--lab LAB] [--timeout S] [--memory-gib G] [--json FILE]

`release` runs nbgrader's generate_assignment preprocessors without its database (minus SaveCells
and the header). `grade` scores each test cell of the instructor source in this process against the
submission's answers run in a sandboxed process of their own (labs/sandbox.py, threat model in
labs/README.md); `record` runs the instructor's notebook in a Jupyter kernel. With a real nbgrader course (this folder is one: nbgrader_config.py), instructors run
`nbgrader generate_assignment LAB` and `nbgrader autograde LAB` from labs/ after `python
labs/tools.py sources`, which writes the .ipynb sources nbgrader reads.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import nbformat

LABS = Path(__file__).resolve().parent
ROOT = LABS.parent
if str(LABS) not in sys.path:  # sandbox.py beside this file, when tools.py is loaded by path (tests)
    sys.path.insert(0, str(LABS))
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


def site() -> str:
    """The book's address (pyproject.toml's [project.urls] Documentation): the built book serves the
    wheel the labs install first, at WHEEL_PATH under it (book/_ext/vramlab_live.py writes it there)."""
    urls = project()["urls"]
    if "Documentation" not in urls:
        raise SystemExit("tools: pyproject.toml's [project.urls] has no Documentation (the book's address)")
    return urls["Documentation"].rstrip("/")


WHEEL_PATH = "_static/wheels/{name}-{version}-py3-none-any.whl"  # vramlab_live.WHEELS and wheel_name()


def install_block() -> str:
    """The labs' install cell: the wheel the book's own site serves (the version this notebook was
    released with; the extras from the package index), else the package index, else the same tag
    from the repository, else one clear message (never a pip traceback). VRAMLAB_SITE, if set, is
    the site to use instead of the book's (a mirror, a local build, the tests)."""
    p = project()
    name, version, repo = p["name"], p["version"], p["urls"]["Repository"]
    path = WHEEL_PATH.format(name=name, version=version)
    return "\n".join([
        f"{BEGIN}; do not edit ---",
        "import importlib.util",
        "import os",
        "import subprocess",
        "import sys",
        "",
        f'if importlib.util.find_spec("{name}") is None:  # Colab, or any fresh environment',
        "    def _pip(spec: str) -> bool:",
        '        print(f"installing {spec} ...", flush=True)',
        '        return subprocess.run([sys.executable, "-m", "pip", "install", "-q", spec]).returncode == 0',
        "",
        f'    _site = os.environ.get("VRAMLAB_SITE", "{site()}").rstrip("/")  # the book serves the wheel',
        f'    if not (_pip(f"{name}[labs] @ {{_site}}/{path}")',
        f'            or _pip("{name}[labs]=={version}")',
        f'            or _pip("{name}[labs] @ git+{repo}@v{version}")):',
        f'        raise SystemExit(f"Could not install {name} {version} from {{_site}}, the package index or {repo}. "',
        '                         "Check that this notebook can reach the internet, or install it yourself: "',
        f'                         f"pip install \'{name}[labs]=={version}\', or the book\'s wheel: '
        f'pip install \'{name}[labs] @ {{_site}}/{path}\'")',
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


def metadata(lab: str) -> dict:
    """A lab notebook's metadata: its kernel, and which lab it is (detect_lab reads it back from a
    submission, whatever its file is called)."""
    return {"kernelspec": KERNEL, "language_info": {"name": "python"}, "vramlab": {"lab": lab}}


def source_notebook(lab: str) -> nbformat.NotebookNode:
    """The instructor notebook, from its MyST source, with stable cell ids (jupytext would make
    random ones, so every regeneration would differ)."""
    import jupytext

    nb = jupytext.read(SOURCE / lab / f"{lab}.md")
    nb.metadata = metadata(lab)
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
    nb.metadata = metadata(lab)
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


MAX_OUTPUT_CHARS = 20_000  # of each output kept in the executed notebook (a cell printing 200 MB is cut)


def _solution_ids(lab: str) -> list[str]:
    return [c.metadata["nbgrader"]["grade_id"] for c in source_notebook(lab).cells
            if c.metadata.get("nbgrader", {}).get("solution")]


def assemble(submission: Any, lab: str) -> nbformat.NotebookNode:
    """The notebook that is graded: the instructor source, cell for cell (its order, types, sources,
    metadata: every test, hidden tests included, every locked cell), with each solution cell's source
    taken from the submission's code cell of the same grade_id. Nothing else of the submission is
    used: a test turned into markdown, a forged or renamed graded cell, deleted tests or metadata,
    extra cells — none of them reaches the graded notebook. A solution the submission lacks becomes a
    cell that raises, so its tests score 0."""
    answers: dict[str, str] = {}
    cells = submission.get("cells") if isinstance(submission, dict) else None
    for cell in cells if isinstance(cells, list) else []:
        try:
            gid = cell["metadata"]["nbgrader"]["grade_id"]
            if cell["cell_type"] == "code" and isinstance(gid, str) and isinstance(cell["source"], (str, list)):
                src = cell["source"] if isinstance(cell["source"], str) else "".join(map(str, cell["source"]))
                answers.setdefault(gid, src)
        except (KeyError, TypeError):
            continue
    nb = copy.deepcopy(source_notebook(lab))
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("solution"):
            gid = meta["grade_id"]
            cell.source = answers.get(gid, f"raise NotImplementedError({'the submission has no code cell ' + repr(gid)!r})")
    return nb


def _zero(lab: str, why: str) -> dict:
    return {c.metadata["nbgrader"]["grade_id"]: (0, c.metadata["nbgrader"]["points"], why)
            for c in source_notebook(lab).cells
            if c.metadata.get("nbgrader", {}).get("grade") and not c.metadata["nbgrader"].get("solution")}


def _graded(cell) -> bool:
    meta = cell.metadata.get("nbgrader", {})
    return bool(meta.get("grade")) and not meta.get("solution")


def grade(submission: Any, lab: str, *, timeout: float = 600, memory_gib: float = 4, sandbox: bool | None = None,
          report: dict | None = None, only: Any = None) -> dict:
    """Autograde a submission. Threat model (labs/README.md): the student may edit the notebook in any
    way and run any Python in their solution cells. So:
    - only the solution cells come from the submission (`assemble`); the tests are the instructor's;
    - the answers run in a process of their own (labs/answer_worker.py, started afresh for each test
      cell, in the sandbox forked from the grading's process starter (vramlab.grading.starter), in a scratch directory, with `timeout` seconds to load and `timeout` per test cell, at most
      `memory_gib` GiB of data, and inside a sandbox where one can be made: sandbox.sandbox_prefix);
    - the tests run here, in the grader, and see the answer's functions as `sandbox.Remote` objects:
      no student code runs where the expected values are computed and compared;
    - an answer that changes a file of the checkout or of the Python packages voids the grading.
    Returns {grade_id: (points earned, points possible, reason or None)}; never raises for a bad
    submission. `report`, if given, receives the sandbox used and each test's printed output. `only`, if given,
    names the test cells to grade (grade ids; each is graded exactly as in a whole grading, since every test
    cell runs in a process of its own with the answers above it) and the scores hold those alone."""
    import tempfile

    import sandbox as sb

    if lab not in labs():
        raise ValueError(f"unknown lab {lab!r}; labs: {', '.join(labs())}")
    nb = assemble(submission, lab)
    if only is not None:
        only = {only} if isinstance(only, str) else set(only)
        unknown = only - {c.metadata["nbgrader"]["grade_id"] for c in nb.cells if _graded(c)}
        if unknown:
            raise ValueError(f"{lab} has no test cell {', '.join(sorted(unknown))}")
    answers = [(i, c.metadata["nbgrader"]["grade_id"], c.source) for i, c in enumerate(nb.cells)
               if c.metadata.get("nbgrader", {}).get("solution") and c.cell_type == "code"]
    sources = {gid: src for _, gid, src in answers}
    preamble = sb.setup_imports([c.source for c in nb.cells[:answers[0][0]] if c.cell_type == "code"])
    prefix, how = sb.sandbox_prefix() if sandbox is not False else ([], "no sandbox (asked for none)")
    if sandbox and not prefix:
        raise RuntimeError(f"a sandbox was required: {how}")
    report = report if report is not None else {}
    report.update(sandbox=how, outputs={}, forked=[])  # forked: the test cells whose process the starter forked
    import vramlab.grading.run

    # without a sandbox an answer could write to the checkout or the packages: compare before and after
    # (in the sandbox they are read-only, and a change would be someone else's)
    before = sb.fingerprint() if not prefix else {}
    scores = {}
    saved_prefix, saved_limits = list(vramlab.grading.run.SANDBOX_PREFIX), dict(vramlab.grading.run.RANK_LIMITS)
    vramlab.grading.run.SANDBOX_PREFIX[:] = prefix  # labs 2-4's checks run the answer's ranks in it too
    vramlab.grading.run.RANK_LIMITS.clear()  # ... under the answer worker's limits and --timeout
    vramlab.grading.run.RANK_LIMITS.update(timeout=timeout, memory_bytes=int(memory_gib * 2**30))
    try:
        # (the starter closed, and with it its sandbox's processes, before the scratch directory goes)
        with tempfile.TemporaryDirectory(prefix="vramlab-grade-") as scratch, contextlib.ExitStack() as closing:
            starter = None
            if prefix:  # one process imports the lab's modules once; each test cell's process is forked from it
                try:
                    starter = sb.Starter(scratch, prefix, sb.preamble_modules(preamble), env=sb.sandbox_env(scratch))
                    closing.callback(starter.close)
                    vramlab.grading.run.STARTER[:] = [starter]  # labs 1, 6 and 7's check programs are forked there too
                except sb.StarterGone:
                    pass  # (each process then starts an interpreter of its own, as without a sandbox)
            for i, cell in enumerate(nb.cells):
                if not _graded(cell):
                    continue
                gid, points = cell.metadata["nbgrader"]["grade_id"], cell.metadata["nbgrader"]["points"]
                if only is not None and gid not in only:
                    continue
                here = Path(scratch) / f"test-{i}"
                here.mkdir()
                # as in the notebook: the answers above this test, in order (an answer further down that
                # ends its process or loops cannot cost an earlier exercise its points)
                above = [(gid_a, src) for j, gid_a, src in answers if j < i]
                try:
                    worker = sb.Worker(above, scratch=str(here), timeout=timeout, preamble=preamble,
                                       memory_bytes=int(memory_gib * 2**30), prefix=prefix, starter=starter)
                except sb.GradingStopped as e:
                    scores[gid] = (0, points, str(e))
                    continue
                if worker.starter is not None:
                    report["forked"].append(gid)
                try:
                    ok, why, out = sb.run_test(cell.source, gid, worker, sources)
                finally:
                    worker.close()
                report["outputs"][gid] = out[-MAX_OUTPUT_CHARS:]
                scores[gid] = (points if ok else 0, points, why)
    finally:
        vramlab.grading.run.STARTER.clear()
        vramlab.grading.run.SANDBOX_PREFIX[:] = saved_prefix
        vramlab.grading.run.RANK_LIMITS.clear()
        vramlab.grading.run.RANK_LIMITS.update(saved_limits)
    after = sb.fingerprint() if not prefix else {}
    changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    if changed:
        shown = ", ".join(str(Path(p).relative_to(ROOT)) if p.startswith(str(ROOT)) else p for p in changed[:3])
        why = (f"grading void: the submission changed {len(changed)} file(s) outside its scratch directory "
               f"({shown}); restore them before grading anything else")
        scores = {gid: (0, s[1], why) for gid, s in scores.items()}
    return scores


def execute(nb: nbformat.NotebookNode, *, timeout: float = 1800, env: dict | None = None) -> tuple[nbformat.NotebookNode, str | None]:
    """Run a whole notebook in a Jupyter kernel (the instructor's, for `record`: trusted code), in a
    scratch directory, each cell at most `timeout` seconds, the kernel's process group killed at the
    end. Returns (the executed notebook, why it stopped early or None)."""
    import tempfile
    import threading
    import time

    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    from sandbox import kill_group  # the kernel runs in a session of its own: it and whatever it started

    nb = copy.deepcopy(nb)

    with tempfile.TemporaryDirectory(prefix="vramlab-run-") as scratch, \
            tempfile.TemporaryDirectory(prefix="vl-kernel-") as sockets:
        # IPC transport: the kernel's sockets are files in a folder only this user can open (over TCP,
        # ipykernel warns that anyone on the machine could listen); a short path, as a Unix socket's must be
        km = KernelManager(kernel_name="python3", transport="ipc", connection_file=os.path.join(sockets, "kernel.json"))
        km.start_kernel(cwd=scratch, env={**os.environ, **(env or {})})
        proc = km.provisioner.process if getattr(km, "provisioner", None) else None
        pid = proc.pid if proc is not None else None
        started: dict = {}
        killed: list = []
        died: list = []
        stop = threading.Event()

        def watch() -> None:  # a cell past `timeout` that ignores the interrupt: kill the kernel
            while not stop.wait(0.5):
                t0, gid = started.get("t", None), started.get("gid")
                if proc is not None and proc.poll() is not None:
                    died.append(gid)
                    return
                if t0 is not None and time.monotonic() - t0 > timeout + 5 and pid:
                    killed.append(gid)
                    kill_group(pid)
                    return

        def on_start(cell, cell_index):
            started.update(t=time.monotonic(), gid=cell.metadata.get("nbgrader", {}).get("grade_id", f"cell {cell_index}"))

        threading.Thread(target=watch, daemon=True).start()
        outcome: dict = {}

        def run() -> None:  # in a thread: nbclient can wait forever on a killed kernel's output
            try:
                NotebookClient(nb, km=km, timeout=timeout, allow_errors=True, interrupt_on_timeout=True,
                               resources={"metadata": {"path": scratch}}, on_cell_start=on_start).execute()
            except DeadKernelError:
                outcome["problem"] = "the kernel died"
            except Exception as e:  # noqa: BLE001 - the report says what stopped it
                first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
                outcome["problem"] = f"execution stopped: {type(e).__name__}: {first}"

        runner = threading.Thread(target=run, daemon=True)
        try:
            runner.start()
            while runner.is_alive() and not killed and not died:
                runner.join(0.5)
            if killed:
                runner.join(5)
                problem = f"{killed[0]} ran past the {timeout:g} s limit: the kernel was stopped"
            elif died and runner.is_alive():
                runner.join(2)
                problem = f"the kernel died during {died[0]}"
            else:
                problem = outcome.get("problem")
        finally:
            stop.set()
            try:
                km.shutdown_kernel(now=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
            kill_group(pid)
    for cell in nb.cells:  # bounded: a cell that printed 200 MB keeps its first 20 kB
        for o in cell.get("outputs", []):
            if isinstance(o.get("text"), str) and len(o["text"]) > MAX_OUTPUT_CHARS:
                o["text"] = o["text"][:MAX_OUTPUT_CHARS] + "\n[... output cut ...]\n"
    return nb, problem


def kernel_scores(nb: nbformat.NotebookNode, problem: str | None = None) -> dict:
    """The test cells' scores of an `execute`d notebook, as nbgrader counts them but for stderr: a
    test earns its points when it ran and raised nothing. (For the instructor's own notebook: a
    student's is scored by `grade`.)"""
    scores = {}
    for cell in nb.cells:
        if _graded(cell):
            meta = cell.metadata["nbgrader"]
            errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
            if errors:
                scores[meta["grade_id"]] = (0, meta["points"], f"{errors[0]['ename']}: {errors[0]['evalue']}"[:500])
            elif cell.get("execution_count") is None:
                scores[meta["grade_id"]] = (0, meta["points"], problem or "not run")
            else:
                scores[meta["grade_id"]] = (meta["points"], meta["points"], None)
    return scores


def read_submission(path: Path) -> tuple[Any, str | None]:
    """(notebook, None), or (None, why it cannot be read) for a missing file, a folder, not JSON,
    an unknown nbformat or a wrong shape: the report gives the reason instead of a traceback."""
    try:
        if not path.is_file():
            return None, f"{path} is not a file"
        if path.stat().st_size > 50 << 20:
            return None, f"{path} is larger than 50 MiB"
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        return None, f"cannot read {path}: {e}"
    except (json.JSONDecodeError, RecursionError):
        return None, f"{path} is not a notebook (not JSON)"
    if not isinstance(raw, dict) or raw.get("nbformat") != 4 or not isinstance(raw.get("cells"), list):
        return None, f"{path} is not an nbformat-4 notebook with a list of cells"
    return raw, None


def _cell_keys(cells: Any) -> set[str]:
    """What identifies a notebook's cells, whoever edited it: each cell's id and grade_id, and a hash
    of each cell's source (whitespace-normalised; very short sources say nothing about the lab)."""
    keys = set()
    for cell in cells if isinstance(cells, list) else []:
        if not isinstance(cell, dict):
            continue
        if isinstance(cell.get("id"), str):
            keys.add("id:" + cell["id"])
        meta = cell.get("metadata")
        gid = meta.get("nbgrader", {}).get("grade_id") if isinstance(meta, dict) and isinstance(meta.get("nbgrader"), dict) else None
        if isinstance(gid, str):
            keys.add("grade_id:" + gid)
        source = cell.get("source")
        source = "".join(map(str, source)) if isinstance(source, list) else source
        if isinstance(source, str) and len(text := " ".join(source.split())) >= 40:
            keys.add("source:" + hashlib.sha1(text.encode()).hexdigest())
    return keys


@functools.lru_cache(maxsize=1)
def _distinctive_keys() -> dict[str, frozenset]:
    """For each lab, the keys of its cells (instructor and student versions) that no other lab has."""
    keys = {lab: _cell_keys(source_notebook(lab).cells) | _cell_keys(student_notebook(lab).cells) for lab in labs()}
    seen: dict[str, int] = {}
    for ks in keys.values():
        for k in ks:
            seen[k] = seen.get(k, 0) + 1
    return {lab: frozenset(k for k in ks if seen[k] == 1) for lab, ks in keys.items()}


def detect_lab(nb: Any, path: Path) -> str | None:
    """The lab a submission answers: the lab `release` wrote into its metadata; else its file name, if
    it names one ('lab07_checkpointing (1).ipynb', 'Copy of lab07_checkpointing.ipynb'); else its
    cells: the lab with the most cells (ids, grade_ids, sources) found in that lab alone. None if
    nothing tells (e.g. alice.ipynb with every cell rewritten)."""
    known = labs()
    meta = nb.get("metadata") if isinstance(nb, dict) else None
    tag = meta.get("vramlab") if isinstance(meta, dict) else None
    if isinstance(tag, dict) and tag.get("lab") in known:
        return tag["lab"]
    for lab in known:
        if re.search(rf"(?:^|[^A-Za-z0-9]){re.escape(lab)}", path.stem):
            return lab
    ids = _cell_keys(nb.get("cells") if isinstance(nb, dict) else None)
    overlap = {lab: len(ids & keys) for lab, keys in _distinctive_keys().items()}
    best = max(overlap.values(), default=0)
    winners = [lab for lab, n in overlap.items() if n == best]
    return winners[0] if best and len(winners) == 1 else None


def total(scores: dict) -> tuple[int, int]:
    """(points earned, points possible) of a `grade` result."""
    return sum(s[0] for s in scores.values()), sum(s[1] for s in scores.values())


def _positive_seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < v <= 86_400:
        raise argparse.ArgumentTypeError(f"must be above 0 and at most 86400, got {text}")
    return v


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("release")
    sub.add_parser("sync", help="derive the labs' install cell and _config.yml's repository from pyproject.toml")
    sub.add_parser("check")
    sub.add_parser("sources")
    r = sub.add_parser("record", help="run a lab's instructor version and store its results in labs/results/")
    r.add_argument("lab")
    g = sub.add_parser("grade", help="score one submission (see labs/README.md for what it defends against)")
    g.add_argument("notebook", type=Path, nargs="+", help="one or more submissions")
    g.add_argument("--lab", default=None, help="which lab (default: from the file name or its cells)")
    g.add_argument("--timeout", type=_positive_seconds, default=600,
                   help="seconds the answers may take to load, and each test cell to run (default 600)")
    g.add_argument("--memory-gib", type=_positive_seconds, default=4, help="data memory of the answers' process (default 4)")
    g.add_argument("--json", type=Path, default=None, help="also write the scores here as JSON")
    g.add_argument("--no-sandbox", action="store_true",
                   help="grade without a sandbox (provisional scores: an answer can read the instructor sources)")
    args = p.parse_args(argv)
    if getattr(args, "lab", None) is not None and args.lab not in labs():
        print(f"tools: unknown lab {args.lab!r}; labs: {', '.join(labs())}", file=sys.stderr)
        return 2
    if args.cmd == "sync":
        changed = sync()
        print("\n".join(f"wrote {c}" for c in changed) or "everything derived from pyproject.toml is current")
    elif args.cmd == "release":
        for lab in labs():
            print(f"wrote {release(lab).relative_to(LABS.parent)}")
    elif args.cmd == "sources":
        write_sources()
    elif args.cmd == "record":
        import tempfile

        out = LABS / "results" / f"{args.lab}.json"
        with tempfile.TemporaryDirectory() as tmp:  # the stored results change only if every cell ran
            staged = Path(tmp) / out.name
            executed, problem = execute(source_notebook(args.lab), env={
                "VRAMLAB_RESULTS": str(staged), "VRAMLAB_COMMAND": f"python labs/tools.py record {args.lab}"})
            scores = kernel_scores(executed, problem)
            failed = [c.metadata.get("nbgrader", {}).get("grade_id", "?") for c in executed.cells
                      if any(o.get("output_type") == "error" for o in c.get("outputs", []))]
            got, possible = total(scores)
            if failed or problem or got != possible or not staged.exists():
                why = (f"cells {', '.join(failed)} failed" if failed else problem or f"instructor score {got}/{possible}")
                print(f"tools: record {args.lab}: {why}; {out.relative_to(LABS.parent)} left as it was", file=sys.stderr)
                return 1
            out.write_bytes(staged.read_bytes())
        print(f"wrote {out.relative_to(LABS.parent)}; instructor score {got}/{possible}")
    elif args.cmd == "check":
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            stale = [lab for lab in labs() if not (RELEASE / lab / f"{lab}.ipynb").is_file()
                     or release(lab, Path(tmp)).read_bytes() != (RELEASE / lab / f"{lab}.ipynb").read_bytes()]
        stray = sorted(p.name for p in RELEASE.iterdir() if p.name not in labs()) if RELEASE.is_dir() else []
        if stray:
            print(f"labs/release has {', '.join(stray)}, which no lab source releases: remove it")
            return 1
        drift = sync(write=False)
        if drift:
            print(f"{', '.join(drift)} no longer match pyproject.toml: run python labs/tools.py sync, then release")
            return 1
        if stale:
            print(f"labs/release is stale for {', '.join(stale)}: run python labs/tools.py release")
            return 1
        print("labs/release is up to date, and the install cells and _config.yml match pyproject.toml")
    else:
        import sandbox as sb

        prefix, how = sb.sandbox_prefix() if not args.no_sandbox else ([], "no sandbox (--no-sandbox)")
        if not prefix and not args.no_sandbox:
            print(f"tools: {how}: without one an answer can read the instructor sources and hidden tests from "
                  "disk; grade on a machine with user namespaces, or pass --no-sandbox for provisional scores",
                  file=sys.stderr)
            return 2
        provisional = not prefix
        results, status = [], 0
        for path in args.notebook:  # several: e.g. nbgrader's submitted/*/LAB/LAB.ipynb, each scored alone
            nb, why = read_submission(path)
            lab = args.lab or detect_lab(nb if nb is not None else {}, path)
            if lab is None:
                print(f"tools: cannot tell which lab {path} answers ({why or 'no lab name, no known cells'}); "
                      f"pass --lab ({', '.join(labs())})", file=sys.stderr)
                status = 2
                continue
            report: dict = {}
            scores = _zero(lab, why) if nb is None else grade(nb, lab, timeout=args.timeout, memory_gib=args.memory_gib,
                                                              sandbox=not provisional, report=report)
            if len(args.notebook) > 1:
                print(f"== {path}")
            print(how + (" - PROVISIONAL scores: an answer could have read the instructor sources" if provisional else ""))
            for gid, (got, possible, err) in scores.items():
                print(f"{gid:12s}{got:>3}/{possible}  {err or 'ok'}")
            print(f"total {'/'.join(map(str, total(scores)))}  ({lab})", flush=True)
            results.append({"notebook": str(path), "lab": lab, "scores": {k: list(v) for k, v in scores.items()},
                            "total": list(total(scores)), "sandbox": how, "provisional": provisional})
        if args.json:
            try:
                args.json.write_text(json.dumps(results[0] if len(args.notebook) == 1 and results else results,
                                                indent=1) + "\n")
            except OSError as e:
                print(f"tools: cannot write {args.json}: {e.strerror or e} (the scores are printed above)", file=sys.stderr)
                return 1
        return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
