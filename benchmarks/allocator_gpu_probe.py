"""The caching allocator on a real GPU, one allocator setting per process (what the CPU cannot
measure; run by `python benchmarks/gpu_campaign.py --only allocator`, which starts this script
twice: PYTORCH_CUDA_ALLOC_CONF unset, then expandable_segments:True).

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python benchmarks/allocator_gpu_probe.py --out x.json

GPT-2, bf16-mixed, AdamW foreach, SDPA, training at --batch (default 8) x --seq (1024) and evaluating
at --eval-batch (32): allocated / reserved / their peaks / the device's use at each point of
- a warm-up step, then a measured step with the cache kept (gpu-truth's method);
- empty_cache() between two training steps (does the next step's peak go down?);
- a phase change: an evaluation at a 4x larger batch under no_grad, then a training step with the
  eval's cache kept, and after empty_cache();
plus torch.cuda.memory_summary() after the measured step, memory_stats()' counters, and the
allocation trace of the warm-up and measured steps (torch.cuda.memory._record_memory_history),
replayed through vramlab.allocator on the spot: the model on the GPU's own event stream.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = 12345  # bytes of the tensor that marks reset_peak_memory_stats() in the trace (a size nothing else asks)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--eval-batch", type=int, default=32)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    if not torch.cuda.is_available():
        print("allocator_gpu_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    from vramlab.allocator import AllocatorConfig, replay
    from vramlab.measure.allocator import events_from_snapshot
    from vramlab.measure.memory import make_optimizer
    from vramlab.measure.models import build_model, make_batch
    from vramlab.measure.record import provenance
    from vramlab.specs import preset

    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=1_000_000)
    spec = preset("gpt2")
    model = build_model(spec, device="cuda")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(params, optimizer="adamw", optimizer_impl="foreach")
    for p in params:  # the optimizer's states first, as in gpu-truth
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    batch = make_batch(spec, batch_size=args.batch, seq_len=args.seq, device="cuda")
    eval_ids = make_batch(spec, batch_size=args.eval_batch, seq_len=args.seq, device="cuda", with_labels=False)
    points: list[dict] = []

    def point(label: str) -> None:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        points.append({"point": label, "allocated": torch.cuda.memory_allocated(),
                       "reserved": torch.cuda.memory_reserved(), "peak_allocated": torch.cuda.max_memory_allocated(),
                       "peak_reserved": torch.cuda.max_memory_reserved(), "device_in_use": total - free})

    def reset() -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def train_step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    train_step()
    point("after the warm-up step")
    reset()
    mark = torch.empty(MARK, dtype=torch.uint8, device="cuda")  # where the trace's peak restarts
    del mark
    train_step()
    point("measured step (cache kept)")
    summary = torch.cuda.memory_summary()
    stats = {k: v for k, v in torch.cuda.memory_stats().items()
             if k.split(".")[0] in ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free")
             or k.endswith(".all.current") or k.endswith(".all.peak")}
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = events_from_snapshot(snap)
    i = next(k for k, e in enumerate(events) if e[0] == "alloc" and e[2] == MARK)
    events.insert(i, ("reset_peak",))
    cfg = AllocatorConfig(expandable_segments="expandable_segments:True" in conf)
    r = replay(events, cfg)
    model_row = {"peak_allocated": r.peak_allocated, "peak_reserved": r.peak_reserved,
                 "allocated": r.allocated[-1], "reserved": r.reserved[-1]}

    torch.cuda.empty_cache()
    point("after empty_cache()")
    reset()
    train_step()
    point("next step after empty_cache()")

    model.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(**eval_ids)
        del out
    model.train()
    point(f"after an evaluation at batch {args.eval_batch} (no_grad)")
    reset()
    train_step()
    point("training step after the evaluation (cache kept)")
    torch.cuda.empty_cache()
    point("after empty_cache() following the evaluation")
    reset()
    train_step()
    point("training step after the evaluation and empty_cache()")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    ev_path = args.out.with_suffix(".events.json.gz")
    with gzip.open(ev_path, "wt") as f:
        json.dump({"alloc_conf": conf, "events": events}, f, separators=(",", ":"))
    res = {"alloc_conf": conf, "case": f"gpt2 b={args.batch} s={args.seq} bf16-mixed sdpa adamw foreach",
           "eval_batch": args.eval_batch, "points": points, "memory_summary": summary, "memory_stats": stats,
           "trace_events": len(events), "events_file": ev_path.name,
           "model_on_this_trace": model_row, "provenance": provenance("cuda"),
           "command": "python benchmarks/allocator_gpu_probe.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "date_unix": int(time.time())}
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
