"""Per-rank memory of DeepSpeed ZeRO 0-3 and FSDP2 on real gloo ranks, on models other than lab 4's:
the validation data for vramlab.zero's estimates, one JSON per run in benchmarks/results/zero/validation/.

    python benchmarks/zero_validation.py                      # the whole sweep (about 25 min on 2 cores)
    python benchmarks/zero_validation.py --only llama_fp32_2r  # one case (comma-separated for several)
    python benchmarks/zero_validation.py --list               # the cases and their command lines
    python benchmarks/zero_validation.py --summary            # tables from the stored files
    python benchmarks/zero_validation.py --check              # the stored files against counts from the models

Each case is one `python -m vramlab.measure.zero ...` (every setup in fresh processes, 2 warm-up steps and 3
measured, AdamW(foreach=False), no gradient clipping); the file it writes records the command, the
DeepSpeed config used, the provenance (date, torch, deepspeed, transformers, python, platform) and,
added here, the case's name and wall time. The reduce and all-gather buckets (5e5 elements) are far
smaller than every model (8-23 M parameters), so ZeRO-1, ZeRO-2 and ZeRO-3 differ; one case keeps
DeepSpeed's default 5e8 for contrast.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "zero" / "validation"
ALL = "0,1,2,3,fsdp2"
B = ["--reduce-bucket", "5e5", "--allgather-bucket", "5e5"]

# name -> (what it is for, zerolab arguments)
CASES: dict[str, tuple[str, list[str]]] = {
    "gpt2lab_fp32_2r": ("lab 4's model with buckets smaller than it (9 buckets)",
                        ["--model", "gpt2-lab4", "--reduce-bucket", "2e5", "--allgather-bucket", "2e5"]),
    "opt_fp32_2r": ("OPT-like, root > block, fp32, 2 ranks", ["--model", "opt-wide-vocab", *B]),
    "pythia_fp32_2r": ("GPT-NeoX-like, untied head, fp32, 2 ranks", ["--model", "pythia-wide-vocab", *B]),
    "llama_fp32_2r": ("Llama-like GQA, block > root, fp32, 2 ranks", ["--model", "llama-gqa-wide-mlp", *B]),
    "mt5_fp32_2r": ("mT5-small-like encoder-decoder, fp32, 2 ranks", ["--model", "mt5-small-like", *B]),
    "opt_bf16_2r": ("OPT-like, bf16, 2 ranks", ["--model", "opt-wide-vocab", "--precision", "bf16", *B]),
    "llama_bf16_2r": ("Llama-like, bf16, 2 ranks", ["--model", "llama-gqa-wide-mlp", "--precision", "bf16", *B]),
    "opt_fp32_4r": ("OPT-like, fp32, 4 ranks", ["--model", "opt-wide-vocab", "--nproc", "4", "--setups", "1,2,3,fsdp2", *B]),
    "llama_fp32_4r": ("Llama-like, fp32, 4 ranks",
                      ["--model", "llama-gqa-wide-mlp", "--nproc", "4", "--setups", "1,2,3,fsdp2", *B]),
    "mt5_fp32_1r": ("mT5-like at 1 rank: does FSDP2's peak rise from 1 to 2 ranks? (2 ranks: mt5_fp32_2r)",
                    ["--model", "mt5-small-like", "--nproc", "1", "--setups", "3,fsdp2", *B]),
    "mt5_fp32_4r": ("mT5-like at 4 ranks", ["--model", "mt5-small-like", "--nproc", "4", "--setups", "3,fsdp2", *B]),
    "mt5_bf16_1r": ("mT5-like, FSDP2 bf16 at 1 rank", ["--model", "mt5-small-like", "--nproc", "1", "--setups", "fsdp2",
                                                       "--precision", "bf16", *B]),
    "mt5_bf16_2r": ("mT5-like, FSDP2 bf16 at 2 ranks", ["--model", "mt5-small-like", "--setups", "fsdp2",
                                                        "--precision", "bf16", *B]),
    "opt_z3_live_fp32_2r": ("ZeRO-3, prefetch 5e5 and max live 1e6 elements (the embedding alone is 6.3 M)",
                            ["--model", "opt-wide-vocab", "--setups", "3", *B, "--prefetch-bucket", "5e5",
                             "--max-live-params", "1e6"]),
    "llama_z3_live_fp32_2r": ("ZeRO-3, prefetch 1e6 and max live 2e6 elements (a block is 3.9 M)",
                              ["--model", "llama-gqa-wide-mlp", "--setups", "3", *B, "--prefetch-bucket", "1e6",
                               "--max-live-params", "2e6"]),
    "llama_z3_persist_fp32_2r": ("ZeRO-3, persistence threshold 3e5: embedding, head, k/v projections stay whole",
                                 ["--model", "llama-gqa-wide-mlp", "--setups", "3", *B,
                                  "--persistence-threshold", "3e5"]),
    "llama_grads_fp32_4r": ("gradients dominate (micro-batch 1 x 16, 4 ranks): ZeRO-2 below ZeRO-1",
                            ["--model", "llama-gqa-wide-mlp", "--micro-batch", "1", "--seq", "16", "--nproc", "4", "--setups", "1,2",
                             *B]),
    "llama_defaultbucket_fp32_2r": ("DeepSpeed's default buckets (5e8 elements) for contrast",
                                    ["--model", "llama-gqa-wide-mlp", "--setups", "0,1,2,3"]),
}


def command(name: str) -> list[str]:
    return ["-m", "vramlab.measure.zero", *CASES[name][1], "--out", str((OUT / f"{name}.json").relative_to(ROOT))]


def run(name: str) -> float:
    out = OUT / f"{name}.json"
    tmp = out.with_suffix(".json.part")
    cmd = command(name)
    cmd[-1] = str(tmp.relative_to(ROOT))
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    p = subprocess.Popen([sys.executable, *cmd], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    tail = []
    for line in p.stderr:  # zerolab's progress lines through, the rest kept for an error
        if line.startswith("zerolab:"):
            print(f"  {line.rstrip()}", file=sys.stderr, flush=True)
        tail = (tail + [line])[-20:]
    if p.wait() != 0:
        tmp.unlink(missing_ok=True)
        raise SystemExit(f"zero_validation: {name} failed: {''.join(tail).strip().splitlines()[-1]}")
    wall = time.perf_counter() - t0
    res = json.loads(tmp.read_text())
    res["command"] = "python " + " ".join(command(name))  # the file's final name, not the temporary one
    res["accumulation_noise_vs_one_process"] = noise(res)
    res["validation_case"] = {"name": name, "about": CASES[name][0], "wall_seconds": round(wall, 1),
                              "driver": "python benchmarks/zero_validation.py --only " + name}
    out.write_text(json.dumps(res, indent=1) + "\n")
    tmp.unlink()
    return wall


_NOISE: dict[tuple, float] = {}


def noise(r: dict) -> float:
    """zerolab.accumulation_noise for a run's model, ranks, batch and steps (once per combination)."""
    key = (r["model_name"], r["ranks"], r["micro_batch_size"], r["seq_len"], r["steps"])
    if key not in _NOISE:
        import torch

        from vramlab.measure import zero as zerolab

        torch.set_num_threads(1)
        _NOISE[key] = zerolab.accumulation_noise(key[1], key[2], key[3], key[4], key[0])
    return _NOISE[key]


