"""Activation checkpointing: what each recompute plan keeps, what it recomputes, and what that
costs in time. Pure Python (no torch): the memory comes from `memory`'s ledger (`recompute_plan`,
`training_phases`), the time from counted FLOPs.

FLOPs follow the usual convention (Kaplan+20, Narayanan+21): a block's forward is 2 FLOPs per
matmul weight per token plus 4 b s^2 d for the attention scores and their product with V (d the
query width; counted whole, as most kernels compute it, causal or not); a step is forward plus a
backward of twice the forward. A plan's extra compute is the forward of what it recomputes:
every checkpointed block once (full, sqrt, every-K, first-N, segments-K), the attention core only
(selective), and no matmul at all under "sac-matmuls" (it recomputes norms, activations and
dropout: memory traffic, which a FLOP count does not see).
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass
from typing import Iterable

from . import checks as _checks
from . import memory as _mem
from . import specs as _specs
from . import precision as _prec
from . import fitting as _fitting
from . import activations as _act
from . import offload as _off
from .activations import Plan, recompute_plan
from .memory import MemoryBreakdown
from .specs import GPUSpec, ModelSpec, gpu as _gpu

PLANS: tuple[str, ...] = ("none", "selective", "sac-matmuls", "full", "sqrt", "offload")
_MAX_FLOPS = 10**40  # a step's FLOPs exceed any count of tokens or bytes
MFU = 0.4  # the share of a GPU's dense peak FLOP/s a step is assumed to reach (step_seconds)


def _block_matmul_params(spec: ModelSpec) -> list[int]:
    """Matmul weights per block, in forward order (norms and biases are not matmuls)."""
    h, i, qd, kv = spec.hidden_size, spec.intermediate_size, spec.q_dim, spec.kv_dim
    attn = h * (qd + 2 * kv) + qd * h
    mlp = h * i * (3 if spec.gated_mlp else 2)
    cross = attn if spec.family == "t5" else 0  # T5's decoder blocks also attend to the encoder
    return [attn + mlp] * spec.num_layers + [attn + cross + mlp] * spec.num_decoder_layers


def flops(model: ModelSpec | str, *, batch_size: int, seq_len: int) -> dict:
    """Forward FLOPs of each block ('blocks', forward order) and of the head ('head': the LM head or
    MLM head), their attention-core part per block ('attention_core'), and the step ('step': 3x
    the forward)."""
    spec = _specs.resolve(model)  # (no positions check: FLOPs are counted for any length, as the papers' formulas)
    b, s = _mem._check_positive(batch_size=batch_size, seq_len=seq_len)
    tokens = b * s
    core = 4 * b * s * s * spec.q_dim
    cores = [core] * spec.num_layers + [2 * core] * spec.num_decoder_layers  # + cross-attention
    blocks = [2 * tokens * p + c for p, c in zip(_block_matmul_params(spec), cores)]
    head = 2 * tokens * spec.vocab_size * (spec.word_embed_proj_dim or spec.hidden_size)
    return {"blocks": blocks, "attention_core": cores, "head": head, "forward": sum(blocks) + head,
            "step": 3 * (sum(blocks) + head)}


def recompute_flops(model: ModelSpec | str, recompute: "str | Plan", *, batch_size: int, seq_len: int) -> int:
    """FLOPs a plan runs again in the backward."""
    spec = _specs.resolve(model)
    return _recomputed(recompute_plan(recompute, spec), flops(spec, batch_size=batch_size, seq_len=seq_len))


def _recomputed(plan: Plan, f: dict) -> int:
    """The FLOPs of `flops`' answer `f` that `plan` runs again."""
    if plan.attention_core:
        return sum(f["attention_core"])
    if plan.keep == "matmuls":
        return 0
    return sum(f["blocks"][i] for i in plan.checkpointed())


