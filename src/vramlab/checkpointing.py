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
import math
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
    b, s = _mem.check_positive(batch_size=batch_size, seq_len=seq_len)
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
    batch_size, seq_len = _mem.check_positive(batch_size=batch_size, seq_len=seq_len)
    plan = recompute_plan(recompute, spec)
    mfu = _checks.number("mfu", mfu, lo=0, lo_open=True, hi=1,
                         what="a fraction of the peak FLOP/s in (0, 1]")
    _mem.check_choice(device, ("cuda", "cpu"), "device")
    gpu = _gpu(gpu) if gpu is not None else None
    phases = _mem.training_phases(spec, batch_size=batch_size, seq_len=seq_len, precision=precision,
                                  optimizer=optimizer, attention=attention, recompute=plan, device=device,
                                  gpu=gpu if device == "cuda" else None)
    f = flops(spec, batch_size=batch_size, seq_len=seq_len)
    extra = _recomputed(plan, f)
    x = _prec.dtype_sizes(precision, device)["x"]
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


# ============================================================================ what the compiler keeps
# torch.compile's AOTAutograd traces forward and backward as one joint graph and cuts it in two with
# `min_cut_rematerialization_partition` (torch/_functorch/partitioners.py): what crosses the cut is
# saved, everything else is recomputed inside the backward's fused kernels. Its default options
# (torch/_functorch/config.py, `ban_recompute_*`) never recompute a matmul or an attention kernel
# (not on the recomputable allowlist), a reduction (output 4x smaller than its input: norm
# statistics) or a tensor a non-fusible backward op must read (a matmul's input, for its weight's
# gradient); pointwise chains (residual adds, norms' affine maps, activation functions, dropout's
# scaling) are rebuilt from whatever of those is saved. `activation_memory_budget` b in [0, 1] then
# asks for at most min + b (max - min) of it, min the graph's inputs (b = 0: full checkpointing of the
# compiled region) and max the default cut (b = 1), solving a 0-1 knapsack over the banned nodes by
# their FLOPs ("flops" runtime estimator).
def compiled_block_saved(model: ModelSpec | str) -> list[_act.Saved]:
    """What one transformer block saves for backward when it is compiled with `torch.compile` and the
    partitioner's default cut (activation_memory_budget = 1), as a ledger (`activations.Saved`,
    widths per token). Derived from the partitioner's rules above, op by op, for the decoder-only
    families (GPT-2, GPT-NeoX, OPT, Llama) without dropout and with fused (SDPA) attention:

    - the block's input (a graph input: the first norm's backward reads it);
    - each norm's statistics (a reduction: mean and rstd for LayerNorm, rstd for RMSNorm; one set for
      GPT-NeoX's two norms of the same input) and its output (the next projection's input, read by
      its weight's gradient matmul);
    - q, k, v (k and v at the KV heads' width), the attention output (also the output projection's
      input) and its log-sum-exp: what the fused kernel's backward reads (GPT-NeoX: the fused qkv
      output whole, v being a view of it, and a transposed copy of the attention output);
    - the output projection's output where a second norm reads the residual (pre-norm blocks in
      sequence: the residual is rebuilt from it and the block's input, no matmul re-run); GPT-NeoX's
      parallel residual needs none;
    - the MLP's up (and gate) projection outputs (the activation's backward reads them) and the down
      projection's input (its weight's gradient reads it): 2 x intermediate ungated, 3 x gated; one
      for ReLU (its backward reads its output, which is the down projection's input).

    Kinds follow `activations.layer_saved`: the block's input in the activations' dtype, what the
    projections and attention read or make in the compute dtype ("half": 16 bits under autocast),
    statistics in fp32. Known limitations: dropout (random ops: their masks are saved, not modelled
    here), eager attention and the math SDPA path (the s x s scores), BERT and T5 are not covered;
    measured in fp32 on CPU inductor only (autocast's dtypes are priced, not measured)."""
    spec = _specs.resolve(model)
    if spec.family not in ("gpt2", "gpt_neox", "opt", "llama"):
        raise ValueError(f"the compiled-block ledger covers decoder-only families (gpt2, gpt_neox, opt, llama), "
                         f"not {spec.family}")
    if spec.attention_dropout > 0 or spec.hidden_dropout > 0:
        raise ValueError(f"{spec.name} has dropout: the compiled-block ledger covers blocks without dropout "
                         "(dataclasses.replace(spec, attention_dropout=0.0, hidden_dropout=0.0))")
    S = _act.Saved
    h, i, qd, kv, a = spec.hidden_size, spec.intermediate_size, spec.q_dim, spec.kv_dim, spec.num_heads
    stats = 1 if spec.norm == "rmsnorm" else 2
    if spec.family == "gpt2":
        kv = qd  # one fused c_attn: q, k and v are views of one (b, s, 3h) output
    saved = [S(name="block input", width=h, kind="x")]
    for n in (1, 2):
        # GPT-NeoX's parallel residual: both norms normalise the block's input, and the compiler
        # computes their shared mean and rstd once (common subexpressions are merged)
        if n == 1 or not spec.parallel_residual:
            saved.append(S(name=f"norm {n} statistics", width=stats, kind="f32"))
        saved.append(S(name=f"norm {n} output (projection input)", width=h, kind="half", for_weight=True))
    if spec.family == "gpt_neox":
        # its rotary embedding concatenates: q and k are new head-major tensors; v stays a view of the
        # fused qkv output, which it keeps whole; the kernel's head-major output needs a transposed copy
        # for the dense projection (as eager autograd keeps: activations.layer_saved)
        saved += [S(name="q, k after rotary", width=qd + kv, kind="half"),
                  S(name="fused qkv output (v is a view)", width=qd + 2 * kv, kind="half"),
                  S(name="attention output", width=qd, kind="half"),
                  S(name="dense input (attention output, transposed copy)", width=qd, kind="half", for_weight=True)]
    else:  # GPT-2's q, k, v are views of c_attn's output (kv = qd above); rotary (Llama) keeps q's layout
        saved += [S(name="q", width=qd, kind="half"), S(name="k, v", width=2 * kv, kind="half"),
                  S(name="attention output (o_proj input)", width=qd, kind="half", for_weight=True)]
    saved.append(S(name="logsumexp", width=a, kind="f32"))
    if not spec.parallel_residual:
        saved.append(S(name="o_proj output (rebuilds the residual)", width=h, kind="half"))
    if spec.activation == "relu" and not spec.gated_mlp:  # relu's backward reads its output: the down input
        saved.append(S(name="relu output (MLP down input)", width=i, kind="half", part="mlp", for_weight=True))
        return saved
    ups = 2 if spec.gated_mlp else 1
    saved += [S(name="MLP up/gate outputs", width=ups * i, kind="half", part="mlp"),
              S(name="MLP down input", width=i, kind="half", part="mlp", for_weight=True)]
    return saved


