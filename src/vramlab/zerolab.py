"""Lab 4's experiments: DeepSpeed's ZeRO stages 0-3 and PyTorch's FSDP2 on real ranks, measured.

    python -m vramlab.zerolab --nproc 2                           # gloo, CPU processes, every setup
    python -m vramlab.zerolab --setups 2,3,fsdp2 --nproc 4
    python -m vramlab.zerolab --precision bf16                    # DeepSpeed bf16, FSDP2 MixedPrecisionPolicy
    python -m vramlab.zerolab --backend nccl --nproc 8            # one process per GPU
    torchrun --nproc-per-node 8 -m vramlab.zerolab --backend nccl --setups 3

Each setup trains the same small GPT-2 (built from a config, random init, fp32 weights) for a few steps on
fixed data, one process group per setup, and reports per rank:
- resident memory after a step, by category: every live storage is found (a scan of the objects
  Python holds) and sorted into parameters (the module's, flat or partitioned), gradients,
  optimizer states (the inner optimizer's states and DeepSpeed's fp32 master partitions) and other
  (communication buckets and the like, largest first with their shapes);
- the step's peak: resident plus the most that a step's own storages held at once
  (`parlab._LiveBytes`), the largest over the measured steps (all but the first two);
- bytes communicated in the step, counted at the `torch.distributed` calls (payload per collective
  and what each rank sends on a ring, `collectives.bytes_sent_per_rank`);
- the trained parameters against one process training the same model on all ranks' data.
Imports torch and DeepSpeed (FSDP2 needs only torch).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

from . import collectives as C
from .specs import ModelSpec, from_config

# The lab's model: GPT-2's architecture with matrices above DeepSpeed's stage-3 persistence threshold
# (1e5 elements: smaller parameters stay whole on every rank) and a small vocabulary.
LAB_CONFIG = dict(model_type="gpt2", n_embd=256, n_inner=1024, n_layer=2, n_head=4, vocab_size=512,
                  n_positions=128, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
SETUPS = ("0", "1", "2", "3", "fsdp2")
LR = 1e-3


def lab_model() -> ModelSpec:
    return from_config(LAB_CONFIG, name="gpt2-lab4")


class ZerolabError(RuntimeError):
    """A rank could not finish: one line that says which and why."""


# ----------------------------------------------------------------------------- measuring (torch)

def _build(seed: int = 0):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = {k: v for k, v in LAB_CONFIG.items() if k != "model_type"}
    return GPT2LMHeadModel(GPT2Config(**cfg))


def _batch(rank: int, b: int, s: int):
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(0, LAB_CONFIG["vocab_size"], (b, s), generator=g)


def _storages() -> dict[int, tuple[int, str, tuple]]:
    """Every live CPU/GPU storage Python can reach: data_ptr -> (bytes, dtype, a shape that views it)."""
    import torch

    out: dict[int, tuple[int, str, tuple]] = {}
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor) and o.device.type != "meta":
                st = o.untyped_storage()
                if st.nbytes():
                    out.setdefault(st.data_ptr(), (st.nbytes(), str(o.dtype).replace("torch.", ""), tuple(o.shape)))
        except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
            continue
    return out


def _ptr(t) -> int | None:
    try:
        return t.untyped_storage().data_ptr() if t is not None and t.untyped_storage().nbytes() else None
    except (RuntimeError, NotImplementedError):
        return None


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _known(model, optimizer) -> dict[str, set[int]]:
    """Storage pointers of each category, from the objects that own them."""
    inner = getattr(optimizer, "optimizer", optimizer)
    params, grads, states = set(), set(), set()
    for p in model.parameters():
        for t in (_local(p), getattr(p, "ds_tensor", None)):
            params.add(_ptr(t))
        grads.add(_ptr(_local(p.grad) if p.grad is not None else None))
    module_ptrs = set(params)
    for group in inner.param_groups:
        for p in group["params"]:
            ptr = _ptr(_local(p))
            if ptr not in module_ptrs:
                states.add(ptr)  # DeepSpeed's fp32 master partition: the paper counts it in K
            grads.add(_ptr(_local(p.grad) if p.grad is not None else None))
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):  # ZeRO-1/2's, ZeRO-3's masters
        for t in getattr(optimizer, name, None) or []:
            states.add(_ptr(t))
    for st in inner.state.values():
        for v in st.values():
            if hasattr(v, "untyped_storage") and v.numel() > 1:
                states.add(_ptr(_local(v)))
    for name in ("grad_partitions_flat_buffer", "averaged_gradients"):  # ZeRO-3's and ZeRO-1/2's gradient shards
        buf = getattr(optimizer, name, None)
        for t in (buf.values() if isinstance(buf, dict) else [buf]):
            for x in (t if isinstance(t, list) else [t]):
                grads.add(_ptr(x))
    return {"parameters": params - {None}, "gradients": grads - {None} - params, "optimizer_states": states - {None}}


def _resident(model, optimizer) -> dict[str, Any]:
    gc.collect()
    live = _storages()
    known = _known(model, optimizer)
    out: dict[str, Any] = {k: sum(live[p][0] for p in ptrs if p in live) for k, ptrs in known.items()}
    claimed = set().union(*known.values())
    rest = sorted((v for p, v in live.items() if p not in claimed), key=lambda v: -v[0])
    out["other"] = sum(v[0] for v in rest)
    out["other_largest"] = [{"bytes": n, "dtype": d, "shape": list(s)} for n, d, s in rest[:4]]
    out["total"] = sum(v[0] for v in live.values())
    out["storages"] = set(live)
    return out


# The dispatcher's collective operations (where torch.distributed's functions, DeepSpeed's and FSDP2's
# calls all end) and the collective each is
C10D_OPS = {"allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "broadcast_": "broadcast",
            "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_coalesced_": "all_gather",
            "allgather_into_tensor_coalesced_": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
            "reduce_scatter_": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter"}


def _nbytes(x) -> int:
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return x.numel() * x.element_size() if hasattr(x, "element_size") else 0


class _CommCounter:
    """Counts every collective while active, at the dispatcher (`c10d::` operations): calls and payload
    bytes by collective, the payload being the whole tensor (all-reduce, broadcast), the gathered
    output or the scattered input."""

    def __init__(self, world: int):
        from torch.utils._python_dispatch import TorchDispatchMode

        self.world, self.calls, self.payload = world, {}, {}
        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.name()
                if name.startswith("c10d::"):
                    outer._count(name.split("::", 1)[1].split(".")[0], args)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def _count(self, name: str, args) -> None:
        op = C10D_OPS.get(name)
        if op is None:
            return
        size = _nbytes(args[0]) if op in ("all_reduce", "broadcast") else max(_nbytes(args[0]), _nbytes(args[1]))
        self.calls[op] = self.calls.get(op, 0) + 1
        self.payload[op] = self.payload.get(op, 0) + size

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)

    def report(self) -> dict[str, Any]:
        sent = {op: C.bytes_sent_per_rank(op, self.world, size / self.calls[op]) * self.calls[op]
                for op, size in self.payload.items()}
        return {"calls": self.calls, "payload": self.payload, "sent_per_rank": sent,
                "sent_per_rank_total": sum(sent.values())}


def _engine(setup: str, model, world: int, micro_batch: int, precision: str = "fp32"):
    import torch

    if setup == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dev = "cuda" if torch.cuda.is_available() and torch.distributed.get_backend() == "nccl" else "cpu"
        mesh = init_device_mesh(dev, (world,))
        model.to(dev)
        kw = {}
        if precision == "bf16":  # bf16 compute on gathered copies; fp32 sharded parameters and reductions
            from torch.distributed.fsdp import MixedPrecisionPolicy

            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh, **kw)
        fully_shard(model, mesh=mesh, **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)

        def step(ids):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
        return model, opt, step

    import logging

    import deepspeed

    deepspeed.utils.logger.setLevel(logging.ERROR)
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": int(setup)}, "steps_per_print": 10**9,
              "gradient_clipping": 0.0,  # DeepSpeed 0.19 clips at norm 1.0 unless told not to
              "bf16": {"enabled": precision == "bf16"}}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    engine, zopt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    def step(ids):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss
    return engine.module, zopt, step


def _full_params(setup: str, model) -> dict[str, Any]:
    import torch

    if setup == "3":
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            return {n: p.detach().to("cpu", torch.float32) for n, p in model.named_parameters()}
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().to("cpu", torch.float32)
            for n, p in model.named_parameters()}


def _reference(world: int, micro_batch: int, seq: int, steps: int) -> dict[str, Any]:
    """One process, all ranks' data at once (the ranks' mean loss = the mean over the whole batch)."""
    import torch

    model = _build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    ids = torch.cat([_batch(r, micro_batch, seq) for r in range(world)])
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def warmup_steps(steps: int) -> int:
    """Steps trained before any is measured: two (one when only two are trained)."""
    return min(2, steps - 1)


def run_setup(setup: str, rank: int, world: int, *, micro_batch: int, seq: int, steps: int,
              precision: str = "fp32") -> dict[str, Any]:
    """Train `steps` steps and measure every one after the warm-up (`warmup_steps`); return this
    rank's report. The step's peak is the largest over the measured steps, as the allocator's peak
    over a run is: which buffers of the last collective are still alive at a step's worst moment
    depends on when Python frees them, and one step can miss a buffer that the next one holds."""
    from .parlab import _LiveBytes

    import torch

    model, opt, step = _engine(setup, _build(), world, micro_batch, precision)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.distributed.get_backend() == "nccl" else None
    ids = _batch(rank, micro_batch, seq).to(dev or "cpu")
    for _ in range(warmup_steps(steps)):
        step(ids)
    before = _resident(model, opt)
    if dev is not None:  # on a GPU the allocator is the truth: its peak over the measured steps
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    peaks, comm = [], None
    for _ in range(steps - warmup_steps(steps)):
        storages = _resident(model, opt)["storages"] if peaks else before.pop("storages")
        with _CommCounter(world) as counter, _LiveBytes({"storages": storages}) as live:
            step(ids)
        peaks.append(live.peak)
        comm = comm or counter  # every measured step sends the same
    cuda = None
    if dev is not None:
        torch.cuda.synchronize()
        cuda = {"gpu": torch.cuda.get_device_name(), "allocated_after_step": torch.cuda.memory_allocated(),
                "peak_allocated": torch.cuda.max_memory_allocated(), "peak_reserved": torch.cuda.max_memory_reserved()}
    after = _resident(model, opt)
    after.pop("storages")
    full = _full_params(setup, model)
    return {"setup": setup, "rank": rank, "resident": after, "step_peak": before["total"] + max(peaks),
            "step_transient_peak": max(peaks), "step_transient_peaks": peaks, "cuda": cuda,
            "comm": comm.report(), "params_after": full}


def _worker(rank: int, world: int, args, port: int) -> None:
    import torch.distributed as dist

    from .commbench import _first_line
    from .parlab import _device

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    _device(args.backend, rank)
    try:
        dist.init_process_group(args.backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=args.timeout))
        reports = []
        for setup in args.setups:
            r = run_setup(setup, rank, world, micro_batch=args.micro_batch, seq=args.seq, steps=args.steps,
                          precision=args.precision)
            reports.append(r)
            dist.barrier()
            gc.collect()
        if rank == 0:
            ref = _reference(world, args.micro_batch, args.seq, args.steps)
        gathered = [None] * world
        slim = [{k: v for k, v in r.items() if k != "params_after"} for r in reports]
        diffs = []
        for r in reports:
            if rank == 0:
                diffs.append(max(float((r["params_after"][n] - ref[n]).abs().max()) for n in ref))
        dist.all_gather_object(gathered, slim)
        if rank == 0:
            from .measure import provenance

            note = (f"NCCL on {world} GPUs; memory by a scan of live storages" if args.backend == "nccl" else
                    f"gloo on {world} CPU processes; memory by a scan of live storages on the CPU, not a GPU measurement")
            out = {"experiment": "zero", "note": note, "backend": args.backend, "ranks": world, "model": LAB_CONFIG,
                   "params": lab_model().params, "micro_batch_size": args.micro_batch,
                   "seq_len": args.seq, "steps": args.steps,
                   "provenance": provenance("cuda" if args.backend == "nccl" else "cpu"),
                   "setups": {s: {"max_abs_diff_vs_one_process": d, "per_rank": [g[i] for g in gathered]}
                              for i, (s, d) in enumerate(zip(args.setups, diffs))}}
            Path(args.out).write_text(json.dumps(out) + "\n")
        dist.barrier()
        dist.destroy_process_group()
        import multiprocessing

        if multiprocessing.current_process().name != "MainProcess":
            # a spawned rank: leave without interpreter teardown, where a thread DeepSpeed leaves behind
            # aborts the process ("terminate called without an active exception") after the work is done
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    except Exception as e:  # noqa: BLE001 - one line per failing rank
        if os.environ.get("ZEROLAB_DEBUG"):  # the whole traceback, for whoever debugs a rank
            import traceback
            traceback.print_exc()
        raise ZerolabError(f"rank {rank}: {type(e).__name__}: {_first_line(e)}") from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    from .commbench import backend_problem, launch

    p = argparse.ArgumentParser(prog="python -m vramlab.zerolab", description=__doc__.split("\n\n")[0])
    p.add_argument("--setups", default=",".join(SETUPS), help="comma-separated: ZeRO stages 0-3 and/or fsdp2")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=5,
                   help="steps trained; every one after the first two is measured (the peak is their largest)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: DeepSpeed's bf16 optimizer, FSDP2's MixedPrecisionPolicy (bf16 compute, fp32 reductions)")
    p.add_argument("--out", default="")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--timeout", type=int, default=300)
    args = p.parse_args(argv)
    args.setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    bad = [s for s in args.setups if s not in SETUPS]
    if bad or not args.setups:
        p.error(f"unknown setup {', '.join(bad) or '(none)'}; choose from {', '.join(SETUPS)}")
    for name in ("nproc", "micro_batch", "seq", "steps"):
        if getattr(args, name) < 1 or (name == "steps" and args.steps < 2):
            p.error(f"--{name.replace('_', '-')} must be at least {2 if name == 'steps' else 1}")
    if args.seq > LAB_CONFIG["n_positions"]:
        p.error(f"--seq must be at most {LAB_CONFIG['n_positions']} (the lab model's positions)")
    why = backend_problem(args)
    if why:
        print(f"zerolab: {why}", file=sys.stderr)
        return 2
    # one process group per setup, in fresh processes: nothing of one setup (DeepSpeed's buffers, a
    # model) can be alive in the next one's measurement
    import tempfile

    merged: dict[str, Any] | None = None
    out, setups = args.out, args.setups
    for k, setup in enumerate(setups):
        print(f"zerolab: {setup if setup == 'fsdp2' else 'ZeRO-' + setup} on {args.nproc} {args.backend} ranks "
              f"({k + 1}/{len(setups)})", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            args.setups, args.out = [setup], str(Path(tmp) / "part.json")
            status = launch(_worker, args, prog="zerolab", error=ZerolabError, torchrun_port=29500)
            if status:
                return status
            if not Path(args.out).exists():  # under torchrun only rank 0 writes
                continue
            part = json.loads(Path(args.out).read_text())
        if merged is None:
            merged = part
        else:
            merged["setups"].update(part["setups"])
    if merged is None:
        return 0
    merged["command"] = "python -m vramlab.zerolab " + " ".join(sys.argv[1:] if argv is None else argv)
    text = json.dumps(merged, indent=1) + "\n"
    if out:
        Path(out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