@dataclass(frozen=True)
class PlanResult:
    """One plan for one training step: its peak (`peak`, a MemoryBreakdown with the peak phase),
    every phase, the recompute FLOPs as a fraction of the step's, and (given a GPU) the step time."""

    plan: Plan
    peak: MemoryBreakdown
    phases: tuple[MemoryBreakdown, ...]
    step_flops: int
    recompute_flops: int
    offload_bytes: int  # each way, per step
    step_seconds: float | None = None  # with a GPU: FLOPs at its achievable rate, plus offload not hidden
    fit: "_fitting.Fit | None" = None  # with a GPU: `fitting.device_fit` of the peak (the one definition of "fits")

    def __post_init__(self) -> None:
        for k, kind in (("plan", Plan), ("peak", MemoryBreakdown)):
            if not isinstance(getattr(self, k), kind):
                raise ValueError(f"{k} must be a {kind.__module__}.{kind.__name__}, got {_checks.show(getattr(self, k))}")
        if not isinstance(self.phases, tuple) or not all(isinstance(m, MemoryBreakdown) for m in self.phases):
            raise ValueError(f"phases must be a tuple of MemoryBreakdowns, got {_checks.show(self.phases)}")
        for k, lo in (("step_flops", 1), ("recompute_flops", 0), ("offload_bytes", 0)):
            object.__setattr__(self, k, _checks.whole(k, getattr(self, k), lo=lo, hi=_MAX_FLOPS))
        if self.step_seconds is not None:
            object.__setattr__(self, "step_seconds", _checks.number("step_seconds", self.step_seconds, lo=0))
        if self.fit is not None and not isinstance(self.fit, _fitting.Fit):
            raise ValueError(f"fit must be None or a vramlab.fitting.Fit, got {_checks.show(self.fit)}")

    @property
    def recompute_fraction(self) -> float:
        """Extra compute as a fraction of the step without recompute (full: about 1/3 of the blocks')."""
        return self.recompute_flops / self.step_flops

    def __str__(self) -> str:
        t = f", step {1e3 * self.step_seconds:,.0f} ms" if self.step_seconds is not None else ""
        return (f"{self.plan.name}: peak {_mem.fmt_bytes(self.peak.total)} ({self.peak.phase}), "
                f"recompute +{100 * self.recompute_fraction:.1f} % of the step's FLOPs{t}")


def evaluate(model: ModelSpec | str, recompute: "str | Plan" = "none", *, batch_size: int, seq_len: int,
             precision: str = "bf16-mixed", optimizer: str = "adamw", attention: str = "sdpa",
             device: str = "cuda", gpu: GPUSpec | str | None = None, mfu: float = MFU) -> PlanResult:
    """A plan's peak memory and its cost. With `gpu`, the step time: FLOPs (plus the recompute) at
    `mfu` of the GPU's dense peak for the precision, and for "offload" the transfer of the
    checkpoints over the host link, both ways, added to the compute: torch's `save_on_cpu` copies on
    the compute stream, measured at SAVE_ON_CPU_EFFICIENCY of the nominal rate (chapter 6)."""
    spec = _specs.resolve(model)
    batch_size, seq_len = _mem._check_positive(batch_size=batch_size, seq_len=seq_len)
    plan = recompute_plan(recompute, spec)
    mfu = _checks.number("mfu", mfu, lo=0, lo_open=True, hi=1,
                         what="a fraction of the peak FLOP/s in (0, 1]")
    _mem._check_choice(device, ("cuda", "cpu"), "device")
    gpu = _gpu(gpu) if gpu is not None else None
    phases = _mem.training_phases(spec, batch_size=batch_size, seq_len=seq_len, precision=precision,
                                  optimizer=optimizer, attention=attention, recompute=plan, device=device,
                                  gpu=gpu if device == "cuda" else None)
    f = flops(spec, batch_size=batch_size, seq_len=seq_len)
    extra = _recomputed(plan, f)
    x = _prec._dtype_bytes(precision, device)["x"]
    moved = len(plan.segments) * batch_size * seq_len * spec.hidden_size * x if plan.offload else 0
    seconds = fit = None
    top = max(phases, key=lambda m: m.total)
    if gpu is not None:
        g = _gpu(gpu)
        if device == "cuda":
            fit = _fitting.device_fit(top, g, largest_tensor=_fitting.fragmentation_bytes(
                spec, batch_size=batch_size, seq_len=seq_len, precision=precision, attention=attention))
        peak = g.peak_tflops_fp32 if precision == "fp32" else g.peak_tflops_16
        if peak <= 0:
            raise ValueError(f"{g.name} has no FLOP/s figure: pass a GPU preset")
        compute = (f["step"] + extra) / (peak * 1e12 * mfu)
        # the checkpoints' copies as chapter 6 measured save_on_cpu's: on the compute stream (nothing
        # overlaps them) at SAVE_ON_CPU_EFFICIENCY of the link's nominal rate
        transfer = 2 * _off.transfer_seconds(moved, g, efficiency=_off.SAVE_ON_CPU_EFFICIENCY) \
            if moved and g.host_link_GBps > 0 else 0.0
        seconds = compute + transfer
    return PlanResult(plan=plan, peak=top, phases=tuple(phases), step_flops=f["step"],
                      recompute_flops=extra, offload_bytes=moved, step_seconds=seconds, fit=fit)


