"""Lab 3's experiments: data, tensor and pipeline parallelism in real processes, measured per rank.

    python -m vramlab.parlab ddp --nproc 2                 # gloo, CPU processes on this machine
    python -m vramlab.parlab tp  --nproc 2
    python -m vramlab.parlab pp  --nproc 2 --micro-batches 1,2,4,8 --schedule gpipe,1f1b
    python -m vramlab.parlab ddp --backend nccl --nproc 8  # one process per GPU
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 -m vramlab.parlab ddp --backend nccl

Under torchrun (RANK/WORLD_SIZE set) it runs in place; otherwise it spawns --nproc local processes
(as `vramlab.commbench`). Every experiment trains a small Llama-architecture model built from a
config (random init) and reports, per rank, what `vramlab.parallel` predicts and what was measured:

- ddp: `DistributedDataParallel`; the gradients after one step against a single process's on the
  whole batch; DDP's gradient buckets (its own logging data) against `parallel.ddp_buckets`; the
  rank's memory against `parallel.estimate_layout`.
- tp: the model's blocks split with DTensor's `parallelize_module` (q/k/v and gate/up column-wise,
  o and down row-wise, embedding and head by vocabulary, a vocabulary-parallel loss); each rank's
  parameter bytes and memory against the prediction, the loss and logits against the unsplit model.
- pp: the blocks split into `nproc` stages run by `torch.distributed.pipelining` (GPipe, 1F1B);
  each stage's peak against the prediction for the number of micro-batches, and the measured bubble
  against the formula.

Memory is measured by live-tensor tracking (PyTorch's MemTracker, as `vramlab.measure`) over one
steady-state step: the optimizer states exist and the gradients are kept between steps
(`zero_grad(set_to_none=False)`, as Megatron-LM's contiguous gradient buffers are), so the end of
the forward passes in flight holds parameters, gradients, optimizer states and activations at once,
the point `estimate_layout` describes. DDP's buckets are allocated by its C++ reducer, which the
tracker cannot see: their bytes (from DDP's logging data) are added to the gradients. Imports torch.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from . import parallel as P
from .specs import ModelSpec, from_config

# The lab's model: Llama's architecture (nn.Linear everywhere, so DTensor's plans apply), small
# enough for two CPU processes, with activations dominating as in real training, and a small
# vocabulary so that the pipeline's last stage computes about what the others do.
LAB_CONFIG = dict(model_type="llama", hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=8, vocab_size=512, max_position_embeddings=512,
                  tie_word_embeddings=False)
EXPERIMENTS = ("ddp", "tp", "pp")


def lab_model() -> ModelSpec:
    return from_config(LAB_CONFIG, name="llama-lab3")


class ParlabError(RuntimeError):
    """A rank could not finish: the message says which and why, in one line."""


# ----------------------------------------------------------------------------- helpers (torch)

def _device(backend: str, rank: int):
    import torch

    if backend == "nccl":
        dev = torch.device(f"cuda:{rank % torch.cuda.device_count()}")
        torch.cuda.set_device(dev)
        return dev
    torch.set_num_threads(1)  # one compute thread per rank, each on its own core when there are enough
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) >= int(os.environ.get("WORLD_SIZE", "1")):
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    return torch.device("cpu")


def _build(spec: ModelSpec, dev):
    import torch

    from .models import build_model

    torch.manual_seed(0)  # the same weights on every rank
    return build_model(spec, attention="sdpa", device=dev)


def _batch(spec: ModelSpec, rows: int, seq: int, dev, seed: int = 1):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, spec.vocab_size, (rows, seq), generator=g).to(dev)


def _mode(dev) -> str:
    return "cuda" if dev.type == "cuda" else "cpu"


class _Tracked:
    """MemTracker around a step, with the current bytes by category readable at chosen points."""

    def __init__(self, model, optimizer, inputs):
        from .measure import _ignore_frozen, _tracker, _tensors

        self.tracker = _tracker()
        self.tracker.track_external(model, optimizer, *_tensors(inputs))
        _ignore_frozen(self.tracker, model)
        self.points: dict[str, dict[str, int]] = {}

    def mark(self, name: str) -> None:
        self.points[name] = self._snap("current")

    def _snap(self, which: str) -> dict[str, int]:
        snaps = self.tracker.get_tracker_snapshot(which)
        snap = next(iter(snaps.values())) if snaps else {}
        return {str(k.value if hasattr(k, "value") else k): int(v) for k, v in snap.items()}

    def peak(self) -> dict[str, int]:
        return self._snap("peak")


def _categories(snap: dict[str, int], *, opt, extra_grad: int = 0) -> dict[str, int]:
    """MemTracker's categories -> the estimate's (`measure._to_breakdown`), as a dict with the total;
    `extra_grad`: gradient bytes the tracker cannot see."""
    from .measure import _state_bytes, _to_breakdown

    bd = _to_breakdown(snap, opt_state_bytes=_state_bytes(opt), label="measured")
    return _with_total({"parameters": bd.parameters, "gradients": bd.gradients + extra_grad,
                        "optimizer_states": bd.optimizer_states, "activations": bd.activations,
                        "temporaries": bd.temporaries, "inputs": bd.inputs, "other": bd.other})


def _measure_step(step, model, opt, inputs, *, extra_grad: int = 0) -> tuple[dict[str, int], dict[str, int]]:
    """One step under MemTracker: (the peak, the end of the forward pass) by category. `step(tr)` calls
    `tr.mark("forward end")` once its loss exists."""
    tr = _Tracked(model, opt, inputs)
    with tr.tracker:
        step(tr)
    return (_categories(tr.peak(), opt=opt, extra_grad=extra_grad),
            _categories(tr.points["forward end"], opt=opt, extra_grad=extra_grad))


def _predicted(b) -> dict[str, int]:
    return {"parameters": b.parameters, "gradients": b.gradients, "optimizer_states": b.optimizer_states,
            "activations": b.activations, "temporaries": b.temporaries, "total": b.total, "phase": b.phase}


def _with_total(d: dict[str, int]) -> dict[str, int]:
    return {**d, "total": sum(d.values())}


def _optimizer(params):
    """AdamW, foreach; split parameters (DTensors) in a group of their own: a foreach kernel cannot
    mix them with plain tensors (the replicated norms)."""
    import torch
    from torch.distributed.tensor import DTensor

    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    return torch.optim.AdamW([{"params": g} for g in groups if g], lr=1e-4, foreach=True)


def _steady(opt, params) -> None:
    """Create the optimizer's states (one step on zero gradients) and keep the gradients allocated."""
    import torch

    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    _zero(opt)


