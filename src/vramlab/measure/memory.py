"""Measure the memory a training step or an inference prefill really uses, by category.

Three modes, one result type (`Measurement`, whose `.breakdown` is a `MemoryBreakdown` like the
estimator's, so predicted minus measured is a subtraction):

- "cuda":  a real step on a GPU. Categories from tensor tracking (PyTorch's MemTracker, which
           applies the allocator's 512-byte rounding); also the allocator's own peak allocated and
           reserved bytes and the device's total in use (CUDA context included).
- "cpu":   a real step on the CPU, categories from live-tensor tracking.
- "trace": the same step under `FakeTensorMode`: every tensor has a shape, dtype and device but no
           storage, so a GPU-sized model is measured on a laptop in seconds. The peak equals real
           CPU tensor tracking.

Known limitations: CPU and trace runs execute CPU kernels, whose choices differ from CUDA's
(the SDPA kernel with dropout, autocast's op lists, optimizer implementations' defaults); GradScaler
is not run under trace (its `found_inf` check needs real values; it holds a few scalars).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import torch

from ..activations import Recompute
from ..memory import Loss, MemoryBreakdown, Optimizer, OptimizerImpl, check_positive, loss_chunk_size
from ..precision import FP32_STATES, Precision
from .models import Attention, build_model, make_batch
from .record import Mode, provenance, resolve_mode
from ..specs import ModelSpec



@dataclass(frozen=True, kw_only=True)
class Measurement:
    """A measured peak. `breakdown` is by category at the tracked peak; on CUDA the allocator's
    view (`peak_allocated`, `peak_reserved`) and the whole device's (`device_in_use`) are added."""

    breakdown: MemoryBreakdown
    mode: str
    device: str
    seconds: float
    peak_allocated: int | None = None  # torch.cuda.max_memory_allocated(): live tensors, rounded
    peak_reserved: int | None = None  # torch.cuda.max_memory_reserved(): the caching allocator's pool
    device_in_use: int | None = None  # total - free from cudaMemGetInfo: + CUDA context, cuBLAS, NCCL
    step_seconds: tuple[float, ...] = ()  # timed steps after the measured one (CUDA: synchronised)
    provenance: dict[str, Any] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.breakdown.total

    @property
    def headline(self) -> int:
        """The number an estimate is compared with: the allocator's peak on CUDA, else the tracked peak."""
        return self.peak_allocated if self.peak_allocated is not None else self.total

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "breakdown"}
        d["step_seconds"] = list(self.step_seconds)
        d["breakdown"] = dataclasses.asdict(self.breakdown)  # categories, label, precision, device
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Measurement":
        d = {**d, "breakdown": MemoryBreakdown(**d["breakdown"]), "step_seconds": tuple(d.get("step_seconds", ()))}
        return cls(**d)


# ----------------------------------------------------------------------------- tracking

class _NoHook:
    def remove(self) -> None:
        pass


def storage_tracker():
    from torch.distributed._tools.mem_tracker import MemTracker

    return MemTracker()


def ignore_frozen(tracker, model: torch.nn.Module) -> None:
    """MemTracker (torch 2.13) registers a gradient hook on every parameter and crashes on frozen
    ones ("cannot register a hook on a tensor that doesn't require gradient"), i.e. on every PEFT
    model. Frozen parameters never get a gradient: give them hook handles that do nothing."""
    for p in model.parameters():
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (anything else in the iterable is skipped):
    views and tensors shared between entries count once."""
    seen, total = set(), 0
    for v in tensors:
        if isinstance(v, torch.Tensor):
            key = id(v.untyped_storage()) if v.device.type != "meta" else id(v)
            if key not in seen:
                seen.add(key)
                total += v.untyped_storage().nbytes()
    return total


def state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    if optimizer is None:
        return 0
    return storage_bytes(v for state in optimizer.state.values() for v in state.values())


def to_breakdown(snap: dict[str, int], *, opt_state_bytes: int, label: str, precision: str = "",
                  device: str = "") -> MemoryBreakdown:
    """MemTracker's categories -> vramlab's. Everything allocated inside optimizer.step() is tagged
    'Optstate' by MemTracker: the part beyond the persistent states is the step's temporaries."""
    opt = snap.get("Optstate", 0)
    states = min(opt, opt_state_bytes)
    return MemoryBreakdown(
        parameters=snap.get("Parameter", 0),
        gradients=snap.get("Gradient", 0),
        optimizer_states=states,
        activations=snap.get("Activation", 0),
        temporaries=snap.get("Temp", 0) + opt - states,
        inputs=snap.get("Other", 0),
        other=snap.get("Buffer", 0),
        label=label, precision=precision, device=device,
    )


