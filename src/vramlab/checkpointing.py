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

import itertools
from dataclasses import dataclass

from . import memory as _mem
from . import offload as _off
from .memory import MemoryBreakdown, Plan, recompute_plan
from .specs import GPUSpec, ModelSpec, gpu as _gpu

PLANS: tuple[str, ...] = ("none", "selective", "sac-matmuls", "full", "sqrt", "offload")
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
    spec = _mem._resolve(model)
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
    spec = _mem._resolve(model)
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
    fit: "_mem.Fit | None" = None  # with a GPU: `memory.device_fit` of the peak (the one definition of "fits")

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
    spec = _mem._resolve(model)
    plan = recompute_plan(recompute, spec)
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu is a fraction of the peak FLOP/s in (0, 1], got {mfu!r}")
    phases = _mem.training_phases(spec, batch_size=batch_size, seq_len=seq_len, precision=precision,
                                  optimizer=optimizer, attention=attention, recompute=plan, device=device,
                                  gpu=gpu if device == "cuda" else None)
    f = flops(spec, batch_size=batch_size, seq_len=seq_len)
    extra = _recomputed(plan, f)
    x = _mem._dtype_bytes(precision, device)["x"]
    moved = len(plan.segments) * batch_size * seq_len * spec.hidden_size * x if plan.offload else 0
    seconds = fit = None
    top = max(phases, key=lambda m: m.total)
    if gpu is not None:
        g = _gpu(gpu)
        if device == "cuda":
            fit = _mem.device_fit(top, g, largest_tensor=_mem.fragmentation_bytes(
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
    spec = _mem._resolve(model)
    n = spec.num_layers + spec.num_decoder_layers
    return (["none", "selective", "sac-matmuls"] + [f"first-{k}" for k in range(1, n + 1)]
            + [f"segments-{k}" for k in range(2, n + 1)] + ["offload"])


def _fits(r: PlanResult, budget_bytes: "int | None") -> bool:
    return r.fit.fits if budget_bytes is None else r.peak.total <= budget_bytes


def _budget(budget_bytes, kw: dict) -> None:
    if budget_bytes is None:
        if kw.get("gpu") is None or kw.get("device", "cuda") != "cuda":
            raise ValueError("without budget_bytes, give a gpu: a plan then fits by memory.device_fit")
    elif not isinstance(budget_bytes, (int, float)) or isinstance(budget_bytes, bool) or not budget_bytes > 0:
        raise ValueError(f"budget_bytes must be a positive number of bytes, got {budget_bytes!r}")


def cheapest_plan(model: ModelSpec | str, budget_bytes: "int | None", *, batch_size: int, seq_len: int,
                  plans: "list[str | Plan] | None" = None, **kw) -> PlanResult | None:
    """The plan whose step fits with the least recompute (ties: the smaller peak; offload last, its
    cost is transfer time). None when nothing fits. Fits: its peak within `budget_bytes`, or, with
    budget_bytes=None and a `gpu`, `memory.device_fit` (estimate + margin + fragmentation + context
    within the GPU, as every calculator decides). `plans` defaults to `candidate_plans`; the other
    arguments are `evaluate`'s."""
    _budget(budget_bytes, kw)
    results = [evaluate(model, p, batch_size=batch_size, seq_len=seq_len, **kw)
               for p in (plans if plans is not None else candidate_plans(model))]
    fitting = [r for r in results if _fits(r, budget_bytes)]
    if not fitting:
        return None
    return min(fitting, key=lambda r: (r.plan.offload, r.recompute_flops, _recomputes(r.plan), r.peak.total))


def _recomputes(plan: Plan) -> bool:
    """Whether a plan runs anything again (sac-matmuls recomputes no matmul, but not nothing)."""
    return bool(plan.segments) or plan.attention_core


def brute_force_blocks(model: ModelSpec | str, budget_bytes: "int | None", *, batch_size: int, seq_len: int, **kw):
    """Every set of blocks checkpointed one by one (2^L plans: small models only), the one that fits
    with the least recompute (ties: smaller peak). The reference `cheapest_plan` is tested against."""
    _budget(budget_bytes, kw)
    spec = _mem._resolve(model)
    n = spec.num_layers + spec.num_decoder_layers
    if n > 12:
        raise ValueError(f"{n} blocks is {2 ** n} plans: brute force is for 12 blocks or fewer")
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
    act = _mem.activation_bytes(_mem._resolve(model), batch_size=batch_size, seq_len=seq_len, recompute=recompute,
                                precision=precision, attention=attention, device=device)
    held = list(itertools.accumulate(act["kept"]))
    return ([(f"forward {i}", b) for i, b in enumerate(held)] + [("loss", held[-1] + act["outside"])]
            + [(f"backward {i}", b + act["outside"]) for i, b in act["backward"]])