# ----------------------------------------------------------------------------- summary

MB = 1e6


def _row(setup: str, s: dict) -> str:
    ranks = s["per_rank"]
    res = ranks[0]["resident"]
    peak = max(ranks, key=lambda r: r["peak"]["step_peak"])
    pk = peak["peak"]
    at = pk["at_peak"]
    top = ", ".join(f"{t['bytes'] / MB:.1f} {t.get('dtype')}{t.get('shape')} {t['role'][:5]}" for t in at["top_transients"][:3])
    cats = at["by_category"]
    spread = {r["peak"]["step_peak"] for r in ranks}
    return (f"{setup:>5} | {res['parameters'] / MB:7.2f} {res['gradients'] / MB:7.2f} {res['optimizer_states'] / MB:7.2f} "
            f"{res['other'] / MB:7.2f} | {pk['step_peak'] / MB:7.2f}{'*' if len(spread) > 1 else ' '} {pk['phase']:8} "
            f"| act {cats['activations/transients'] / MB:6.2f} (gath {at['transient_by_role']['gathered_parameters'] / MB:5.2f} "
            f"grad {at['transient_by_role']['gradients'] / MB:5.2f}) | {top}")


def summary(names: list[str]) -> None:
    for name in names:
        path = OUT / f"{name}.json"
        if not path.exists():
            print(f"{name}: not run")
            continue
        r = json.loads(path.read_text())
        st = r["structure"]
        print(f"\n{name}: {r['model_name']} ({r['model_family']}), {r['params']:,} params (root {st['root_params']:,}, "
              f"block {max(st['block_params']):,}), {r['ranks']} ranks, {r['precision']}, micro-batch {r['micro_batch_size']}"
              f" x seq {r['seq_len']}, knobs { {k: v for k, v in r['deepspeed_knobs'].items() if v is not None} }")
        print("setup | resident MB: params   grads   optim   other | step peak MB, phase | at the peak ...  "
              "(* ranks differ: the largest shown)")
        for setup, s in r["setups"].items():
            print(_row(setup, s))


