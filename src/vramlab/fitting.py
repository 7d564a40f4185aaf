"""Does it fit? One definition of "fits" for every calculator (`device_fit`: an estimate, the
allocator's rounding and fragmentation, the CUDA context and a margin against a GPU's memory), the
largest batch or sequence that does (`fit`, `largest_true`), and the largest single tensor a step
allocates. Pure Python: no torch import.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from typing import Callable, Literal

from . import checks as _checks
from .activations import ATTENTIONS, WHOLE_MODEL, AttentionImpl, DeviceShare
from .checks import MAX_BYTES
from .memory import (INFERENCE_OPTIONS, MemoryBreakdown, INFER_BYTES, estimate_options,
                     estimate_inference, estimate_training, param_bytes)
from .step import OPTIONS as STEP_OPTIONS
from .precision import PRECISIONS
from .specs import GPUSpec, ModelSpec, gpu as _gpu, resolve as _resolve
from .units import fmt_bytes


ESTIMATE_MARGIN = 0.03
# expandable segments map physical memory page by page: 20 MiB pages in the large pool, 2 MiB in the small
# one (CUDACachingAllocator.cpp: `segment_size = pool->is_small ? kSmallBuffer : kLargeBuffer`); what is
# mapped but unallocated is at most the last page of each pool's segment
_PAGE = (20 + 2) * 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class Fit:
    """Whether a workload fits a GPU, the largest batch size that does, and what was assumed to
    stand between the estimate (allocated bytes) and an out-of-memory error."""

    gpu: GPUSpec
    needed: int  # bytes at the given batch size: estimate + margin + fragmentation + context
    available: int  # what cudaMemGetInfo calls total
    fits: bool
    max_batch_size: int | None  # 0: not even batch size 1 fits; None: not searched (`device_fit`)
    estimate: int  # the estimate at the given batch size (max_memory_allocated)
    margin: int  # ESTIMATE_MARGIN of the estimate
    fragmentation: int  # the caching allocator's headroom at the given batch size
    context: int  # the CUDA context and libraries, outside the allocator
    expandable_segments: bool = False
    capped: bool = False  # even the search's limit fits: max_batch_size is a lower bound, not the answer
    batch_size: int | None = None  # the batch size whose bytes `needed` and its terms are (`fit` sets it)

    def __post_init__(self) -> None:
        if not isinstance(self.gpu, GPUSpec):
            raise ValueError(f"gpu must be a vramlab.specs.GPUSpec, got {_checks.show(self.gpu)}")
        for k in ("needed", "available", "estimate", "margin", "fragmentation", "context"):
            object.__setattr__(self, k, _checks.whole(k, getattr(self, k), lo=0, hi=MAX_BYTES))
        for k in ("fits", "expandable_segments", "capped"):
            object.__setattr__(self, k, _checks.flag(k, getattr(self, k)))
        for k in ("max_batch_size", "batch_size"):
            if getattr(self, k) is not None:
                object.__setattr__(self, k, _checks.whole(k, getattr(self, k), lo=0 if k == "max_batch_size" else 1))

    @property
    def reserve(self) -> int:
        """Everything beyond the estimate: margin + fragmentation + context."""
        return self.margin + self.fragmentation + self.context

    def explain(self) -> str:
        """One line per term of `needed`, under a line that says which batch size they are for (the
        one asked, beside the largest that fits, when the search ran)."""
        at = f"at batch size {self.batch_size:,}" if self.batch_size is not None else "at the batch size asked"
        if self.max_batch_size is not None:
            largest = f"more than {self.max_batch_size:,}" if self.capped else f"{self.max_batch_size:,}"
            at += f" (the largest that fits is {largest})"
        alloc = "expandable: a 20 MiB and a 2 MiB page" if self.expandable_segments else "the largest tensor"
        rows = [("estimate (max_memory_allocated)", self.estimate, ""),
                (f"+ estimate margin ({ESTIMATE_MARGIN:.0%})", self.margin, ""),
                ("+ fragmentation", self.fragmentation, f"  ({alloc})"),
                ("+ CUDA context and libraries", self.context, ""),
                ("= needed", self.needed, f"  of {fmt_bytes(self.available)} usable")]
        return "\n".join([f"  needed {at}:"] + [f"  {label:<31}{fmt_bytes(n):>12}{note}" for label, n, note in rows])

    def __str__(self) -> str:
        verdict = "fits" if self.fits else "does NOT fit"
        line = (f"{verdict} on {self.gpu.name} ({fmt_bytes(self.needed)} needed incl. {fmt_bytes(self.reserve)} "
                f"reserve, {fmt_bytes(self.available)} available)")
        if self.max_batch_size is None:
            return line
        largest = (f"more than {self.max_batch_size:,} (the search stops there)" if self.capped
                   else f"{self.max_batch_size}")
        return f"{line}; largest batch size that fits: {largest}"


def device_fit(estimate: "MemoryBreakdown | int", gpu: GPUSpec | str, *, largest_tensor: int,
               expandable_segments: bool = False, max_batch_size: int | None = None, capped: bool = False) -> Fit:
    """The one definition of "fits" that every calculator uses: the estimate (`max_memory_allocated`)
    + ESTIMATE_MARGIN of it + the caching allocator's fragmentation (`largest_tensor` bytes: the block
    it cannot reuse for the peak's request, `fragmentation_bytes`; with expandable segments, the
    last 20 MiB page of the large pool and 2 MiB page of the small one) + the CUDA
    context (`gpu.context_bytes`) <= what cudaMemGetInfo calls total (`gpu.usable_bytes`).
    `fit` searches the largest batch size with it; `parallel.fits` and `zero.fits` apply it to the
    fullest device of a layout."""
    g = _gpu(gpu)
    total = estimate.total if isinstance(estimate, MemoryBreakdown) else estimate
    if _checks.index(total) is None or not 0 <= total <= MAX_BYTES:
        raise ValueError(f"estimate must be a MemoryBreakdown or a whole number of bytes from 0 to {MAX_BYTES:,}, "
                         f"got {_checks.show(estimate if isinstance(estimate, MemoryBreakdown) else total)}")
    total = operator.index(total)
    largest_tensor = _checks.whole("largest_tensor", largest_tensor, lo=0, hi=MAX_BYTES)
    expandable_segments = _checks.flag("expandable_segments", expandable_segments)
    if max_batch_size is not None:
        max_batch_size = _checks.whole("max_batch_size", max_batch_size, lo=0)
    capped = _checks.flag("capped", capped)
    margin = int(total * ESTIMATE_MARGIN)
    frag = _PAGE if expandable_segments else largest_tensor
    needed = total + margin + frag + g.context_bytes
    return Fit(gpu=g, needed=needed, available=g.usable_bytes, fits=needed <= g.usable_bytes,
               max_batch_size=max_batch_size, estimate=total, margin=margin, fragmentation=frag,
               context=g.context_bytes, expandable_segments=expandable_segments, capped=capped)


def largest_tensor_bytes(model: ModelSpec | str, *, batch_size: int, seq_len: int, mode: Literal["train", "infer"] = "train",
                         precision: str = "fp32", attention: AttentionImpl = "sdpa", dtype: str = "bf16",
                         new_tokens: int | None = None, all_logits: bool = True, share: DeviceShare = WHOLE_MODEL,
                         **_ignored) -> int:
    """The largest single allocation of a step: the fp32 logits (or their gradient), the
    embedding's gradient, or eager attention's scores. `share`: on one device of a layout (the
    logits on the last stage, the embedding's gradient on the first, both split by t; DTensor's
    dense embedding gradient whole). Other keywords of `estimate_training`/`estimate_inference` are
    accepted (and ignored), so that one set of options serves both; any other is an error. A mixture
    of experts' gate-and-up output (top-k rows a token) is a candidate too."""
    spec = _resolve(model, moe=True)  # a mixture of experts too (estimate_training says which it prices)
    _checks.no_unknown("largest_tensor_bytes", _ignored, estimate_options())
    batch_size, seq_len = _checks.whole("batch_size", batch_size), _checks.whole("seq_len", seq_len)
    _checks.one_of("mode", mode, ("train", "infer"))
    _checks.one_of("precision", precision, PRECISIONS)
    _checks.one_of("attention implementation", attention, ATTENTIONS)
    _checks.one_of("dtype", dtype, tuple(INFER_BYTES))
    if new_tokens is not None:
        new_tokens = _checks.whole("new_tokens", new_tokens, lo=0)
    all_logits = _checks.flag("all_logits", all_logits)
    if not isinstance(share, DeviceShare):
        raise ValueError(f"share must be a vramlab.activations.DeviceShare, got {_checks.show(share)}")
    b, s, V = batch_size, seq_len, spec.vocab_size
    if not share.whole:
        t, e = share.tp, spec.word_embed_proj_dim or spec.hidden_size
        vocab = -(-V // t)
        emb = (V if share.embedding_grad == "dense" and t > 1 else vocab) * e * param_bytes(precision)
        scores = -(-b * spec.num_heads * s * s * 4 // t) if attention == "eager" else 0
        return max(b * s * vocab * 4 if share.last else 0, emb if share.first or share.last else 0, scores)
    e = spec.word_embed_proj_dim or spec.hidden_size
    if mode == "infer":
        nb = 2 if dtype == "int8" else INFER_BYTES.get(dtype, 2)
        tokens = b if (new_tokens is not None or not all_logits or spec.family == "t5") else b * s
        scores = b * spec.num_heads * s * s * nb if attention == "eager" else 0
        experts = b * s * spec.num_experts_per_tok * 2 * spec.moe_intermediate_size * nb if spec.is_moe else 0
        return max(tokens * V * nb, scores, b * s * spec.intermediate_size * nb, experts)
    scores = b * spec.num_heads * s * s * 4 if attention == "eager" else 0
    # a mixture of experts' gate-and-up output, top-k rows a token (transformers runs the experts in the
    # weights' dtype: fp32 under autocast)
    experts = b * s * spec.num_experts_per_tok * 2 * spec.moe_intermediate_size * 4 if spec.is_moe else 0
    return max(b * s * V * 4, V * e * param_bytes(precision), scores, experts)


def fragmentation_bytes(model: ModelSpec | str, *, batch_size: int, seq_len: int, precision: str = "fp32",
                        share: DeviceShare = WHOLE_MODEL, **kw) -> int:
    """What the caching allocator holds reserved but cannot hand to the step's peak request: the
    block `device_fit` adds for fragmentation. Under 16-bit compute, when the fp32 logits are the
    step's largest tensor, it is the freed block of the 16-bit logits, half the size of the fp32
    gradient that the backward asks for next (measured on an H100, GPT-2 bf16-mixed s=512, batches 64
    to 104: reserved minus allocated at the peak 0.83-0.97 of the 16-bit logits; the estimate's
    largest batch is then the measured one, 104). Otherwise one block of the largest tensor
    (`largest_tensor_bytes`), which is safe without a measurement that says more."""
    spec = _resolve(model, moe=True)
    _checks.no_unknown("fragmentation_bytes", kw, estimate_options() | {"mode"})
    largest = largest_tensor_bytes(spec, batch_size=batch_size, seq_len=seq_len, precision=precision, share=share, **kw)
    batch_size, seq_len = operator.index(batch_size), operator.index(seq_len)  # checked there
    if kw.get("mode", "train") != "train" or precision == "fp32" or not (share.whole or share.last):
        return largest
    vocab = -(-spec.vocab_size // share.tp)
    logits32 = batch_size * seq_len * vocab * 4
    return logits32 // 2 if logits32 == largest else largest


def _gpu_step_options(est: Callable, options: dict, who: str, who_mode: str, chosen: tuple[str, ...] = ()) -> dict:
    """The options a search (`fit`, `largest_micro_batch`, `longest_sequence`) passes on to `est`:
    device must be "cuda" (dropped), and every other one must be `est`'s, less what the search chooses
    itself (`chosen`, and the batch size, model and GPU)."""
    if options.get("device", "cuda") != "cuda":
        raise ValueError(f"{who} answers for a GPU: leave device at 'cuda'")
    options = {k: v for k, v in options.items() if k != "device"}
    allowed = set(STEP_OPTIONS if est is estimate_training else INFERENCE_OPTIONS) - {"batch_size", "gpu", "device",
                                                                                      *chosen}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(f"{who_mode} does not take {', '.join(unknown)}; it takes {', '.join(sorted(allowed))}")
    return options


def largest_true(fits: Callable[[int], bool], *, start: int = 1, limit: int = 1 << 16) -> int:
    """The largest n in 1..limit with fits(n), for a `fits` that is true up to some n and false
    beyond (memory grows with the batch): gallop from `start` (up, or down by halves), then bisect.
    Returns 0 when even 1 does not fit. Few calls near a good `start`: each may be a GPU probe."""
    if not callable(fits):
        raise ValueError(f"fits must be a function of the batch size that returns True or False, got {_checks.show(fits)}")
    start, limit = _checks.whole("start", start), _checks.whole("limit", limit)
    start = max(1, min(start, limit))
    if fits(start):
        lo, step = start, max(1, start // 8)
        while lo < limit:
            hi = min(lo + step, limit)
            if not fits(hi):
                break
            lo, step = hi, step * 2
        else:
            return lo
    else:
        hi, lo = start, start // 2
        while lo >= 1 and not fits(lo):
            hi, lo = lo, lo // 2
        if lo < 1:
            return 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def fit(model: ModelSpec | str, gpu: GPUSpec | str, *, batch_size: int = 1, mode: Literal["train", "infer"] = "train",
        expandable_segments: bool = False, max_search: int = 1 << 16, **options) -> Fit:
    """Does the training step (or inference) fit on `gpu`, and what is the largest batch size that
    does? `options` are those of estimate_training / estimate_inference.

    needed = estimate + ESTIMATE_MARGIN x estimate + fragmentation + context <= usable memory, where
    - estimate: `max_memory_allocated` as the estimator predicts it (cuBLAS workspaces included);
    - fragmentation: with PyTorch's default caching allocator, room for one more block of the step's
      largest tensor (a freed segment that cannot be reused for it: the H100's OOM at GPT-2 s512
      batch 112 had 9.94 GiB reserved but unallocated when it asked for 10.74 GiB, the logits);
      with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (`expandable_segments=True`), segments
      grow page by page (20 MiB pages for large blocks, 2 MiB for small) and the allocator's overhead shrinks to
      at most those two pages' unused ends;
    - context: the CUDA context and libraries outside the allocator (`gpu.context_bytes`);
    - usable: what cudaMemGetInfo calls total (`gpu.usable_bytes`), less than nvidia-smi's total.
    Checked against bisected out-of-memory boundaries on an H100 (tests/test_gpu_truth.py)."""
    g = _gpu(gpu)
    if not isinstance(mode, str) or mode not in ("train", "infer"):
        raise ValueError(f"mode must be 'train' or 'infer', got {_checks.show(mode)}")
    batch_size, max_search = _checks.whole("batch_size", batch_size), _checks.whole("max_search", max_search)
    expandable_segments = _checks.flag("expandable_segments", expandable_segments)
    est = estimate_training if mode == "train" else estimate_inference
    options = _gpu_step_options(est, options, "fit()", f"fit(mode={mode!r})")
    if "seq_len" not in options:
        raise ValueError("seq_len must be given: the tokens per sequence of the step whose fit is asked")
    # every option checked once, at batch size 1, before the search
    est(model, batch_size=1, gpu=g, **options)

    def verdict(bs: int, **found) -> Fit:
        return device_fit(est(model, batch_size=bs, gpu=g, **options), g, expandable_segments=expandable_segments,
                          largest_tensor=fragmentation_bytes(model, batch_size=bs, mode=mode, **options), **found)

    lo = largest_true(lambda bs: verdict(bs).fits, limit=max_search)
    return replace(verdict(batch_size, max_batch_size=lo, capped=lo >= max_search), batch_size=batch_size)


@dataclass(frozen=True, kw_only=True)
class MicroBatchFit:
    """Gradient accumulation's answer for a global batch: run `accumulation_steps` micro-batches of
    `micro_batch_size` sequences (the last one `last_micro_batch`, smaller when the global batch is not
    a multiple) and one optimizer step. `micro_batch_size` 0: not even one sequence fits. `fit` is
    `device_fit` at that micro-batch (or at 1 when none fits)."""

    global_batch: int
    micro_batch_size: int
    accumulation_steps: int
    last_micro_batch: int
    fit: Fit

    def __str__(self) -> str:
        if not self.micro_batch_size:
            return (f"global batch {self.global_batch:,}: not even a micro-batch of 1 fits on {self.fit.gpu.name} "
                    f"({fmt_bytes(self.fit.needed)} needed, {fmt_bytes(self.fit.available)} available)")
        last = (f" (the last of {self.last_micro_batch:,})" if self.last_micro_batch != self.micro_batch_size else "")
        return (f"global batch {self.global_batch:,} = {self.accumulation_steps:,} micro-batch(es) of "
                f"{self.micro_batch_size:,}{last} on {self.fit.gpu.name} ({fmt_bytes(self.fit.needed)} needed of "
                f"{fmt_bytes(self.fit.available)})")


def largest_micro_batch(model: ModelSpec | str, gpu: GPUSpec | str, *, global_batch: int, divisor: bool = True,
                        expandable_segments: bool = False, **options) -> MicroBatchFit:
    """The largest micro-batch that fits `gpu` (`device_fit`, as `fit`) when a step must see
    `global_batch` sequences, and the accumulation steps it takes. `options` are estimate_training's
    (seq_len required; not batch_size or accumulation_steps, which this chooses).

    divisor=True: the micro-batch divides the global batch (every micro-batch the same size, so the
    mean of the k micro-batch losses, each scaled by 1/k, is the global batch's mean).
    divisor=False: any micro-batch up to the global batch; k = ceil(N / m) and the last micro-batch
    holds the remainder N - (k - 1) m (smaller, so it fits too; scale each loss by its share, m / N).
    With k > 1 the gradients stay from the first micro-batch's backward to the optimizer's step, so a
    micro-batch of m fits with accumulation only if m plus every gradient does (`training_phases`)."""
    g = _gpu(gpu)
    n = _checks.whole("global_batch", global_batch, hi=_checks.MAX_COUNT)
    divisor = _checks.flag("divisor", divisor)
    expandable_segments = _checks.flag("expandable_segments", expandable_segments)
    for k in ("batch_size", "accumulation_steps", "mode"):
        if k in options:
            raise ValueError(f"largest_micro_batch chooses {k} itself: pass global_batch and the step's other options")
    options = _gpu_step_options(estimate_training, options, "largest_micro_batch()", "largest_micro_batch()",
                                chosen=("accumulation_steps",))
    if "seq_len" not in options:
        raise ValueError("seq_len must be given: the tokens per sequence of the step whose fit is asked")
    estimate_training(model, batch_size=1, gpu=g, **options)  # every option checked once

    def verdict(m: int) -> Fit:
        k = -(-n // m)
        return replace(device_fit(estimate_training(model, batch_size=m, gpu=g, accumulation_steps=k, **options), g,
                                  expandable_segments=expandable_segments,
                                  largest_tensor=fragmentation_bytes(model, batch_size=m, **options)), batch_size=m)

    if divisor:
        # the divisors of n, largest first; every one is tried until one fits (k = 1 holds no gradients
        # between micro-batches, so memory is not monotonic at m = n)
        divisors = sorted({d for i in range(1, int(n ** 0.5) + 1) if n % i == 0 for d in (i, n // i)}, reverse=True)
        m = next((d for d in divisors if verdict(d).fits), 0)
    else:
        m = n if verdict(n).fits else (largest_true(lambda x: verdict(x).fits, start=max(1, n // 2), limit=n - 1)
                                       if n > 1 else 0)
    if not m:
        return MicroBatchFit(global_batch=n, micro_batch_size=0, accumulation_steps=0, last_micro_batch=0,
                             fit=verdict(1))
    k = -(-n // m)
    return MicroBatchFit(global_batch=n, micro_batch_size=m, accumulation_steps=k, last_micro_batch=n - (k - 1) * m,
                         fit=verdict(m))


# how far the search for the longest sequence goes for a model with no position limit (T5's relative
# positions): 1 M tokens
MAX_SEQ_SEARCH = 1 << 20


@dataclass(frozen=True, kw_only=True)
class SequenceFit:
    """The longest sequence whose step fits a GPU at a given batch size (`longest_sequence`).
    `seq_len` 0: not even one token fits. `capped`: the model's positions stop the search, not the
    memory (every sequence it can read fits). `fit` is `device_fit` at `seq_len` (or at 1 when none fits)."""

    seq_len: int
    batch_size: int
    limit: int  # the most tokens the model reads (its positions; MAX_SEQ_SEARCH when it has no limit)
    capped: bool
    fit: Fit

    def __str__(self) -> str:
        g = self.fit.gpu.name
        if not self.seq_len:
            return f"not even one token a sequence fits on {g} at batch size {self.batch_size:,}"
        why = " (the model's positions stop it, not the memory)" if self.capped else ""
        return (f"longest sequence that fits on {g} at batch size {self.batch_size:,}: {self.seq_len:,} tokens{why} "
                f"({fmt_bytes(self.fit.needed)} needed of {fmt_bytes(self.fit.available)})")


def longest_sequence(model: ModelSpec | str, gpu: GPUSpec | str, *, batch_size: int = 1,
                     mode: Literal["train", "infer"] = "train", expandable_segments: bool = False,
                     **options) -> SequenceFit:
    """The longest sequence (tokens) whose training step (or inference) fits `gpu` at `batch_size`:
    the same `device_fit` as `fit` (estimate + margin + fragmentation + CUDA context <= usable), searched
    over the sequence length instead of the batch (memory grows with it: activations b·s, the logits
    b·s·V, eager attention's scores b·a·s²). Up to the model's positions (`max_position_embeddings`).
    `options` are estimate_training's / estimate_inference's, without seq_len."""
    from .checks import positions as _positions

    g = _gpu(gpu)
    if not isinstance(mode, str) or mode not in ("train", "infer"):
        raise ValueError(f"mode must be 'train' or 'infer', got {_checks.show(mode)}")
    batch_size = _checks.whole("batch_size", batch_size)
    expandable_segments = _checks.flag("expandable_segments", expandable_segments)
    if "seq_len" in options:
        raise ValueError("longest_sequence chooses seq_len itself: give the step's other options")
    est = estimate_training if mode == "train" else estimate_inference
    options = _gpu_step_options(est, options, "longest_sequence()", f"longest_sequence(mode={mode!r})",
                                chosen=("seq_len",))
    spec = _resolve(model, moe=True)
    est(spec, batch_size=batch_size, seq_len=1, gpu=g, **options)  # every option checked once
    limit = spec.max_position_embeddings if spec.family != "t5" and spec.max_position_embeddings else MAX_SEQ_SEARCH
    _positions(spec, limit)

    def verdict(s: int) -> Fit:
        return replace(device_fit(est(spec, batch_size=batch_size, seq_len=s, gpu=g, **options), g,
                                  expandable_segments=expandable_segments,
                                  largest_tensor=fragmentation_bytes(spec, batch_size=batch_size, seq_len=s, mode=mode,
                                                                     **options)), batch_size=batch_size)

    s = largest_true(lambda n: verdict(n).fits, start=min(2048, limit), limit=limit)
    return SequenceFit(seq_len=s, batch_size=batch_size, limit=limit, capped=s >= limit, fit=verdict(max(s, 1)))
