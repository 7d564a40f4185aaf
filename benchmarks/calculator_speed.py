"""How long the live calculators take to answer, at the edges of their input ranges: the page's
budget is 100 ms per answer (a reader drags a slider). Speed lives here, not in the tests: a busy
machine must never fail a test.

Timed, each the best of a few repeats:
- every calculator at its defaults, with each input at each end of its range (each choice, min and
  max) while the others keep their defaults, with every input at its largest, and on a fixed random
  sample of combinations;
- the functions the calculators call at their heaviest: `pipeline.simulate(256, 1024)` for every
  schedule, `parallel.estimate_layout` of a 70B model with pp = 80 and 1,024 micro-batches,
  `offload.smallest_resident` over 2,000 equal layers.

    python benchmarks/calculator_speed.py              # writes benchmarks/results/speed/calculators_<host>.json
    python benchmarks/calculator_speed.py --quick      # defaults and the named cases only
    python benchmarks/calculator_speed.py --strict     # exit 1 when anything is over the budget

Progress goes to stderr; the summary (slowest first) to stdout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from vramlab import offload, parallel, pipeline  # noqa: E402
from vramlab.present import calculators

BUDGET_MS = 100.0


def clear_caches() -> None:
    """Empty every memo (functools cache) of vramlab's modules: a reader's new input finds them cold,
    so each timing starts cold too (a repeat would otherwise time the cache)."""
    for name, mod in list(sys.modules.items()):
        if name == "vramlab" or name.startswith("vramlab."):
            for obj in vars(mod).values():
                if callable(getattr(obj, "cache_clear", None)) and getattr(obj, "__module__", "") == name:
                    obj.cache_clear()


def _best_ms(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        clear_caches()
        t = time.perf_counter()
        fn()
        best = min(best, (time.perf_counter() - t) * 1e3)
        if best > 10 * BUDGET_MS:  # far over: one timing says enough
            break
    return best


def _edges(calc: calculators.Calculator) -> list[dict]:
    out = [{}]
    for i in calc.inputs:
        if i.kind == "file":  # no file: the built-in example
            continue
        values = list(i.choices) if i.kind == "choice" else [i.min, i.max]
        if i.kind == "int":
            values = [int(v) for v in values]
        out += [{i.name: v} for v in values if v != i.default]
    out.append({i.name: (i.choices[-1] if i.kind == "choice" else (int(i.max) if i.kind == "int" else i.max))
                for i in calc.inputs if i.kind != "file"})
    return out


def _sample(calc: calculators.Calculator, rng: random.Random, n: int) -> list[dict]:
    out = []
    for _ in range(n):
        v = {}
        for i in calc.inputs:
            if i.kind == "file":
                continue  # the built-in example
            if i.kind == "choice":
                v[i.name] = rng.choice(i.choices)
            elif i.kind == "int":
                v[i.name] = rng.randint(int(i.min), int(i.max))
            else:
                v[i.name] = rng.uniform(i.min, i.max)
        out.append(v)
    return out


def named_cases() -> list[tuple[str, object]]:
    big = "llama-3.1-70b"
    layers = 2000
    cases = [(f"pipeline.simulate(256, 1024, {s!r}{', chunks=2' if s == 'interleaved' else ''})",
              (lambda s=s: pipeline.simulate(256, 1024, s, chunks=2 if s == "interleaved" else 1)))
             for s in ("gpipe", "1f1b", "interleaved")]
    cases.append((f"parallel.estimate_layout({big}, pp=80, micro_batches=1024)",
                  lambda: parallel.estimate_layout(big, parallel.Layout(pp=80, micro_batches=1024),
                                                   micro_batch_size=1, seq_len=4096)))
    cases.append((f"offload.smallest_resident({layers} equal layers)",
                  lambda: offload.smallest_resident([50 << 20] * layers, [2e-4] * layers, link_GBps=25)))
    return cases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="defaults and the named cases only")
    ap.add_argument("--strict", action="store_true", help="exit 1 when anything is over the budget")
    ap.add_argument("--sample", type=int, default=20, help="random combinations per calculator (default 20)")
    ap.add_argument("--out", default=None, help="results file (default benchmarks/results/speed/calculators_<host>.json)")
    a = ap.parse_args(argv)
    out = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / "speed" / f"calculators_{socket.gethostname()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    rows = []
    rng = random.Random(29)
    for name, calc in calculators.CALCULATORS.items():
        inputs = [{}] if a.quick else _edges(calc) + _sample(calc, rng, a.sample)
        for values in inputs:
            error = []
            ms = _best_ms(lambda: error.append(calc.run(**values).error))
            rows.append({"case": f"{name}({json.dumps(values)})", "ms": round(ms, 3), "error": error[-1]})
        worst = max((r for r in rows if r["case"].startswith(name + "(")), key=lambda r: r["ms"])
        print(f"{name}: {len(inputs)} inputs, slowest {worst['ms']:.1f} ms", file=sys.stderr)
    for label, fn in named_cases():
        ms = _best_ms(fn)
        rows.append({"case": label, "ms": round(ms, 3), "error": ""})
        print(f"{label}: {ms:.1f} ms", file=sys.stderr)

    over = [r for r in rows if r["ms"] > BUDGET_MS]
    result = {
        "what": "time to answer, best of 3, each with vramlab's memos emptied first, ms (calculators: Calculator.run, validation included)",
        "budget_ms": BUDGET_MS,
        "provenance": {"device": "cpu", "host": socket.gethostname(), "cpus": os.cpu_count(),
                       "python": platform.python_version(), "platform": platform.platform(),
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "command": "python benchmarks/calculator_speed.py " + " ".join(argv or sys.argv[1:])},
        "over_budget": len(over),
        "slowest": sorted(rows, key=lambda r: -r["ms"])[:15],
        "rows": rows,
    }
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{len(rows)} timings, {len(over)} over {BUDGET_MS:.0f} ms; slowest:")
    for r in result["slowest"][:10]:
        print(f"  {r['ms']:9.1f} ms  {r['case'][:110]}")
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 1 if (a.strict and over) else 0


if __name__ == "__main__":
    raise SystemExit(main())
