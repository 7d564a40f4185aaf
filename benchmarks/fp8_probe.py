"""FP8 training on a GPU: one training step of a model built from its config (no hub), bf16 against
torchao's float8 training (`torchao.float8.convert_to_float8_training`, tensorwise dynamic scaling), each in its own
process; the allocator's peak, reserved bytes and the device's use beside vramlab's bf16 estimate, and the step time.
Chapter 5's FP8 table is the published recipes' arithmetic; this is what one real recipe does on one GPU.

    python benchmarks/fp8_probe.py                        # llama-3.2-1b, b=4, s=2048, both recipes
    python benchmarks/fp8_probe.py --model gpt2 --batch 8 --seq 1024
    python benchmarks/fp8_probe.py --case float8          # one configuration (what the default runs per process)

On a machine without CUDA, or without torchao's float8 training, it says so in one line and exits 0.
Output: benchmarks/results/fp8/<gpu>.json (--out).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = ("bf16", "float8")


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=CASES, default=None, help="one configuration (default: each, in its own process)")
    ap.add_argument("--model", default="llama-3.2-1b", help="a vramlab preset, built from its config")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3, help="steps before the measured one (states, autotuning)")
    ap.add_argument("--out", type=Path, default=None)
    return ap.parse_args(argv)


def case(args) -> dict:
    """One configuration in this process: warm-up steps, then one measured step (the peak from a reset)."""
    import torch

    sys.path.insert(0, str(ROOT / "src"))
    import vramlab
    from vramlab.measure.models import build_model, make_batch

    spec = vramlab.preset(args.model)
    model = build_model(spec, attention="sdpa", dtype=torch.bfloat16, device="cuda")
    if args.case == "float8":
        from torchao.float8 import convert_to_float8_training

        # the head's vocabulary is not a multiple of 16 in every model: torchao's rule, skip it
        convert_to_float8_training(model, module_filter_fn=lambda m, fqn: "lm_head" not in fqn)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    batch = make_batch(spec, batch_size=args.batch, seq_len=args.seq, device="cuda")

    def step():
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    free, total = torch.cuda.mem_get_info()
    est = vramlab.memory.estimate_training(spec, batch_size=args.batch, seq_len=args.seq, precision="bf16")
    return {"case": args.case, "model": args.model, "batch_size": args.batch, "seq_len": args.seq,
            "peak_allocated": torch.cuda.max_memory_allocated(), "peak_reserved": torch.cuda.max_memory_reserved(),
            "device_in_use": total - free, "step_seconds": seconds, "vramlab_bf16_estimate": est.total,
            "vramlab_bf16_phase": est.phase}


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    try:
        import torch
    except ImportError:
        print("fp8_probe: needs torch with CUDA; nothing recorded")
        return 0
    if not torch.cuda.is_available():
        print("fp8_probe: needs a CUDA GPU (torch.cuda.is_available() is False); nothing recorded")
        return 0
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        print(f"fp8_probe: needs torchao's float8 training ({e}); nothing recorded")
        return 0
    if args.case:
        print(json.dumps(case(args)))
        return 0
    sys.path.insert(0, str(ROOT / "src"))
    from vramlab.measure.record import provenance

    name = torch.cuda.get_device_name(0)
    tag = "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split())
    out = args.out or ROOT / "benchmarks" / "results" / "fp8" / f"{tag}.json"
    runs = []
    for c in CASES:
        cmd = [sys.executable, __file__, "--case", c, "--model", args.model, "--batch", str(args.batch),
               "--seq", str(args.seq), "--steps", str(args.steps)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if r.returncode:
            runs.append({"case": c, "failed": (r.stderr.strip().splitlines() or ["?"])[-1]})
        else:
            runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(f"fp8_probe: {c}: " + (f"peak {runs[-1]['peak_allocated'] / 2**30:.2f} GiB" if "failed" not in runs[-1]
                                     else runs[-1]["failed"]))
    import torchao

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": name, "provenance": {**provenance("cuda"), "torchao": torchao.__version__},
                               "command": "python benchmarks/fp8_probe.py " + " ".join(argv or sys.argv[1:]),
                               "runs": runs}, indent=1) + "\n")
    print(f"fp8_probe: wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
