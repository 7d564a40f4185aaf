"""ZeRO-Offload on a real GPU, for chapter 6's numbers: DeepSpeed stage 2 with
`offload_optimizer: cpu` (DeepSpeedCPUAdam, DeepSpeed's own choice when it offloads), one rank, bf16;
and the host rates the chapter's time model rests on. Each configuration in its own process.

    python benchmarks/offload_gpu_validation.py              # everything (a CUDA GPU and deepspeed)
    python benchmarks/offload_gpu_validation.py --only cpu_adam,matmul
    python benchmarks/offload_gpu_validation.py --list

Per ZeRO-Offload case: the allocator's peak over two measured steps (after two warm-ups; reserved
beside it), each step's parts (forward, backward, DeepSpeed's step) timed with the GPU synchronised,
and the bytes CUDA copied each way in one more step, summed from the memcpy records of torch.profiler's
trace (an independent count: nothing of vramlab's). `cpu_adam`: DeepSpeedCPUAdam against torch's
AdamW on the host, one flat fp32 tensor (seconds a parameter). `matmul`: bf16, fp32 (no TF32) and
INT8 (`torch._int_mm`) matrix products, for the INT8 rate of the streaming model.
Writes benchmarks/results/offload/gpu/<case>.json (or --out-dir), with provenance.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "offload" / "gpu"
SEQ = 1024
# name -> (what it is for, model preset, micro-batch, reduce bucket in elements or None for DeepSpeed's 5e8)
CASES: dict[str, tuple[str, str, int, float | None]] = {
    "zo_gpt2_medium_bucket2e7": ("bucket (20 M) smaller than the model and than its largest tensor (51 M, tied wte)",
                                 "gpt2-medium", 4, 2e7),
    "zo_pythia_1b_bucket5e7": ("untied head: two 103 M tensors, bucket 50 M", "pythia-1b", 4, 5e7),
    "zo_llama_3_2_1b": ("DeepSpeed's default bucket (500 M) above the model's largest tensor (263 M)", "llama-3.2-1b", 4,
                        None),
}
EXTRA = {"cpu_adam": "DeepSpeedCPUAdam and torch's AdamW on this host", "matmul": "bf16, fp32 and INT8 matmul rates"}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _provenance() -> dict:
    """vramlab.measure.memory.provenance's keys (gpu, driver, cuda, torch, transformers, date), and the host's
    CPU and DeepSpeed: the host runs the optimizer step here."""
    import torch

    from vramlab.measure.record import provenance

    out = provenance("cuda" if torch.cuda.is_available() else None)
    out.update(cpu=_cpu_model(), cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads())
    try:
        out["deepspeed"] = __import__("deepspeed").__version__
    except ImportError:
        pass
    return out


def _memcpy_bytes(trace: Path) -> dict[str, int]:
    """Bytes per memcpy kind ("Memcpy DtoH (Device -> Pinned)", ...) in a torch.profiler chrome trace."""
    events = json.loads(trace.read_text()).get("traceEvents", [])
    out: dict[str, int] = {}
    for e in events:
        if "Memcpy" in str(e.get("name")) and "bytes" in (e.get("args") or {}):
            out[e["name"]] = out.get(e["name"], 0) + int(e["args"]["bytes"])
    return out


def zero_offload_case(name: str) -> dict:
    import deepspeed
    import torch

    from vramlab.measure.models import build_model, make_batch
    from vramlab.specs import preset

    _, model_name, batch_size, bucket = CASES[name]
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29571"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                 ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    deepspeed.init_distributed(dist_backend="nccl", verbose=False)
    spec = preset(model_name)
    model = build_model(spec, device="cuda", dtype=torch.bfloat16)
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if bucket is not None:
        zero.update(reduce_bucket_size=int(bucket), allgather_bucket_size=int(bucket))
    cfg = {"train_micro_batch_size_per_gpu": batch_size, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
           "zero_optimization": zero, "steps_per_print": 10**9}
    engine, optimizer, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    batch = make_batch(spec, batch_size=batch_size, seq_len=SEQ, device="cuda")
    numels = [p.numel() for p in model.parameters()]

    def step() -> dict:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = engine(**batch).loss
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        engine.backward(loss)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        return {"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2, "total": t3 - t0}

    for _ in range(2):
        step()
    torch.cuda.reset_peak_memory_stats()
    timed = [step() for _ in range(2)]
    peak, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    free, total = torch.cuda.mem_get_info()
    with tempfile.TemporaryDirectory() as tmp:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        copies = _memcpy_bytes(trace)
    return {"case": name, "what": CASES[name][0], "model": model_name, "params": sum(numels),
            "largest_param": max(numels), "batch_size": batch_size, "seq_len": SEQ,
            "reduce_bucket": int(engine.zero_reduce_bucket_size()), "deepspeed_config": cfg,
            "optimizer": type(optimizer.optimizer).__name__ if hasattr(optimizer, "optimizer") else type(optimizer).__name__,
            "peak_allocated": peak, "peak_reserved": reserved, "device_used_after": total - free,
            "steps": timed, "memcpy_bytes": copies,
            "dtoh_bytes": sum(v for k, v in copies.items() if "DtoH" in k),
            "htod_bytes": sum(v for k, v in copies.items() if "HtoD" in k)}


def _median_seconds(fn, reps: int = 4) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cpu_adam_case(n: int = 100_000_000) -> dict:
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    out = {"case": "cpu_adam", "what": EXTRA["cpu_adam"], "params": n}
    t0 = time.perf_counter()
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n) * 1e-3
    ds = DeepSpeedCPUAdam([p], lr=1e-4, adamw_mode=True)
    out["deepspeed_build_and_init_seconds"] = time.perf_counter() - t0
    out["deepspeed_cpu_adam_s_per_param"] = _median_seconds(ds.step) / n
    del ds
    for label, kw in (("torch_adamw_s_per_param", {"foreach": False}), ("torch_adamw_fused_s_per_param", {"fused": True})):
        q = torch.nn.Parameter(torch.randn(n))
        q.grad = torch.randn(n) * 1e-3
        try:
            opt = torch.optim.AdamW([q], lr=1e-4, **kw)
            out[label] = _median_seconds(opt.step) / n
        except (RuntimeError, TypeError) as e:
            out[label] = None
            out[label + "_error"] = str(e).splitlines()[0]
        del q
    return out


def matmul_case(n: int = 8192) -> dict:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    out = {"case": "matmul", "what": EXTRA["matmul"], "n": n}

    def rate(a, b, mm) -> float:
        for _ in range(3):
            mm(a, b)
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(10):
            mm(a, b)
        e1.record()
        torch.cuda.synchronize()
        return 2 * n**3 * 10 / (e0.elapsed_time(e1) / 1e3)

    for dt in (torch.bfloat16, torch.float32):
        a, b = torch.randn(n, n, device="cuda", dtype=dt), torch.randn(n, n, device="cuda", dtype=dt)
        out[f"{str(dt).split('.')[-1]}_flops"] = rate(a, b, torch.mm)
    a = torch.randint(-127, 128, (n, n), device="cuda", dtype=torch.int8)
    b = torch.randint(-127, 128, (n, n), device="cuda", dtype=torch.int8)
    out["int8_ops"] = rate(a, b, torch._int_mm)
    return out


def run_one(name: str) -> dict:
    if name == "cpu_adam":
        return cpu_adam_case()
    if name == "matmul":
        return matmul_case()
    return zero_offload_case(name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated cases (default: all)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--out-dir", type=Path, default=OUT)
    ap.add_argument("--timeout", type=int, default=240, help="seconds a case may take")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # a worker: one case, its JSON on stdout's last line
    a = ap.parse_args(argv)
    names = [*EXTRA, *CASES]
    if a.list:
        for n in names:
            print(f"{n:28s} {EXTRA.get(n) or CASES[n][0]}")
        return 0
    if a.case:
        res = run_one(a.case)
        res["provenance"] = _provenance()
        print(json.dumps(res))
        return 0
    chosen = [s.strip() for s in a.only.split(",")] if a.only else names
    bad = [s for s in chosen if s not in names]
    if bad:
        print(f"offload_gpu_validation: unknown case {', '.join(bad)}; --list shows them", file=sys.stderr)
        return 2
    a.out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    failed = 0
    for n in chosen:
        t0 = time.perf_counter()
        cmd = [sys.executable, __file__, "--case", n]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=env)
        except subprocess.TimeoutExpired:
            print(f"{n}: timed out after {a.timeout} s", flush=True)
            failed += 1
            continue
        if r.returncode != 0 or not r.stdout.strip():
            why = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
            print(f"{n}: failed ({why})", flush=True)
            (a.out_dir / f"{n}.err.txt").write_text(r.stderr[-20000:])
            failed += 1
            continue
        res = json.loads(r.stdout.strip().splitlines()[-1])
        res["wall_seconds"] = round(time.perf_counter() - t0, 1)
        res["command"] = f"python benchmarks/offload_gpu_validation.py --only {n}"
        (a.out_dir / f"{n}.json").write_text(json.dumps(res, indent=1) + "\n")
        print(f"{n}: done in {res['wall_seconds']} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
