"""Gradient accumulation: the peak of one optimizer step against the micro-batch, at a
fixed global batch, on three decoder models that are not lab 1's (built from configs, random
weights): one whose activations dominate (GPT-NeoX-like, eager attention, 256 tokens), one whose
model states dominate (OPT-like, 8k vocabulary, 16 tokens: the embedding's gradient decides the
peak), and an untied Llama-like GQA model under CPU bf16 autocast. Each step is the real loop:
k micro-batches, `(loss / k).backward()` each, one AdamW step (`vramlab.measure.memory.
measure_training(accumulation_steps=k)`). Memory by trace mode (every tensor the CPU kernels make,
tracked with FakeTensor: not a GPU measurement).

    python benchmarks/accumulation_validation.py        # about 3 min on 2 cores
    python benchmarks/accumulation_validation.py --list

Writes benchmarks/results/accumulation/validation_trace.json: per case the traced peak and its
categories at each micro-batch; the book and tests/test_accumulation.py recompute the estimate.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "accumulation" / "validation_trace.json"
GLOBAL_BATCH = 8
MICRO = (1, 2, 4, 8)
MODELS = {
    "neox-activations": (dict(model_type="gpt_neox", vocab_size=512, hidden_size=128, intermediate_size=512,
                              num_hidden_layers=3, num_attention_heads=4, rotary_pct=0.25, max_position_embeddings=512,
                              use_parallel_residual=True, attention_dropout=0.0, hidden_dropout=0.0,
                              tie_word_embeddings=False),
                         dict(seq_len=256, attention="eager", precision="fp32")),
    "opt-model-states": (dict(model_type="opt", vocab_size=8192, hidden_size=128, ffn_dim=512, num_hidden_layers=2,
                              num_attention_heads=4, max_position_embeddings=512, word_embed_proj_dim=128,
                              do_layer_norm_before=True, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                              layerdrop=0.0, tie_word_embeddings=True),
                         dict(seq_len=16, attention="sdpa", precision="fp32")),
    "llama-gqa-bf16": (dict(model_type="llama", vocab_size=2048, hidden_size=128, intermediate_size=384,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=512, tie_word_embeddings=False),
                       dict(seq_len=64, attention="sdpa", precision="bf16-mixed")),
}


def spec(name: str):
    from vramlab.specs import from_config

    return from_config(MODELS[name][0], name=name)


def run_case(name: str) -> dict:
    import torch

    from vramlab.measure.memory import measure_training

    torch.set_num_threads(1)
    s = spec(name)
    options = MODELS[name][1]
    rows = []
    for m in MICRO:
        k = GLOBAL_BATCH // m
        t = time.perf_counter()
        meas = measure_training(s, batch_size=m, accumulation_steps=k, mode="trace", **options)
        rows.append({"micro_batch": m, "accumulation_steps": k, "measured": meas.total,
                     "breakdown": meas.breakdown.to_dict(), "seconds": round(time.perf_counter() - t, 1)})
        print(f"{name} micro-batch {m} x {k}: {meas.total:,} B", file=sys.stderr)
    return {"config": MODELS[name][0], "options": options, "global_batch": GLOBAL_BATCH, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    if args.list:
        for name, (_, options) in MODELS.items():
            print(name, options)
        return 0
    from vramlab.measure.record import provenance

    res = {"what": "gradient accumulation: traced peak (FakeTensorMode + MemTracker, CPU kernels) of one optimizer "
                   "step vs micro-batch at a fixed global batch; not a GPU measurement",
           "command": "python benchmarks/accumulation_validation.py", "mode": "trace",
           "provenance": provenance("cpu"), "cases": {name: run_case(name) for name in MODELS}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
