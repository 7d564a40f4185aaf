"""FSDP2's per-rank memory on a GPU, for GPU-scale models and worlds larger than the machine's GPUs:
the validation data for vramlab.zero's FSDP2 estimates on CUDA, one JSON per case in
benchmarks/results/zero/gpu/.

    python benchmarks/fsdp2_gpu_validation.py                 # every case (a few minutes on an H100)
    python benchmarks/fsdp2_gpu_validation.py --only llama1b_fp32_8r_rank0
    python benchmarks/fsdp2_gpu_validation.py --list          # the cases and their command lines
    python benchmarks/fsdp2_gpu_validation.py --jobs 3        # cases run side by side (peaks are per process)

Each case is one `python -m vramlab.measure.zero --backend fake ...`: one rank of a world of N alone in its
process with torch's fake process group, so every collective returns at once and moves nothing while
FSDP2 allocates its all-gather and reduce-scatter buffers, shards and gathered parameters as on real
ranks (on the CPU the same method gives byte for byte what real gloo ranks measure:
tests/test_validation.py). On the GPU the caching allocator's peak over the measured steps
(`max_memory_allocated`, reset after two warm-up steps) is the truth; NCCL's own buffers, which live
outside PyTorch's allocator, are not in it. Needs torch and transformers; runs from a checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "zero" / "gpu"

# name -> (what it is for, zerolab arguments)
CASES: dict[str, tuple[str, list[str]]] = {
    "llama1b_fp32_8r_rank0": ("Llama-3.2-1B, fp32, 8 ranks: root (tied, 263 M) > block, logits 2 x 1024 x 128,256",
                              ["--model", "llama-3.2-1b", "--nproc", "8"]),
    "llama1b_bf16_8r_rank7": ("Llama-3.2-1B, bf16 policy, 8 ranks, the last rank",
                              ["--model", "llama-3.2-1b", "--nproc", "8", "--rank", "7", "--precision", "bf16"]),
    "llama1b_bf16_2r_rank0": ("Llama-3.2-1B, bf16 policy, 2 ranks", ["--model", "llama-3.2-1b", "--nproc", "2",
                                                                    "--precision", "bf16"]),
    "llama1b_bf16_1r_rank0": ("Llama-3.2-1B, bf16 policy, 1 rank (FSDP2 without sharding)",
                              ["--model", "llama-3.2-1b", "--nproc", "1", "--precision", "bf16"]),
    "llama1b_fp32_8r_rank0_short": ("Llama-3.2-1B, fp32, 8 ranks, micro-batch 1 x 256: the gathered root and its "
                                    "gradient weigh more than the activations",
                                    ["--model", "llama-3.2-1b", "--nproc", "8", "--micro-batch", "1", "--seq", "256"]),
    "pythia410m_fp32_4r_rank0": ("Pythia-410M, fp32, 4 ranks, untied head", ["--model", "pythia-410m", "--nproc", "4"]),
    "pythia410m_bf16_8r_rank0": ("Pythia-410M, bf16 policy, 8 ranks", ["--model", "pythia-410m", "--nproc", "8",
                                                                       "--precision", "bf16"]),
    "pythia410m_fp32_4r_rank0_nocache": ("Pythia-410M, fp32, 4 ranks, transformers' KV cache off (as scripts that "
                                         "set use_cache=False train): the fused qkv output stays alive",
                                         ["--model", "pythia-410m", "--nproc", "4", "--kv-cache", "off"]),
    "mistralblock_bf16_4r_rank0": ("Mistral-7B's block (218 M) > root (67 M), bf16 policy, 4 ranks, 1 x 2048",
                                   ["--model", "mistral-block-small-vocab", "--nproc", "4", "--precision", "bf16"]),
    "mistralblock_fp32_8r_rank0": ("Mistral-7B's block > root, fp32, 8 ranks, 1 x 2048",
                                   ["--model", "mistral-block-small-vocab", "--nproc", "8"]),
    "mt5base_fp32_4r_rank0": ("mT5-base, encoder-decoder, root 384 M, fp32, 4 ranks", ["--model", "mt5-base", "--nproc", "4"]),
    "mt5base_bf16_2r_rank1": ("mT5-base, bf16 policy, 2 ranks, the last rank",
                              ["--model", "mt5-base", "--nproc", "2", "--rank", "1", "--precision", "bf16"]),
}
STEPS = "4"  # two warm-up steps, two measured


def command(name: str, out: Path | None = None) -> list[str]:
    out = out or OUT / f"{name}.json"
    return ["-m", "vramlab.measure.zero", "--backend", "fake", "--setups", "fsdp2", "--steps", STEPS, *CASES[name][1],
            "--out", str(out.relative_to(ROOT))]


def run(name: str) -> str:
    out = OUT / f"{name}.json"
    tmp = out.with_suffix(".json.part")
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "4",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    p = subprocess.run([sys.executable, *command(name, tmp)], cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        tmp.unlink(missing_ok=True)
        tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"{name}: FAILED: {tail}"
    res = json.loads(tmp.read_text())
    res["command"] = "python " + " ".join(command(name))
    res["validation_case"] = {"name": name, "about": CASES[name][0], "wall_seconds": round(time.perf_counter() - t0, 1),
                              "driver": "python benchmarks/fsdp2_gpu_validation.py --only " + name}
    out.write_text(json.dumps(res, indent=1) + "\n")
    tmp.unlink()
    r = res["setups"]["fsdp2"]["per_rank"][0]
    cuda = r.get("cuda") or {}
    alloc = cuda.get("peak_allocated")
    return (f"{name}: tracked peak {r['peak']['step_peak'] / 2**30:.3f} GiB ({r['peak']['phase']}), allocator "
            f"{alloc / 2**30 if alloc else float('nan'):.3f} GiB, reserved "
            f"{(cuda.get('peak_reserved') or 0) / 2**30:.3f} GiB, {time.perf_counter() - t0:.0f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help=f"comma-separated cases: {', '.join(CASES)}")
    p.add_argument("--list", action="store_true", help="print the cases and their commands")
    p.add_argument("--jobs", type=int, default=1, help="cases run side by side (default 1)")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(CASES)
    bad = [n for n in names if n not in CASES]
    if bad:
        p.error(f"unknown case {', '.join(bad)}; choose from {', '.join(CASES)}")
    if args.jobs < 1:
        p.error("--jobs must be at least 1")
    if args.list:
        for n in names:
            print(f"{n:30} {CASES[n][0]}\n{'':30} python {' '.join(command(n))}")
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    failed = 0
    with ThreadPoolExecutor(args.jobs) as pool:
        for line in pool.map(run, names):
            failed += "FAILED" in line
            print(f"[{time.perf_counter() - t0:5.0f} s] fsdp2_gpu_validation: {line}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