def _zero(opt) -> None:
    """zero_grad(set_to_none=False) one tensor at a time (its foreach kernel cannot mix DTensors and tensors):
    the gradients stay allocated."""
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.grad.zero_()


def _lm_loss(logits, labels):
    import torch.nn.functional as F

    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def _train_step(model, batch, opt, loss_context=None):
    """One steady-state training step, `step(tr=None)`: forward and loss (inside `loss_context()`, e.g.
    tensor parallelism's `loss_parallel`, with the backward), the forward's end marked on a tracker
    when one is given, optimizer step, gradients zeroed but kept."""
    import contextlib

    def step(tr=None):
        with (loss_context or contextlib.nullcontext)():
            loss = _lm_loss(model(batch).logits, batch)
            if tr:
                tr.mark("forward end")
            loss.backward()
        opt.step()
        _zero(opt)
    return step


# ----------------------------------------------------------------------------- DDP

def _run_ddp(rank: int, world: int, args, dev) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    spec, b, s = lab_model(), args.micro_batch, args.seq
    batch = _batch(spec, b * world, s, dev)
    mine = batch[rank * b:(rank + 1) * b]
    # 1. gradients: DDP on this rank's rows against one process on the whole batch
    model = _build(spec, dev)
    ref = copy.deepcopy(model)
    ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None, bucket_cap_mb=args.bucket_cap_mb)
    _lm_loss(ddp(mine).logits, mine).backward()
    _lm_loss(ref(batch).logits, batch).backward()
    worst = max(((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30)).item()
                for p, q in zip(model.parameters(), ref.parameters()))
    del ddp, model, ref
    gc.collect()
    # 2. memory of a steady-state step, and the buckets DDP settled on
    model = _build(spec, dev)
    ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None, bucket_cap_mb=args.bucket_cap_mb)
    params = list(model.parameters())
    opt = _optimizer(params)
    _steady(opt, params)

    step = _train_step(ddp, mine, opt)
    step()  # DDP records the order in which gradients became ready,
    step()  # and rebuilds its buckets in that order at the start of the second forward
    # the reducer's buckets as they are now (zero tensors shaped like them: their bytes, in reduction order)
    order = [int(i) for i in str(ddp._get_ddp_logging_data().get("prev_iteration_grad_ready_order_indices", "")).split(",")
             if i.strip()]
    buckets = [g.buffer().numel() * g.buffer().element_size() for g in ddp.reducer._get_zeros_like_grad_buckets()]
    peak, forward_end = _measure_step(step, model, opt, mine, extra_grad=sum(buckets))
    pred = P.estimate_layout(spec, P.Layout(dp=world), micro_batch_size=b, seq_len=s, precision="fp32",
                             device=dev.type)[0]
    return {"rank": rank, "grad_max_rel_diff": worst, "buckets": buckets,
            "buckets_predicted": P.ddp_buckets([p.numel() * p.element_size() for p in params],
                                               bucket_cap_mb=args.bucket_cap_mb),
            # the same rule fed the order DDP recorded (ddp_buckets takes parameter order and reverses it)
            "buckets_predicted_ready_order": P.ddp_buckets([params[i].numel() * params[i].element_size()
                                                            for i in reversed(order)], bucket_cap_mb=args.bucket_cap_mb)
            if sorted(order) == list(range(len(params))) else None,
            "measured": peak, "measured_forward_end": forward_end, "predicted": _predicted(pred),
            "param_bytes": sum(p.numel() * p.element_size() for p in params)}


