"""The caching allocator's model (vramlab.allocator) against the H100: record each case's
allocations and frees in order on the CPU (vramlab.measure.allocator, trace mode: nothing is
allocated), replay them through the model (default allocator and expandable segments), and set the
replayed peaks beside the H100's max_memory_allocated / max_memory_reserved for the same case
(gpu-truth files, copied here with their provenance so the book never reads ../shared).

    python benchmarks/allocator_validation.py [--only gpt2-b4-s512,...] [--gpu-truth ../shared/gpu-truth]

Writes benchmarks/results/allocator/validation.json and, for the book's example, the recorded
events of GPT-2 b=8 s=1024 bf16-mixed followed by an evaluation at batch 32 and one more training
step (benchmarks/results/allocator/events_gpt2_b8_s1024_bf16-mixed.json.gz).
Minutes on 2 CPU cores (each case records in 10-60 s).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "allocator"
H100_TOTAL = 85017493504  # torch.cuda.mem_get_info() total on the H100 (gpu-truth README)

# (key, preset, overrides, options, gpu-truth file, the H100 rows' case name, alloc_conf)
CASES = [
    ("gpt2-b4-s512", "gpt2", {}, dict(batch_size=4, seq_len=512), "benchmark_cases_h100.jsonl", "gpt2 b=4 s=512"),
    ("gpt2-b16-s256", "gpt2", {}, dict(batch_size=16, seq_len=256), "benchmark_cases_h100.jsonl", "gpt2 b=16 s=256"),
    ("gpt2-b4-s1024", "gpt2", {}, dict(batch_size=4, seq_len=1024), "benchmark_cases_h100.jsonl", "gpt2 b=4 s=1024"),
    ("gpt2-b4-s1024-eager", "gpt2", {}, dict(batch_size=4, seq_len=1024, attention="eager"),
     "benchmark_cases_h100.jsonl", "gpt2 b=4 s=1024 attention=eager"),
    ("bert-base-b8-s256", "bert-base", {}, dict(batch_size=8, seq_len=256), "benchmark_cases_h100.jsonl",
     "bert-base b=8 s=256"),
    ("opt-125m-b4-s512", "opt-125m", {}, dict(batch_size=4, seq_len=512), "benchmark_cases_h100.jsonl",
     "opt-125m b=4 s=512"),
    ("pythia-160m-b4-s512", "pythia-160m", {}, dict(batch_size=4, seq_len=512), "benchmark_cases_h100.jsonl",
     "pythia-160m b=4 s=512"),
    ("t5-small-b4-s256", "t5-small", {}, dict(batch_size=4, seq_len=256), "benchmark_cases_h100.jsonl",
     "t5-small b=4 s=256"),
    ("llama2l-b2-s512", "llama-3.2-1b", {"num_layers": 2}, dict(batch_size=2, seq_len=512),
     "benchmark_cases_h100.jsonl", "llama-3.2-1b[num_layers=2] b=2 s=512"),
    ("llama4l-b4-s1024-full", "llama-3.2-1b", {"num_layers": 4}, dict(batch_size=4, seq_len=1024, recompute="full"),
     "benchmark_cases_h100.jsonl", "llama-3.2-1b[num_layers=4] b=4 s=1024 recompute=full"),
    ("gpt2-b8-s256-bf16-mixed", "gpt2", {}, dict(batch_size=8, seq_len=256, precision="bf16-mixed"),
     "benchmark_cases_h100.jsonl", "gpt2 b=8 s=256 precision=bf16-mixed"),
    ("gpt2-b8-s1024-bf16-mixed", "gpt2", {}, dict(batch_size=8, seq_len=1024, precision="bf16-mixed"),
     "presets_train_h100.jsonl", "gpt2 b=8 s=1024 bf16-mixed recompute=none attention=sdpa"),
    ("gpt2-b8-s1024-fp32", "gpt2", {}, dict(batch_size=8, seq_len=1024), "presets_train_h100.jsonl",
     "gpt2 b=8 s=1024 fp32 recompute=none attention=sdpa"),
    ("pythia-160m-b8-s1024-bf16-mixed", "pythia-160m", {}, dict(batch_size=8, seq_len=1024, precision="bf16-mixed"),
     "presets_train_h100.jsonl", "pythia-160m b=8 s=1024 bf16-mixed recompute=none attention=sdpa"),
]
BOOK_EXAMPLE = "gpt2-b8-s1024-bf16-mixed"
MAXBATCH = [104, 112, 120]  # GPT-2 s=512 bf16-mixed: 104 fits, 112 OOMs (default); 112 fits, 120 OOMs (expandable)


def h100_rows(truth: Path, file: str, case: str) -> dict[str, dict]:
    """The H100 rows of `case` in `file`, by allocator setting ("default" / "expandable")."""
    rows = {}
    for line in (truth / file).read_text().splitlines():
        r = json.loads(line)
        if r.get("case") == case:
            conf = "expandable" if "expandable_segments:True" in r.get("alloc_conf", "") else "default"
            rows.setdefault(conf, {k: r[k] for k in ("case", "peak_allocated", "peak_reserved", "device_in_use")
                                   if k in r} | {"source": f"gpu-truth/{file}"})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated case keys (and/or 'maxbatch')")
    ap.add_argument("--gpu-truth", type=Path, default=ROOT.parent / "shared" / "gpu-truth")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    torch.set_num_threads(1)
    from vramlab.allocator import AllocatorConfig, replay
    from vramlab.measure.allocator import evaluate_then_train, record_training_events, replayable
    from vramlab.measure.record import provenance
    from vramlab.specs import preset

    only = {k for k in args.only.split(",") if k}
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "validation.json"
    res = json.loads(path.read_text()) if path.exists() else {}
    res.update({
        "what": "vramlab.allocator's replay of CPU-recorded allocation events vs the H100's allocator peaks",
        "recorded_on": provenance("cpu"),
        "h100": "NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, transformers 5.17.0, driver 580.159.04, CUDA 13.0, "
                "2026-11-22; one warm step, reset_peak_memory_stats(), one measured step (gpu-truth/README.md)",
    })
    cases = res.setdefault("cases", {})
    for key, name, over, opts, file, h100_case in CASES:
        if only and key not in only:
            continue
        t0 = time.perf_counter()
        spec = dataclasses.replace(preset(name), **over)
        events = record_training_events(spec, **opts)
        secs = time.perf_counter() - t0
        ev = replayable(events)
        row = {"model": name, "overrides": over, "options": opts, "events": len(ev), "record_seconds": round(secs, 1),
               "h100": h100_rows(args.gpu_truth, file, h100_case)}
        for conf, cfg in (("default", AllocatorConfig()), ("expandable", AllocatorConfig(expandable_segments=True))):
            r = replay(ev, cfg)
            row[conf] = {"peak_allocated": r.peak_allocated, "peak_reserved": r.peak_reserved}
        cases[key] = row
        print(f"{key}: {secs:.0f} s, model {row['default']}, H100 {row['h100'].get('default')}", flush=True)
        if key == BOOK_EXAMPLE:  # the book's example, with a phase change after the measured step
            events = record_training_events(spec, **opts, extra_phase=evaluate_then_train(4 * opts["batch_size"],
                                                                                          opts["seq_len"]))
            with gzip.open(OUT / "events_gpt2_b8_s1024_bf16-mixed.json.gz", "wt") as f:
                json.dump({"case": h100_case, "recorded_on": provenance("cpu"),
                           "method": "vramlab.measure.allocator.record_training_events (trace mode), then "
                                     "evaluate_then_train(32, 1024)",
                           "events": events}, f, separators=(",", ":"))
    if not only or "maxbatch" in only:
        # capacity: what the H100 could hand the allocator (total less the CUDA context and cuBLAS handles,
        # device_in_use - peak_reserved = 804,061,184 B in every maxbatch row)
        context = 804061184
        cfgs = {"default": AllocatorConfig(capacity=H100_TOTAL - context),
                "expandable": AllocatorConfig(capacity=H100_TOTAL - context, expandable_segments=True)}
        truth = [json.loads(x) for x in (args.gpu_truth / "maxbatch_gpt2_h100.jsonl").read_text().splitlines()]
        mb = res.setdefault("maxbatch", {"capacity": H100_TOTAL - context, "h100": [], "model": []})
        mb["h100"] = [{k: r[k] for k in ("batch", "fits", "peak_allocated", "peak_reserved", "alloc_conf", "error")
                       if k in r} for r in truth]
        mb["model"] = []
        for bs in MAXBATCH:
            ev = replayable(record_training_events(preset("gpt2"), batch_size=bs, seq_len=512, precision="bf16-mixed"))
            for conf, cfg in cfgs.items():
                r = replay(ev, cfg)
                mb["model"].append({"batch": bs, "alloc_conf": conf, "fits": r.oom is None,
                                    "peak_allocated": r.peak_allocated, "peak_reserved": r.peak_reserved,
                                    "oom": None if r.oom is None else str(r.oom)})
                print(f"maxbatch b={bs} {conf}: fits={r.oom is None} {r.oom or ''}", flush=True)
    path.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
