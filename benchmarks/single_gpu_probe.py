"""The FSDP2 GPU cases' models without FSDP2, on one GPU: estimate_training against the allocator, one
configuration per process (vramlab.measure.memory.measure_isolated), to tell the single-device engine's error
from the FSDP2 layer's. Writes benchmarks/results/h100/single_gpu_probe_h100.jsonl.

    python benchmarks/single_gpu_probe.py
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from vramlab import estimate_training, preset  # noqa: E402
from vramlab.measure.memory import measure_isolated  # noqa: E402
from vramlab.measure.record import provenance  # noqa: E402
from vramlab.measure.zero import model_spec  # noqa: E402

CASES = [  # (model, overrides, options)
    ("pythia-410m", {}, dict(batch_size=4, seq_len=1024, precision="fp32")),
    ("pythia-410m", {}, dict(batch_size=4, seq_len=1024, precision="bf16")),
    ("pythia-160m", {}, dict(batch_size=4, seq_len=1024, precision="fp32")),
    ("mistral-block-small-vocab", {}, dict(batch_size=1, seq_len=2048, precision="fp32")),
    ("mistral-block-small-vocab", {}, dict(batch_size=1, seq_len=2048, precision="bf16")),
    ("mt5-base", {}, dict(batch_size=2, seq_len=512, precision="bf16")),
    ("mt5-base", {}, dict(batch_size=2, seq_len=512, precision="fp32")),
    ("llama-3.2-1b", {"num_layers": 4}, dict(batch_size=2, seq_len=1024, precision="fp32")),
    ("llama-3.2-1b", {"num_layers": 4}, dict(batch_size=2, seq_len=1024, precision="bf16")),
]


def spec_of(name, over):
    try:
        s = model_spec(name)
    except KeyError:
        s = preset(name)
    return dataclasses.replace(s, **over)


def main() -> int:
    out = ROOT / "benchmarks" / "results" / "h100" / "single_gpu_probe_h100.jsonl"
    rows = []
    for name, over, opts in CASES:
        spec = spec_of(name, over)
        t0 = time.perf_counter()
        m = measure_isolated("training", spec, optimizer_impl="for-loop", **opts)
        est = estimate_training(spec, device="cuda", optimizer_impl="for-loop", **opts)
        row = {"case": f"{name}{over or ''} {opts}", "model": name, "overrides": over, "options": opts,
               "measured": m.to_dict() if m else None, "estimate": est.to_dict(), "estimate_phase": est.phase,
               "error_pct": 100 * (est.total / m.peak_allocated - 1) if m else None}
        rows.append(row)
        print(f"{row['case']:80} est {est.total / 2**30:7.3f} ({est.phase[:28]}) alloc "
              f"{(m.peak_allocated if m else 0) / 2**30:7.3f} err {row['error_pct'] or 0:+.1f} %  "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    prov = provenance("cuda")
    with out.open("w") as f:
        for r in rows:
            f.write(json.dumps({**r, "provenance": prov, "command": "python benchmarks/single_gpu_probe.py"}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
