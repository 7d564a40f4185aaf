"""Benchmark collectives through torch.distributed and print them as nccl-tests does.

    python -m vramlab.commbench --nproc 2                      # gloo, CPU processes on this machine
    python -m vramlab.commbench --backend nccl --nproc 8       # one process per GPU
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 -m vramlab.commbench --backend nccl

Under torchrun (RANK/WORLD_SIZE set) it runs in place; otherwise it spawns --nproc local
processes. Each size: warm-up operations, then --runs timed runs of --iters back-to-back operations
(as nccl-tests times them); the reported time per operation is the median over runs of the slowest
rank. Results (with provenance) go to --out as JSON. Imports torch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from .collectives import OPS, busbw_factor

NCCL_NAMES = {"all_reduce": "all_reduce_perf", "all_gather": "all_gather_perf", "reduce_scatter": "reduce_scatter_perf",
              "broadcast": "broadcast_perf", "reduce": "reduce_perf", "all_to_all": "alltoall_perf"}


def default_sizes(lo: int = 1 << 10, hi: int = 16 << 20) -> list[int]:
    sizes, s = [], lo
    while s <= hi:
        sizes.append(s)
        s *= 4
    return sizes


def _run_op(dist, op: str, buf, out) -> None:
    if op == "all_reduce":
        dist.all_reduce(buf)
    elif op == "broadcast":
        dist.broadcast(buf, src=0)
    elif op == "reduce":
        dist.reduce(buf, dst=0)
    elif op == "all_gather":
        dist.all_gather_into_tensor(out, buf)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(out, buf)
    elif op == "all_to_all":
        dist.all_to_all_single(out, buf)


def _bench(rank: int, world: int, args) -> list[dict] | None:
    import torch
    import torch.distributed as dist

    dev = torch.device(f"cuda:{rank % torch.cuda.device_count()}") if args.backend == "nccl" else torch.device("cpu")
    if dev.type == "cpu":  # one compute thread per rank, each rank on its own core when there are enough
        torch.set_num_threads(1)
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if args.pin and len(cores) >= world:
            os.sched_setaffinity(0, {cores[rank]})
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    rows = []
    for size in args.sizes:
        count = size // 4  # float32 elements; nccl-tests' size convention per op (see collectives.py)
        n = world
        if args.op == "all_gather":
            buf, out = torch.ones(max(count // n, 1), device=dev), torch.empty(max(count // n, 1) * n, device=dev)
        elif args.op == "reduce_scatter":
            buf, out = torch.ones(max(count // n, 1) * n, device=dev), torch.empty(max(count // n, 1), device=dev)
        elif args.op == "all_to_all":
            c = max(count // n, 1) * n
            buf, out = torch.ones(c, device=dev), torch.empty(c, device=dev)
        else:
            buf, out = torch.ones(count, device=dev), None
        for _ in range(args.warmup):
            _run_op(dist, args.op, buf, out)
        times = []
        for _ in range(args.runs):  # as nccl-tests: time `iters` back-to-back ops, divide; median of runs
            dist.barrier()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                _run_op(dist, args.op, buf, out)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            dt = torch.tensor([(time.perf_counter() - t0) / args.iters], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank decides
            times.append(dt.item())
        t = statistics.median(times)
        nbytes = (out if args.op == "all_gather" else buf).numel() * 4
        rows.append({"size": nbytes, "count": nbytes // 4, "type": "float", "redop": "sum", "root": 0 if args.op in
                     ("broadcast", "reduce") else -1, "time_us": t * 1e6, "min_time_us": min(times) * 1e6, "algbw_GBps": nbytes / t / 1e9,
                     "busbw_GBps": nbytes / t / 1e9 * float(busbw_factor(args.op, n))})
    return rows if rank == 0 else None


def _worker(rank: int, world: int, args, port: int) -> None:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group(args.backend, rank=rank, world_size=world)
    try:
        rows = _bench(rank, world, args)
        if rows is not None:
            _report(rows, args, world)
    finally:
        dist.destroy_process_group()


def _report(rows: list[dict], args, world: int) -> None:
    print(f"# {NCCL_NAMES[args.op]} (vramlab.commbench): backend {args.backend}, {world} ranks")
    print(f"#{'size':>12}{'count':>12}{'type':>7}{'redop':>7}{'root':>6}{'time':>10}{'algbw':>8}{'busbw':>8}")
    print(f"#{'(B)':>12}{'(elements)':>12}{'':>7}{'':>7}{'':>6}{'(us)':>10}{'(GB/s)':>8}{'(GB/s)':>8}")
    for r in rows:
        print(f"{r['size']:>13}{r['count']:>12}{r['type']:>7}{r['redop']:>7}{r['root']:>6}{r['time_us']:>10.1f}"
              f"{r['algbw_GBps']:>8.2f}{r['busbw_GBps']:>8.2f}")
    if args.out:
        from .measure import provenance

        out = {"op": args.op, "backend": args.backend, "ranks": world, "warmup": args.warmup, "iters": args.iters,
               "runs": args.runs,
               "command": " ".join(["python -m vramlab.commbench", *sys.argv[1:]]),
               "provenance": provenance("cuda" if args.backend == "nccl" else "cpu"), "rows": rows}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"# wrote {args.out}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Benchmark a collective (nccl-tests format).")
    p.add_argument("--op", default="all_reduce", choices=OPS)
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    p.add_argument("--nproc", type=int, default=2, help="local processes to spawn (ignored under torchrun)")
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=default_sizes(),
                   help="comma-separated sizes in bytes (default 1 KiB .. 16 MiB, x4)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10, help="back-to-back operations per timed run")
    p.add_argument("--runs", type=int, default=5, help="timed runs per size (the median is reported)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--port", type=int, default=29511)
    p.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin CPU ranks to cores")
    args = p.parse_args(argv)
    if args.nproc < 1 or any(s < 4 for s in args.sizes):
        p.error("--nproc must be >= 1 and sizes >= 4 bytes")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        _worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, args.port)
        return 0
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(args.nproc, args, args.port), nprocs=args.nproc, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
