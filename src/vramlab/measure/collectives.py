"""Benchmark collectives through torch.distributed and print them as nccl-tests does.

    python -m vramlab.measure.collectives --nproc 2                      # gloo, CPU processes on this machine
    python -m vramlab.measure.collectives --backend nccl --nproc 8       # one process per GPU
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 -m vramlab.measure.collectives --backend nccl

Under torchrun (RANK/WORLD_SIZE set) it runs in place; otherwise it spawns --nproc local
processes. After --warmup-s seconds of small all-reduces, the sizes take turns (--order
interleaved): each visit runs --warmup untimed operations, then one timed run of --iters back-to-back
operations, each operation timed on its own (host clock for gloo, CUDA events for NCCL) and the
slowest rank's time kept; --runs rounds. Reported per size: nccl-tests' time (mean of a run's
operations, median over runs; algbw and busbw use it), and the median and 90th percentile of
all single operations, which is what a model of the typical operation should be fitted to on a
machine with a scheduling tail. Results (with provenance and every operation's time) go to --out
as JSON. Imports torch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from .. import checks
from .. import collectives as C
from ..collectives import OPS

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


def _timed_run(torch, dist, args, buf, out, dev):
    """Seconds taken by each of `iters` back-to-back operations on this rank (float64 tensor).
    CPU (gloo): the calls block, so the host clock between calls times each one. CUDA: events
    recorded between the operations on the stream time each one without synchronising in between."""
    if dev.type == "cuda":
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(args.iters + 1)]
        torch.cuda.synchronize()
        ev[0].record()
        for i in range(args.iters):
            _run_op(dist, args.op, buf, out)
            ev[i + 1].record()
        torch.cuda.synchronize()
        return torch.tensor([ev[i].elapsed_time(ev[i + 1]) * 1e-3 for i in range(args.iters)], dtype=torch.float64)
    stamps = [time.perf_counter()]
    for _ in range(args.iters):
        _run_op(dist, args.op, buf, out)
        stamps.append(time.perf_counter())
    return torch.tensor([b - a for a, b in zip(stamps, stamps[1:])], dtype=torch.float64)


def _warm_up(torch, dist, dev, seconds: float) -> None:
    """Run small all-reduces for about `seconds` before anything is timed: the first hundreds of ms after
    start-up are slower (connections, caches, idle CPUs waking). The ranks agree on when to stop by
    all-reducing a 'keep going' flag - the warm-up operation itself - so they run the same count."""
    flag, t0 = torch.ones(1, device=dev), time.perf_counter()
    while flag.item() == 1.0:
        flag.fill_(1.0 if time.perf_counter() - t0 < seconds else 0.0)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)


def _buffers(torch, op: str, count: int, n: int, dev):
    """(input, output) tensors of an op for a buffer of `count` float32 elements, as nccl-tests sizes them."""
    if op == "all_gather":
        return torch.ones(max(count // n, 1), device=dev), torch.empty(max(count // n, 1) * n, device=dev)
    if op == "reduce_scatter":
        return torch.ones(max(count // n, 1) * n, device=dev), torch.empty(max(count // n, 1), device=dev)
    if op == "all_to_all":
        c = max(count // n, 1) * n
        return torch.ones(c, device=dev), torch.empty(c, device=dev)
    return torch.ones(count, device=dev), None


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
    n = world
    bufs = [_buffers(torch, args.op, size // 4, n, dev) for size in args.sizes]  # float32; see collectives.py
    _warm_up(torch, dist, dev, args.warmup_s)
    timed = [[] for _ in bufs]  # per size: the timed runs, each a list of its operations' seconds
    # interleaved (default): the sizes take turns, one timed run each per round, so that a slow spell of
    # the machine is spread over all sizes instead of landing on whichever was being measured then.
    # sequential: all runs of one size, then the next (as nccl-tests).
    k = len(bufs)
    visits = ([i for _ in range(args.runs) for i in range(k)] if args.order == "interleaved"
              else [i for i in range(k) for _ in range(args.runs)])
    for v, i in enumerate(visits):
        buf, out = bufs[i]
        for _ in range(args.warmup):
            _run_op(dist, args.op, buf, out)
        dist.barrier()
        dt = _timed_run(torch, dist, args, buf, out, dev).to(dev)  # NCCL reduces device tensors only
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # op by op, the slowest rank decides
        timed[i].append(dt.cpu().tolist())
        if rank == 0 and (v + 1) % k == 0:
            print(f"# {v + 1}/{len(visits)} timed runs done", file=sys.stderr, flush=True)
    rows = []
    for (buf, out), runs in zip(bufs, timed):
        m = [statistics.fmean(run) for run in runs]  # as nccl-tests: mean of a run's back-to-back ops
        ops = [x for run in runs for x in run]
        t = statistics.median(m)
        nbytes = (out if args.op == "all_gather" else buf).numel() * 4
        rows.append({"size": nbytes, "count": nbytes // 4, "type": "float", "redop": "sum", "root": 0 if args.op in
                     ("broadcast", "reduce") else -1, "time_us": t * 1e6, "min_time_us": min(m) * 1e6,
                     "op_median_us": statistics.median(ops) * 1e6,
                     "op_p90_us": _p90(ops) * 1e6,
                     "op_times_us": [round(x * 1e6, 2) for x in ops],
                     "algbw_GBps": C.algbw(nbytes, t) / 1e9, "busbw_GBps": C.busbw(args.op, n, nbytes, t) / 1e9})
    return rows if rank == 0 else None


class CommbenchError(RuntimeError):
    """A rank could not finish: the message says which and why, in one line."""


def _p90(xs: list[float]) -> float:
    """The 90th percentile, interpolated between order statistics: never below the median, also
    for two or three samples (the old lower order statistic read the minimum there)."""
    return xs[0] if len(xs) == 1 else statistics.quantiles(xs, n=10, method="inclusive")[-1]


def _worker(rank: int, world: int, args, port: int) -> None:
    import datetime

    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    timeout = datetime.timedelta(seconds=args.timeout)
    try:
        dist.init_process_group(args.backend, rank=rank, world_size=world, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - the rendezvous never completed
        raise CommbenchError(f"rank {rank} of {world}: the process group did not form within {args.timeout:g} s "
                             f"(a rank never started or cannot reach {os.environ['MASTER_ADDR']}:"
                             f"{os.environ['MASTER_PORT']}): {first_line(e)}") from None
    try:
        rows = _bench(rank, world, args)
        if rows is not None:
            _report(rows, args, world)
    except CommbenchError:
        raise
    except Exception as e:  # noqa: BLE001 - a collective timed out or a peer died
        raise CommbenchError(f"rank {rank} of {world}: a collective did not complete within {args.timeout:g} s or a "
                             f"peer failed (a rank stopped or is stuck): {first_line(e)}") from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing holds now (the OS picks it)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _report(rows: list[dict], args, world: int) -> None:
    print(f"# {NCCL_NAMES[args.op]} (vramlab.measure.collectives): backend {args.backend}, {world} ranks")
    print(f"#{'size':>12}{'count':>12}{'type':>7}{'redop':>7}{'root':>6}{'time':>10}{'algbw':>8}{'busbw':>8}"
          f"{'op median':>11}{'op p90':>9}")
    print(f"#{'(B)':>12}{'(elements)':>12}{'':>7}{'':>7}{'':>6}{'(us)':>10}{'(GB/s)':>8}{'(GB/s)':>8}"
          f"{'(us)':>11}{'(us)':>9}")
    for r in rows:
        print(f"{r['size']:>13}{r['count']:>12}{r['type']:>7}{r['redop']:>7}{r['root']:>6}{r['time_us']:>10.1f}"
              f"{r['algbw_GBps']:>8.2f}{r['busbw_GBps']:>8.2f}{r['op_median_us']:>11.1f}{r['op_p90_us']:>9.1f}")
    if args.out:
        from .record import provenance

        out = {"op": args.op, "backend": args.backend, "ranks": world, "warmup": args.warmup,
               "warmup_s": args.warmup_s, "iters": args.iters, "order": args.order,
               "runs": args.runs,
               "command": " ".join(["python -m vramlab.measure.collectives", *sys.argv[1:]]),
               "provenance": provenance("cuda" if args.backend == "nccl" else "cpu"), "rows": rows}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"# wrote {args.out}")


PROG = "python -m vramlab.measure.collectives"


def main(argv: list[str] | None = None) -> int:
    p = checks.Parser(prog=PROG, description="Benchmark a collective (nccl-tests format).")
    p.add_argument("--op", default="all_reduce", choices=OPS)
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    p.add_argument("--nproc", type=checks.argtype(checks.whole, int, lo=1, hi=256), default=2,
                   help="local processes to spawn, 1 to 256 (ignored under torchrun)")
    p.add_argument("--sizes", type=_sizes, default=default_sizes(),
                   help="comma-separated sizes in bytes, multiples of 4 (float32) (default 1 KiB .. 16 MiB, x4)")
    p.add_argument("--warmup", type=checks.argtype(checks.whole, int, lo=0, hi=10_000), default=3,
                   help="untimed operations before each size")
    p.add_argument("--warmup-s", type=_float, default=0.5, help="seconds of small all-reduces before the first size")
    p.add_argument("--iters", type=checks.argtype(checks.whole, int, lo=1, hi=100_000), default=20,
                   help="back-to-back operations per timed run")
    p.add_argument("--runs", type=checks.argtype(checks.whole, int, lo=1, hi=10_000), default=5,
                   help="timed runs per size (the median is reported)")
    p.add_argument("--order", default="interleaved", choices=("interleaved", "sequential"),
                   help="interleaved: sizes take turns run by run (default); sequential: one size after another")
    p.add_argument("--out", default=None, help="write the results as JSON here (checked before the run)")
    p.add_argument("--port", type=checks.argtype(checks.whole, int, lo=0, hi=65535), default=0,
                   help="rendezvous port, 1 to 65535 (default 0: a free one)")
    p.add_argument("--timeout", type=_float, default=60.0,
                   help="seconds a rendezvous or one collective may take before the run stops (default 60)")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin CPU ranks to cores")
    args = p.parse_args(argv)
    if not (0 <= args.warmup_s <= 60):
        p.error(f"--warmup-s must be from 0 to 60 seconds, got {args.warmup_s:g}")
    if not (0 < args.timeout <= 3600):
        p.error(f"--timeout must be from 0 to 3600 seconds, got {args.timeout:g}")
    checks.output_path(PROG, args.out, make_folder=True)
    return launch(_worker, args, prog=PROG, error=CommbenchError, torchrun_port=29511)


def _float(text: str) -> float:
    """An argparse type: a number as float() reads it (its range is checked after parsing)."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}") from None