def expected_resident(r: dict, setup: str) -> dict[str, float]:
    """What each rank should hold between steps, counted from the model alone. DeepSpeed keeps an fp32
    master partition beside Adam's two moments from stage 1 on (12 B/param / N, fp32 runs too); ZeRO-3
    a partition of every parameter (the persistent ones, at or below the threshold, whole as well), its
    gradient partition and its reduce bucket, all in the compute dtype; in bf16, stage 0 runs
    DeepSpeed's FP16_UnfusedOptimizer, a whole fp32 master beside the moments (12 B/param, not
    partitioned). FSDP2 keeps fp32 shards and the two moments, bf16 or not (its MixedPrecisionPolicy
    casts the gathered copies). Flat buffers are padded a little for alignment."""
    psi, n = r["params"], r["ranks"]
    w = 4 if r["precision"] == "fp32" else 2  # DeepSpeed's parameters, gradients and buckets
    if setup == "fsdp2":
        return {"parameters": 4 * psi / n, "gradients": 0, "optimizer_states": 8 * psi / n}
    if setup == "0":
        return {"parameters": w * psi, "gradients": 0, "optimizer_states": (8 if w == 4 else 12) * psi}
    if setup in ("1", "2"):
        return {"parameters": w * psi, "gradients": 0, "optimizer_states": 12 * psi / n}
    knobs = r["deepspeed_knobs"]
    threshold = knobs.get("stage3_param_persistence_threshold") or 100_000
    st = r["structure"]
    persistent = st["at_or_below_threshold"]["params"] if threshold == st["persistence_threshold"] else None
    bucket = knobs.get("reduce_bucket_size") or 500_000_000
    out = {"gradients": w * psi / n, "optimizer_states": 12 * psi / n, "other": w * bucket}
    if persistent is not None:
        out["parameters"] = w * (psi / n + persistent)
    return out