# ----------------------------------------------------------------------------- TP

def tp_plan(spec: ModelSpec) -> dict[str, Any]:
    """Megatron's split as a DTensor plan for transformers' Llama: q/k/v and gate/up column-wise
    (by heads and by MLP width), o and down row-wise (one all-reduce each), the embedding and the
    head by vocabulary (the head's logits stay split for a vocabulary-parallel loss)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(spec.num_layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    return plan


def _run_tp(rank: int, world: int, args, dev) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module


    spec, b, s = lab_model(), args.micro_batch, args.seq
    batch = _batch(spec, b, s, dev)  # the same rows on every rank: TP splits the model, not the data
    mesh = init_device_mesh(dev.type, (world,))
    ref = _build(spec, dev)
    model = parallelize_module(_build(spec, dev), mesh, tp_plan(spec))

    def loss_of(m):
        logits = m(batch).logits
        with loss_parallel():
            return _lm_loss(logits, batch), logits

    # 1. the split model computes what the unsplit one does
    with torch.no_grad():
        want = ref(batch).logits
        loss_ref = _lm_loss(want, batch)
        loss_tp, logits = loss_of(model)
        got = logits.full_tensor()
    rel = ((got - want).abs().max() / want.abs().max()).item()
    loss_diff = abs(loss_tp.item() - loss_ref.item())
    del ref, want, got, logits
    gc.collect()
    params = list(model.parameters())
    local = sum(p.to_local().numel() * p.element_size() if hasattr(p, "to_local") else p.numel() * p.element_size()
                for p in params)
    full = sum(p.numel() * p.element_size() for p in params)  # a DTensor's numel is the global one
    opt = _optimizer(params)
    _steady(opt, params)

    step = _train_step(model, batch, opt, loss_parallel)
    step()
    peak, forward_end = _measure_step(step, model, opt, batch)
    pred = P.estimate_layout(spec, P.Layout(tp=world), micro_batch_size=b, seq_len=s, precision="fp32",
                             device=dev.type)[0]
    return {"rank": rank, "logits_max_rel_diff": rel, "loss_abs_diff": loss_diff, "param_bytes_local": local,
            "param_bytes_full": full, "param_bytes_predicted": P.rank_params(spec, P.Layout(tp=world), 0) * 4,
            "measured": peak, "measured_forward_end": forward_end, "predicted": _predicted(pred)}


# ----------------------------------------------------------------------------- PP

def _stage_module(model, layers: range, first: bool, last: bool):
    import torch

    class Stage(torch.nn.Module):
        """Blocks `layers` of a transformers Llama, with the embedding on the first stage and the final
        norm and head on the last."""

        def __init__(self):
            super().__init__()
            inner = model.model
            self.embed_tokens = inner.embed_tokens if first else None
            self.layers = torch.nn.ModuleList(inner.layers[i] for i in layers)
            self.rotary_emb = inner.rotary_emb
            self.norm = inner.norm if last else None
            self.lm_head = model.lm_head if last else None

        def forward(self, x):
            h = self.embed_tokens(x) if self.embed_tokens is not None else x
            pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            pe = self.rotary_emb(h, pos)
            for layer in self.layers:
                out = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
                h = out[0] if isinstance(out, tuple) else out
            return self.lm_head(self.norm(h)) if self.lm_head is not None else h

    return Stage()


def _run_pp(rank: int, world: int, args, dev) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe


    spec, b, s = lab_model(), args.micro_batch, args.seq
    layers = P.stage_layers(spec.num_layers, world)[rank]
    first, last = rank == 0, rank == world - 1
    rows = []
    for schedule in args.schedules:
        for m in args.micro_batches:
            if schedule == "1f1b" and m < world:  # torch's 1F1B needs a micro-batch per stage to start
                continue
            model = _build(spec, dev)
            mod = _stage_module(model, layers, first, last)
            del model
            params = list(mod.parameters())
            opt = _optimizer(params)
            _steady(opt, params)
            stage = PipelineStage(mod, rank, world, dev)
            cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
            sched = cls(stage, n_microbatches=m, loss_fn=_lm_loss)
            batch = _batch(spec, b * m, s, dev)

            def step():
                # return_outputs=False: the last stage would otherwise keep every micro-batch's logits
                # to hand them back merged
                if first:
                    sched.step(batch, return_outputs=False)
                elif last:
                    sched.step(target=batch, return_outputs=False)
                else:
                    sched.step(return_outputs=False)
                opt.step()
                _zero(opt)

            step()  # warm-up: the stage's buffers and the p2p connections
            dist.barrier()
            resident = _resident(mod, opt, batch)
            with _LiveBytes(resident) as live:
                step()
            measured = {**{k: v for k, v in resident.items() if k != "storages"}, "activations": live.peak}
            # time: every forward and backward of this stage, on the machine's monotonic clock (one clock
            # for all processes of a machine), in each of `repeats` steps
            ops = _instrument(stage, dev)
            steps = []
            for _ in range(args.repeats):
                dist.barrier()
                ops.clear()
                t0 = time.perf_counter()
                step()
                steps.append({"start": t0, "end": time.perf_counter(), "ops": list(ops)})
            pred = P.estimate_layout(spec, P.Layout(pp=world, micro_batches=m, schedule=schedule), micro_batch_size=b,
                                     seq_len=s, precision="fp32", device=dev.type)[rank]
            rows.append({"schedule": schedule, "micro_batches": m, "rank": rank, "layers": [layers.start, layers.stop],
                         "measured": _with_total(measured), "predicted": _predicted(pred),
                         "steps": steps})
            del sched, stage, mod, opt, params
            gc.collect()
    return {"rank": rank, "rows": rows}


def _storage_bytes(tensors, seen) -> int:
    total = 0
    for t in tensors:
        if hasattr(t, "to_local"):
            t = t.to_local()
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def _resident(mod, opt, batch) -> dict:
    """The bytes that exist before a step, by category, and their storages."""
    seen: set[int] = set()
    params = list(mod.parameters())
    out = {"parameters": _storage_bytes(params, seen),
           "gradients": _storage_bytes([p.grad for p in params if p.grad is not None], seen),
           "optimizer_states": _storage_bytes([v for s in opt.state.values() for v in s.values()
                                               if hasattr(v, "untyped_storage")], seen),
           "inputs": _storage_bytes([batch], seen)}
    return {**out, "storages": seen}


class _LiveBytes:
    """Live-tensor tracking without module hooks (MemTracker's refuse a pipeline's interleaved forward
    and backward passes): every storage an operation creates is counted from its creation until it
    is freed; `peak` is the most alive at once. Storages that existed before (`resident`) are not."""

    def __init__(self, resident: dict):
        from torch.utils._python_dispatch import TorchDispatchMode

        self.seen, self.now, self.peak = set(resident["storages"]), 0, 0
        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                outer._track(out)
                return out

        self.mode = Mode()

    def _track(self, out) -> None:
        import weakref

        import torch
        from torch.utils._pytree import tree_flatten

        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            try:
                st = t.untyped_storage()
                key = st.data_ptr()
            except (RuntimeError, NotImplementedError):  # a wrapper subclass (DTensor): its local tensor is counted
                continue
            if key in self.seen or st.nbytes() == 0:
                continue
            self.seen.add(key)
            self.now += st.nbytes()
            self.peak = max(self.peak, self.now)
            weakref.finalize(st, self._free, key, st.nbytes())

    def _free(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.now -= nbytes

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def _instrument(stage, dev) -> list:
    """Record (kind, start, end) of every forward and backward the schedule runs on `stage`."""
    import torch

    ops: list = []
    for kind, name in (("F", "forward_one_chunk"), ("B", "backward_one_chunk")):
        fn = getattr(stage, name)

        def timed(*a, _fn=fn, _kind=kind, **kw):
            t0 = time.perf_counter()
            out = _fn(*a, **kw)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            ops.append((_kind, t0, time.perf_counter()))
            return out

        setattr(stage, name, timed)
    return ops


def measured_bubble(ranks: list[dict], schedule: str, micro_batches: int) -> dict[str, Any]:
    """The bubble of a pipeline run from the stages' recorded operations. In each timed step the span
    T runs from the first operation's start to the last one's end over all stages; the bubble is
    1 - W / T, W the busiest stage's own forward and backward time in that step (the formula's equal
    stages, each taking what the slowest one takes). Reported: the median over steps, the median of
    `replayed_bubble` (the same step with free communication), and each stage's mean forward and
    backward time."""
    rows = [next((r for r in rank["rows"] if r["schedule"] == schedule and r["micro_batches"] == micro_batches), None)
            for rank in ranks]
    if any(r is None for r in rows):
        raise ValueError(f"no {schedule} run with {micro_batches} micro-batches in these results")
    fractions, replayed = [], []
    for k in range(len(rows[0]["steps"])):
        ops = [row["steps"][k]["ops"] for row in rows]
        span = max(o[2] for stage in ops for o in stage) - min(o[1] for stage in ops for o in stage)
        fractions.append(1 - max(sum(o[2] - o[1] for o in stage) for stage in ops) / span)
        replayed.append(replayed_bubble(ops))
    per_stage = [{kind: statistics.fmean(o[2] - o[1] for step in row["steps"] for o in step["ops"] if o[0] == kind)
                  for kind in "FB"} for row in rows]
    return {"bubble": statistics.median(fractions), "per_step": fractions,
            "replayed": statistics.median(replayed), "forward_s": [x["F"] for x in per_stage],
            "backward_s": [x["B"] for x in per_stage]}


def replayed_bubble(stage_ops: list[list]) -> float:
    """The bubble of one measured step replayed with nothing but its computation: each stage runs its
    recorded operations in their recorded order, each taking exactly its measured time, each as soon
    as its input exists (the dependencies of `parallel.simulate`: a forward needs the previous stage's
    forward of that micro-batch, a backward the next stage's backward or, on the last stage, its own
    forward); sends and the time between operations cost nothing. Measured minus replayed is what
    communication and scheduling overhead add; replayed minus the formula is what unequal and varying
    operation times add."""
    orders, took = [], []
    for ops in stage_ops:
        count = {"F": 0, "B": 0}
        order = []
        for kind, _, _ in ops:
            order.append((kind, count[kind], 0))
            count[kind] += 1
        orders.append(order)
        took.append([end - start for _, start, end in ops])
    ticks = P.replay_orders(orders, took)
    return 1 - max(sum(t) for t in took) / max(end for *_, end in ticks)


def error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured."""
    return (predicted - measured) / measured


