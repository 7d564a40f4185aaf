"""vLLM's own accounting of a paged KV cache on this GPU, beside vramlab.serving (chapter 1).

One model per process (vLLM takes the GPU's memory for itself): the preset's config.json written to a
temporary folder, vLLM started on it with random weights (`load_format="dummy"`, no tokenizer: nothing comes
from a hub), and what vLLM decided read back from its engine -- the KV blocks it allocated, its block size,
the memory it had for them, and the concurrency it logs at start-up. Beside each: `serving.serving_plan`'s
blocks for the same memory (exact arithmetic) and its pool from the GPU, which differs from vLLM's by the
profile run's activation peak and CUDA graphs that vLLM measures and vramlab takes as inputs.

    python benchmarks/vllm_serving_probe.py --out benchmarks/results/serving/<gpu>_vllm.json [--models a,b]

Without vLLM installed it writes nothing and says so in one line (exit 0: the campaign goes on)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("llama-3.2-1b", "qwen2.5-7b", "llama-3.1-8b")
MAX_MODEL_LEN = 2048


def one(name: str) -> dict:
    """Start vLLM on `name`'s config with dummy weights; what it allocated (run in a child process)."""
    from vllm import LLM

    from vramlab import serving, specs

    spec = specs.preset(name)
    with tempfile.TemporaryDirectory() as d:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        cfg = spec.to_hf_config()  # vLLM picks its model class by `architectures`
        cfg.setdefault("architectures", [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[cfg["model_type"]]])
        (Path(d) / "config.json").write_text(json.dumps(cfg))
        llm = LLM(model=d, load_format="dummy", skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN,
                  gpu_memory_utilization=0.9, dtype="bfloat16", enforce_eager=False)
        cache = llm.llm_engine.vllm_config.cache_config
        blocks, block_size = int(cache.num_gpu_blocks), int(cache.block_size)
    kv = serving.kv_block(spec, block_size=block_size, kv_dtype="bf16")
    plan = serving.serving_plan(spec, gpu=os.environ.get("VRAMLAB_GPU", "h100"), prompt_len=MAX_MODEL_LEN,
                                output_len=0, block_size=block_size)
    return {"model": name, "vllm_num_gpu_blocks": blocks, "block_size": block_size,
            "vllm_kv_bytes": blocks * kv.bytes_per_block, "bytes_per_block": kv.bytes_per_block,
            "vllm_max_concurrency": blocks / kv.blocks_per_sequence(MAX_MODEL_LEN),
            "predicted_num_blocks_without_profile": plan.num_blocks,
            "predicted_pool_without_profile": plan.available_kv_bytes,
            "profile_and_graphs_implied": plan.available_kv_bytes - blocks * kv.bytes_per_block}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    if args.one:  # the child: one model, its report on stdout
        print(json.dumps(one(args.one)))
        return 0
    try:
        import vllm
    except ImportError:
        print("vllm_serving_probe: vLLM is not installed here; nothing measured")
        return 0
    from vramlab.measure.record import provenance

    runs = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        r = subprocess.run([sys.executable, __file__, "--out", args.out, "--one", name], capture_output=True,
                           text=True, timeout=1200)
        last = (r.stdout.strip().splitlines() or [""])[-1]
        runs.append(json.loads(last) if r.returncode == 0 and last.startswith("{") else
                    {"model": name, "error": (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]})
        print(f"vllm_serving_probe: {name}: {runs[-1].get('vllm_num_gpu_blocks', runs[-1].get('error'))}")
    out = {"runs": runs, "vllm": vllm.__version__, "provenance": provenance("cuda"),
           "command": "python benchmarks/vllm_serving_probe.py --out " + args.out}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