def check(names: list[str]) -> int:
    """The stored runs against counts made from the model: resident categories (within 0.5 % + 4 KiB),
    every setup trained what one process trains, the peak is at least what the step starts with, the
    step ends where it started, the tracker's start equals the scan's resident total, and the tracker
    agrees with the CPU allocator (collectives' own blocks left out) wherever the latter lost no free."""
    bad = 0
    for name in names:
        path = OUT / f"{name}.json"
        if not path.exists():
            continue
        r = json.loads(path.read_text())
        # fp32: within 1e-5 per step, or within 5x what one process gets by adding the ranks' gradients
        # instead of taking one batch (zerolab.accumulation_noise); bf16 runs are compared with an fp32 process (bf16 spacing at 1.0
        # is 0.0078)
        tol = (max(1e-5 * r["steps"], 5 * r.get("accumulation_noise_vs_one_process", 0)) if r["precision"] == "fp32"
               else 2e-2)
        for setup, s in r["setups"].items():
            want = expected_resident(r, setup)
            notes = []
            if s["max_abs_diff_vs_one_process"] > tol:
                notes.append(f"trained params differ from one process by {s['max_abs_diff_vs_one_process']:.2e} "
                             f"(allowed {tol:.1e})")
            for rank in s["per_rank"]:
                res, pk = rank["resident"], rank["peak"]
                for cat, v in want.items():
                    if abs(res[cat] - v) > 0.005 * v + 4096:
                        notes.append(f"rank {rank['rank']} {cat} {res[cat]:,} vs {v:,.0f} expected")
                for st in pk["per_step"]:
                    if abs(st["start"] - res["total"]) > 4096 or abs(st["end"] - st["start"]) > 4096:
                        notes.append(f"rank {rank['rank']} step starts at {st['start']:,}, ends at {st['end']:,}, "
                                     f"resident {res['total']:,}")
                    if st["first_seen_as_input_bytes"]:
                        notes.append(f"rank {rank['rank']}: {st['first_seen_as_input_bytes']:,} B first seen as an input")
                if pk["step_peak"] < res["total"]:
                    notes.append(f"rank {rank['rank']} peak below resident")
                if pk.get("tracked_equals_allocator") is False:
                    notes.append(f"rank {rank['rank']} tracker and CPU allocator disagree")
            bad += bool(notes)
            print(f"{name:28} {setup:>5}: {'ok' if not notes else '; '.join(sorted(set(notes))[:6])}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help=f"comma-separated cases: {', '.join(CASES)}")
    p.add_argument("--list", action="store_true", help="print the cases and their commands")
    p.add_argument("--summary", action="store_true", help="print tables from the stored results")
    p.add_argument("--noise", action="store_true",
                   help="add accumulation_noise_vs_one_process to stored results that lack it")
    p.add_argument("--check", action="store_true",
                   help="check the stored results against counts made from each model (exit 1 on a mismatch)")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(CASES)
    bad = [n for n in names if n not in CASES]
    if bad:
        p.error(f"unknown case {', '.join(bad)}; choose from {', '.join(CASES)}")
    if args.list:
        for n in names:
            print(f"{n:28} {CASES[n][0]}\n{'':28} python {' '.join(command(n))}")
        return 0
    if args.summary:
        summary(names)
        return 0
    if args.check:
        return check(names)
    if args.noise:
        for n in names:
            path = OUT / f"{n}.json"
            if path.exists() and "accumulation_noise_vs_one_process" not in (r := json.loads(path.read_text())):
                r["accumulation_noise_vs_one_process"] = noise(r)
                path.write_text(json.dumps(r, indent=1) + "\n")
                print(f"zero_validation: {n}: noise {r['accumulation_noise_vs_one_process']:.2e}", file=sys.stderr)
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for k, n in enumerate(names):
        print(f"zero_validation: [{k + 1}/{len(names)}] {n}: {CASES[n][0]} "
              f"({time.perf_counter() - t0:.0f} s so far)", file=sys.stderr, flush=True)
        wall = run(n)
        print(f"zero_validation: {n} done in {wall:.0f} s", file=sys.stderr, flush=True)
    print(f"zero_validation: {len(names)} case(s) in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
