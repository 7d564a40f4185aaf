"""Lab 3's pipeline parallelism, measured (`python -m vramlab.measure.parallel pp`): the blocks split into
stages (`--chunks` v per rank for the interleaved schedule) run by `torch.distributed.pipelining` (GPipe,
1F1B, interleaved 1F1B) on each rank (`run_pp`); each stage's peak, the micro-batches in flight, the bytes
sent across stage boundaries and each forward and backward timed; the bubble measured from those times,
replayed with free communication, against the formula (`measured_bubble`, `replayed_bubble`,
`bubble_rows`). Imports torch inside its functions.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

from .. import parallel as P
from .. import pipeline as PIPE
from ..specs import ModelSpec
from . import ledger
from .ledger import ledger_step
from .ranks import (FAMILIES, ParlabError, adamw, apply_recompute, autocast, error, lm_loss, model_spec,
                    predicted_dict, predicts, run_info, seeded_model, shard_bytes, steady, storage_bytes, submodule,
                    token_batch, with_total, zero_grads)


def _stage_module(model, layers: range, first: bool, last: bool, spec: ModelSpec | None = None,
                  precision: str = "fp32"):
    """Blocks `layers` of a transformers causal LM (Llama, GPT-NeoX or OPT), with the embedding (and OPT's
    learned positions) on the first stage and the final norm and head on the last; forward in bf16
    autocast for precision="bf16". The stage keeps no reference to `model`: the blocks it does not hold
    are freed with the model."""
    import torch

    fam = FAMILIES[spec.family if spec is not None else "llama"]
    parts = {"embed_tokens": submodule(model, fam["embed"]) if first else None,
             "embed_positions": submodule(model, fam["positions"]) if first and fam.get("positions") else None,
             "layers": torch.nn.ModuleList(submodule(model, fam["layers"])[i] for i in layers),
             "rotary_emb": submodule(model, fam["rotary"]) if fam.get("rotary") else None,
             "norm": submodule(model, fam["norm"]) if last else None,
             "lm_head": submodule(model, fam["head"]) if last else None}
    return _stage_class()(parts, precision)


def _stage_class():
    import torch

    class Stage(torch.nn.Module):
        def __init__(self, parts: dict, precision: str):
            super().__init__()
            for name, module in parts.items():
                setattr(self, name, module)
            self.precision = precision

        def forward(self, x):
            with autocast(self.precision, x.device):
                h = self.embed_tokens(x) if self.embed_tokens is not None else x
                pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
                if self.embed_positions is not None:  # as OPTDecoder: one position row per sequence
                    h = h + self.embed_positions(None, 0, position_ids=pos.expand(h.shape[0], -1))
                kw = {"position_embeddings": self.rotary_emb(h, pos)} if self.rotary_emb is not None else {}
                for layer in self.layers:
                    out = layer(h, attention_mask=None, position_ids=pos, **kw)
                    h = out[0] if isinstance(out, tuple) else out
                return self.lm_head(self.norm(h)) if self.lm_head is not None else h

    return Stage


def pp_problem(spec: ModelSpec, p: int, schedules: list[str], chunks: int, micro_batches: list[int]) -> str | None:
    """Why these pipeline settings cannot run (None when they can)."""
    need = p * (chunks if "interleaved" in schedules else 1)
    if spec.num_layers < need:
        return (f"{spec.name} has {spec.num_layers} layers: {p} stages"
                f"{f' x {chunks} chunks' if need > p else ''} need at least {need}")
    if "interleaved" in schedules:
        bad = [m for m in micro_batches if m % max(1, m // p)]
        if bad:
            return f"interleaved 1F1B needs micro-batches a multiple of max(1, m // {p}); not {bad}"
    return None


def run_pp(rank: int, world: int, args, dev) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    spec, b, s = model_spec(args.model), args.micro_batch, args.seq
    why = pp_problem(spec, world, args.schedules, args.chunks, args.micro_batches)
    if why:
        raise ParlabError(why)
    led = ledger.LEDGER
    rows = []
    for schedule in args.schedules:
        v = args.chunks if schedule == "interleaved" else 1
        n_stages = world * v
        split = P.stage_layers(spec.num_layers, n_stages)
        mine = [rank + k * world for k in range(v)]  # virtual stages r, r + p, ... (Megatron's interleaving)
        for m in args.micro_batches:
            if schedule == "1f1b" and m < world:  # torch's 1F1B needs a micro-batch per stage to start
                continue
            led.set_phase("setup")
            model = seeded_model(spec, dev)
            apply_recompute(model, spec, args.recompute)
            mods = [_stage_module(model, split[k], k == 0, k == n_stages - 1, spec, args.precision) for k in mine]
            del model
            params = [p for mod in mods for p in mod.parameters()]
            opt = adamw(params, args.foreach)
            steady(opt, params)
            stages = [PipelineStage(mod, k, n_stages, dev) for mod, k in zip(mods, mine)]

            def loss_fn(out, target):
                led.set_phase("loss")
                with autocast(args.precision, dev):
                    loss = lm_loss(out, target)
                led.set_phase("schedule")
                return loss

            if schedule == "interleaved":
                sched = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss_fn)
            else:
                sched = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](stages[0], n_microbatches=m,
                                                                                 loss_fn=loss_fn)
            batch = token_batch(spec, b * m, s, dev)
            first, last = 0 in mine, n_stages - 1 in mine
            state = _instrument_pp(stages, dev, led)

            def step(tr=None):
                # return_outputs=False: the last stage would otherwise keep every micro-batch's logits
                # to hand them back merged
                led.set_phase("schedule")
                if first:
                    sched.step(batch, return_outputs=False)
                elif last:
                    sched.step(target=batch, return_outputs=False)
                else:
                    sched.step(return_outputs=False)
                led.set_phase("optimizer")
                opt.step()
                zero_grads(opt)
                led.set_phase("after step")

            step()  # warm-up: the stage's buffers and the p2p connections
            dist.barrier()
            holder = torch.nn.ModuleList(mods)
            resident = _resident(holder, opt, batch)
            state.reset()
            led.context = state.snapshot
            memory = ledger_step(step, mods, opt, [batch])
            led.context = None
            memory["in_flight"] = {"max": state.max_in_flight, "max_per_virtual_stage": state.max_per_stage,
                                   "at_peak": memory.pop("peak_context")}
            p2p = state.p2p_counts()
            # lab 3's accounting (as `LiveBytes` counted it): the resident states plus the most bytes of storages
            # returned by operations during the step that are not resident states (the ledger's `peak` also holds
            # what exists before the step untouched: the stage's receive buffers, leftovers)
            measured = {**{k: v for k, v in resident.items() if k != "storages"},
                        "activations": memory["lab_accounting_peak"]}
            # time: every forward and backward of this stage, on the machine's monotonic clock (one clock
            # for all processes of a machine), in each of `repeats` steps
            steps = []
            with led.paused():  # the ledger's dispatch overhead would lengthen every operation
                for _ in range(args.repeats):
                    dist.barrier()
                    state.ops.clear()
                    t0 = time.perf_counter()
                    step()
                    ops = state.ops if schedule == "interleaved" else [o[:3] for o in state.ops]
                    steps.append({"start": t0, "end": time.perf_counter(), "ops": list(ops)})
            pred = None
            if predicts(args) and schedule in ("gpipe", "1f1b"):
                pred = P.estimate_layout(spec, P.Layout(pp=world, micro_batches=m, schedule=schedule),
                                         micro_batch_size=b, seq_len=s, precision="fp32", device=dev.type)[rank]
            layers = [[split[k].start, split[k].stop] for k in mine]
            rows.append({"schedule": schedule, "micro_batches": m, "rank": rank,
                         "layers": layers[0] if v == 1 else layers, "virtual_stages": mine,
                         "param_bytes": shard_bytes(params),
                         "measured": with_total(measured), "predicted": predicted_dict(pred) if pred is not None else None,
                         "memory": memory, "p2p": p2p, "steps": steps,
                         "run": run_info(spec, args, {"dp": 1, "tp": 1, "pp": world, "virtual_per_rank": v})
                         | {"micro_batches": m, "schedule": schedule}})
            del sched, stages, mods, holder, opt, params, state
            gc.collect()
    return {"rank": rank, "rows": rows}


class _PipeState:
    """What `_instrument_pp` records: each forward and backward (kind, start, end, virtual stage), the
    micro-batches in flight per virtual stage (forwards begun minus backwards finished), and the bytes
    of the p2p operations the stages post (activations forward, gradients backward)."""

    def __init__(self, stage_ids):
        self.ops: list = []
        self.ids = list(stage_ids)
        self.reset()

    def reset(self) -> None:
        self.in_flight = {k: 0 for k in self.ids}
        self.max_per_stage = {k: 0 for k in self.ids}
        self.max_in_flight = 0
        self.p2p = {k: 0 for k in ("sent_forward_bytes", "sent_backward_bytes", "received_forward_bytes",
                                   "received_backward_bytes", "sent_messages", "received_messages")}

    def snapshot(self) -> dict[str, Any]:
        return {"total": sum(self.in_flight.values()), "per_virtual_stage": dict(self.in_flight)}

    def p2p_counts(self) -> dict[str, int]:
        return {**self.p2p, "sent_bytes": self.p2p["sent_forward_bytes"] + self.p2p["sent_backward_bytes"]}


def _instrument_pp(stages, dev, led) -> _PipeState:
    import torch

    state = _PipeState([st.stage_index for st in stages])
    for stage in stages:
        idx = stage.stage_index
        for kind, name in (("F", "forward_one_chunk"), ("B", "backward_one_chunk")):
            fn = getattr(stage, name)

            def timed(*a, _fn=fn, _kind=kind, _idx=idx, **kw):
                if _kind == "F":
                    state.in_flight[_idx] += 1
                    state.max_per_stage[_idx] = max(state.max_per_stage[_idx], state.in_flight[_idx])
                    state.max_in_flight = max(state.max_in_flight, sum(state.in_flight.values()))
                led.set_phase("forward" if _kind == "F" else "backward")
                t0 = time.perf_counter()
                try:
                    out = _fn(*a, **kw)
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                finally:
                    led.set_phase("schedule")
                state.ops.append((_kind, t0, time.perf_counter(), _idx))
                if _kind == "B":
                    state.in_flight[_idx] -= 1
                return out

            setattr(stage, name, timed)
        for name, key in (("get_fwd_send_ops", "sent_forward"), ("get_bwd_send_ops", "sent_backward"),
                          ("get_fwd_recv_ops", "received_forward"), ("get_bwd_recv_ops", "received_backward")):
            fn = getattr(stage, name)

            def counted(*a, _fn=fn, _key=key, **kw):
                ops = _fn(*a, **kw)
                state.p2p[_key + "_bytes"] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
                state.p2p[_key.split("_")[0] + "_messages"] += len(ops)
                return ops

            setattr(stage, name, counted)
    return state


def _resident(mod, opt, batch) -> dict:
    """The bytes that exist before a step, by category, and their storages."""
    seen: set[int] = set()
    params = list(mod.parameters())
    out = {"parameters": storage_bytes(params, seen),
           "gradients": storage_bytes([p.grad for p in params if p.grad is not None], seen),
           "optimizer_states": storage_bytes([v for s in opt.state.values() for v in s.values()
                                               if hasattr(v, "untyped_storage")], seen),
           "inputs": storage_bytes([batch], seen)}
    return {**out, "storages": seen}


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
    as its input exists (the dependencies of `pipeline.simulate`: a forward needs the previous stage's
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
    ticks = PIPE.replay_orders(orders, took)
    return 1 - max(sum(t) for t in took) / max(end for *_, end in ticks)


def bubble_rows(result: dict) -> list[dict[str, Any]]:
    """Measured bubble against the formula (share of the step's time, equal stages) per schedule and m
    (GPipe and 1F1B: one stage per rank)."""
    seen = sorted({(row["schedule"], row["micro_batches"]) for rank in result["per_rank"] for row in rank["rows"]
                   if row["schedule"] in ("gpipe", "1f1b")})
    p = result["ranks"]
    out = []
    for schedule, m in seen:
        got = measured_bubble(result["per_rank"], schedule, m)
        formula = float(PIPE.bubble_fraction(p, m, schedule, of="total"))
        out.append({"schedule": schedule, "micro_batches": m, "formula": formula, "measured": got["bubble"],
                    "replayed": got["replayed"], "error": error(formula, got["bubble"]), "forward_s": got["forward_s"],
                    "backward_s": got["backward_s"]})
    return out
