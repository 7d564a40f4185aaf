"""Prompt tuning, prefix tuning and P-tuning (peft 0.21) measured against `compression.peft_training`:
one training step of small models built from configs (an mT5, a GPT-2 and a Llama, none
the lab's), wrapped by peft's own PromptTuningConfig / PrefixTuningConfig / PromptEncoderConfig,
on real CPU tensors (the CPU kernels' tensors, tracked: not a GPU measurement), one process each.

    python benchmarks/prompt_tuning_validation.py      # about a minute on 2 cores

Writes benchmarks/results/prompt_tuning_cpu.json: per case the measured breakdown and the
prediction; tests/test_prompt_tuning.py recomputes the prediction and compares.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "prompt_tuning_cpu.json"
MODELS = {
    "mt5-tiny": {"model_type": "mt5", "vocab_size": 2000, "d_model": 128, "d_kv": 16, "d_ff": 256, "num_layers": 3,
                 "num_decoder_layers": 3, "num_heads": 8, "feed_forward_proj": "gated-gelu", "untied_lm_head": True},
    "gpt2-tiny": {"model_type": "gpt2", "n_embd": 128, "n_layer": 3, "n_head": 4, "vocab_size": 1000, "n_positions": 512},
    "llama-small": {"model_type": "llama", "hidden_size": 192, "intermediate_size": 512, "num_hidden_layers": 3,
                    "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 500,
                    "max_position_embeddings": 512, "tie_word_embeddings": False},
}
# (model, method, batch, seq, virtual tokens, options)
CASES = [(m, meth, 8, s, p, opts) for m, s in (("mt5-tiny", 32), ("gpt2-tiny", 64), ("llama-small", 64))
         for meth, p, opts in (("full", 0, {}), ("prompt", 16, {}), ("prompt", 48, {}), ("prefix", 16, {}),
                               ("prefix", 16, {"prefix_projection": True}), ("p-tuning", 16, {}))]


def one(model: str, method: str, b: int, s: int, p: int, opts: dict) -> dict:
    """Measure in this process (called by `main` in a fresh process per case)."""
    import warnings

    import peft
    import torch

    from vramlab.measure.memory import measure_training
    from vramlab.specs import from_config

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    spec = from_config(MODELS[model], name=model)
    task = "SEQ_2_SEQ_LM" if spec.family == "t5" else "CAUSAL_LM"
    cls = {"prompt": peft.PromptTuningConfig, "prefix": peft.PrefixTuningConfig, "p-tuning": peft.PromptEncoderConfig}.get(method)
    hook = None if cls is None else (lambda m: peft.get_peft_model(m, cls(task_type=task, num_virtual_tokens=p, **opts)))
    meas = measure_training(spec, batch_size=b, seq_len=s, mode="cpu", model_hook=hook)
    return meas.breakdown.to_dict()


def main() -> int:
    from vramlab import compression as C
    from vramlab.measure.record import provenance
    from vramlab.specs import from_config

    rows = []
    for model, method, b, s, p, opts in CASES:
        arg = json.dumps([model, method, b, s, p, opts])
        r = subprocess.run([sys.executable, __file__, "--one", arg], capture_output=True, text=True, timeout=600)
        if r.returncode:
            print(r.stderr, file=sys.stderr)
            return 1
        measured = json.loads(r.stdout.strip().splitlines()[-1])
        spec = from_config(MODELS[model], name=model)
        kw = {} if method == "full" else dict(num_virtual_tokens=p, **opts)
        est = C.peft_training(spec, method=method, batch_size=b, seq_len=s, device="cpu", **kw)
        total = sum(v for k, v in measured.items() if k in C.MemoryBreakdown.__dataclass_fields__ and isinstance(v, int))
        rows.append({"model": model, "config": MODELS[model], "method": method, "batch_size": b, "seq_len": s,
                     "num_virtual_tokens": p, "options": opts, "measured_bytes": total, "measured": measured,
                     "estimated_bytes": est.total, "error_pct": round(100 * (est.total - total) / total, 2)})
        print(f"{model:12s} {method:9s} p={p:3d} {opts}: measured {total / 2**20:7.2f} MiB, "
              f"predicted {est.total / 2**20:7.2f} MiB ({rows[-1]['error_pct']:+.1f} %)")
    OUT.write_text(json.dumps({"what": __doc__.split("\n\n")[0], "mode": "cpu (real tensors, tracked)",
                               "provenance": provenance("cpu"), "command": "python benchmarks/prompt_tuning_validation.py",
                               "cases": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        print(json.dumps(one(*json.loads(sys.argv[2]))))
        raise SystemExit(0)
    raise SystemExit(main())
