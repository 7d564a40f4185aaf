"""Training and inference memory, by category. Pure Python: no torch import.

`estimate_training` returns the peak of one steady-state training step (optimizer states already
exist; forward, backward, optimizer.step(), zero_grad(set_to_none=True)), taken as the maximum over
the step's phases, with the breakdown at that peak. `estimate_inference` returns a prefill's peak
(weights, KV cache, activations, logits). Both return a frozen `MemoryBreakdown` of integer bytes.
"""

from __future__ import annotations

import operator
import dataclasses
from dataclasses import dataclass
from typing import Iterable, Literal

from . import checks as _checks
from . import moe as _moe
from . import optimizers as _optim
from .activations import (ATTENTIONS, WHOLE_MODEL, AttentionImpl, DeviceShare, Recompute, cuda_amp,
                          activation_bytes, recompute_plan)
from .checks import MAX_BYTES, MAX_PARAMS
from .precision import FP32_STATES, PRECISIONS, PURE_16BIT, Precision, dtype_sizes, loss_bytes
from .specs import GPUSpec, ModelSpec, gpu as _gpu
from .step import (LOSSES, MAX_ACCUMULATION, OPTIMIZER_IMPLS, OPTIONS as STEP_OPTIONS, Loss, Optimizer,
                   OptimizerImpl, Step, as_step, gpu_or_none)
from .specs import resolve as _resolve
from .units import fmt_bytes

