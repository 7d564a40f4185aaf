"""Run a lab's instructor version without Jupyter: the code cells of its MyST source, in order, in
one namespace. Standard library only, so it runs where no Jupyter stack is installed (the bare GPU
image: torch, transformers, peft). Grading still goes through nbgrader (labs/tools.py); this is for
recording results on a GPU.

    python labs/kernelless.py lab01_where_memory_goes [--results PATH]
"""

from __future__ import annotations

import argparse
import linecache
import os
import re
import sys
import time
from pathlib import Path

LABS = Path(__file__).resolve().parent
_FENCE = re.compile(r"^```\{code-cell\}[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)


def code_cells(lab: str) -> list[str]:
    """The source of every code cell of labs/source/<lab>/<lab>.md, without its YAML metadata."""
    path = LABS / "source" / lab / f"{lab}.md"
    if not path.exists():
        known = sorted(p.name for p in (LABS / "source").iterdir() if p.is_dir())
        raise SystemExit(f"kernelless: unknown lab {lab!r}; known: {', '.join(known)}")
    cells = []
    for body in _FENCE.findall(path.read_text(encoding="utf-8")):
        if body.startswith("---\n"):  # the cell's YAML metadata block
            body = body.split("\n---\n", 1)[1]
        elif body.startswith(":"):  # short-form metadata lines (":tags: [...]")
            body = "\n".join(line for line in body.splitlines() if not line.startswith(":")).lstrip("\n")
        cells.append(body.rstrip("\n"))
    return cells


def run(lab: str, *, results: Path | None = None, command: str | None = None) -> dict:
    """Execute the lab's code cells; VRAMLAB_RESULTS / VRAMLAB_COMMAND tell its save cell where
    to write and what to record as the command. Returns the namespace the cells built."""
    import matplotlib

    matplotlib.use("Agg")  # plt.show() draws nothing, nowhere
    env = {"VRAMLAB_RESULTS": str(results or LABS / "results" / f"{lab}.json"),
           "VRAMLAB_COMMAND": command or f"python labs/kernelless.py {lab}"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    cwd = Path.cwd()
    os.chdir(LABS / "source" / lab)  # where nbgrader and Jupyter run it
    ns: dict = {"__name__": "__main__"}
    try:
        cells = code_cells(lab)
        for i, src in enumerate(cells, 1):
            t0 = time.perf_counter()
            name = f"<{lab} cell {i}>"
            # as IPython does: keep the cell's lines where inspect.getsource (lab 2's grader) finds them
            linecache.cache[name] = (len(src), None, src.splitlines(keepends=True), name)
            exec(compile(src, name, "exec"), ns)  # noqa: S102 - our own lab sources
            print(f"[{lab}] cell {i}/{len(cells)} done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    finally:
        os.chdir(cwd)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return ns


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("lab")
    p.add_argument("--results", type=Path, help="default: labs/results/<lab>.json")
    args = p.parse_args(argv)
    run(args.lab, results=args.results.resolve() if args.results else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