def compiled_activations(model: ModelSpec | str, *, batch_size: int, seq_len: int, precision: str = "fp32",
                         device: str = "cpu", memory_budget: float = 1.0) -> dict:
    """Bytes one block saves for backward, eager against compiled (`compiled_block_saved`):
    'eager' (the ledger's block, `activations.activation_bytes`), 'compiled' (the partitioner's
    default cut), 'minimum' (the block's input: activation_memory_budget = 0, which saves only the
    compiled region's inputs), and 'budget' (the most the partitioner may keep at `memory_budget`:
    minimum + memory_budget x (compiled - minimum), in the partitioner's own accounting, where a view
    weighs its own elements; plus, for a fused qkv projection (GPT-2, GPT-NeoX), the rest of that
    output, which one saved view of it keeps alive: its knapsack keeps at most that), per block and
    for all the model's blocks ('*_layers'). 'saved': the compiled ledger, priced (name, bytes).

    Known limitations: validated against CPU inductor in fp32 (`vramlab.measure.checkpointing
    compile`); other precisions price the same tensors in the compute dtype, unmeasured."""
    spec = _specs.resolve(model)
    b, s = _mem.check_positive(batch_size=batch_size, seq_len=seq_len)
    memory_budget = _checks.number("memory_budget", memory_budget, lo=0, hi=1,
                                   what="torch._functorch.config.activation_memory_budget, in [0, 1]")
    _mem.check_choice(device, ("cuda", "cpu"), "device")
    ledger = compiled_block_saved(spec)
    nb = _prec.dtype_sizes(precision, device)
    size = dict(tokens=b * s, scores=b * spec.num_heads * s * s, nbytes=nb, batch=b)
    priced = [(x.name, _act.saved_tensor_bytes(x, **size)) for x in ledger]
    compiled = sum(n for _, n in priced)
    minimum = priced[0][1]  # the block's input
    eager = _act.activation_bytes(spec, batch_size=b, seq_len=s, precision=precision, device=device)["full"][0]
    # The partitioner weighs each saved node at its own size, a view at the view's: GPT-2's q, k, v and
    # GPT-NeoX's v are views of one fused qkv output, whose storage a saved view keeps whole. Its
    # default cut counts GPT-NeoX's v at the KV width (GPT-2 saves all three views: no difference); a
    # cut under a budget may keep one view of either, and with it the rest of the fused output.
    fused = spec.family in ("gpt2", "gpt_neox")
    x_bytes = nb["half"] * b * s  # q, k, v are in the compute dtype
    kv = spec.q_dim if spec.family == "gpt2" else spec.kv_dim
    nodes = compiled - ((spec.q_dim + kv) * x_bytes if spec.family == "gpt_neox" else 0)
    if memory_budget == 1:
        budget = compiled
    elif memory_budget == 0:
        budget = minimum
    else:
        budget = minimum + math.floor(memory_budget * (nodes - minimum)) + ((spec.q_dim + kv) * x_bytes if fused else 0)
    n = spec.num_layers
    return {"eager": eager, "compiled": compiled, "minimum": minimum, "budget": budget, "memory_budget": memory_budget,
            "eager_layers": n * eager, "compiled_layers": n * compiled, "minimum_layers": n * minimum,
            "budget_layers": n * budget, "saved": priced}