def memory_rows(result: dict) -> list[dict[str, Any]]:
    """One row per rank (ddp, tp) or per schedule, micro-batch count and stage (pp): predicted and
    measured bytes by category and the total's relative error."""
    out = []
    items = ([row for rank in result["per_rank"] for row in rank["rows"]] if result["experiment"] == "pp"
             else result["per_rank"])
    for row in items:
        meas, pred = row["measured"], row["predicted"]
        out.append({"schedule": row.get("schedule", ""), "micro_batches": row.get("micro_batches", 1),
                    "rank": row["rank"], "measured": meas["total"], "predicted": pred["total"],
                    "error": error(pred["total"], meas["total"]),
                    "states_measured": meas["parameters"] + meas["gradients"] + meas["optimizer_states"],
                    "states_predicted": pred["parameters"] + pred["gradients"] + pred["optimizer_states"]})
    return sorted(out, key=lambda r: (r["schedule"], r["micro_batches"], r["rank"]))


def bubble_rows(result: dict) -> list[dict[str, Any]]:
    """Measured bubble against the formula (share of the step's time, equal stages) per schedule and m."""
    seen = sorted({(row["schedule"], row["micro_batches"]) for rank in result["per_rank"] for row in rank["rows"]})
    p = result["ranks"]
    out = []
    for schedule, m in seen:
        got = measured_bubble(result["per_rank"], schedule, m)
        formula = float(P.bubble_fraction(p, m, schedule, of="total"))
        out.append({"schedule": schedule, "micro_batches": m, "formula": formula, "measured": got["bubble"],
                    "replayed": got["replayed"], "error": error(formula, got["bubble"]), "forward_s": got["forward_s"],
                    "backward_s": got["backward_s"]})
    return out


