"""One training step's settings as one frozen, validated value. Pure Python: no torch import.

A `Step` is what one steady-state training step is, on one device or as the part every rank shares: the
model (resolved), the micro-batch and sequence, the precision recipe, the optimizer and its options, the
attention kernel, the recompute plan, the loss and its chunking, gradient accumulation, the device's
kernels, a mixture of experts' capacity, the optimizer stepped inside the backward. Every check runs once,
here, when the value is made; the estimators (`memory.training_phases` and those built on it) take a `Step`
with the share, layout or ranks they add. `Step(model, batch_size=..., seq_len=..., **options)` is what
`memory.estimate_training(model, **options)` builds; `as_step` turns either form into a `Step`.

An option that does not apply to the chosen setting is refused in one line (a GaLore rank for an optimizer
that is not GaLore, a loss chunk for the whole loss, a capacity factor for a dense model), never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from . import checks as _checks
from . import moe as _moe
from . import optimizers as _optim
from .activations import ATTENTIONS, Plan, recompute_plan
from .precision import PRECISIONS
from .specs import GPUSpec, ModelSpec, gpu as _gpu
from .specs import resolve as _resolve

Optimizer = Literal["adamw", "adam", "sgd", "sgd-momentum", "adamw-8bit"]
OptimizerImpl = Literal["for-loop", "foreach", "fused"]
Loss = Literal["whole", "chunked", "fused"]

OPTIMIZER_IMPLS: tuple[str, ...] = ("for-loop", "foreach", "fused")
LOSSES: tuple[str, ...] = ("whole", "chunked", "fused")
DEVICES: tuple[str, ...] = ("cuda", "cpu")
MAX_ACCUMULATION = 1 << 16  # micro-batches per optimizer step


def gpu_or_none(gpu) -> "GPUSpec | None":
    return None if gpu is None else _gpu(gpu)


@dataclass(frozen=True)
class Step:
    """One training step's settings, checked once (see the module's docstring; `memory.training_phases`
    says what each one models). `model` may be given as a name or a `ModelSpec`: it is held resolved.
    `recompute` is held as given (a name, a `Plan` or block indices); `plan` is the plan it names."""

    model: ModelSpec
    batch_size: int
    seq_len: int
    precision: str = "fp32"
    optimizer: str = "adamw"
    optimizer_impl: str = "foreach"
    attention: str = "sdpa"
    recompute: Any = "none"
    device: str = "cuda"
    trainable_params: int | None = None
    gpu: GPUSpec | None = None
    use_cache: bool = False
    accumulation_steps: int = 1
    loss: str = "whole"
    loss_chunk_tokens: int | None = None
    capacity_factor: float | None = None
    optimizer_in_backward: bool = False
    galore_rank: int | None = None  # GaLore's projection rank (optimizer "galore-adamw" only; None: its default)
    plan: Plan = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        put = object.__setattr__
        spec = _resolve(self.model, moe=True)  # a mixture of experts passes (its MLPs: `moe.training_layer_saved`)
        put(self, "model", spec)
        put(self, "capacity_factor", _moe.check_trainable(spec, self.capacity_factor))
        put(self, "batch_size", _checks.whole("batch_size", self.batch_size))
        put(self, "seq_len", _checks.whole("seq_len", self.seq_len))
        _checks.positions(spec, self.seq_len)
        _checks.one_of("precision", self.precision, PRECISIONS)
        _checks.one_of("optimizer", self.optimizer, _optim.NAMES)
        _checks.one_of("optimizer_impl", self.optimizer_impl, OPTIMIZER_IMPLS)
        _checks.one_of("attention implementation", self.attention, ATTENTIONS)
        _checks.one_of("device", self.device, DEVICES)
        put(self, "use_cache", _checks.flag("use_cache", self.use_cache))
        put(self, "accumulation_steps", _checks.whole("accumulation_steps", self.accumulation_steps,
                                                      hi=MAX_ACCUMULATION))
        put(self, "optimizer_in_backward", _checks.flag("optimizer_in_backward", self.optimizer_in_backward))
        if self.optimizer_in_backward and self.accumulation_steps > 1:
            raise ValueError("optimizer_in_backward steps each parameter as its gradient is made, so gradients cannot "
                             f"accumulate over micro-batches: pass accumulation_steps=1 (got {self.accumulation_steps})")
        _checks.one_of("loss", self.loss, LOSSES)
        if self.loss_chunk_tokens is not None:
            put(self, "loss_chunk_tokens", _checks.whole("loss_chunk_tokens", self.loss_chunk_tokens))
            if self.loss == "whole":
                raise ValueError("loss_chunk_tokens applies to loss='chunked' or 'fused', not to the whole loss")
        if self.loss != "whole" and not spec.is_causal_lm:
            raise ValueError(f"loss={self.loss!r} is modelled for causal LMs (decoder-only), not {spec.family}; "
                             "use loss='whole'")
        put(self, "gpu", gpu_or_none(self.gpu))
        if self.trainable_params is not None:
            put(self, "trainable_params", _checks.whole("trainable_params", self.trainable_params, lo=0,
                                                        hi=spec.params))
        if self.galore_rank is not None:
            if self.optimizer != "galore-adamw":
                raise ValueError(f"galore_rank is GaLore's projection rank: it applies to optimizer='galore-adamw', "
                                 f"not {self.optimizer!r}; leave it None")
            put(self, "galore_rank", _checks.whole("galore_rank", self.galore_rank))
        plan = recompute_plan(self.recompute, spec)
        if self.use_cache and plan.segments:
            raise ValueError("use_cache=True with recompute: transformers turns the KV cache off under gradient "
                             "checkpointing; pass use_cache=False")
        put(self, "plan", plan)

    @property
    def rank(self) -> int:
        """GaLore's projection rank: the one given, else GaLore's default (`optimizers.GALORE_RANK`)."""
        return _optim.GALORE_RANK if self.galore_rank is None else self.galore_rank


# the options a Step takes besides the model (what `estimate_training` and the searches pass on)
OPTIONS: tuple[str, ...] = tuple(f.name for f in fields(Step) if f.init and f.name != "model")


def as_step(model: "Step | ModelSpec | str", options: dict, where: str = "training_phases") -> Step:
    """`model` if it is a Step (then no other option may be given), else the Step of `model` and `options`;
    an option a Step does not take is refused in one line."""
    if isinstance(model, Step):
        if options:
            raise ValueError(f"{where} takes a Step or a model with options, not both: "
                             f"drop {', '.join(sorted(options))} or set them in the Step")
        return model
    _checks.no_unknown(where, options, OPTIONS)
    return Step(model, **options)