def candidate_plans(model: ModelSpec | str) -> list[str]:
    """The plans `cheapest_plan` weighs: none, selective, sac-matmuls, first-N for every N (the
    cheapest way to checkpoint N equal blocks: the earliest are recomputed while the fewest other
    blocks are alive), segments-K for every K (same compute as full, fewer checkpoints), offload."""
    spec = _specs.resolve(model)
    n = spec.num_layers + spec.num_decoder_layers
    return (["none", "selective", "sac-matmuls"] + [f"first-{k}" for k in range(1, n + 1)]
            + [f"segments-{k}" for k in range(2, n + 1)] + ["offload"])


def _fits(r: PlanResult, budget_bytes: "int | None") -> bool:
    return r.fit.fits if budget_bytes is None else r.peak.total <= budget_bytes


# what cheapest_plan and brute_force_blocks pass on to `evaluate` (its keywords but the sizes)
_EVALUATE_OPTIONS = tuple(k for k, p in inspect.signature(evaluate).parameters.items()
                          if p.kind is p.KEYWORD_ONLY and k not in ("batch_size", "seq_len"))


def _budget(where: str, budget_bytes, kw: dict):
    """The planners' arguments, checked before any plan is weighed: no unknown keyword, a budget in
    bytes (numpy's numbers too) or a GPU to fit by."""
    _checks.no_unknown(where, kw, _EVALUATE_OPTIONS)
    if budget_bytes is None:
        if kw.get("gpu") is None or kw.get("device", "cuda") != "cuda":
            raise ValueError("without budget_bytes, give a gpu: a plan then fits by fitting.device_fit")
        return None
    return _checks.number("budget_bytes", budget_bytes, lo=0, lo_open=True, hi=_checks.MAX_BYTES,
                          what="a positive number of bytes")