def measure(step: Callable[[], Any], *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
            inputs: Any = (), label: str = "measured", mode: str = "cpu", warmup_steps: int = 0,
            timing_steps: int = 0, precision: str = "") -> Measurement:
    """Run `step()` and return its peak memory by category.

    `model`, `optimizer` and `inputs` must already exist (they are what is resident before the
    step: parameters, optimizer states, the batch). `warmup_steps` run first, unmeasured (cuBLAS
    handles and workspaces, autotuning, lazy state: the steady state), then one step is measured;
    `timing_steps` more are timed (synchronised on CUDA) and `seconds` is their median. `mode` only
    labels the result and, on "cuda", adds the allocator's and device's peaks, the allocator's
    `max_memory_allocated` being the headline. Build the objects on the device (or under
    FakeTensorMode for "trace") yourself, or use `measure_training` / `measure_inference`; for a
    number nothing else can leak into, run them with `measure_isolated` (a fresh process).
    """
    cuda = mode == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup_steps):
        step()
    dev = str(next(model.parameters()).device) if cuda else "cpu"
    tracker = storage_tracker()
    tracker.track_external(model, *([optimizer] if optimizer is not None else []), *tensors_in(inputs))
    ignore_frozen(tracker, model)
    if cuda:
        gc.collect()  # garbage from the warm-up (reference cycles) must not count in this step's peak
        sync()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    global ACTIVE
    with tracker:
        ACTIVE = tracker
        try:
            step()
        finally:
            ACTIVE = None
    sync()
    seconds = time.perf_counter() - t0
    extra: dict[str, Any] = {}
    if cuda:
        free, total = torch.cuda.mem_get_info()
        extra = dict(peak_allocated=torch.cuda.max_memory_allocated(), peak_reserved=torch.cuda.max_memory_reserved(),
                     device_in_use=total - free)
    snaps = tracker.get_tracker_snapshot("peak")
    snap = next(iter(snaps.values())) if snaps else {}
    snap = {str(k.value if hasattr(k, "value") else k): v for k, v in snap.items()}
    # the kernels that ran: CUDA's, or the CPU's (a trace runs CPU kernels too)
    bd = to_breakdown(snap, opt_state_bytes=state_bytes(optimizer), label=label, precision=precision,
                       device="cuda" if cuda else "cpu")
    del tracker
    times = []
    for _ in range(timing_steps):
        sync()
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    if times:
        seconds = statistics.median(times)
    return Measurement(breakdown=bd, mode=mode, device=dev, seconds=seconds, step_seconds=tuple(times),
                       provenance=provenance(dev), **extra)


ACTIVE = None  # the tracker of the step `measure` is running


def next_micro_batch() -> None:
    """Inside a measured step, before the model's next forward (gradient accumulation's next
    micro-batch): MemTracker refuses a second call of the root module in one step unless its
    per-module statistics are cleared; the step's peak and categories are kept."""
    if ACTIVE is not None:
        ACTIVE.reset_mod_stats()


def tensors_in(inputs: Any) -> list[torch.Tensor]:
    if isinstance(inputs, torch.Tensor):
        return [inputs]
    if isinstance(inputs, dict):
        inputs = list(inputs.values())
    return [t for t in inputs if isinstance(t, torch.Tensor)]


# ----------------------------------------------------------------------------- the heap, walked for tensors

_FROZEN: list = []  # weak references to the tensors alive when `settle_imports` froze the heap


def settle_imports(modules: Sequence[str] = ()) -> None:
    """Import `modules` (already imported where a process forks from a preloaded server), then move
    every object alive (the imported libraries: some 400,000) to the collector's permanent
    generation: each later `gc.collect` and `live_tensors` walks only what was made since. Called
    once by each rank before it builds a model (a ZeRO rank walks the heap twice a measured step; a
    full walk took ~1 s, half of lab 4's CPU time). The tensors among the frozen objects stay in view:
    `live_tensors` yields those still alive too."""
    import importlib
    import weakref

    for name in modules:
        importlib.import_module(name)
    while gc.collect():  # a pass's finalizers can free more; garbage frozen would stay "live" for good
        pass
    _FROZEN[:] = [weakref.ref(t) for t in _tensors(gc.get_objects())]
    gc.freeze()


def _tensors(objects):
    """The tensors among `objects`, by their real type (`isinstance` asks each object's `__class__`,
    which some objects compute, and costs ten times more over a whole heap)."""
    is_tensor: dict[type, bool] = {}
    for o in objects:
        tp = type(o)
        hit = is_tensor.get(tp)
        if hit is None:
            hit = is_tensor[tp] = issubclass(tp, torch.Tensor)
        if hit:
            yield o


