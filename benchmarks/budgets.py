"""Every speed and latency budget the course keeps, measured on this machine and written to one
results file. The tests never time anything (a busy machine must not fail a test): this is where
speed is judged.

Budgets (each measured as a median over repeats, or once where one run is the quantity):
- estimator      `estimate_training` of Llama-3.1-8B, median of 200 calls        <= 1 ms
- calculators    every live calculator at its defaults and the ends of its ranges  <= 100 ms each
                 (benchmarks/calculator_speed.py --quick; its full sweep has its own file)
- build          the README's strict book build, whole and per page              <= 5 min; <= 30 s a page
- pages          the built book in chromium: first live result, recompute         <= 8 s; <= 100 ms
                 (benchmarks/page_speed.py; needs chromium and tests/browser's npm install)
- labs           each lab's instructor version run in CPU mode, as the tests do   <= 90 s each

Each is also given as a multiple of a reference workload timed at the start and the end (a fixed
pure-Python loop): on a busier or slower machine both grow, so the ratio says whether the code got
slower or the machine did.

    python benchmarks/budgets.py                        # all of it (~20 min on 2 quiet cores)
    python benchmarks/budgets.py --only estimator,calculators,build
    python benchmarks/budgets.py --strict               # exit 1 when a budget is exceeded
    python benchmarks/budgets.py --only pages --html _build/html --update   # re-measure one step, keep the rest

Writes benchmarks/results/speed/budgets_<host>.json (with provenance); progress on stderr, a table on stdout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
STEPS = ("estimator", "calculators", "build", "pages", "labs")
LABS = ("lab01_where_memory_goes", "lab02_collectives", "lab03_parallelism", "lab04_zero", "lab05_mixed_precision",
        "lab06_offload", "lab07_checkpointing", "lab08_compression")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def reference_seconds(repeats: int = 5) -> float:
    """A fixed pure-Python workload (median of `repeats`): the machine's speed right now."""
    def work():
        t = time.perf_counter()
        s = 0
        for i in range(2_000_000):
            s += i * i % 7
        return time.perf_counter() - t
    return statistics.median(work() for _ in range(repeats))


def row(name: str, measured: float, budget: float, unit: str, how: str, **extra) -> dict:
    return {"budget": name, "measured": round(measured, 4), "limit": budget, "unit": unit, "ok": measured <= budget,
            "how": how, **extra}


def estimator() -> list[dict]:
    import vramlab

    s = vramlab.preset("llama-3.1-8b")
    times = []
    for _ in range(200):
        t = time.perf_counter()
        vramlab.estimate_training(s, batch_size=4, seq_len=4096, precision="bf16-mixed")
        times.append(time.perf_counter() - t)
    return [row("estimate_training (llama-3.1-8b)", 1e3 * statistics.median(times), 1.0, "ms", "median of 200 calls")]


def calculators() -> list[dict]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import calculator_speed as cs
    from vramlab.present import calculators as C

    out = []
    for name, calc in C.CALCULATORS.items():
        ms = [statistics.median(_ms(lambda v=v: calc.run(**v)) for _ in range(5)) for v in cs._edges(calc)]
        out.append(row(f"calculator {name}", max(ms), cs.BUDGET_MS, "ms",
                       f"slowest of {len(ms)} inputs (defaults, each range's ends), each the median of 5, memos emptied"))
    return out


def _ms(fn) -> float:
    import calculator_speed

    calculator_speed.clear_caches()  # a new input finds the memos cold: so does each timing
    t = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t)