def loss_bytes(*, tokens: int, hidden_size: int, vocab_size: int, chunk_tokens: "int | None" = None,
               dtype_bytes: int = 4) -> dict:
    """Cross-entropy through an LM head (`F.cross_entropy(h @ W.T, y)`, h tokens x hidden, W vocab x
    hidden), whole or chunked, and its backward: 'saved', the bytes kept for backward beyond h and W;
    'peak', the most bytes alive at once beyond h and W (gradients included).

    Whole: log_softmax saves its output, N x V (the logits are freed once it has run). The backward
    holds three N x V tensors at once: the log-probabilities, their gradient (nll_loss's backward
    scatters it) and the logits' gradient log_softmax's backward makes; then the head's gradient
    (V x h) is made while the logits' gradient is alive. Peak 3 N V + V h elements.

    Chunked (chunks of c tokens, each one's logits made, reduced and thrown away inside
    `torch.utils.checkpoint` and recomputed in the backward; Liger-Kernel's fused linear
    cross-entropy and Wijmans+24's cut cross-entropy go further and never write a chunk's logits to
    memory): nothing N x V is saved; the backward holds one chunk's three c x V tensors, the head's
    accumulating gradient and the chunk's part of it, and h's gradient: 3 c V + 2 V h + N h elements
    (one chunk, c >= N: 3 N V + V h + N h, the whole loss's peak with nothing saved)."""
    tokens = _checks.whole("tokens", tokens, lo=1)
    hidden_size = _checks.whole("hidden_size", hidden_size, lo=1)
    vocab_size = _checks.whole("vocab_size", vocab_size, lo=1)
    dtype_bytes = _checks.whole("dtype_bytes", dtype_bytes, lo=1, hi=8)
    n, h, v = tokens, hidden_size, vocab_size
    if chunk_tokens is not None:
        chunk_tokens = _checks.whole("chunk_tokens", chunk_tokens, lo=1)
    if chunk_tokens is None:
        return {"saved": n * v * dtype_bytes, "peak": (3 * n * v + v * h) * dtype_bytes}
    c = min(chunk_tokens, n)
    head_grads = 2 if c < n else 1  # the accumulated gradient and the next chunk's part of it
    return {"saved": 0, "peak": (3 * c * v + head_grads * v * h + n * h) * dtype_bytes}
