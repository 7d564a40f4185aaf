"""Lab 3's experiments: data, tensor and pipeline parallelism in real processes, measured per rank.

    python -m vramlab.measure.parallel ddp --nproc 2                 # gloo, CPU processes on this machine
    python -m vramlab.measure.parallel tp  --nproc 2
    python -m vramlab.measure.parallel pp  --nproc 2 --micro-batches 1,2,4,8 --schedule gpipe,1f1b
    python -m vramlab.measure.parallel cp  --method ring --nproc 4    # context parallelism (`cp_main`'s options)
    python -m vramlab.measure.parallel ep  --ep 2 --dp 4 --capacity-factor 1.5 --zero 1  # expert parallelism (`ep_main`)
    python -m vramlab.measure.parallel ddp --backend nccl --nproc 8  # one process per GPU
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 -m vramlab.measure.parallel ddp --backend nccl

    # other models and layouts (the estimator's validation: benchmarks/layout_validation.py)
    python -m vramlab.measure.parallel ddp --model opt-val --gradient-as-bucket-view --optimizer-impl for-loop
    python -m vramlab.measure.parallel tp  --model llama-gqa-val --sp --recompute selective --precision bf16
    python -m vramlab.measure.parallel pp  --model neox-val --nproc 4 --schedule gpipe,1f1b,interleaved --chunks 2

Under torchrun (RANK/WORLD_SIZE set) it runs in place; otherwise it spawns --nproc local processes
(as `vramlab.measure.collectives`). Every experiment trains a small model built from a config (random init;
`--model`, default lab 3's Llama, `MODELS` lists the others: OPT-like with tied embeddings,
GPT-NeoX-like with a fused query_key_value, Llama-like with grouped-query attention) and reports,
per rank, what `vramlab.parallel` predicts (lab 3's model, the lab's settings only) and what was
measured:

- ddp: `DistributedDataParallel`; the gradients after one step against a single process's on the
  whole batch; DDP's gradient buckets (its own logging data) against `parallel.ddp_buckets`; the
  rank's memory against `parallel.estimate_layout`.
- tp: the model's blocks split with DTensor's `parallelize_module` (`tp_plan`: q/k/v or the fused qkv
  and the MLP's first projections column-wise, the attention output and the MLP's last projection
  row-wise, embedding and head by vocabulary with a vocabulary-parallel loss; `--sp` adds sequence
  parallelism on the norms); each rank's parameter bytes and memory against the prediction, the loss
  and logits against the unsplit model.
- pp: the blocks split into `nproc` stages (`--chunks` v per rank for the interleaved schedule) run by
  `torch.distributed.pipelining` (GPipe, 1F1B, interleaved 1F1B); each stage's peak, the micro-batches
  in flight, the bytes sent across stage boundaries and the measured bubble against the formula.

Memory, two ways:

- `measured` (lab 3's accounting, kept as it was): MemTracker over one steady-state step for ddp and tp
  (DDP's buckets, allocated by its C++ reducer, added to the gradients from its logging data), live
  storages created during the step on top of the resident states for pp. MemTracker registers DDP's
  buckets a second time, as temporaries, once c10d.allreduce_ hands them back: where its peak falls
  after the first bucket's all-reduce, `measured` counts those buckets twice (`measured_note`).
- `memory` (every run): `ledger.Ledger`, a dispatch-level record of every storage from the start of the rank
  (model build, DDP's construction, warm-up steps included), each with its bytes, dtype, shape, the
  operation that created it and the phase it was created in; DTensor operations are followed into
  their local tensors (so DTensor's internal buffers are seen). Over one steady-state step (optimizer
  states exist, gradients kept allocated, `zero_grad(set_to_none=False)`, as Megatron-LM's contiguous
  gradient buffers are) it reports the peak, the phase it falls in (forward, loss, backward,
  optimizer, schedule), the peak of each phase, the bytes at each of those points by category
  (parameters, gradients, optimizer states, inputs, buffers, persistent other = storages that existed
  before the step and are none of these, activations = created by forward passes, backward / optimizer
  transients, step other), the 10 largest non-state storages at the peak and the largest storages each
  phase created. Not seen: memory allocated outside PyTorch's dispatcher (gloo's own buffers,
  allocator slack) and operations run on threads other than the rank's main and autograd threads.
  Imports torch.

Where the parts are: ddp and tp here, with the command; pp in `vramlab.measure.pipeline`, cp in
`vramlab.measure.context_parallel`, ep in `vramlab.measure.expert_parallel` (this command runs them all);
the rank machinery they share (lab 3's models, a rank's step, `run_rank`) in `vramlab.measure.ranks`; the
ledger in `vramlab.measure.ledger`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

from .. import checks
from .. import parallel as P
from ..specs import ModelSpec
from . import ledger
from .context_parallel import cp_main
from .expert_parallel import ep_main
from .ledger import STATE_CATEGORIES, ledger_step
from .pipeline import bubble_rows, pp_problem, run_pp
from .ranks import (FAMILIES, MODELS, PROG, RANK_IMPORTS, ParlabError, adamw, apply_recompute, autocast, error,
                    family_plan, lm_loss, model_spec, predicted_dict, predicts, run_info, run_rank, seeded_model,
                    shard_bytes, steady, submodule, token_batch, with_total, zero_grads)

EXPERIMENTS = ("ddp", "tp", "pp")


class _Tracked:
    """MemTracker around a step, with the current bytes by category readable at chosen points."""

    def __init__(self, model, optimizer, inputs):
        from .memory import ignore_frozen, storage_tracker, tensors_in

        self.tracker = storage_tracker()
        self.tracker.track_external(model, optimizer, *tensors_in(inputs))
        ignore_frozen(self.tracker, model)
        self.points: dict[str, dict[str, int]] = {}

    def mark(self, name: str) -> None:
        self.points[name] = self._snap("current")

    def set_phase(self, name: str) -> None:
        pass

    def _snap(self, which: str) -> dict[str, int]:
        snaps = self.tracker.get_tracker_snapshot(which)
        snap = next(iter(snaps.values())) if snaps else {}
        return {str(k.value if hasattr(k, "value") else k): int(v) for k, v in snap.items()}

    def peak(self) -> dict[str, int]:
        return self._snap("peak")


def _categories(snap: dict[str, int], *, opt, extra_grad: int = 0) -> dict[str, int]:
    """MemTracker's categories -> the estimate's (`measure.to_breakdown`), as a dict with the total;
    `extra_grad`: gradient bytes the tracker cannot see."""
    from .memory import state_bytes, to_breakdown

    bd = to_breakdown(snap, opt_state_bytes=state_bytes(opt), label="measured")
    return with_total({"parameters": bd.parameters, "gradients": bd.gradients + extra_grad,
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


def _train_step(model, batch, opt, loss_context=None, precision: str = "fp32"):
    """One steady-state training step, `step(tr=None)`: forward and loss (inside `loss_context()`, e.g.
    tensor parallelism's `loss_parallel`, with the backward; in bf16 autocast for precision="bf16"), the
    forward's end marked and the phases named on a tracker when one is given, optimizer step, gradients
    zeroed but kept."""

    def step(tr=None):
        phase = tr.set_phase if tr else (lambda name: None)
        with (loss_context or contextlib.nullcontext)():
            phase("forward")
            with autocast(precision, batch.device):
                logits = model(batch).logits
                phase("loss")
                loss = lm_loss(logits, batch)
                del logits
            if tr:
                tr.mark("forward end")
            phase("backward")
            loss.backward()
        phase("optimizer")
        opt.step()
        zero_grads(opt)
        phase("after step")
    return step


# ----------------------------------------------------------------------------- DDP

def _run_ddp(rank: int, world: int, args, dev) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    spec, b, s = model_spec(args.model), args.micro_batch, args.seq
    view = bool(args.gradient_as_bucket_view)
    batch = token_batch(spec, b * world, s, dev)
    mine = batch[rank * b:(rank + 1) * b]
    # 1. gradients: DDP on this rank's rows against one process on the whole batch
    model = seeded_model(spec, dev)
    ref = copy.deepcopy(model)
    ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None, bucket_cap_mb=args.bucket_cap_mb,
              gradient_as_bucket_view=view)
    lm_loss(ddp(mine).logits, mine).backward()
    lm_loss(ref(batch).logits, batch).backward()
    # relative to each tensor's largest gradient, or to 1e-6 of the model's largest where a tensor's gradient is
    # nothing but rounding (a key projection's bias: zero in exact arithmetic, the softmax ignores it)
    floor = 1e-6 * max(q.grad.abs().max().item() for q in ref.parameters())
    worst = max(((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(max(floor, 1e-30))).item()
                for p, q in zip(model.parameters(), ref.parameters()))
    del ddp, model, ref
    gc.collect()
    # 2. memory of a steady-state step, and the buckets DDP settled on
    model = seeded_model(spec, dev)
    apply_recompute(model, spec, args.recompute)
    ledger.LEDGER.set_phase("ddp construction")
    ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None, bucket_cap_mb=args.bucket_cap_mb,
              gradient_as_bucket_view=view)
    ledger.LEDGER.set_phase("setup")
    params = list(model.parameters())
    opt = adamw(params, args.foreach)
    steady(opt, params)

    step = _train_step(ddp, mine, opt, precision=args.precision)
    step()  # DDP records the order in which gradients became ready,
    step()  # and rebuilds its buckets in that order at the start of the second forward
    # the reducer's buckets as they are now (zero tensors shaped like them: their bytes, in reduction order)
    order = [int(i) for i in str(ddp._get_ddp_logging_data().get("prev_iteration_grad_ready_order_indices", "")).split(",")
             if i.strip()]
    buckets = [g.buffer().numel() * g.buffer().element_size() for g in ddp.reducer._get_zeros_like_grad_buckets()]
    # MemTracker cannot see the buckets (allocated by DDP's C++ reducer): with gradient_as_bucket_view the
    # gradients are views of them and already counted, otherwise they are a second copy of the gradients
    peak, forward_end = _memtracker(step, model, opt, mine, extra_grad=0 if view else sum(buckets))
    memory = ledger_step(step, [model], opt, [batch])
    if peak is None:
        peak, forward_end = _measured_from_ledger(memory), None
    pred = P.estimate_layout(spec, P.Layout(dp=world), micro_batch_size=b, seq_len=s, precision="fp32",
                             device=dev.type)[0] if predicts(args) else None
    return {"rank": rank, "grad_max_rel_diff": worst, "buckets": buckets,
            "buckets_predicted": P.ddp_buckets([p.numel() * p.element_size() for p in params],
                                               bucket_cap_mb=args.bucket_cap_mb),
            # the same rule fed the order DDP recorded (ddp_buckets takes parameter order and reverses it)
            "buckets_predicted_ready_order": P.ddp_buckets([params[i].numel() * params[i].element_size()
                                                            for i in reversed(order)], bucket_cap_mb=args.bucket_cap_mb)
            if sorted(order) == list(range(len(params))) else None,
            "measured": peak, "measured_forward_end": forward_end,
            "predicted": predicted_dict(pred) if pred is not None else None,
            "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "gradient_as_bucket_view": view, "memory": memory,
            "measured_note": None if view else (
                "MemTracker registers DDP's existing buckets as new temporaries when c10d.allreduce_ returns them, "
                "on top of extra_grad: 'measured' double-counts the buckets already all-reduced at its peak; "
                "'memory' (the ledger) knows them from DDP's construction and counts them once"),
            "run": run_info(spec, args, {"dp": world, "tp": 1, "pp": 1}) | {"micro_batches": 1}}


def _memtracker(step, model, opt, inputs, **kw):
    """MemTracker's (peak, forward end), or (None, None) where it cannot follow the step."""
    try:
        return _measure_step(step, model, opt, inputs, **kw)
    except Exception as e:  # noqa: BLE001 - the ledger still measures
        print(f"parlab: MemTracker could not follow this step ({type(e).__name__}: {str(e)[:120]}); "
              f"'measured' is the ledger's", file=sys.stderr)
        return None, None


def _measured_from_ledger(memory: dict) -> dict[str, int]:
    """lab 3's `measured` categories from the ledger's peak (where MemTracker cannot run)."""
    c = memory["at_peak"]["categories"]
    return with_total({"parameters": c["parameters"], "gradients": c["gradients"],
                        "optimizer_states": c["optimizer_states"],
                        "activations": c["activations"] + c["backward_transients"] + c["step_other"],
                        "temporaries": c["optimizer_transients"], "inputs": c["inputs"],
                        "other": c["buffers"] + c["persistent_other"]})


# ----------------------------------------------------------------------------- TP

def tp_plan(spec: ModelSpec, sp: bool = False) -> dict[str, Any]:
    """Megatron's split as a DTensor plan for the model's family (`FAMILIES`): q/k/v (or the fused
    query_key_value, laid out head by head) and the MLP's first projections (gate/up, fc1, dense_h_to_4h)
    column-wise, by heads and by MLP width; the attention output (o_proj, out_proj, dense) and the MLP's
    last projection (down_proj, fc2, dense_4h_to_h) row-wise, one all-reduce each; the embedding and the
    head by vocabulary (the head's logits stay split for a vocabulary-parallel loss).

    `sp`: sequence parallelism (Korthikanti et al.): the norms run on a sequence shard (`SequenceParallel`),
    the residual stream stays split by sequence between blocks, each attention and MLP block gathers its
    input once (`PrepareModuleInput`: all-gather) and its row-wise output is reduce-scattered back to
    sequence shards (`output_layouts=Shard(1)`)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    fam = family_plan(spec)
    if sp and not fam["sp"]:
        raise ParlabError(f"{spec.name}: sequence parallelism is not supported for the {spec.family} family here")
    if not sp:
        plan: dict[str, Any] = {fam["embed"]: RowwiseParallel(input_layouts=Replicate()),
                                fam["head"]: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    else:
        plan = {fam["embed"]: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
                fam["norm"]: SequenceParallel(),
                fam["head"]: ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}
    for i in range(spec.num_layers):
        pre = f"{fam['layers']}.{i}"
        for name in fam["col"]:
            plan[f"{pre}.{name}"] = ColwiseParallel()
        for name in fam["row"]:
            plan[f"{pre}.{name}"] = (RowwiseParallel(output_layouts=Shard(1), use_local_output=False) if sp
                                     else RowwiseParallel())
        if sp:
            for name in fam["block_norms"]:
                plan[f"{pre}.{name}"] = SequenceParallel()
            plan[f"{pre}.{fam['attn']}"] = (
                PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                   desired_input_kwarg_layouts={"hidden_states": Replicate()}, use_local_output=True)
                if fam["attn_kw"] else
                PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True))
            plan[f"{pre}.{fam['mlp']}"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                             use_local_output=True)
    return plan


def _after_tp(model, spec: ModelSpec, world: int) -> None:
    """What `parallelize_module` leaves to the model: OPT's attention reshapes by its own head count (set it
    to the rank's), and a tied head gets its own copy of the split embedding (tie them again)."""
    fam = family_plan(spec)
    if spec.family == "opt":
        for layer in submodule(model, fam["layers"]):
            layer.self_attn.num_heads = spec.num_heads // world
    if spec.tie_word_embeddings:
        submodule(model, fam["head"]).weight = submodule(model, fam["embed"]).weight


def tp_problem(spec: ModelSpec, t: int, *, sp: bool = False, seq: int = 0) -> str | None:
    """Why `spec` cannot be split t ways here (None when it can)."""
    sizes = {"num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
             "vocab_size": spec.vocab_size, "intermediate_size": spec.intermediate_size}
    if sp:
        sizes["seq_len"] = seq
    bad = [f"{k} {v}" for k, v in sizes.items() if v % t]
    if bad:
        return f"{spec.name} cannot be split {t} ways: {', '.join(bad)} not divisible by {t}"
    if sp and not family_plan(spec)["sp"]:
        return f"--sp is not supported for the {spec.family} family (supported: " \
               f"{', '.join(f for f, d in FAMILIES.items() if d['sp'])})"
    return None


def _run_tp(rank: int, world: int, args, dev) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    spec, b, s = model_spec(args.model), args.micro_batch, args.seq
    why = tp_problem(spec, world, sp=args.sp, seq=s)
    if why:
        raise ParlabError(why)
    batch = token_batch(spec, b, s, dev)  # the same rows on every rank: TP splits the model, not the data
    mesh = init_device_mesh(dev.type, (world,))
    ref = seeded_model(spec, dev)
    model = parallelize_module(seeded_model(spec, dev), mesh, tp_plan(spec, sp=args.sp))
    _after_tp(model, spec, world)

    def loss_of(m):
        logits = m(batch).logits
        with loss_parallel():
            return lm_loss(logits, batch), logits

    # 1. the split model computes what the unsplit one does
    with torch.no_grad():
        want = ref(batch).logits
        loss_ref = lm_loss(want, batch)
        loss_tp, logits = loss_of(model)
        got = logits.full_tensor()
    rel = ((got - want).abs().max() / want.abs().max()).item()
    loss_diff = abs(loss_tp.item() - loss_ref.item())
    del ref, want, got, logits
    # 2. the gradients DTensor hands back where there is none yet (a first step, or zero_grad(set_to_none=True)):
    # their layout and local size where it differs from the parameter's
    logits = model(batch).logits
    with loss_parallel():
        lm_loss(logits, batch).backward()
    fresh = _grad_layouts(model)
    for p in model.parameters():
        p.grad = None
    del logits
    gc.collect()
    apply_recompute(model, spec, args.recompute)
    params = list(model.parameters())
    local = shard_bytes(params)
    full = sum(p.numel() * p.element_size() for p in params)  # a DTensor's numel is the global one
    opt = adamw(params, args.foreach)
    steady(opt, params)

    step = _train_step(model, batch, opt, loss_parallel, precision=args.precision)
    step()
    peak, forward_end = _memtracker(step, model, opt, batch)
    memory = ledger_step(step, [model], opt, [batch])
    if peak is None:
        peak, forward_end = _measured_from_ledger(memory), None
    layouts = _grad_layouts(model)  # in the steady state: the gradients exist and are accumulated into
    pred = P.estimate_layout(spec, P.Layout(tp=world), micro_batch_size=b, seq_len=s, precision="fp32",
                             device=dev.type)[0] if predicts(args) else None
    return {"rank": rank, "logits_max_rel_diff": rel, "loss_abs_diff": loss_diff, "param_bytes_local": local,
            "param_bytes_full": full,
            "param_bytes_predicted": P.rank_params(spec, P.Layout(tp=world), 0) * 4 if predicts(args) else None,
            "measured": peak, "measured_forward_end": forward_end,
            "predicted": predicted_dict(pred) if pred is not None else None,
            "grad_layouts_differing": layouts, "grad_layouts_differing_fresh": fresh, "memory": memory,
            "run": run_info(spec, args, {"dp": 1, "tp": world, "pp": 1}) | {"micro_batches": 1}}


def _grad_layouts(model) -> dict[str, dict[str, Any]]:
    """Gradients whose DTensor layout differs from their parameter's (DTensor's vocabulary-parallel
    embedding hands back a replicated, full-vocabulary gradient), with the local shapes."""
    from torch.distributed.tensor import DTensor

    return {n: {"param": [str(x) for x in p.placements], "grad": [str(x) for x in p.grad.placements],
                "param_local_shape": list(p.to_local().shape), "grad_local_shape": list(p.grad.to_local().shape)}
            for n, p in model.named_parameters()
            if isinstance(p, DTensor) and isinstance(p.grad, DTensor) and p.grad.placements != p.placements}


def layout_estimate(result: dict, row: dict):
    """`parallel.estimate_layout` for the stage one measured row ran, configured as the run was (its
    model, layout, schedule, chunks, micro-batches, precision, recompute, sequence parallelism, DDP's
    bucket view, AdamW one tensor at a time or foreach, DTensor's tensor parallelism, the device)."""
    info = result["settings"]
    lay = info["layout"]
    schedule = row.get("schedule") or "1f1b"
    v = result.get("chunks", 2) if schedule == "interleaved" else 1
    layout = P.Layout(dp=lay["dp"], tp=lay["tp"], pp=lay["pp"], sp=bool(info["sequence_parallel"]),
                      micro_batches=row.get("micro_batches", 1), schedule=schedule, chunks=v)
    stages = P.estimate_layout(
        model_spec(info["model_name"]), layout, micro_batch_size=result["micro_batch_size"], seq_len=result["seq_len"],
        precision="fp32" if info["precision"] == "fp32" else "bf16-mixed",
        optimizer_impl="foreach" if info["optimizer"].get("foreach") else "for-loop",
        device="cuda" if result.get("backend") == "nccl" else "cpu", recompute=info["recompute"],
        gradient_as_bucket_view=bool(result.get("gradient_as_bucket_view")),
        implementation="dtensor" if lay["tp"] > 1 else "megatron")
    return stages[row["rank"] % lay["pp"]]


def memory_rows(result: dict) -> list[dict[str, Any]]:
    """One row per rank (ddp, tp) or per schedule, micro-batch count and stage (pp): the measured step
    peak (the ledger's: every live storage through one steady-state step; on a GPU the allocator's
    where the run recorded it), `layout_estimate`'s prediction, the relative error and both phases."""
    out = []
    items = ([row for rank in result["per_rank"] for row in rank["rows"]] if result["experiment"] == "pp"
             else result["per_rank"])
    for row in items:
        mem = row["memory"]
        pred = layout_estimate(result, row)
        out.append({"schedule": row.get("schedule", ""), "micro_batches": row.get("micro_batches", 1),
                    "rank": row["rank"], "measured": mem["peak"], "measured_phase": mem["peak_phase"],
                    "predicted": pred.total, "predicted_phase": pred.phase, "error": error(pred.total, mem["peak"]),
                    "states_measured": sum(mem["at_peak"]["categories"].get(k, 0) for k in STATE_CATEGORIES),
                    "states_predicted": pred.parameters + pred.gradients + pred.optimizer_states})
    return sorted(out, key=lambda r: (r["schedule"], r["micro_batches"], r["rank"]))


def _report(ranks: list[dict], args, world: int) -> None:
    from .record import provenance

    rows = [r for rank in ranks for r in rank["rows"]] if args.experiment == "pp" else ranks
    run = {k: v for k, v in rows[0]["run"].items() if k not in ("micro_batches", "schedule")} if rows else {}
    for r in rows:
        r.pop("run", None)
    run.pop("model_config", None)
    out = {"experiment": args.experiment, "backend": args.backend, "ranks": world,
           "model": MODELS[args.model][1], "model_name": args.model, "micro_batch_size": args.micro_batch,
           "seq_len": args.seq, "micro_batches": args.micro_batches if args.experiment == "pp" else [1],
           **({"schedules": args.schedules, "chunks": args.chunks} if args.experiment == "pp" else {}),
           "gradient_as_bucket_view": bool(args.gradient_as_bucket_view), "settings": run,
           "command": " ".join(["python -m vramlab.measure.parallel", *sys.argv[1:]]),
           "provenance": provenance("cuda" if args.backend == "nccl" else "cpu"), "per_rank": ranks}
    from ..units import fmt_bytes

    spec = model_spec(args.model)
    extra = ["--sp" if args.sp else "", f"recompute {args.recompute}" if args.recompute != "none" else "",
             "bf16 autocast" if args.precision == "bf16" else "",
             "gradient_as_bucket_view" if args.gradient_as_bucket_view else ""]
    print(f"# vramlab.measure.parallel {args.experiment}: backend {args.backend}, {world} ranks, {spec.name}, "
          f"micro-batch {args.micro_batch} x {args.seq}{''.join(', ' + e for e in extra if e)}")
    print(f"#{'schedule':>11}{'m':>4}{'rank':>6}{'predicted':>12}{'measured':>12}{'error':>8}"
          f"{'peak':>12}  {'phase':<10}{'in flight':>10}{'p2p sent':>12}")
    peaks = {(r.get("schedule", ""), r.get("micro_batches", 1), r["rank"]): r for r in rows}
    for r in memory_rows(out):
        row = peaks[(r["schedule"], r["micro_batches"], r["rank"])]
        mem = row.get("memory") or {}
        fl = (mem.get("in_flight") or {}).get("at_peak") or {}
        p2p = row.get("p2p")
        err = f"{100 * r['error']:+.1f}%" if r["error"] is not None else "-"
        print(f" {r['schedule'] or '-':>11}{r['micro_batches']:>4}{r['rank']:>6}"
              f"{fmt_bytes(r['predicted']) if r['predicted'] is not None else '-':>12}"
              f"{fmt_bytes(r['measured']):>12}{err:>8}"
              f"{fmt_bytes(mem['peak']) if mem else '-':>12}  {mem.get('peak_phase', '-'):<10}"
              f"{fl.get('total', '-') if fl else '-':>10}{fmt_bytes(p2p['sent_bytes']) if p2p else '-':>12}")
    if args.experiment == "pp" and any(s in ("gpipe", "1f1b") for s in args.schedules):
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
    if len(set(xs)) != len(xs):
        raise argparse.ArgumentTypeError(f"each value once, got {text!r}")
    return xs


SCHEDULES = ("gpipe", "1f1b", "interleaved")


def _schedules(text: str) -> list[str]:
    xs = text.split(",")
    bad = [x for x in xs if x not in SCHEDULES]
    if bad:
        raise argparse.ArgumentTypeError(f"schedules are {', '.join(SCHEDULES)}, got {bad}")
    if len(set(xs)) != len(xs):
        raise argparse.ArgumentTypeError(f"each schedule once, got {text!r}")
    return xs


# options that only one experiment reads (given to another, they would be ignored): their defaults
ONLY_FOR = {"bucket_cap_mb": ("ddp", 1.0), "micro_batches": ("pp", [1, 2, 4, 8]),
            "schedules": ("pp", ["gpipe", "1f1b"]), "chunks": ("pp", 2), "repeats": ("pp", 3)}


def _worker(rank: int, world: int, args, port: int) -> None:
    """One rank of ddp, tp or pp (started by `collectives.launch`, by reference: a module-level function)."""
    run = {"ddp": _run_ddp, "tp": _run_tp, "pp": run_pp}[args.experiment]
    run_rank(rank, world, args, port, run, _report)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["cp"]:  # context parallelism: its own options (`cp_main`)
        return cp_main(argv[1:])
    if argv[:1] == ["ep"]:  # expert parallelism: its own options (`ep_main`)
        return ep_main(argv[1:])
    A, whole = checks.argtype, checks.whole
    p = checks.Parser(prog=PROG, description="Lab 3's parallelism experiments, measured per rank.")
    p.add_argument("experiment", choices=EXPERIMENTS)
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    p.add_argument("--nproc", type=A(whole, int, lo=1, hi=64), default=2,
                   help="local processes to spawn, 1 to 64 (ignored under torchrun)")
    p.add_argument("--model", default="lab", choices=list(MODELS),
                   help="the model (default: lab 3's Llama; the others validate vramlab.parallel)")
    p.add_argument("--micro-batch", type=A(whole, int, lo=1, hi=4096), default=4,
                   help="sequences per micro-batch and rank (default 4)")
    p.add_argument("--seq", type=A(whole, int, lo=2), default=128,
                   help="tokens per sequence, at most the model's positions (default 128)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                   help="fp32, or bf16 autocast around forward and loss (fp32 parameters, gradients, states)")
    p.add_argument("--optimizer-impl", default="foreach", choices=("foreach", "for-loop"),
                   help="AdamW's implementation (default foreach, lab 3's)")
    p.add_argument("--recompute", default="none", choices=("none", "selective", "full"),
                   help="activation recomputation: none, selective (the attention core), full (every block)")
    p.add_argument("--bucket-cap-mb", type=A(checks.positive, float, hi=1 << 20), default=None,
                   help="ddp: DDP's bucket_cap_mb, a positive number (default 1)")
    p.add_argument("--gradient-as-bucket-view", action="store_true", help="ddp: gradients as views of DDP's buckets")
    p.add_argument("--sp", action="store_true", help="tp: sequence parallelism on the norms")
    p.add_argument("--micro-batches", type=_ints, default=None, help="pp: micro-batches per step (default 1,2,4,8)")
    p.add_argument("--schedule", dest="schedules", type=_schedules, default=None,
                   help="pp: schedules, from gpipe, 1f1b, interleaved (default gpipe,1f1b)")
    p.add_argument("--chunks", type=A(whole, int, lo=2, hi=8), default=None,
                   help="pp, interleaved: model chunks (virtual stages) per rank, 2 to 8 (default 2)")
    p.add_argument("--repeats", type=A(whole, int, lo=1, hi=100), default=None,
                   help="pp: timed steps per setting (median), 1 to 100 (default 3)")
    p.add_argument("--out", default=None, help="write the results as JSON here (checked before any rank starts)")
    p.add_argument("--port", type=A(whole, int, lo=0, hi=65535), default=0,
                   help="rendezvous port, 1 to 65535 (default 0: a free one)")
    p.add_argument("--timeout", type=A(checks.positive, float, hi=86400), default=120.0,
                   help="seconds a rendezvous or collective may take (default 120)")
    args = p.parse_args(argv)
    for name, (experiment, default) in ONLY_FOR.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
        elif args.experiment != experiment:
            option = "--schedule" if name == "schedules" else "--" + name.replace("_", "-")
            p.error(f"{option} applies to {experiment} only")
    if args.sp and args.experiment != "tp":
        p.error("--sp applies to tp only")
    if args.gradient_as_bucket_view and args.experiment != "ddp":
        p.error("--gradient-as-bucket-view applies to ddp only")
    args.foreach = args.optimizer_impl == "foreach"
    spec = model_spec(args.model)
    try:
        checks.positions(spec, args.seq, name="--seq")
    except ValueError as e:
        p.error(str(e))
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if torchrun else args.nproc
    why = (tp_problem(spec, world, sp=args.sp, seq=args.seq) if args.experiment == "tp" else
           pp_problem(spec, world, args.schedules, args.chunks, args.micro_batches) if args.experiment == "pp" else None)
    if why:
        p.error(why)
    from .collectives import launch

    checks.output_path(PROG, args.out, make_folder=True)
    return launch(_worker, args, prog=PROG, error=ParlabError, torchrun_port=29512, preload=RANK_IMPORTS)


if __name__ == "__main__":
    sys.exit(main())