def build(html_dir: Path) -> list[dict]:
    log(f"building the book into {html_dir.parent} (strict) ...")
    t = time.perf_counter()
    r = subprocess.run([str(Path(sys.executable).with_name("jupyter-book")), "build", str(ROOT), "-W", "--keep-going",
                        "--path-output", str(html_dir.parent.parent)], capture_output=True, text=True, cwd=ROOT)
    total = time.perf_counter() - t
    if r.returncode:
        tail = (r.stdout + r.stderr).strip().splitlines()[-5:]
        raise RuntimeError("the book build failed: " + " | ".join(tail))
    pages = {Path(m.group(1)).name: float(m.group(2))
             for m in re.finditer(r"(\S+\.md): Executed notebook in ([\d.]+) seconds", r.stdout + r.stderr)}
    out = [row("book build (strict)", total, 300, "s", "one build, install done")]
    slow = max(pages.items(), key=lambda kv: kv[1]) if pages else ("(none)", 0.0)
    out.append(row("slowest page's execution", slow[1], 30, "s", f"{slow[0]} of {len(pages)} pages",
                   pages={k: round(v, 2) for k, v in pages.items()}))
    return out


def pages(html_dir: Path) -> list[dict]:
    script = ROOT / "benchmarks" / "page_speed.py"
    if not script.exists():
        raise RuntimeError("benchmarks/page_speed.py is missing")
    with tempfile.TemporaryDirectory() as tmp:
        out_file = Path(tmp) / "pages.json"
        r = subprocess.run([sys.executable, str(script), "--html", str(html_dir), "--out", str(out_file)],
                           capture_output=True, text=True, cwd=ROOT)
        if r.returncode or not out_file.exists():
            raise RuntimeError("page_speed.py: " + ((r.stderr or r.stdout).strip().splitlines() or ["failed"])[-1])
        res = json.loads(out_file.read_text())
    out = []
    for c in res.get("calculators", []):
        out.append(row(f"page {c['calc']}: first live result", c["cold_s"], res["budgets"]["cold_s"], "s",
                       "cold: Python loaded into the page, then the answer"))
        out.append(row(f"page {c['calc']}: recompute", c["recompute_ms_median"], res["budgets"]["recompute_ms"], "ms",
                       f"median of {len(c['recompute_ms'])} recomputes, end to end"))
    return out


def labs(which: list[str]) -> list[dict]:
    sys.path.insert(0, str(ROOT / "labs"))
    import tools

    out = []
    for lab in which:
        log(f"running {lab}'s instructor version in CPU mode ...")
        with tempfile.TemporaryDirectory() as tmp:
            t = time.perf_counter()
            _, problem = tools.execute(tools.source_notebook(lab), env={"VRAMLAB_RESULTS": str(Path(tmp) / "r.json")})
            s = time.perf_counter() - t
        out.append(row(f"{lab} (CPU mode)", s, 90, "s", "one run of the instructor notebook",
                       **({"problem": str(problem)} if problem else {})))
    return out