def backend_problem(args) -> str | None:
    """Why `args.backend` cannot run `args.nproc` local ranks here (NCCL: one process per GPU), or None."""
    if getattr(args, "backend", "gloo") != "nccl":
        return None
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        return "--backend nccl needs CUDA GPUs and this machine has none; use --backend gloo"
    if "RANK" not in os.environ and args.nproc > gpus:
        return (f"--backend nccl runs one process per GPU: --nproc {args.nproc}, but this machine has {gpus} "
                f"GPU{'s' if gpus > 1 else ''}")
    return None


def launch(worker, args, *, prog: str, error: type[Exception], torchrun_port: int, preload: tuple[str, ...] = ()) -> int:
    """Run `worker(rank, world, args, port)` in place under torchrun (RANK and WORLD_SIZE set), else in
    `args.nproc` local processes on `args.port` (or a free one). A rank's `error` or any other failure is
    printed as one line prefixed with `prog`; returns the exit status.

    Each rank is a process of its own, started afresh for this call. With NCCL they are spawned (a new
    interpreter each: nothing of CUDA can be inherited). On the CPU (gloo) they are forked from a fork
    server that imported `worker`'s module and `preload` (e.g. deepspeed, transformers) once, before any
    rank of this command ran: a rank then starts in a second rather than importing the same libraries
    again, and its state is still its own (the server holds imported modules, never a model or a tensor
    of a measurement)."""
    why = backend_problem(args)
    if why:  # one process per GPU: say so before any rank starts
        print(f"{prog}: {why}", file=sys.stderr)
        return 2
    try:
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
            worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, args.port or torchrun_port)
            return 0
        import multiprocessing

        import torch.multiprocessing as mp

        method = "spawn" if getattr(args, "backend", "gloo") == "nccl" else "forkserver"
        if method == "forkserver":
            multiprocessing.get_context(method).set_forkserver_preload([worker.__module__, *preload])
        mp.start_processes(worker, args=(args.nproc, args, args.port or free_port()), nprocs=args.nproc, join=True,
                           start_method=method)
    except error as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - mp.spawn re-raises a rank's error wrapped: keep its last line
        last = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        print(f"{prog}: {last[-1] if last else type(e).__name__}", file=sys.stderr)
        return 1
    return 0


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers of bytes, got {text!r}") from None
    bad = [s for s in sizes if s < 4 or s % 4 or s > 1 << 34]
    if bad:
        raise argparse.ArgumentTypeError(f"sizes are float32 buffers: multiples of 4 from 4 B to 16 GiB, got {bad}")
    if len(set(sizes)) != len(sizes):
        raise argparse.ArgumentTypeError(f"each size once, got {text!r}")
    return sizes


if __name__ == "__main__":
    sys.exit(main())