def live_tensors():
    """Every tensor Python can reach: the collector's objects, and those `settle_imports` froze."""
    yield from _tensors(gc.get_objects())
    for ref in _FROZEN:
        t = ref()
        if t is not None:
            yield t


# ----------------------------------------------------------------------------- training step

AUTOCAST = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def make_optimizer(params, *, optimizer: Optimizer, optimizer_impl: OptimizerImpl, lr: float = 1e-4):
    kw: dict[str, Any] = {"foreach": optimizer_impl == "foreach"}
    if optimizer_impl == "fused":
        kw = {"fused": True}
    if optimizer in ("adamw", "adam"):
        cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.Adam
        return cls(params, lr=lr, **kw)
    if optimizer in ("sgd", "sgd-momentum"):
        return torch.optim.SGD(params, lr=lr, momentum=0.9 if optimizer == "sgd-momentum" else 0.0, **kw)
    if optimizer == "adamw-8bit":  # block-wise, 256-value blocks (compression.adam8bit_state_bytes)
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise NotImplementedError("measuring 'adamw-8bit' needs bitsandbytes (pip install bitsandbytes)") from None
        return bnb.optim.AdamW8bit(params, lr=lr)
    raise NotImplementedError(f"measuring optimizer {optimizer!r} is not supported")


@contextlib.contextmanager
def fake_mode(enabled: bool):
    if not enabled:
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=False), _unpadded_masks():
        yield


@contextlib.contextmanager
def _unpadded_masks():
    """With real tensors, transformers sees that an unpadded batch needs no attention mask and lets
    SDPA apply causality itself; with fake tensors it cannot read the mask and materialises a
    (b, 1, s, s) fp32 mask that a real run never holds. Our batches are never padded: tell it so."""
    import transformers.masking_utils as mu

    originals = {n: f for n, f in vars(mu).items() if callable(f) and n.startswith(("_ignore_", "_can_skip_"))}

    def unpadded(f):
        def wrapper(padding_mask, *args, **kwargs):
            return f(None, *args, **kwargs)
        return wrapper

    for n, f in originals.items():
        setattr(mu, n, unpadded(f))
    originals["find_packed_sequence_indices"] = mu.find_packed_sequence_indices
    mu.find_packed_sequence_indices = lambda position_ids: None  # one sequence per row, never packed
    try:
        yield
    finally:
        for n, f in originals.items():
            setattr(mu, n, f)


def _enable_checkpointing(model: torch.nn.Module) -> None:
    """Full activation checkpointing of every block, non-reentrant. transformers 5.x renamed
    gradient_checkpointing_enable to activation_checkpointing_enable; 5.17 (the GPU image) has only
    the old name, 5.23 warns on it."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


class _Skip(torch.nn.Module):
    """A block run inside an earlier position's segment: passes the hidden states on."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class _Segment(torch.nn.Module):
    """Consecutive blocks run as one checkpoint (torch.utils.checkpoint, non-reentrant): only the
    segment's input is kept; the backward runs the blocks again. `context_fn` selects what the
    recompute may keep (selective activation checkpointing)."""

    def __init__(self, blocks: list[torch.nn.Module], context_fn: Callable | None = None):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)
        self.context_fn = context_fn

    def forward(self, hidden_states, *args, **kwargs):
        from torch.utils.checkpoint import checkpoint, noop_context_fn

        def run(h):
            for block in self.blocks:
                h = block(h, *args, **kwargs)
            return h

        if not (self.training and torch.is_grad_enabled()):
            return run(hidden_states)
        return checkpoint(run, hidden_states, use_reentrant=False, context_fn=self.context_fn or noop_context_fn)


# the operators whose outputs the "sac-matmuls" plan saves (everything else is recomputed)
_MATMUL_OPS = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
               "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")