def _provenance(argv) -> dict:
    return {"device": "cpu", "host": socket.gethostname(), "cpus": os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(), "platform": platform.platform(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python benchmarks/budgets.py " + " ".join(argv if argv is not None else sys.argv[1:])}


def _step_of(r: dict) -> str:
    if r.get("step"):
        return r["step"]
    name = r["budget"]
    return ("pages" if name.startswith("page ") else "labs" if name.startswith("lab") else
            "calculators" if name.startswith("calculator ") else "estimator" if name.startswith("estimate") else "build")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])

    def one_line(message: str):  # bad input: one line, exit status 2 (argparse's usage block omitted)
        print(f"budgets.py: error: {message}", file=sys.stderr)
        raise SystemExit(2)
    ap.error = one_line
    ap.add_argument("--only", default=",".join(STEPS), help=f"comma-separated steps of {', '.join(STEPS)} (default: all)")
    ap.add_argument("--labs", default=",".join(LABS), help="which labs the labs step runs (default: all eight)")
    ap.add_argument("--html", default=None, help="a built book to time in the browser (default: the one the build step makes)")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a budget is exceeded")
    ap.add_argument("--out", default=None, help="results file (default benchmarks/results/speed/budgets_<host>.json)")
    ap.add_argument("--update", action="store_true",
                    help="keep the results file's rows of the steps not run now (each step keeps its own provenance)")
    a = ap.parse_args(argv)
    steps = [s.strip() for s in a.only.split(",") if s.strip()]
    bad = [s for s in steps if s not in STEPS]
    if bad or not steps:
        ap.error(f"--only takes steps among {', '.join(STEPS)}, got {a.only!r}")
    which = [s.strip() for s in a.labs.split(",") if s.strip()]
    if [x for x in which if x not in LABS] or not which:
        ap.error(f"--labs takes labs among {', '.join(LABS)}, got {a.labs!r}")
    out = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / "speed" / f"budgets_{socket.gethostname()}.json"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.touch()
    except OSError as e:
        ap.error(f"cannot write --out {out}: {e.strerror or e}")

    previous = {}
    if a.update and out.stat().st_size:
        try:
            previous = json.loads(out.read_text())
        except ValueError:
            ap.error(f"--update: {out} is not a results file")
    ref0 = reference_seconds()
    rows, failures = [], []
    with tempfile.TemporaryDirectory() as tmp:
        html = Path(a.html) if a.html else Path(tmp) / "_build" / "html"
        for step in steps:
            log(f"== {step}")
            before = len(rows)
            try:
                if step == "estimator":
                    rows += estimator()
                elif step == "calculators":
                    rows += calculators()
                elif step == "build":
                    rows += build(html)
                elif step == "pages":
                    if not (html / "index.html").exists():
                        raise RuntimeError(f"no built book at {html} (run the build step or give --html)")
                    rows += pages(html)
                elif step == "labs":
                    rows += labs(which)
            except Exception as e:  # one step's failure is reported, the others still run
                failures.append({"step": step, "error": f"{type(e).__name__}: {e}"})
                log(f"{step}: not measured: {e}")
            for r in rows[before:]:
                r["step"] = step
    ref1 = reference_seconds()
    ref = (ref0 + ref1) / 2
    for r in rows:
        seconds = r["measured"] * {"ms": 1e-3, "s": 1.0}[r["unit"]]
        r["in_reference_units"] = float(f"{seconds / ref:.4g}")
    now = _provenance(argv)
    for r in rows:
        r["measured_at"] = {"date": now["date"], "reference_workload_s": round(ref, 4), "command": now["command"]}
    if previous:  # the steps not run now keep their rows (and when and how they were measured)
        kept = [r for r in previous.get("rows", []) if _step_of(r) not in steps]
        for r in kept:
            r.setdefault("step", _step_of(r))
            r.setdefault("measured_at", {"date": previous["provenance"]["date"],
                                         "reference_workload_s": round(sum(previous["reference_workload_s"].values()) / 2, 4),
                                         "command": previous["provenance"]["command"]})
        rows = kept + rows
        failures = [f for f in previous.get("not_measured", []) if f["step"] not in steps] + failures
    result = {
        "what": "the course's speed and latency budgets on this machine (benchmarks/budgets.py)",
        "reference_workload_s": {"start": round(ref0, 4), "end": round(ref1, 4)},
        "provenance": now,
        "over_budget": [r["budget"] for r in rows if not r["ok"]],
        "not_measured": failures,
        "rows": rows,
    }
    out.write_text(json.dumps(result, indent=1) + "\n")
    width = max([len(r["budget"]) for r in rows] + [6])
    print(f"{'budget':<{width}}  {'measured':>10}  {'limit':>8}")
    for r in rows:
        print(f"{r['budget']:<{width}}  {r['measured']:>8.1f} {r['unit']:<2} {r['limit']:>6g} {r['unit']:<2}"
              f"{'' if r['ok'] else '  OVER'}")
    for f in failures:
        print(f"{f['step']}: not measured ({f['error']})")
    print(f"reference workload {ref0:.3f} s at the start, {ref1:.3f} s at the end; "
          f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 1 if a.strict and (result["over_budget"] or failures) else 0


if __name__ == "__main__":
    raise SystemExit(main())