def cheapest_plan(model: ModelSpec | str, budget_bytes: "int | None", *, batch_size: int, seq_len: int,
                  plans: "list[str | Plan] | None" = None, **kw) -> PlanResult | None:
    """The plan whose step fits with the least recompute (ties: the smaller peak; offload last, its
    cost is transfer time). None when nothing fits. Fits: its peak within `budget_bytes`, or, with
    budget_bytes=None and a `gpu`, `fitting.device_fit` (estimate + margin + fragmentation + context
    within the GPU, as every calculator decides). `plans` defaults to `candidate_plans`; the other
    arguments are `evaluate`'s."""
    budget_bytes = _budget("cheapest_plan", budget_bytes, kw)
    spec = _specs.resolve(model)
    if plans is None:
        plans = candidate_plans(spec)
    elif isinstance(plans, (str, bytes, dict, Plan)) or not isinstance(plans, Iterable):
        raise ValueError(f"plans must be a list of recompute plans (names or Plans), got {_checks.show(plans)}")
    plans = [recompute_plan(p, spec) for p in plans]  # every plan checked before the first is weighed
    if not plans:
        raise ValueError("plans must not be empty")
    # The answer is the fitting plan least by (offload, recompute FLOPs, recomputes at all, peak): the
    # first three need no ledger, so the plans are weighed group by group in that order and the first
    # group with a plan that fits answers (the same plan an evaluation of every plan would pick: within
    # a group the original order breaks ties). Parameters and optimizer states are the same under
    # every plan: when they alone do not fit, nothing does, and one evaluation says so.
    f = flops(spec, batch_size=batch_size, seq_len=seq_len)
    rank = {i: (p.offload, _recomputed(p, f), _recomputes(p)) for i, p in enumerate(plans)}
    order = sorted(rank, key=rank.get)
    for _, group in itertools.groupby(order, key=rank.get):
        results = [evaluate(spec, plans[i], batch_size=batch_size, seq_len=seq_len, **kw) for i in group]
        fitting = [r for r in results if _fits(r, budget_bytes)]
        if fitting:
            return min(fitting, key=lambda r: r.peak.total)
        if _states_exceed(results[0], budget_bytes):
            return None
    return None


def _states_exceed(r: PlanResult, budget_bytes: "int | None") -> bool:
    """Whether the parameters and optimizer states alone (held in every phase, whatever the plan)
    exceed the budget, or what the GPU makes available when `budget_bytes` is None."""
    held = min(m.parameters + m.optimizer_states for m in r.phases)
    if budget_bytes is not None:
        return held > budget_bytes
    return r.fit is not None and held > r.fit.available


def _recomputes(plan: Plan) -> bool:
    """Whether a plan runs anything again (sac-matmuls recomputes no matmul, but not nothing)."""
    return bool(plan.segments) or plan.attention_core


def brute_force_blocks(model: ModelSpec | str, budget_bytes: "int | None", *, batch_size: int, seq_len: int, **kw):
    """Every set of blocks checkpointed one by one (2^L plans: small models only), the one that fits
    with the least recompute (ties: smaller peak). The reference `cheapest_plan` is tested against."""
    budget_bytes = _budget("brute_force_blocks", budget_bytes, kw)
    spec = _specs.resolve(model)
    n = spec.num_layers + spec.num_decoder_layers
    if n > 12:
        raise ValueError(f"{n} blocks is {2 ** n} plans: brute force is for 12 blocks or fewer")
    evaluate(spec, "none", batch_size=batch_size, seq_len=seq_len, **kw)  # the options, checked once first
    best = None
    for k in range(n + 1):
        for blocks in itertools.combinations(range(n), k):
            r = evaluate(spec, blocks, batch_size=batch_size, seq_len=seq_len, **kw)
            if _fits(r, budget_bytes) and (best is None or (r.recompute_flops, r.peak.total)
                                                 < (best.recompute_flops, best.peak.total)):
                best = r
    return best


def timeline(model: ModelSpec | str, recompute: "str | Plan" = "none", *, batch_size: int, seq_len: int,
             precision: str = "fp32", attention: str = "sdpa", device: str = "cuda") -> list[tuple[str, int]]:
    """Activation bytes held over one step, event by event: after each block's forward (a
    checkpointed block drops its tensors as they are used and keeps its checkpoint), the loss, and
    during each block's backward (a segment is recomputed whole when its last block's backward
    begins). Activations only: model states and gradients are `evaluate`'s."""
    act = _act.activation_bytes(_specs.resolve(model), batch_size=batch_size, seq_len=seq_len, recompute=recompute,
                                precision=precision, attention=attention, device=device)
    held = list(itertools.accumulate(act["kept"]))
    return ([(f"forward {i}", b) for i, b in enumerate(held)] + [("loss", held[-1] + act["outside"])]
            + [(f"backward {i}", b + act["outside"]) for i, b in act["backward"]])
