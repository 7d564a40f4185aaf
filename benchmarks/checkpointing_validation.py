"""Activation checkpointing beyond lab 7's models: every measurable plan on two decoder
families that are not the lab's (OPT and GPT-NeoX, built from configs with a small vocabulary so that
the blocks, not the logits, decide the peak), at a size where the peak of most plans falls inside a
recomputed block's backward. Memory by trace mode (every tensor the CPU kernels make, tracked with
FakeTensor: the bytes a GPU would hold, not a GPU measurement), one process per configuration.

    python benchmarks/checkpointing_validation.py          # about 5 min on 2 cores
    python benchmarks/checkpointing_validation.py --list

Writes benchmarks/results/checkpointing/validation_trace.json: per case the traced peak, the
prediction (vramlab.checkpointing.evaluate) and the phase it predicts the peak in; tests read the
measured bytes and recompute the prediction themselves.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "checkpointing" / "validation_trace.json"
MODELS = {
    "opt-narrow-vocab": dict(model_type="opt", vocab_size=8192, hidden_size=1024, ffn_dim=4096, num_hidden_layers=8,
                             num_attention_heads=16, max_position_embeddings=2048, word_embed_proj_dim=1024,
                             do_layer_norm_before=True, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                             layerdrop=0.0, tie_word_embeddings=True),
    "neox-narrow-vocab": dict(model_type="gpt_neox", vocab_size=8192, hidden_size=1024, intermediate_size=4096,
                              num_hidden_layers=8, num_attention_heads=16, rotary_pct=0.25, max_position_embeddings=2048,
                              use_parallel_residual=True, attention_dropout=0.0, hidden_dropout=0.0,
                              tie_word_embeddings=False),
}
PLANS = ("none", "full", "sqrt", "segments-4", "sac-matmuls", "every-2")
BATCH, SEQ = 8, 1024
# (model, plans, precision): both families in fp32, OPT again under bf16 autocast
CASES = [(m, PLANS, "fp32") for m in MODELS] + [("opt-narrow-vocab", ("none", "full", "sqrt"), "bf16-mixed")]


def spec(name: str):
    from vramlab.specs import from_config

    return from_config(MODELS[name], name=name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    todo = [(m, p, prec) for m, plans, prec in CASES for p in plans]
    if a.list:
        for m, p, prec in todo:
            print(f"{m:18s} {p:12s} {prec} b={BATCH} s={SEQ}")
        return 0
    try:  # before the minutes of tracing, not after
        a.out.parent.mkdir(parents=True, exist_ok=True)
        if a.out.is_dir():
            raise IsADirectoryError(f"{a.out} is a folder")
    except OSError as e:
        print(f"checkpointing_validation: cannot write --out {a.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    from vramlab.measure.checkpointing import _case
    from vramlab.measure.record import provenance

    t0 = time.perf_counter()
    cases = []
    for k, (m, p, prec) in enumerate(todo, 1):
        c = _case(spec(m), p, batch_size=BATCH, seq_len=SEQ, mode="trace", precision=prec, timing_steps=0)
        cases.append(c)
        print(f"[{k}/{len(todo)}] {m} {p:12s} {prec:10s} traced {c['measured_bytes'] / 2**20:8.1f} MiB, predicted "
              f"{c['estimated_bytes'] / 2**20:8.1f} MiB ({c['error_pct']:+.2f} %) in {c['estimated_phase']}", flush=True)
    out = {"experiment": "activation checkpointing beyond the lab's models", "mode": "trace",
           "note": "memory by FakeTensor tracking of the CPU kernels' tensors, not a GPU measurement",
           "models": MODELS, "provenance": provenance(), "command": "python benchmarks/checkpointing_validation.py",
           "wall_seconds": round(time.perf_counter() - t0, 1), "cases": cases}
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out.relative_to(ROOT) if a.out.is_relative_to(ROOT) else a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