TORCHTUNE_CHUNKS = 8  # torchtune's default num_output_chunks (CEWithChunkedOutputLoss)
CATEGORIES: tuple[str, ...] = ("parameters", "gradients", "optimizer_states", "activations", "temporaries",
                               "kv_cache", "inputs", "other")


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Integer bytes by category. `a - b` subtracts category by category (predicted - measured)."""

    parameters: int = 0
    gradients: int = 0
    optimizer_states: int = 0
    activations: int = 0
    temporaries: int = 0
    kv_cache: int = 0
    inputs: int = 0
    other: int = 0
    label: str = ""
    phase: str = ""  # the step phase where the peak occurs (estimates)
    precision: str = ""  # what was estimated or measured, so that a subtraction can say if it compares
    device: str = ""  # like with like ("cuda" kernels, or "cpu")
    warning: str = ""  # set by subtraction when the two sides differ in precision or device

    def __post_init__(self) -> None:
        # integer bytes (numpy's too, stored as ints); a difference (`a - b`) may be negative
        for c in CATEGORIES:
            v = getattr(self, c)
            if type(v) is not int:
                object.__setattr__(self, c, _checks.whole(c, v, lo=-MAX_BYTES, hi=MAX_BYTES))
            elif not -MAX_BYTES <= v <= MAX_BYTES:
                _checks.whole(c, v, lo=-MAX_BYTES, hi=MAX_BYTES)
        for k in ("label", "phase", "precision", "device", "warning"):
            _string(k, getattr(self, k))

    @property
    def total(self) -> int:
        return sum(getattr(self, c) for c in CATEGORIES)

    def to_dict(self) -> dict[str, int]:
        return {c: getattr(self, c) for c in CATEGORIES}

    def __sub__(self, other: "MemoryBreakdown") -> "MemoryBreakdown":
        """Category by category. When both sides say what they are and differ in precision or in
        device (an AMP estimate minus an fp32 trace, CUDA kernels minus CPU kernels), the result
        carries a `warning` that its table prints: the difference is not the estimate's error."""
        differ = [f"{k} {getattr(self, k)} vs {getattr(other, k)}" for k in ("precision", "device")
                  if getattr(self, k) and getattr(other, k) and getattr(self, k) != getattr(other, k)]
        return MemoryBreakdown(**{c: getattr(self, c) - getattr(other, c) for c in CATEGORIES},
                               label=f"{self.label} - {other.label}",
                               warning=f"not like with like: {'; '.join(differ)}" if differ else "")

    def table(self, *, title: str | None = None) -> str:
        """A readable table in binary units, largest category first, with shares of the total."""
        rows = [(c, getattr(self, c)) for c in CATEGORIES if getattr(self, c)]
        rows.sort(key=lambda r: -abs(r[1]))
        total = self.total
        head = title or self.label or "memory"
        lines = [head, "-" * max(len(head), 38)]
        for name, n in rows:
            share = f"{100 * n / total:5.1f}%" if total else ""
            lines.append(f"{name.replace('_', ' '):<18}{fmt_bytes(n):>12}  {share}")
        lines.append(f"{'total':<18}{fmt_bytes(total):>12}")
        if self.phase:
            lines.append(f"(peak during: {self.phase})")
        if self.warning:
            lines.append(f"WARNING: {self.warning}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def param_bytes(precision: Precision) -> int:
    """Bytes per parameter of the model as held in memory: PyTorch AMP keeps the model (the
    master weights) in fp32 and casts on the fly; pure bf16 holds bf16 weights."""
    check_choice(precision, PRECISIONS, "precision")
    return 2 if precision in PURE_16BIT else 4


def state_bytes(precision: Precision) -> int:
    """Bytes per element of the optimizer's states: fp32 where the recipe asks for it, otherwise the
    parameters' dtype (torch.optim's behaviour)."""
    check_choice(precision, PRECISIONS, "precision")
    return 4 if precision in FP32_STATES else param_bytes(precision)


def optimizer_state_bytes(optimizer: Optimizer, n_params: int, precision: Precision) -> int:
    """Persistent optimizer state. PyTorch keeps Adam's m and v (and momentum) in the parameter's
    dtype: 8 B/param for fp32 params (ZeRO's K=12 counts fp32 master weights too, which AMP keeps
    as the model itself), 4 B/param for pure-bf16 params. 8-bit Adam (Dettmers+21, arXiv:2110.02861) as
    bitsandbytes keeps it, the n values taken as one tensor (a flat shard): 1 byte each for m and v plus one
    fp32 absmax per 256-value block of each, and its two 256-entry maps (`vramlab.optimizers`; a whole
    model's tensors: `model_states`). The other optimizers depend on each tensor's shape: `model_states`."""
    check_choice(optimizer, _optim.SHARDED, "optimizer")
    n_params = _checks.whole("n_params", n_params, lo=0, hi=MAX_PARAMS)
    sb = state_bytes(precision)
    master = 4 * n_params if precision == "fp16-fp32-master" else 0  # fp32 master weights (ZeRO's K includes them)
    if optimizer in ("adamw", "adam"):
        return 2 * n_params * sb + master
    if optimizer == "sgd-momentum":
        return n_params * sb + master
    if optimizer == "sgd":
        return master
    if optimizer == "adamw-8bit":  # bitsandbytes, the n values as one tensor (a flat shard)
        return sum(_optim.tensor_states(optimizer, (n_params,), param_bytes=4).values()) \
            + _optim.shared_bytes(optimizer, [(n_params,)]) + master if n_params else master
    raise ValueError(f"unknown optimizer {optimizer!r}; choose from {', '.join(_optim.SHARDED)}")


def optimizer_step_temporaries(optimizer: Optimizer, impl: OptimizerImpl, spec: "ModelSpec | Iterable[int]",
                               n_params: int, precision: Precision) -> int:
    """Transient memory inside optimizer.step() (PyTorch 2.x implementations):
    - foreach (the CUDA default): each _foreach_ op over the whole parameter list returns a full new
      list, so AdamW briefly holds one extra copy of all parameters (the denominator sqrt(v)+eps);
    - for-loop: the same ops one tensor at a time: sqrt(v) and sqrt(v)/c make two copies of the
      tensor being updated, while the previous tensor's denominator is still referenced (Python frees
      it only when the name is rebound): max over neighbours of size[i-1] + 2 size[i];
    - fused: one kernel updates in place: ~0. SGD (no momentum) updates in place.
    The other libraries step tensor by tensor (`impl` does not apply), each holding a few full-size
    temporaries of the tensor it steps (read from their source; the CPU-measured ones checked in
    tests/test_optimizers.py): torch's Adafactor makes one full-size var_estimate a tensor (foreach: all at once,
    its documented "~ sizeof(params)"; the single-tensor path, its default on the CPU: the previous tensor's
    beside the current one's); transformers' Adafactor two fp32 copies (grad**2 + eps, the estimate), four for
    a 16-bit tensor (its fp32 gradient and weight too); torchao's compiled step the two moments dequantized to fp32;
    GaLore the update projected back (two copies), and on the steps that recompute its projection (the first,
    then every update_proj_gap) the SVD of the largest projected matrix (its fp32 copy, U and Vh), LAPACK's or
    cuSOLVER's workspace aside; bitsandbytes (paged too) updates in place; an offloaded optimizer steps on the host.
    `spec`: the model, or the element counts of the tensors stepped (one device's share)."""
    check_choice(optimizer, _optim.NAMES, "optimizer")
    check_choice(impl, OPTIMIZER_IMPLS, "optimizer implementation")
    n_params = _checks.whole("n_params", n_params, lo=0, hi=MAX_PARAMS)
    if not isinstance(spec, ModelSpec):
        spec = _checks.wholes("spec", spec, lo=0, hi=MAX_PARAMS)  # the tensors' element counts
    pb = param_bytes(precision)
    sizes = [n for _, n in spec.param_tensors()] if isinstance(spec, ModelSpec) else list(spec)
    largest = max(sizes, default=0)
    if impl == "fused" and optimizer == "adafactor":
        raise ValueError("torch.optim.Adafactor has no fused implementation: use optimizer_impl foreach or for-loop")
    if optimizer in ("adamw-8bit", "paged-adamw", "paged-adamw-8bit", "adamw-cpu-offload"):
        return 0  # bitsandbytes dequantizes block by block, in place; an offloaded step runs on the host
    if optimizer in ("adafactor-hf", "adafactor-momentum"):  # grad**2 + eps and the estimate; a 16-bit tensor's
        return (2 if pb == 4 else 4) * largest * 4          # fp32 gradient and weight copies too
    if optimizer in ("adamw-8bit-ao", "adamw-4bit-ao", "adamw-fp8-ao"):
        return 2 * largest * 4
    if optimizer == "galore-adamw":
        svd = 0
        if isinstance(spec, ModelSpec):
            for name, shape in spec.param_shapes():
                if _optim.galore_target(name, shape):
                    m, s = max(shape), min(shape)
                    svd = max(svd, (m * s * 4 if pb != 4 else 0) + (m * s + s * s) * 4)
        return max(2 * largest * pb, svd)
    if impl == "fused" or optimizer in ("sgd", "sgd-momentum"):  # SGD updates buffers and params in place
        return 0
    if impl == "foreach":  # the copy has the states' dtype
        return n_params * state_bytes(precision)
    if impl == "for-loop":  # torch's Adafactor: one full-size var_estimate a tensor, the previous one's still held
        return _for_loop_peak(spec, copies=1 if optimizer == "adafactor" else 2) * pb
    raise ValueError(f"unknown optimizer implementation {impl!r}; choose from {', '.join(OPTIMIZER_IMPLS)}")


def model_states(model: ModelSpec | str, *, precision: Precision = "fp32", optimizer: Optimizer = "adamw",
                 trainable_params: int | None = None, galore_rank: int = _optim.GALORE_RANK) -> MemoryBreakdown:
    """Parameters, gradients and optimizer states: what the ZeRO paper calls model states
    (Rajbhandari+19: 16 bytes/param for mixed-precision Adam, 2 + 2 + 12). A mixture of experts
    counts every expert. `optimizer` is any of the registry's (`optimizers.NAMES`): the states counted
    are those the device's caching allocator holds (`optimizers.Ledger.device`): a paged optimizer's
    paged buffers and an offloaded optimizer's host copies are not (`optimizer_ledger`); torch's 0-dim step
    counters, on the host unless the step is fused, are not either."""
    spec = _resolve(model, moe=True)
    check_choice(precision, PRECISIONS, "precision")
    check_choice(optimizer, _optim.NAMES, "optimizer")
    n_all = spec.params
    n_train = n_all if trainable_params is None else _checks.whole("trainable_params", trainable_params, lo=0, hi=n_all)
    pb = param_bytes(precision)
    if trainable_params is not None and optimizer in _optim.SHAPED:
        raise ValueError(f"optimizer {optimizer!r} with trainable_params: its states depend on the adapters' "
                         f"shapes, which are not modelled; use one of {', '.join(_optim.SHARDED)}")
    if optimizer in _optim.SHARDED and (optimizer != "adamw-8bit" or trainable_params is not None):
        states = optimizer_state_bytes(optimizer, n_train, precision)
    elif trainable_params is not None:  # the adapters, as one flat tensor
        states = optimizer_ledger(spec, optimizer, precision, tensors=[(n_train,)] if n_train else []).device
    else:  # tensor by tensor
        states = optimizer_ledger(spec, optimizer, precision, galore_rank=galore_rank).device
    return MemoryBreakdown(parameters=n_all * pb, gradients=n_train * pb, optimizer_states=states,
                           label=f"{spec.name} model states ({precision}, {optimizer})")


def optimizer_ledger(model: ModelSpec | str, optimizer: str, precision: Precision = "fp32", *,
                     galore_rank: int = _optim.GALORE_RANK, tensors=None) -> "_optim.Ledger":
    """Where `optimizer`'s bytes live for `model` under `precision` (`vramlab.optimizers.Ledger`: the device's
    allocator, paged unified memory, the host). torch.optim's states follow the recipe (`state_bytes`); the
    other libraries keep theirs as they do whatever the recipe; fp16-fp32-master's fp32 master weights count
    with the states, as everywhere."""
    spec = _resolve(model, moe=True)
    check_choice(precision, PRECISIONS, "precision")
    check_choice(optimizer, _optim.NAMES, "optimizer")
    if precision in FP32_STATES and optimizer not in _optim.SHARDED:
        raise ValueError(f"precision {precision!r} keeps fp32 states or master weights for a 16-bit model, which "
                         f"{optimizer!r} does not: use bf16 (its states follow the model) or one of {', '.join(_optim.SHARDED)}")
    pb = param_bytes(precision)
    lg = _optim.ledger(optimizer, spec if tensors is None else tensors, param_bytes=pb,
                       state_bytes=state_bytes(precision) if optimizer in _optim.TORCH else None, rank=galore_rank)
    if precision == "fp16-fp32-master":
        n = spec.params if tensors is None else sum(n for _, n in _optim.named_sizes(tensors))
        lg = dataclasses.replace(lg, device=lg.device + 4 * n)
    return lg


def _for_loop_peak(spec: "ModelSpec | Iterable[int]", copies: int = 2) -> int:
    """The for-loop AdamW's largest moment in elements: a tensor's two copies beside its predecessor's
    (`copies` = 1: torch's single-tensor Adafactor, one copy a tensor)."""
    sizes = [0] + ([n for _, n in spec.param_tensors()] if isinstance(spec, ModelSpec) else list(spec))
    return max(a + copies * b for a, b in zip(sizes, sizes[1:]))


# ============================================================================ training
def cublas_workspace_bytes(gpu: GPUSpec | str | None = None) -> int:
    """One cuBLAS handle's workspace on `gpu` (default: Hopper's 32 MiB, what the H100 measured)."""
    if gpu is None:
        return 4096 * 8 * 1024
    return _gpu(gpu).cublas_workspace_bytes


def _string(name: str, value) -> str:
    """A string, possibly empty (a label); `checks.text` where it must say something."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {_checks.show(value)}")
    return value


# estimate_inference's keywords but the model (tests/test_memory.py holds them equal to its signature)
INFERENCE_OPTIONS: tuple[str, ...] = ("batch_size", "seq_len", "dtype", "kv_dtype", "attention", "all_logits",
                                      "new_tokens", "device", "gpu")


def estimate_options() -> frozenset[str]:
    """The keywords of estimate_training (a Step's options) and estimate_inference (but the model): what
    `fit` passes on."""
    return frozenset(STEP_OPTIONS) | frozenset(INFERENCE_OPTIONS)


def check_choice(value: str, choices: tuple[str, ...], what: str) -> None:
    _checks.one_of(what, value, choices)


MAX_BATCH = _checks.MAX_COUNT  # sequences in one step; far beyond any GPU, small enough to stay exact and fast


def check_positive(**sizes: int) -> list[int]:
    """Whole positive numbers (numpy integers too), and not absurdly large: a batch of 10^35 is a
    typo, not a question. Returns them as plain ints, in the order given."""
    return [_checks.whole(name, v) for name, v in sizes.items()]


def _check_positions(spec: ModelSpec, seq_len: int, name: str = "seq_len") -> None:
    _checks.positions(spec, seq_len, name=name)


def loss_chunk_size(model: ModelSpec | str, *, tokens: int, loss: Loss = "whole",
                    loss_chunk_tokens: int | None = None) -> int:
    """Tokens per chunk of the loss over `tokens` = batch x sequence positions: all of them for the
    whole loss; `loss_chunk_tokens` (at most `tokens`) for the chunked and fused ones, or by default
    torchtune's (the tokens in 8 chunks) and Liger-Kernel's (logits no larger than the head's input:
    the next power of two above tokens / ceil(V / h), `fused_linear_cross_entropy_forward`)."""
    spec = _resolve(model, moe=True)
    tokens = _checks.whole("tokens", tokens)
    check_choice(loss, LOSSES, "loss")
    if loss_chunk_tokens is not None:
        loss_chunk_tokens = _checks.whole("loss_chunk_tokens", loss_chunk_tokens)
        if loss == "whole":
            raise ValueError("loss_chunk_tokens applies to loss='chunked' or 'fused', not to the whole loss")
        return min(loss_chunk_tokens, tokens)
    if loss == "whole":
        return tokens
    if loss == "chunked":
        return -(-tokens // TORCHTUNE_CHUNKS)
    grow = -(-spec.vocab_size // (spec.word_embed_proj_dim or spec.hidden_size))
    return min(1 << (-(-tokens // grow) - 1).bit_length(), tokens)


def estimate_training(model: "Step | ModelSpec | str", **options) -> MemoryBreakdown:
    """Peak memory of one steady-state training step: the largest of `training_phases(...)`, whose
    docstring describes the options (a `Step`'s fields; `model` may be a Step)."""
    return max(training_phases(as_step(model, options, "estimate_training")), key=lambda m: m.total)


def training_phases(step: "Step | ModelSpec | str", *, share: DeviceShare = WHOLE_MODEL,
                    **options) -> list[MemoryBreakdown]:
    """Memory, in bytes, at each candidate peak of one steady-state training step, in step order
    (`.phase` names each); `estimate_training` returns the largest.

    batch_size  # sequences per step (micro-batch)
    seq_len     # tokens per sequence (T5: encoder and decoder each)
    precision   fp32 | bf16-mixed | fp16-mixed (PyTorch AMP: fp32 model + autocast) | bf16 (pure)
    optimizer   adamw | adam | sgd | sgd-momentum | adamw-8bit, and on one device the rest of `optimizers.NAMES`
                (Adafactor, torchao's 8-/4-bit/FP8 AdamW, GaLore with `galore_rank`, bitsandbytes' paged AdamW,
                torchao's CPU-offloaded AdamW: `vramlab.optimizers`); optimizer_impl for-loop | foreach | fused
    optimizer_in_backward  each parameter stepped as soon as its gradient is made, then the gradient freed
                (PyTorch's `register_post_accumulate_grad_hook` recipe, torchtune's optimizer_in_bwd): no phase
                holds more than one tensor's gradient (a tied embedding's waits for both uses), and there is no
                optimizer.step() after the backward. It rules out gradient accumulation and a global gradient-norm
                clip. With adamw-cpu-offload it is torchao's offload_gradients=True: each gradient leaves the
                device as it is made (by default they stay until zero_grad, and the host steps after the backward).
    attention   eager (stores the s x s scores) | sdpa (flash / memory-efficient kernels)
    recompute   a plan (`recompute_plan`): none | full (activation checkpointing of every block) |
                selective | sac-matmuls | sqrt | offload | every-K | first-N | segments-K | block set
    device      cuda | cpu: which kernels run (dropout masks are 1-byte bool on CUDA, full-width on
                CPU; CPU SDPA with dropout materialises the scores)
    trainable_params  fewer than all for frozen-base fine-tuning (PEFT): gradients and optimizer
                states cover only these (activations are still those of the full model)
    gpu         on CUDA, sets the cuBLAS workspaces' size (default: Hopper's 32 MiB per handle)
    share       one device's part of a parallel layout (`DeviceShare`; `parallel.estimate_layout`
                builds them): the default, the whole model on one device, is `estimate_training`
    accumulation_steps  micro-batches per optimizer step (gradient accumulation; batch_size is the
                micro-batch): with k > 1 the gradients made by the first micro-batch's backward stay
                until the step, so micro-batches 2..k ("micro-batch 2-k: ..." phases) run their
                forward and backward over all of them (`_later_micro_batches`); the peak is the same
                for every k > 1. Checked against traces of the real loop (tests/test_accumulation.py)
    loss        whole | chunked | fused (causal LMs on one device): the model's own cross-entropy
                (b s V fp32 log-softmax saved, and under AMP an fp32 copy of the logits; the backward
                holds two more b s V fp32 tensors); torchtune's chunked loss (`CEWithChunkedOutputLoss`:
                the head per chunk, each chunk upcast to fp32 alone); Liger-Kernel's fused linear
                cross-entropy (`LigerFusedLinearCrossEntropyFunction`: loss and gradients computed in
                the forward chunk by chunk, no b s V tensor). `loss_chunk_tokens` tokens per chunk, by
                default torchtune's 8 chunks and Liger's rule (`loss_chunk_size`); the phases are in
                `_loss_phases`. Checked against traces of the real step (tests/test_loss_memory.py)
    use_cache   the model trains with transformers' KV cache on: a config that says use_cache=True
                (the default of most) without gradient checkpointing. The cache's torch.cat copies
                every block's k and v, which attention then saves: a fused-QKV block keeps 2h per
                token less (GPT-NeoX: the fused output, kept alive by v's view, is freed) or more
                (GPT-2: q's view keeps it); separate projections are unchanged (measured in trace
                mode and on an H100: tests/test_validation.py). The default, off, is what training
                scripts that set use_cache=False and every vramlab measurement run.
    capacity_factor  a mixture of experts (Mixtral, Qwen2-/Qwen3-MoE, OLMoE) only: None is dropless
                routing as transformers runs it (every token copied top-k times, `moe.training_layer_saved`);
                a number is GShard/Switch drop-and-pad routing (DeepSpeed's sharded_moe.py, Megatron-Core's
                drop-and-pad mode): each expert a buffer of `moe.expert_capacity` rows. All experts' weights,
                gradients and optimizer states count (spec.params). One device only; recompute plans
                other than the matmul-saving ones. Checked against traces (tests/test_moe_training.py).

    The step's phases are forward end, backward start (the logits' gradient), the LM head's
    backward, a recomputed block's backward, and optimizer.step(); the peak is their maximum.
    Model states follow ZeRO (Rajbhandari+19, arXiv:1910.02054) as PyTorch implements them;
    activations follow the op-by-op ledger in `layer_saved` (cf. Korthikanti+22, Table 2).

    On CUDA (device="cuda") the estimate is of `torch.cuda.max_memory_allocated()`: it includes the
    two cuBLAS workspaces (in `other`) and CUDA autocast's op lists; checked against an H100 in
    tests/test_gpu_truth.py (every stored case within 3 %).

    Known limitations: allocator rounding and fragmentation (max_memory_reserved), the CUDA context
    and NCCL buffers are not included (see `fit`). Where the peak falls inside one block's
    backward (tiny models with small vocabularies, especially under full recompute) the transient
    gradients are modelled, not traced: errors up to ~10-20 % there, against < 1 % for real models
    (benchmarks/estimator_accuracy.py). CUDA kernels are modelled from PyTorch's source and checked
    against one GPU (an H100); other GPUs pick other kernels in places. PEFT (`trainable_params`)
    assumes adapters on the attention projections and leaves the adapters' own bytes out.
    """
    step = as_step(step, options)  # every option checked once, there
    spec, batch_size, seq_len, precision = step.model, step.batch_size, step.seq_len, step.precision
    optimizer, optimizer_impl, attention, device = step.optimizer, step.optimizer_impl, step.attention, step.device
    trainable_params, gpu, use_cache, plan = step.trainable_params, step.gpu, step.use_cache, step.plan
    k_acc, in_bwd, loss, capacity_factor = step.accumulation_steps, step.optimizer_in_backward, step.loss, step.capacity_factor
    if not isinstance(share, DeviceShare):
        raise ValueError(f"share must be a vramlab.memory.DeviceShare, got {_checks.show(share)}")
    if optimizer not in _optim.SHARDED and not share.whole:
        raise ValueError(f"optimizer {optimizer!r} is modelled on one device; a parallel layout takes one of "
                         f"{', '.join(_optim.SHARDED)}")
    if in_bwd and not share.whole:
        raise ValueError("optimizer_in_backward is modelled on one device, not a parallel layout's share")
    chunk = loss_chunk_size(spec, tokens=batch_size * seq_len, loss=loss, loss_chunk_tokens=step.loss_chunk_tokens)
    if loss != "whole" and not (share.blocks is None and share.first and share.last and share.tp == 1
                                and share.in_flight == 1 and not share.loss_parallel):
        raise ValueError(f"loss={loss!r} is modelled with the whole model on one device (one GPU, or a context-"
                         "parallel rank), not a pipeline stage or a tensor-parallel shard; use loss='whole'")
    if not share.whole and trainable_params is not None:
        raise ValueError("trainable_params (frozen-base fine-tuning) is modelled on one device only")
    # cuBLAS workspaces, held by the caching allocator for the process's life: one per handle, and
    # the forward (Python thread) and backward (autograd's device thread) use different handles
    workspaces = 2 * cublas_workspace_bytes(gpu) if device == "cuda" else 0
    pb = param_bytes(precision)
    if share.whole:
        states = model_states(spec, precision=precision, optimizer=optimizer, trainable_params=trainable_params,
                              galore_rank=step.rank)
        P, G, O = states.parameters, states.gradients, states.optimizer_states
        n_all = spec.params
        n_train = n_all if trainable_params is None else operator.index(trainable_params)  # checked by model_states
        tensors: "ModelSpec | tuple[int, ...]" = spec
    else:
        tensors = share.param_tensors or tuple(n for _, n in spec.param_tensors())
        n_all = n_train = sum(tensors)
        shard = -(-n_all // share.optimizer_shards)
        P, G, O = n_all * pb, n_all * pb, optimizer_state_bytes(optimizer, shard, precision)
        if share.optimizer_shards > 1:  # the optimizer steps its flat shard
            tensors = (shard,)
    T_opt = optimizer_step_temporaries(optimizer, optimizer_impl, tensors, -(-n_train // share.optimizer_shards), precision)
    if in_bwd:  # one tensor stepped at a time: its gradient and its step's temporaries
        G = 0

        def step_of(n: int) -> int:
            return optimizer_step_temporaries(optimizer, optimizer_impl, [n], n, precision)

    b, s, V = batch_size, seq_len, spec.vocab_size
    t, first, last = share.tp, share.first, share.last
    ids = b * s * 8 * (2 if spec.family == "t5" else 1)  # int64 ids (+ T5's separate labels)
    inputs = (ids if first else 0) + (b * s * 8 if last and not first else 0)  # a last stage gets the labels
    act = activation_bytes(spec, batch_size=b, seq_len=s, precision=precision, attention=attention,
                           recompute=plan, device=device, frozen_base=n_train < n_all, share=share,
                           use_cache=bool(use_cache), capacity_factor=capacity_factor)
    A = act["layers"] + act["outside"] + act["weight_copies"]
    nb = dtype_sizes(precision, device)
    # a non-last pipeline stage keeps the output it sent until that micro-batch's backward
    vocab = -(-V // t)  # a vocabulary-parallel head and loss: V/t columns per rank
    # the b x s x h tensor that crosses a stage boundary (a rank's 1/t of it under sequence parallelism)
    transfer = -(-b * s * spec.hidden_size * nb["x"] // (t if share.sp else 1))
    boundary = 0
    if share.stage_output:  # the output a stage keeps until the micro-batch's backward: b x s x h, or the logits
        boundary = b * s * vocab * nb["half"] if last else transfer
    # the other micro-batches in flight on this device: their saved tensors and stage outputs (autocast's
    # weight casts are cached once for all of them, inside one autocast region around the schedule)
    if last and not share.others_at_end:  # the interleaved schedule's last device: the others are in earlier chunks
        one_other = A - act["weight_copies"] - act["outside_last"] + transfer
    else:
        one_other = A - act["weight_copies"] + boundary
    # a received stage input is its receive buffer (in `buffers`); sends not yet waited on hold theirs
    others = (share.in_flight - 1) * one_other + (share.pending_sends - share.received) * transfer
    amp = cuda_amp(precision, device)
    lsm = loss_bytes(spec, precision)
    logits32 = b * s * vocab * lsm if last else 0  # the loss's log-softmax (and its gradient): fp32 ...
    logits16 = b * s * vocab * 2 if precision != "fp32" and last else 0  # the half logits under AMP
    # transformers' causal-LM loss upcasts (logits.float()), so log_softmax's input and gradient are
    # fp32. BERT and T5 hand the half logits to CrossEntropyLoss: CUDA autocast runs log_softmax
    # with dtype=fp32 (no fp32 copy of the input), and its backward returns d(logits) in half; a pure
    # 16-bit BERT or T5 runs the whole loss in 16 bits (... or 16-bit there: `loss_bytes`).
    upcast = spec.is_causal_lm or (not amp and lsm == 4)
    logits_alive = logits16 + (logits32 if upcast else 0)
    d_logits = logits32 if upcast else logits16
    e = spec.word_embed_proj_dim or spec.hidden_size
    trained = n_train == n_all
    head_grad = vocab * e * pb if trained and last else 0  # the head's (or tied embedding's) gradient, made first
    # gradients: kept between steps (all of them, in every phase), or made during the backward;
    # DDP's flat buckets (gradient_copies = 2) exist all the time
    buckets = G * (share.gradient_copies - 1)
    kept_grads = G if share.keep_gradients else 0

    tied = bool(spec.tie_word_embeddings and first and last)
    if in_bwd:  # the largest tensor of a block: the most a block's backward holds at once
        block_tensors = [n for name, n in spec.param_tensors() if in_block(name)] or [0]
        one = max(block_tensors) * pb if trained else 0

    def grads(made: int) -> int:
        return buckets + (kept_grads or made)

    base = dict(parameters=P, optimizer_states=O, inputs=inputs, other=workspaces + share.buffers, precision=precision, device=device,
                label=f"{spec.name} train b={b} s={s} {precision}")
    if loss != "whole":
        phases = _loss_phases(step, base, A=A, chunk=chunk, e=e, nb=nb, trained=trained, amp=amp, grads=grads)
    else:
        phases = [MemoryBreakdown(**base, activations=others + A + (0 if last else boundary) + logits_alive,
                                  gradients=grads(0),
                                  phase="forward end (loss computed)" if last else "forward end (micro-batches in flight)")]
    if last and loss == "whole":
        phases += [
            # nll_loss backward makes d(log_softmax) (fp32) and log_softmax backward makes d(logits)
            MemoryBreakdown(**base, activations=others + A + boundary,
                            temporaries=logits32 + d_logits + (b * s * vocab * 4 if share.loss_parallel else 0),
                            gradients=grads(0), phase="backward start (logits gradient)"),
            MemoryBreakdown(**base, activations=others + A + boundary - b * s * vocab * lsm, temporaries=d_logits,
                            gradients=grads(head_grad), phase="LM head backward"),
        ]
        if in_bwd and head_grad and not tied:  # the head's gradient is stepped (then freed) once its mm is done
            phases.append(MemoryBreakdown(**base, activations=others + A + boundary - b * s * vocab * lsm,
                                          gradients=head_grad, temporaries=step_of(head_grad // pb),
                                          phase="LM head's step in the backward"))
    half = nb["half"]
    # freed by now on the last stage: the loss's log-softmax, the head's input and the shifted labels
    loss_side = b * s * (vocab * lsm + -(-e * half // (t if share.sp else 1)) + (8 if spec.is_causal_lm else 0)) if last else 0
    n_blocks = spec.num_layers + spec.num_decoder_layers
    # a block's gradients; with a frozen base (PEFT) the trainable parameters are the blocks' adapters
    block_grads = (spec.param_groups()["layers"] if trained else n_train) * pb // n_blocks // t
    # each block's backward that may peak: a recomputed segment (all it saves, at once, while its
    # gradients flow: the blocks after it have made theirs) or the device's last block (its gradients
    # in flight; small vocabularies peak here)
    segment_ends = {e - 1 for _, e in plan.segments}
    last_block = (share.blocks or (0, n_blocks))[1] - 1
    # the final norm's saved tensors were freed with the head's (its backward ran before any block's)
    head_side = loss_side + act["final_norm"]
    # a block's own gradients at its backward's peak: those made by then (`activation_bytes`), not all
    made = act["block_grads_made"]
    own = block_grads if made is None or not trained else min(block_grads, -(-made * pb // t))
    block_phases = []
    if in_bwd:  # made so far: only the tied head's (waiting for the embedding's) and the tensor just made
        pending = head_grad if tied else 0
        own = min(own, one)

        def grads(made: int) -> int:  # noqa: F811
            return pending + (own if made else 0)
    block_step = step_of(one // pb) if in_bwd and one else 0  # a block's largest tensor stepped as its gradient lands
    for i, alive in act["backward"]:
        if i in segment_ends:
            block_phases.append(MemoryBreakdown(
                **base, activations=others + boundary + alive + act["outside"] - head_side,
                temporaries=max(act["block_backward"] + act["block_grad_in"], block_step),
                gradients=grads(head_grad + (last_block - i) * block_grads + own),
                phase=f"backward of a recomputed block (block {i})"))
        elif i == last_block:
            block_phases.append(MemoryBreakdown(
                **base, activations=others + boundary + alive + act["outside"] + act["weight_copies"] - head_side,
                gradients=grads(head_grad + (own if made is not None and trained else 0)),
                temporaries=max(act["block_backward"] + act["block_grad_in"], block_step),
                phase="backward of the last block"))
    if block_phases:
        phases.append(max(block_phases, key=lambda m: m.total))
    if first:
        # the embedding's backward makes a dense V x e gradient; tied to the LM head, autograd adds it
        # to the head's gradient. In fp32 the head's gradient is a transposed view (mm's backward),
        # which autograd cannot add to in place: old, new and sum coexist for a moment (measured on
        # CPU and CUDA). Under CUDA autocast it is a fresh fp32 tensor (the cast's backward) and the
        # sum is in place: old and new only (measured on an H100; fake tensors never add in place).
        # DTensor's vocabulary-parallel embedding builds the full V x e gradient before sharding it.
        emb = vocab * e * pb if trained else 0
        dense = V * e * pb if trained and share.embedding_grad == "dense" and t > 1 else 0
        accumulate = (2 if amp else 3) if spec.tie_word_embeddings and last else 1
        if in_bwd:  # the embedding's gradient (summed with the tied head's), then its step; all else stepped
            phases.append(MemoryBreakdown(**base, activations=others, gradients=0, temporaries=emb * accumulate,
                                          phase="embedding backward (gradient accumulation)"))
            phases.append(MemoryBreakdown(**base, activations=others, gradients=emb,
                                          temporaries=step_of(emb // pb) if emb else 0,
                                          phase="embedding's step in the backward"))
        elif share.keep_gradients:  # the new gradient beside the kept one, then added in place
            phases.append(MemoryBreakdown(**base, activations=others, gradients=grads(0), temporaries=dense or emb,
                                          phase="embedding backward (gradient accumulation)"))
        else:
            phases.append(MemoryBreakdown(**base, activations=others, gradients=grads(G - emb),
                                          temporaries=emb * accumulate + dense,
                                          phase="embedding backward (gradient accumulation)"))
    if k_acc > 1:
        phases += _later_micro_batches(phases, k_acc, held=buckets + G, head_grad=head_grad,
                                       tied=tied)
    if not in_bwd:
        phases.append(MemoryBreakdown(**base, gradients=buckets + G, temporaries=T_opt, phase="optimizer.step()"))
    return phases


def in_block(name: str) -> bool:
    """A parameter of a transformer block (GPT-2's h.N, Llama's layers.N, BERT's layer.N, T5's block.N)."""
    parts = name.split(".")
    return any(p in ("h", "layers", "layer", "block") and nxt.isdigit() for p, nxt in zip(parts, parts[1:]))


def _loss_phases(step: Step, base: dict, *, A: int, chunk: int, e: int, nb: dict[str, int], trained: bool,
                 amp: bool, grads) -> list[MemoryBreakdown]:
    """The loss's phases of a causal LM on one device, chunked or fused (`training_phases`' `loss`),
    in place of the whole loss's forward end, backward start and LM head backward. `A` is the whole
    step's saved activations, which count the loss's log-softmax (N x V fp32), the head's input
    (N x e, in the compute dtype) and the shifted labels (N int64). N tokens in chunks of c; the
    logits' dtype is the compute dtype (`half`), the final hidden states' the residual's (`x`).

    chunked (torchtune's `CEWithChunkedOutputLoss`: the head on every chunk first, then each
    chunk's logits upcast to fp32 and reduced): every chunk's log-softmax is saved, N x V fp32 as
    for the whole loss, but the fp32 copy exists one chunk at a time. Forward end: the logits' chunks
    (N x V, compute dtype) and one chunk's fp32 copy (none in fp32). The backward runs every chunk's
    loss backward first (later autograd nodes first): one chunk's d(log-softmax) and d(logits) in
    fp32 beside the saved log-softmax; then the head's backward over the chunks' logits gradients (now
    in the compute dtype), the head's gradient summed chunk by chunk: autograd cannot add into the
    transposed view mm's backward returns, so the sum so far, the next chunk's and their sum coexist.
    fused (Liger-Kernel's `LigerFusedLinearCrossEntropyFunction`): the forward computes the loss and
    both gradients chunk by chunk and saves them (the input's, N x e, in the hidden states' dtype;
    the weight's, V x e, in the weight's); nothing N x V is saved or made. Its peak is inside the
    forward: the final hidden states, the two gradients and one chunk's logits (overwritten by their
    gradient) with the chunk's c x e input gradient; under autocast on the CPU, which has no
    fp32-output addmm (`out_dtype`, CUDA), the chunk's gradient is copied to fp32 for the weight's.
    The blocks' backward phases that follow are the whole loss's (`training_phases`)."""
    N, c, V = step.batch_size * step.seq_len, chunk, step.model.vocab_size
    loss, device, pb = step.loss, step.device, param_bytes(step.precision)
    half, x = nb["half"], nb["x"]
    head = V * e * half if trained else 0  # one chunk's head gradient, in the compute dtype
    if loss == "chunked":
        upcast = c * V * 4 if half != 4 else 0  # one chunk's logits.float()
        several = c < N
        return [
            MemoryBreakdown(**base, activations=A + N * V * half + upcast, gradients=grads(0),
                            phase="forward end (chunked loss: every chunk's logits, one chunk upcast)"),
            MemoryBreakdown(**base, activations=A, temporaries=2 * c * V * 4, gradients=grads(0),
                            phase="backward start (one chunk's logits gradient)"),
            MemoryBreakdown(**base, activations=A - N * V * 4, temporaries=max(
                N * V * half + head + c * e * half,  # the first chunk's head backward
                # the second's: its head gradient added to the first's, out of place (a transposed view)
                max(N - 2 * c, 0) * V * half + 3 * head + 2 * c * e * half if several else 0),
                gradients=grads(0), phase="LM head backward (chunked loss)"),
        ]
    grad_weight = V * e * pb if trained else 0
    within = c * V * 4 if amp and device == "cpu" else c * e * half
    return [MemoryBreakdown(**base, activations=A - N * V * 4 - N * e * half + N * e * x,
                            temporaries=N * e * x + grad_weight + c * V * half + within, gradients=grads(0),
                            phase="loss forward (fused: gradients and one chunk's logits)")]


def _later_micro_batches(first: list[MemoryBreakdown], k: int, *, held: int, head_grad: int,
                         tied: bool) -> list[MemoryBreakdown]:
    """Gradient accumulation: the phases of micro-batches 2..k, from the first's (which starts with no
    gradients: zero_grad(set_to_none=True) ran after the last step). Every gradient the first backward
    made stays (`held`) under the next forward and backward. Autograd's AccumulateGrad adds each new
    gradient into `.grad` in place (`variable.grad += new_grad`: torch/csrc/autograd/functions/
    accumulate_grad.h), so a new gradient is a temporary until it is added, where the first micro-batch
    kept it as the gradient itself:
    - the LM head's weight gradient, made while d(logits) exists; tied to the embedding it waits in
      autograd's input buffer for the embedding's backward, under every block's backward;
    - the embedding's gradient: beside the head's when tied (their sum made as in the first
      micro-batch: old, new and sum in fp32, two under CUDA autocast), else alone.
    A block's weight gradients are added one by one (each freed once added): within the modelled
    block-backward transients."""
    name = f"micro-batch 2-{k}: " if k > 2 else "micro-batch 2: "
    later = []
    for ph in first:
        temps, grads = ph.temporaries, held
        if ph.phase.startswith("LM head backward"):
            temps += head_grad  # the new head gradient, before it is added
        elif "block" in ph.phase and tied:
            temps += head_grad  # the head's new gradient in the input buffer, waiting for the embedding's
        # the embedding's backward: its new gradient (and, tied, the head's and their sum) as in the
        # first micro-batch's temporaries; now added into the held gradient instead of becoming it
        later.append(dataclasses.replace(ph, gradients=grads, temporaries=temps, phase=name + ph.phase))
    return later


# ============================================================================ inference
INFER_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}


def kv_cache_bytes(spec: ModelSpec, *, batch_size: int, seq_len: int, dtype: str = "bf16") -> int:
    """K and V for every layer and token: 2 * L * n_kv_heads * head_dim * s * b * bytes.
    Grouped-query attention stores n_kv_heads, not n_heads (a calculator that uses the hidden size
    overestimates Llama-3-8B's cache 4x). T5: the decoder's self-attention cache plus its
    cross-attention cache of the encoder's seq_len tokens. Source: Pope+22 (arXiv:2211.05102);
    vLLM (Kwon+23, arXiv:2309.06180): OPT-13B ~ 800 KB per token in fp16."""
    spec = _resolve(spec)
    batch_size, seq_len = check_positive(batch_size=batch_size, seq_len=seq_len)
    check_choice(dtype, tuple(INFER_BYTES), "dtype")
    layers = spec.num_decoder_layers if spec.family == "t5" else spec.num_layers
    if spec.family == "bert":
        return 0
    per_token = 2 * layers * spec.num_kv_heads * spec.head_dim * INFER_BYTES[dtype]
    return per_token * seq_len * batch_size * (2 if spec.family == "t5" else 1)


def _block_transient(spec: ModelSpec, *, tokens: int, batch_size: int, seq_len: int, e: int,
                     attention: AttentionImpl) -> int:
    """The most one block holds at once without gradients, beyond its KV: the residual and its
    normalised copy, and the MLP's two widest intermediates (act(gate) and up, or the activation's
    input and output: measured 2h + 2i per token on an H100 for Llama-3.2-1B's prefill); eager
    attention adds the scores and probabilities."""
    h, i = spec.hidden_size, spec.intermediate_size
    stream = 2 * tokens * h * e
    attn = tokens * (spec.q_dim + 2 * spec.kv_dim + spec.q_dim) * e  # q, k, v (rotary copies) and the output
    if attention == "eager":
        attn += 2 * batch_size * spec.num_heads * seq_len * seq_len * e
    return stream + max(attn, 2 * tokens * i * e)


def estimate_inference(model: ModelSpec | str, *, batch_size: int, seq_len: int, dtype: str = "bf16",
                       kv_dtype: str | None = None, attention: AttentionImpl = "sdpa", all_logits: bool = True,
                       new_tokens: int | None = None, device: Literal["cuda", "cpu"] = "cuda",
                       gpu: GPUSpec | str | None = None) -> MemoryBreakdown:
    """Peak memory of inference without gradients, in a model held in `dtype`.

    new_tokens=None: a prefill, one forward pass over batch_size x seq_len tokens with the KV cache
      on, as `model(ids, use_cache=True)`: the logits of every position when `all_logits` (what a
      forward returns; b*s*V values, often the largest tensor), else of the last only.
    new_tokens=N: `model.generate(ids, max_new_tokens=N)` with a prompt of seq_len tokens: its prefill keeps
      one logits row, then the cache grows token by token to seq_len + new_tokens; the peak is the
      larger of the prefill's (prompt cache + one block's intermediates) and the last step's (full
      cache + the copy torch.cat makes of one layer's cache + the last token's logits).
    T5 runs the encoder on seq_len tokens and one decoder token. On CUDA one cuBLAS workspace is
    added (in `other`). Checked against an H100 (tests/test_gpu_truth.py).

    A mixture of experts (family "moe") holds all its experts' weights; its cache is what
    transformers' DynamicCache holds (for DeepSeek's latent attention, the latent and the shared
    rotary key: `moe.kv_cache_bytes`), and its last layer's peak is the largest phase of
    `moe.prefill_block_bytes` (the routed experts' token copies, ~top-k x the hidden state per token).

    Known limitations: the block's intermediates are a bound on what it holds at once, not a trace."""
    spec = _resolve(model, moe=True)
    batch_size, seq_len = check_positive(batch_size=batch_size, seq_len=seq_len)
    if new_tokens is not None:  # by its own name, before it is added to seq_len
        new_tokens = _checks.whole("new_tokens", new_tokens, lo=0)
        _checks.has_decoder(spec, "generation (new_tokens; leave it None for a prefill)")
        _check_positions(spec, seq_len + new_tokens, name=f"seq_len + new_tokens = {seq_len:,} + {new_tokens:,} =")
    else:
        _check_positions(spec, seq_len)
    check_choice(dtype, tuple(INFER_BYTES), "dtype")
    check_choice(attention, ATTENTIONS, "attention implementation")
    check_choice(device, ("cuda", "cpu"), "device")
    all_logits = _checks.flag("all_logits", all_logits)
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    check_choice(kv_dtype, tuple(INFER_BYTES), "kv_dtype")
    gpu = gpu_or_none(gpu)
    e = 2 if dtype == "int8" else INFER_BYTES[dtype]  # int8 weights compute in 16-bit
    b, s, V = batch_size, seq_len, spec.vocab_size
    h = spec.word_embed_proj_dim or spec.hidden_size
    weights = spec.params * INFER_BYTES[dtype]
    workspace = cublas_workspace_bytes(gpu) if device == "cuda" else 0
    if spec.is_moe:
        kv = _moe.kv_cache_bytes(spec, batch_size=b, seq_len=s, dtype=kv_dtype)
        block = max(_moe.prefill_block_bytes(spec, tokens=b * s, dtype_bytes=e).values())
        if attention == "eager":
            block += 2 * b * spec.num_heads * s * s * e
    else:
        kv = kv_cache_bytes(spec, batch_size=b, seq_len=s, dtype=kv_dtype)
        block = _block_transient(spec, tokens=b * s, batch_size=b, seq_len=s, e=e, attention=attention)
    base = dict(parameters=weights, inputs=b * s * 8, other=workspace, precision=dtype, device=device)
    if new_tokens is None:
        kept = b if (not all_logits or spec.family == "t5") else b * s  # positions whose logits are returned
        end = kept * (h + V) * e  # the final norm's output and the logits
        return MemoryBreakdown(**base, kv_cache=kv, activations=max(block, end), phase="prefill",
                               label=f"{spec.name} prefill b={b} s={s} {dtype}")
    one_row = b * V * (e + 4)  # the last position's logits, and generate's fp32 copy of them
    prefill = MemoryBreakdown(**base, kv_cache=kv, activations=max(block, b * h * e + one_row),
                              phase="generate: prompt prefill", label=f"{spec.name} generate b={b} s={s}+{new_tokens} {dtype}")
    full = (_moe.kv_cache_bytes if spec.is_moe else kv_cache_bytes)(spec, batch_size=b, seq_len=s + new_tokens,
                                                                     dtype=kv_dtype)
    layers = spec.num_decoder_layers if spec.family == "t5" else spec.num_layers
    last = MemoryBreakdown(**base, kv_cache=full, activations=one_row, temporaries=full // max(layers, 1),
                           phase=f"generate: token {new_tokens} (cache at {s + new_tokens} positions)", label=prefill.label)
    return max((prefill, last), key=lambda m: m.total)


# ============================================================================ checkpoints
def checkpoint_bytes(model: ModelSpec | str | int, *, dtype: str = "fp32") -> int:
    """Size of the weights on disk: params x bytes per param (BERT-base, 110 M params in fp32:
    419.62 MiB). Accepts a ModelSpec, a preset name or a parameter count."""
    if isinstance(model, (str, ModelSpec)):
        n = _resolve(model).params
    else:
        n = _checks.whole("parameter_count", model, hi=MAX_PARAMS)
    check_choice(dtype, tuple(INFER_BYTES), "dtype")
    return n * INFER_BYTES[dtype]




# fit() adds this share of the estimate: the estimator's tested accuracy against the allocator on
# CUDA (tests/test_gpu_truth.py holds every measured case within 3 %), so an under-estimate of up
# to that much still fits