# ----------------------------------------------------------------------------- processes

def _worker(rank: int, world: int, args, port: int) -> None:
    import torch.distributed as dist

    from .commbench import _first_line

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    os.environ["WORLD_SIZE"] = str(world)
    try:
        dist.init_process_group(args.backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=args.timeout))
    except Exception as e:  # noqa: BLE001
        raise ParlabError(f"rank {rank} of {world}: the process group did not form within {args.timeout:g} s: "
                          f"{_first_line(e)}") from None
    try:
        dev = _device(args.backend, rank)
        result = {"ddp": _run_ddp, "tp": _run_tp, "pp": _run_pp}[args.experiment](rank, world, args, dev)
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            _report(gathered, args, world)
    except ParlabError:
        raise
    except Exception as e:  # noqa: BLE001
        raise ParlabError(f"rank {rank} of {world}: {type(e).__name__}: {_first_line(e)}") from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _report(ranks: list[dict], args, world: int) -> None:
    from .measure import provenance

    out = {"experiment": args.experiment, "backend": args.backend, "ranks": world,
           "model": LAB_CONFIG, "micro_batch_size": args.micro_batch, "seq_len": args.seq,
           "command": " ".join(["python -m vramlab.parlab", *sys.argv[1:]]),
           "provenance": provenance("cuda" if args.backend == "nccl" else "cpu"), "per_rank": ranks}
    from .units import fmt_bytes

    print(f"# vramlab.parlab {args.experiment}: backend {args.backend}, {world} ranks, {lab_model().name}, "
          f"micro-batch {args.micro_batch} x {args.seq}")
    print(f"#{'schedule':>9}{'m':>4}{'rank':>6}{'predicted':>12}{'measured':>12}{'error':>8}")
    for r in memory_rows(out):
        print(f" {r['schedule'] or '-':>9}{r['micro_batches']:>4}{r['rank']:>6}{fmt_bytes(r['predicted']):>12}"
              f"{fmt_bytes(r['measured']):>12}{100 * r['error']:>+7.1f}%")
    if args.experiment == "pp":
        print(f"#{'schedule':>9}{'m':>4}{'bubble: formula':>17}{'replayed':>10}{'measured':>10}")
        for b in bubble_rows(out):
            print(f" {b['schedule']:>9}{b['micro_batches']:>4}{b['formula']:>17.3f}{b['replayed']:>10.3f}{b['measured']:>10.3f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"# wrote {args.out}")


def _ints(text: str) -> list[int]:
    try:
        xs = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None
    if not xs or any(not 1 <= x <= 64 for x in xs):
        raise argparse.ArgumentTypeError(f"each value must be from 1 to 64, got {text!r}")
    return xs


def _schedules(text: str) -> list[str]:
    xs = text.split(",")
    bad = [x for x in xs if x not in ("gpipe", "1f1b")]
    if bad:
        raise argparse.ArgumentTypeError(f"schedules are gpipe and 1f1b, got {bad}")
    return xs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Lab 3's parallelism experiments, measured per rank.")
    p.add_argument("experiment", choices=EXPERIMENTS)
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    p.add_argument("--nproc", type=int, default=2, help="local processes to spawn (ignored under torchrun)")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch and rank (default 4)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--bucket-cap-mb", type=float, default=1.0, help="ddp: DDP's bucket_cap_mb (default 1)")
    p.add_argument("--micro-batches", type=_ints, default=[1, 2, 4, 8], help="pp: micro-batches per step")
    p.add_argument("--schedule", dest="schedules", type=_schedules, default=["gpipe", "1f1b"], help="pp: schedules")
    p.add_argument("--repeats", type=int, default=3, help="pp: timed steps per setting (median)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--port", type=int, default=0, help="rendezvous port (default: a free one)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a rendezvous or collective may take")
    args = p.parse_args(argv)
    if not 1 <= args.nproc <= 64:
        p.error("--nproc must be from 1 to 64")
    if not 1 <= args.micro_batch <= 4096 or not 2 <= args.seq <= LAB_CONFIG["max_position_embeddings"]:
        p.error(f"--micro-batch must be from 1 to 4096 and --seq from 2 to {LAB_CONFIG['max_position_embeddings']}")
    if not 1 <= args.repeats <= 100:
        p.error("--repeats must be from 1 to 100")
    from .commbench import _check_out, launch

    if args.out:
        _check_out(args.out)
    return launch(_worker, args, prog="parlab", error=ParlabError, torchrun_port=29512)

if __name__ == "__main__":
    sys.exit(main())