def save_matmuls_context():
    """Selective activation checkpointing (`create_selective_checkpoint_contexts`) with the policy
    "save the outputs of matmuls and fused attention, recompute the rest"."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    save = {getattr(aten, name).default for name in _MATMUL_OPS if hasattr(aten, name)}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


_PLAN_FAMILIES = ("gpt2", "llama", "opt", "gpt_neox")  # decoder-only: one list of blocks, each returning a tensor


def check_measurable(spec: ModelSpec, recompute: Recompute):
    """The plan `measure_training` would run for `spec`, or NotImplementedError (one line) where it
    cannot: "selective" and "offload" are computed, not measured; plans other than none and full
    (transformers' own switch) regroup the blocks of decoder-only models only."""
    from ..activations import recompute_plan

    plan = recompute_plan(recompute, spec)
    if plan.attention_core or plan.offload:
        raise NotImplementedError(f"the {plan.name!r} plan is computed by vramlab.memory but not measured")
    if plan.segments and recompute != "full" and spec.family not in _PLAN_FAMILIES:
        raise NotImplementedError(f"recompute plans other than none/full are measured on decoder-only models "
                                  f"({', '.join(_PLAN_FAMILIES)} families), not {spec.family}")
    return plan


def block_list(model: torch.nn.Module, spec: ModelSpec) -> torch.nn.ModuleList:
    lists = [m for _, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == spec.num_layers
             and len({type(b) for b in m}) == 1]
    if len(lists) != 1:
        raise NotImplementedError(f"{spec.name}: no single list of {spec.num_layers} blocks to regroup")
    return lists[0]


def apply_plan(model: torch.nn.Module, spec: ModelSpec, recompute: Recompute) -> torch.nn.Module:
    """Rearrange `model`'s blocks for a recompute plan (`vramlab.activations.recompute_plan`): each
    checkpointed segment becomes one `_Segment` at its first block's position (`_Skip` at the
    others); "sac-matmuls" checkpoints every block with `save_matmuls_context`. "none" and
    "selective" (Korthikanti's attention-core recompute, a change inside attention) are not
    rearrangements: the first is the model as it is, the second is not measured. Offloading the
    checkpoints to host memory is not measured either."""
    plan = check_measurable(spec, recompute)
    if not plan.segments:
        return model
    blocks = block_list(model, spec)
    model.config.use_cache = False  # a training step keeps no KV cache
    context = save_matmuls_context if plan.keep == "matmuls" else None
    for a, e in plan.segments:
        inner = [blocks[i] for i in range(a, e)]
        blocks[a] = _Segment(inner, context)
        for i in range(a + 1, e):
            blocks[i] = _Skip()
    return model


def _defaults(mode_: str, warmup_steps: int | None, timing_steps: int | None) -> tuple[int, int]:
    """CUDA: one warm-up step (the steady state the estimate describes) and three timed steps;
    CPU and trace: neither (a trace has no time worth taking, and no lazy state to warm)."""
    cuda = mode_ == "cuda"
    return (1 if cuda else 0) if warmup_steps is None else warmup_steps, (3 if cuda else 0) if timing_steps is None else timing_steps


def training_model(spec, *, attention: str, dtype, device: str, recompute: str = "none", model_hook=None):
    """The model a measured training step runs: built from its spec, `model_hook` applied (peft's
    wrapping), then the recompute plan (`full`: every block checkpointed; another plan: `apply_plan`)."""
    model = build_model(spec, attention=attention, dtype=dtype, device=device)
    if model_hook is not None:
        model = model_hook(model)
    if recompute == "full":
        _enable_checkpointing(model)
    elif recompute != "none":
        model = apply_plan(model, spec, recompute)
    return model


# ----------------------------------------------------------------------------- the loss, chunked or fused

IGNORE_INDEX = -100


def _shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM shift (`ForCausalLMLoss`): pad with the ignore index, drop the first
    position; one new (b, s) int64 tensor, flattened to N = b * s targets."""
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous().view(-1)


def chunked_cross_entropy(hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """torchtune's chunked loss (`CEWithChunkedOutputLoss` with a model whose output projection
    returns a list of chunks): the LM head runs on each chunk of `chunk` tokens (all chunks first,
    as torchtune's `TransformerDecoder` returns them), then each chunk's logits are upcast to fp32 and
    reduced by cross-entropy with reduction="sum"; the sums are added and divided by the number of
    targets. No N x V fp32 copy of the logits exists at once; each chunk's log-softmax is kept for
    the backward, as autograd keeps the whole loss's."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    targets = _shifted_labels(labels)
    # the head's function, not its module: MemTracker refuses a module called twice in one step
    logits = [torch.nn.functional.linear(h, head.weight, head.bias) for h in flat.split(chunk)]
    total = 0.0
    for z, y in zip(logits, targets.split(chunk)):
        total = total + torch.nn.functional.cross_entropy(z.float(), y, ignore_index=IGNORE_INDEX, reduction="sum")
    del logits  # the training loop drops the logits before the backward (torchtune's recipes: `del logits`)
    return total / (targets != IGNORE_INDEX).sum()


class FusedLinearCrossEntropy(torch.autograd.Function):
    """Liger-Kernel's fused linear cross-entropy (`LigerFusedLinearCrossEntropyFunction`), in plain
    torch: the forward computes the loss AND the gradients chunk by chunk. For each chunk of c tokens:
    its logits (c x V, in the matmul's dtype), overwritten in place by their gradient (Liger's Triton
    kernel; here in-place torch ops, with one fp32 value per row), the input's gradient written into
    `grad_input` (N x h, the input's dtype) and the weight's added into `grad_weight` (V x h, the
    weight's dtype). Both are saved for the backward, which only scales them by the incoming gradient
    (in place). No N x V tensor ever exists. The matmuls take the weight itself (`F.linear(x, W)`,
    `z @ W`), never a view of it, so that autocast reuses its cached 16-bit copy of the weight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        F = torch.nn.functional
        grad_input = torch.zeros_like(x)
        grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
        valid = targets != IGNORE_INDEX
        count = valid.sum()
        acc = torch.promote_types(x.dtype, torch.float32)  # Liger's kernel works in fp32 (fp64 stays fp64)
        total = torch.zeros((), dtype=acc, device=x.device)
        for start in range(0, x.shape[0], chunk):
            xc, yc, vc = x[start:start + chunk], targets[start:start + chunk], valid[start:start + chunk]
            z = F.linear(xc, weight)  # (c, V): the chunk's logits
            idx = yc.clamp(min=0).unsqueeze(1)
            m = z.amax(-1, keepdim=True)
            picked = z.gather(1, idx).to(acc)
            z.sub_(m).exp_()
            sums = z.sum(-1, keepdim=True, dtype=acc)
            total = total + ((sums.log() + m.to(acc) - picked).squeeze(1) * vc).sum()
            z.div_(sums.to(z.dtype)).scatter_add_(1, idx, torch.full_like(idx, -1, dtype=z.dtype))  # softmax - onehot
            z.mul_((vc.to(acc) / count).unsqueeze(1).to(z.dtype))  # the mean's gradient; ignored targets get none
            grad_input[start:start + chunk] = z @ weight  # (weight itself, not a view: autocast's cached copy)
            if grad_weight is not None:  # added in place (Liger: addmm with out=grad_weight)
                if z.dtype == grad_weight.dtype:
                    grad_weight.addmm_(z.t(), xc.to(z.dtype))
                else:  # autocast: Liger's CUDA addmm(out_dtype=fp32) has no CPU kernel: an fp32 copy of the chunk
                    grad_weight.addmm_(z.t().to(grad_weight.dtype), xc.to(grad_weight.dtype))
            del z
        ctx.save_for_backward(grad_input, grad_weight)
        return total / count

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_weight = ctx.saved_tensors
        grad_input.mul_(grad_output)  # Liger's element_mul_kernel: in place
        if grad_weight is not None:
            grad_weight.mul_(grad_output)
        return grad_input, grad_weight, None, None


def fused_cross_entropy(hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """The fused loss on the final hidden states: Liger's `LigerFusedLinearCrossEntropyLoss` in place
    of the LM head and the loss (the head has no bias in any model here)."""
    if getattr(head, "bias", None) is not None:
        raise NotImplementedError("the fused loss is measured for LM heads without a bias")
    flat = hidden.reshape(-1, hidden.shape[-1])
    return FusedLinearCrossEntropy.apply(flat, head.weight, _shifted_labels(labels), chunk)


def _loss_step(model: torch.nn.Module, batch: dict, *, loss: str, chunk: int) -> torch.Tensor:
    """A causal LM's forward with its loss replaced: the base model's final hidden states, then the
    chunked or fused loss through the LM head."""
    hidden = model.base_model(input_ids=batch["input_ids"])[0]
    fn = chunked_cross_entropy if loss == "chunked" else fused_cross_entropy
    return fn(hidden, model.get_output_embeddings(), batch["labels"], chunk)


def measure_training(spec: ModelSpec, *, batch_size: int, seq_len: int, precision: Precision = "fp32",
                     optimizer: Optimizer = "adamw", optimizer_impl: OptimizerImpl = "foreach",
                     attention: Attention = "sdpa", recompute: Recompute = "none", mode: Mode = "auto",
                     device: str | None = None, model_hook: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
                     warmup_steps: int | None = None, timing_steps: int | None = None,
                     accumulation_steps: int = 1, loss: Loss = "whole",
                     loss_chunk_tokens: int | None = None, capacity_factor: float | None = None) -> Measurement:
    """Peak of one steady-state training step of `spec`: optimizer states already exist; forward,
    backward, optimizer.step(), zero_grad(set_to_none=True). Same arguments as
    `vramlab.estimate_training`, plus `mode` (auto = cuda if available, else trace).
    `model_hook` may change the model before the step (e.g. wrap it with PEFT). On CUDA one
    warm-up step runs first and three timed steps after (see `measure`).

    accumulation_steps=k: gradient accumulation, the real loop: k micro-batches of `batch_size`
    sequences, each forward and `(loss / k).backward()` (autograd adds into the gradients the first
    one made), then one optimizer.step() and zero_grad(set_to_none=True). One micro-batch's ids are
    on the device at a time (counted in `inputs`, like the estimate); the others wait on the host
    (the tracker does not count them), as a data loader delivers them.

    loss: "whole" is the model's own (`model(**batch).loss`); "chunked" and "fused" run the base
    model to its final hidden states and then `chunked_cross_entropy` (torchtune's way) or
    `fused_cross_entropy` (Liger's algorithm in plain torch), in chunks of `loss_chunk_tokens`
    tokens (None: each method's own default, `vramlab.memory.loss_chunk_size`). Causal LMs only.

    capacity_factor: a mixture of experts with drop-and-pad routing (`vramlab.measure.moe.use_capacity`);
    None runs transformers' dropless experts (in trace mode through transformers' fallback op where
    the weights are not bf16: `vramlab.measure.moe.grouped_mm_fallback_unless_bf16`)."""
    from ..moe import check_trainable
    from .moe import grouped_mm_fallback_unless_bf16, use_capacity

    capacity_factor = check_trainable(spec, capacity_factor)
    check_positive(batch_size=batch_size, seq_len=seq_len)
    k = check_positive(accumulation_steps=accumulation_steps)[0]
    chunk = loss_chunk_size(spec, tokens=batch_size * seq_len, loss=loss, loss_chunk_tokens=loss_chunk_tokens)
    if loss != "whole" and not spec.is_causal_lm:
        raise NotImplementedError(f"the {loss} loss is measured on causal LMs, not {spec.family}")
    if precision in FP32_STATES:
        raise NotImplementedError(f"measuring precision {precision!r} needs an optimizer with fp32 states (or master "
                                  "weights) for 16-bit parameters, which torch.optim does not provide")
    mode_ = resolve_mode(mode)
    if mode_ == "trace" and optimizer == "adamw-8bit":
        raise NotImplementedError("bitsandbytes' 8-bit AdamW cannot run on fake tensors: measure it with mode='cpu' "
                                  "or 'cuda'")
    dev = device or ("cuda" if mode_ == "cuda" else "cpu")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    fallback = grouped_mm_fallback_unless_bf16() if spec.is_moe and mode_ == "trace" else contextlib.nullcontext()
    if capacity_factor is not None:
        hook = model_hook
        model_hook = lambda m: use_capacity(hook(m) if hook else m, capacity_factor)  # noqa: E731
    with fake_mode(mode_ == "trace"), fallback:
        model = training_model(spec, attention=attention, dtype=dtype, device=dev, recompute=recompute,
                               model_hook=model_hook)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = make_optimizer(params, optimizer=optimizer, optimizer_impl=optimizer_impl)
        # steady state: create the optimizer's states with one step on zero gradients
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        batch = make_batch(spec, batch_size=batch_size, seq_len=seq_len, device=dev)
        # the other micro-batches of an accumulation step: other tokens, the same shapes
        micro = [batch] + [{n: (t + i) % spec.vocab_size for n, t in batch.items()} for i in range(1, k)]
        amp = AUTOCAST.get(precision)
        dev_type = torch.device(dev).type

        def step() -> None:
            for i, mb in enumerate(micro):
                if i:
                    next_micro_batch()
                with torch.autocast(dev_type, dtype=amp, enabled=amp is not None):
                    value = model(**mb).loss if loss == "whole" else _loss_step(model, mb, loss=loss, chunk=chunk)
                (value / k if k > 1 else value).backward()  # the mean over the global batch
                del value
            opt.step()
            opt.zero_grad(set_to_none=True)

        label = f"{spec.name} train b={batch_size} s={seq_len} {precision} ({mode_})"
        if k > 1:
            label = f"{spec.name} train b={batch_size} x {k} micro-batches s={seq_len} {precision} ({mode_})"
        if loss != "whole":
            label += f" {loss} loss, chunks of {chunk} tokens"
        warm, timed = _defaults(mode_, warmup_steps, timing_steps)
        return measure(step, model=model, optimizer=opt, inputs=batch, label=label, mode=mode_, warmup_steps=warm,
                       timing_steps=timed, precision=precision)


def measure_inference(spec: ModelSpec, *, batch_size: int, seq_len: int, precision: Literal["fp32", "bf16", "fp16"] = "bf16",
                      attention: Attention = "sdpa", mode: Mode = "auto", device: str | None = None,
                      new_tokens: int | None = None, warmup_steps: int | None = None,
                      timing_steps: int | None = None) -> Measurement:
    """Peak of inference without gradients: one prefill forward pass of `batch_size` x `seq_len`
    tokens with the KV cache on (transformers' DynamicCache), all logits kept; or, with
    `new_tokens`, `model.generate(max_new_tokens=new_tokens)` (greedy; no early stop at EOS, so the
    cache really grows to seq_len + new_tokens). Same questions as `vramlab.estimate_inference`."""
    check_positive(batch_size=batch_size, seq_len=seq_len)
    mode_ = resolve_mode(mode)
    dev = device or ("cuda" if mode_ == "cuda" else "cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    with fake_mode(mode_ == "trace"):
        model = build_model(spec, attention=attention, dtype=dtype, device=dev, train=False)
        batch = make_batch(spec, batch_size=batch_size, seq_len=seq_len, device=dev, with_labels=False)
        if spec.family == "t5":
            batch["decoder_input_ids"] = batch["input_ids"][:, :1]
        out: list[Any] = []
        if new_tokens is not None:  # MemTracker allows a module called many times only below the root
            model = _Generate(model, new_tokens)

        def step() -> None:
            out.clear()  # the previous step's outputs go before this step allocates
            with torch.no_grad():
                if new_tokens is not None:
                    out.append(model(batch["input_ids"]))
                    return
                kw = {"use_cache": True} if spec.family != "bert" else {}
                out.append(model(**batch, **kw))  # keep the outputs (logits, cache) alive, as a server would

        what = "prefill" if new_tokens is None else f"generate +{new_tokens}"
        label = f"{spec.name} {what} b={batch_size} s={seq_len} {precision} ({mode_})"
        warm, timed = _defaults(mode_, warmup_steps, timing_steps)
        return measure(step, model=model, inputs=batch, label=label, mode=mode_, warmup_steps=warm, timing_steps=timed,
                       precision=precision)


class _Generate(torch.nn.Module):
    """`model.generate` as one module call: greedy, exactly `new_tokens` tokens (no early stop at
    EOS, which a random model may emit at once), the cache growing to prompt + new tokens."""

    def __init__(self, model: torch.nn.Module, new_tokens: int):
        super().__init__()
        self.model, self.new_tokens = model, new_tokens

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.new_tokens,
                                   min_new_tokens=self.new_tokens, do_sample=False, pad_token_id=0)


# ----------------------------------------------------------------------------- isolation

_KINDS = {"training": "measure_training", "inference": "measure_inference"}


def measure_isolated(kind: Literal["training", "inference"], spec: ModelSpec, *, alloc_conf: str | None = None,
                     timeout: float | None = None, **options) -> Measurement | None:
    """`measure_training` / `measure_inference` in a fresh Python process, so that nothing of an
    earlier measurement (models, optimizers, the caching allocator's pool, peak statistics) can
    count in this one: one configuration per process, as on the H100 runs. Returns None when the
    configuration runs out of GPU memory. `alloc_conf` sets PYTORCH_CUDA_ALLOC_CONF for that process
    (e.g. "expandable_segments:True"). Errors other than OOM are raised with the child's message."""
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {', '.join(_KINDS)}, got {kind!r}")
    request = {"kind": kind, "spec": dataclasses.asdict(spec), "options": options}
    mode = options.get("mode", "auto")
    if FORK_ON_CPU and (mode in ("cpu", "trace") or (mode == "auto" and not torch.cuda.is_available())):
        answer, err = in_fork(_answer, request, timeout=timeout, what=f"isolated {kind} measurement")
    else:
        answer, err = _in_new_interpreter(request, timeout, alloc_conf)
    if "error" in answer or not answer:
        why = answer.get("error") or (err.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"isolated {kind} measurement of {spec.name} failed: {why}")
    return None if answer.get("oom") else Measurement.from_dict(answer)


def _in_new_interpreter(request: dict, timeout: float | None, alloc_conf: str | None) -> tuple[dict, str]:
    """`request` measured by `python -m vramlab.measure.memory`: (its answer or {}, its stderr)."""
    env = dict(os.environ)
    # the child imports this very vramlab, wherever the parent found it (a checkout on PYTHONPATH too,
    # even after the parent changed directory)
    here = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([here, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    if alloc_conf is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    r = subprocess.run([sys.executable, "-m", "vramlab.measure.memory"], input=json.dumps(request), capture_output=True,
                       text=True, env=env, timeout=timeout)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    answer = json.loads(lines[-1]) if lines else {}
    if r.returncode != 0 and "error" not in answer:  # it ended without its answer line: the reason is on stderr
        answer = {}
    return answer, r.stderr


def largest_batch(spec: ModelSpec, *, start: int = 1, alloc_conf: str | None = None, limit: int = 4096,
                  progress: Callable[[str], None] | None = print, **options) -> tuple[int, dict[int, int | None]]:
    """The largest batch size whose training step runs on this GPU without running out of memory,
    found by experiment: one fresh process per probe (an OOM, or the allocator's cache, in one probe
    cannot change the next), galloping from `start` (e.g. vramlab.fit's answer) and bisecting.
    Returns (largest batch, {batch: peak allocated bytes, or None for an OOM})."""
    probes: dict[int, int | None] = {}

    def fits(bs: int) -> bool:
        m = measure_isolated("training", spec, batch_size=bs, mode="cuda", timing_steps=0, alloc_conf=alloc_conf,
                             **options)
        probes[bs] = None if m is None else m.peak_allocated
        if progress:
            progress(f"batch {bs:5d}: " + ("out of memory" if m is None else f"fits, peak allocated {m.peak_allocated:,} B"))
        return m is not None

    from ..fitting import largest_true

    return largest_true(fits, start=start, limit=limit), probes


def error_line(e: BaseException) -> str:
    """An exception as the one line a measuring process reports to its parent: its type and first line."""
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


def _answer(request: dict) -> dict:
    """One measurement described by `request`: the Measurement's dict, {"oom": True} or {"error": one line}."""
    spec = ModelSpec(**request["spec"])
    fn = globals()[_KINDS[request["kind"]]]
    try:
        return fn(spec, **request["options"]).to_dict()
    except torch.cuda.OutOfMemoryError:
        return {"oom": True}
    except RuntimeError as e:  # some libraries report an OOM as a plain RuntimeError (cuBLAS, NCCL)
        if "out of memory" in str(e).lower() or "ALLOC_FAILED" in str(e):
            return {"oom": True}
        return {"error": error_line(e)}
    except Exception as e:  # noqa: BLE001 - reported to the parent in one line
        return {"error": error_line(e)}


def _child() -> int:
    """`python -m vramlab.measure.memory`: one measurement described on stdin, its JSON on stdout."""
    answer = _answer(json.loads(sys.stdin.read()))
    print(json.dumps(answer))
    return 1 if "error" in answer else 0


# On the CPU (trace or cpu mode) a fresh interpreter per measurement would spend most of its time importing
# torch and transformers again: the measurement runs instead in a process forked from a fork server that
# imported them once (its first use in this process). The process is still new for each measurement and
# holds nothing of an earlier one (the server never builds a model); on a GPU a new interpreter is kept.
_PRELOAD = ["vramlab.measure.memory", "transformers", "transformers.modeling_utils"]
FORK_ON_CPU = True  # False: a new interpreter on the CPU too, as on a GPU


def _in_fork(fn: Callable[[Any], dict], arg: Any, out: str) -> None:
    fd = os.open(out + ".log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # its prints, as a child's stderr
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    Path(out).write_text(json.dumps(fn(arg)))


def in_fork(fn: Callable[[Any], dict], arg: Any, *, timeout: float | None = None, preload: Sequence[str] = (),
            what: str = "measurement") -> tuple[dict, str]:
    """`fn(arg)` (a module-level function that returns a JSON-able dict) in a new process forked from
    this process's fork server: (its answer or {}, what it printed). The server imports `_PRELOAD` and
    `preload` once, when this process first uses it (a later `preload` is not imported there: the
    forked process imports what it lacks itself). Raises subprocess.TimeoutExpired after `timeout` s."""
    import multiprocessing
    import tempfile

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(dict.fromkeys([*_PRELOAD, *preload])))
    with tempfile.TemporaryDirectory(prefix="vramlab-measure-") as tmp:
        out = os.path.join(tmp, "answer.json")
        p = ctx.Process(target=_in_fork, args=(fn, arg, out), daemon=True)
        p.start()
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join()
            raise subprocess.TimeoutExpired(what, timeout or 0)
        answer = json.loads(Path(out).read_text()) if os.path.exists(out) else {}
        log = Path(out + ".log").read_text(errors="replace") if os.path.exists(out + ".log") else ""
        if not answer and p.exitcode:
            log += f"\nthe {what}'s process ended with exit code {p.exitcode}"
    return answer, log


if __name__ == "__main__":
    sys.exit(_child())
