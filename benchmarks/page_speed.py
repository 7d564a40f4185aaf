"""How fast the built book's live calculators answer in a real browser: for each case of
tests/browser/cases.json (the browser test's), the first live result after the first change (cold:
Pyodide and vramlab load in the page's Web Worker) and a recompute (the median of --repeats more
changes, undoing and redoing the case's last change), against the budgets: 8 s cold, 100 ms a recompute.

    python benchmarks/page_speed.py [--html _build/html] [--repeats 7] [--strict]

Serves the built book on localhost, drives Debian's chromium with tests/browser/check.mjs (needs
`npm install --prefix tests/browser`), and writes benchmarks/results/speed/pages_<host>.json with its
provenance (chromium's version, host, CPUs, date, command). A benchmark, not a test: --strict exits 1
when a calculator is over budget; times depend on the machine (a 2-core CI runner is slower)."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_browser import BROWSER, CASES, CHROMIUM, _missing, check  # noqa: E402  (the browser test's driver)

COLD_BUDGET_S = 8.0
RECOMPUTE_BUDGET_MS = 100.0


def _chromium_version() -> str:
    try:
        out = subprocess.run([CHROMIUM, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError, TypeError):
        return "unknown"
    return out.strip().splitlines()[-1] if out.strip() else "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--html", default="_build/html", help="the built book's html folder (default: _build/html)")
    ap.add_argument("--repeats", type=int, default=7, help="recomputes timed per calculator (at least 5; default 7)")
    ap.add_argument("--out", default=None, help="result file (default: benchmarks/results/speed/pages_<host>.json)")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a calculator is over budget")
    args = ap.parse_args(argv)
    html = Path(args.html)
    if not (html / "book").is_dir():
        ap.error(f"--html {args.html}: not a built book's html folder (build it: jupyter-book build .)")
    if args.repeats < 5:
        ap.error(f"--repeats {args.repeats}: at least 5 recomputes make a median")
    why = _missing()
    if why:
        print(f"page_speed: cannot run: {why}", file=sys.stderr)
        return 2
    cases = [{**c, "repeats": args.repeats} for c in CASES]
    with tempfile.TemporaryDirectory() as tmp:
        report = check(html, {"pages": [], "widths": [1280], "calcs": cases}, Path(tmp) / "plan.json", timeout=3600)
    rows = []
    for r in report["calcs"]:
        cold = r["runs"][0]["seconds"]
        recompute_ms = 1000 * statistics.median(r["recomputes"])
        rows.append({"calc": r["calc"], "page": r["page"], "cold_s": round(cold, 3),
                     "recompute_ms_median": round(recompute_ms, 1),
                     "recompute_ms": [round(1000 * s, 1) for s in r["recomputes"]],
                     "over_budget": cold > COLD_BUDGET_S or recompute_ms > RECOMPUTE_BUDGET_MS})
        flag = "  OVER BUDGET" if rows[-1]["over_budget"] else ""
        print(f"{r['calc']:>14}: first live result {cold:6.2f} s, recompute {recompute_ms:7.1f} ms (median of "
              f"{len(r['recomputes'])}){flag}")
    host = socket.gethostname().split(".")[0] or "host"
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / "speed" / f"pages_{host}.json"
    result = {
        "what": "the built book's live calculators in chromium: seconds to the first live result after the first change "
                "(cold), and the median of the recomputes (ms), end to end as a reader sees them",
        "budgets": {"cold_s": COLD_BUDGET_S, "recompute_ms": RECOMPUTE_BUDGET_MS},
        "provenance": {"device": "cpu", "browser": _chromium_version(), "host": host, "cpus": os.cpu_count(),
                       "python": platform.python_version(), "platform": platform.platform(),
                       "node": (subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip()
                                if shutil.which("node") else "unknown"),
                       "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                       "command": "python benchmarks/page_speed.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                       "cases": str((BROWSER / "cases.json").relative_to(ROOT))},
        "over_budget": sum(r["over_budget"] for r in rows),
        "calculators": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 1 if args.strict and result["over_budget"] else 0


if __name__ == "__main__":
    sys.exit(main())
