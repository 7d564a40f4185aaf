"""Number formats and precision recipes. Pure Python: no torch import.

A floating-point format with e exponent bits and m mantissa bits (IEEE 754 style, bias 2^(e-1)-1)
represents normal numbers (1 + f) 2^(E - bias); its machine epsilon is 2^-m, its smallest normal
2^(1 - bias), its smallest subnormal 2^(1 - bias - m). fp8 e4m3 (OCP "FN" variant) has no infinity
and gives its top exponent to normal numbers: max 448. The tests check every figure against
`torch.finfo`.

Mixed-precision training (Micikevicius et al. 2017, arXiv:1710.03740): an update lr x grad smaller
than half a unit in the last place of the weight is lost when the weight is 16-bit, hence fp32
master weights; gradients smaller than fp16's smallest subnormal flush to zero, hence loss scaling.
"""

from __future__ import annotations

import math
import numbers as _numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from . import checks as _checks

if TYPE_CHECKING:
    from .specs import ModelSpec


@dataclass(frozen=True, kw_only=True)
class Format:
    name: str
    bits: int
    exponent_bits: int  # 0 for integers
    mantissa_bits: int  # explicit fraction bits (the sign bit is separate)
    finite_only: bool = False  # fp8 e4m3fn: no infinity, max 448

    def __post_init__(self) -> None:
        _checks.text("name", self.name)
        bits = _checks.whole("bits", self.bits, lo=2, hi=64)
        e = _checks.whole("exponent_bits", self.exponent_bits, lo=0, hi=min(bits - 1, 11))  # 11: fp64's
        m = _checks.whole("mantissa_bits", self.mantissa_bits, lo=0 if e else 1, hi=bits - 1 - e if e else bits - 1)
        if e == 1:
            raise ValueError("exponent_bits must be 0 (an integer format) or at least 2, got 1")
        for k, v in (("bits", bits), ("exponent_bits", e), ("mantissa_bits", m),
                     ("finite_only", _checks.flag("finite_only", self.finite_only))):
            object.__setattr__(self, k, v)

    @property
    def is_float(self) -> bool:
        return self.exponent_bits > 0

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def max(self) -> float:
        if not self.is_float:
            return float(2 ** (self.bits - 1) - 1)
        m = self.mantissa_bits
        if self.finite_only:  # top exponent is usable, but all-ones mantissa there is NaN
            emax = 2 ** self.exponent_bits - 1 - self.bias
            return (2 - 2 ** (1 - m)) * 2.0 ** emax
        emax = 2 ** self.exponent_bits - 2 - self.bias
        return (2 - 2.0 ** -m) * 2.0 ** emax

    @property
    def smallest_normal(self) -> float:
        return 2.0 ** (1 - self.bias) if self.is_float else 1.0

    @property
    def smallest_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.mantissa_bits) if self.is_float else 1.0

    @property
    def eps(self) -> float:
        """Machine epsilon: the gap between 1 and the next representable number."""
        return 2.0 ** -self.mantissa_bits if self.is_float else 1.0

    @property
    def bytes(self) -> float:
        return self.bits / 8


FORMATS: dict[str, Format] = {f.name: f for f in (
    Format(name="fp32", bits=32, exponent_bits=8, mantissa_bits=23),
    Format(name="tf32", bits=19, exponent_bits=8, mantissa_bits=10),  # stored as fp32; tensor-core input
    Format(name="fp16", bits=16, exponent_bits=5, mantissa_bits=10),
    Format(name="bf16", bits=16, exponent_bits=8, mantissa_bits=7),
    Format(name="fp8-e4m3", bits=8, exponent_bits=4, mantissa_bits=3, finite_only=True),
    Format(name="fp8-e5m2", bits=8, exponent_bits=5, mantissa_bits=2),
    Format(name="int8", bits=8, exponent_bits=0, mantissa_bits=7),
)}


def fmt(name: str | Format) -> Format:
    """A format by name (FORMATS' keys), or a Format as it is."""
    if isinstance(name, Format):
        return name
    return FORMATS[_checks.one_of("format", name, FORMATS)]


def _real(name: str, x) -> float:
    """A real number (numpy's too) as a float: NaN and the infinities are values a cast takes;
    strings, bools and ints beyond a float's range are refused, naming `name`."""
    if isinstance(x, _numbers.Real) and not _checks.is_bool(x):
        try:
            return float(x)
        except OverflowError:
            pass
    _checks.number(name, x, lo=None, what="a real number")  # raises: it names what x is not
    raise AssertionError("unreachable")  # pragma: no cover


def round_to(x: float, f: str | Format) -> float:
    """`x` rounded to the nearest value of format `f` (ties to even), as PyTorch's cast does.
    Overflow gives +-inf; fp8 e4m3fn has no infinity, and torch's cast saturates there to +-448
    (checked against torch in the tests). Small values go through the subnormals and flush to 0."""
    f = fmt(f)
    x = _real("x", x)
    if not f.is_float:
        if math.isnan(x):
            raise ValueError(f"x must be a number {f.name} holds: {f.name} has no NaN, so round_to(nan, {f.name!r}) "
                             "has no answer")
        top = f.max  # two's complement: -(top + 1) .. top (int8: -128 .. 127)
        return float(max(-top - 1, min(top, round(x)))) if math.isfinite(x) else (top if x > 0 else -top - 1)
    if f.finite_only and math.isinf(x):
        return math.copysign(f.max, x)
    if x == 0 or math.isnan(x) or math.isinf(x):
        return x
    sign = -1.0 if x < 0 else 1.0
    a = abs(x)
    exp = math.floor(math.log2(a))
    exp = max(exp, 1 - f.bias)  # below the normal range the spacing stays that of the subnormals
    quantum = 2.0 ** (exp - f.mantissa_bits)
    q = a / quantum
    r = math.floor(q)
    frac = q - r
    if frac > 0.5 or (frac == 0.5 and r % 2 == 1):
        r += 1
    y = r * quantum
    if y > f.max:  # IEEE rounding overflows once a is at least max + half an ulp of max
        return sign * (f.max if f.finite_only else math.inf)
    return sign * y


def update_survives(weight: float, lr: float, grad: float, f: str | Format) -> bool:
    """Does w - lr * grad, computed in format `f` (the product rounded first, then the
    difference), differ from w? The update is lost when |lr x grad| < half the weight's ulp."""
    f = fmt(f)
    weight, lr, grad = (_checks.number(k, v, lo=None) for k, v in (("weight", weight), ("lr", lr), ("grad", grad)))
    w = round_to(weight, f)
    u = round_to(lr * grad, f)
    return round_to(w - u, f) != w


def min_loss_scale(grad: float, f: str | Format = "fp16") -> int:
    """The smallest power-of-two loss scale S for which grad x S does not flush to zero when cast
    to `f` (grad itself given in fp32)."""
    f = fmt(f)
    grad = _checks.number("grad", grad, lo=None)
    if grad == 0:
        raise ValueError("a zero gradient stays zero at any scale")
    s = 1
    while round_to(abs(grad) * s, f) == 0:
        s *= 2
        if s > 2**128:
            raise ValueError("no finite scale makes this gradient representable")
    return s


@dataclass
class DynamicLossScaler:
    """The update rule of torch.amp.GradScaler: multiply the scale by `backoff_factor` and skip the
    step when the scaled gradients overflow; multiply it by `growth_factor` after `growth_interval`
    consecutive finite steps."""

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    growth_tracker: int = 0
    skipped_steps: int = 0

    def __post_init__(self) -> None:
        # torch.amp.GradScaler's own rules: growth_factor > 1, backoff_factor < 1
        self.scale = _checks.number("scale", self.scale, lo=0, lo_open=True)
        self.growth_factor = _checks.number("growth_factor", self.growth_factor, lo=1, lo_open=True)
        self.backoff_factor = _checks.number("backoff_factor", self.backoff_factor, lo=0, hi=1, lo_open=True,
                                             hi_open=True)
        self.growth_interval = _checks.whole("growth_interval", self.growth_interval)
        self.growth_tracker = _checks.whole("growth_tracker", self.growth_tracker, lo=0)
        self.skipped_steps = _checks.whole("skipped_steps", self.skipped_steps, lo=0)

    def update(self, found_inf: bool) -> bool:
        """Record one step; returns True when the optimizer step is taken (no overflow)."""
        if _checks.flag("found_inf", found_inf):
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            self.skipped_steps += 1
            return False
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0
        return True


# ----------------------------------------------------------------------------- recipes (bytes per parameter)
Recipe = Literal["fp32", "amp-fp16", "amp-bf16", "pure-bf16", "pure-bf16-fp32-states", "zero-paper"]


@dataclass(frozen=True, kw_only=True)
class RecipeLedger:
    """Bytes per parameter of model states under a training recipe with Adam."""

    name: str
    weights: float
    gradients: float
    master_weights: float
    optimizer_states: float
    note: str

    def __post_init__(self) -> None:
        _checks.text("name", self.name)
        for k in ("weights", "gradients", "master_weights", "optimizer_states"):
            object.__setattr__(self, k, _checks.number(k, getattr(self, k), lo=0, hi=64))
        if not isinstance(self.note, str):
            raise ValueError(f"note must be a string, got {self.note!r}")

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.master_weights + self.optimizer_states


RECIPES: dict[str, RecipeLedger] = {r.name: r for r in (
    RecipeLedger(name="fp32", weights=4, gradients=4, master_weights=0, optimizer_states=8,
                 note="everything fp32"),
    RecipeLedger(name="amp-fp16", weights=4, gradients=4, master_weights=0, optimizer_states=8,
                 note="PyTorch AMP: the fp32 model is the master copy; fp16 casts of weights and activations are "
                      "transient (kept for backward: counted as activations); GradScaler adds a few scalars"),
    RecipeLedger(name="amp-bf16", weights=4, gradients=4, master_weights=0, optimizer_states=8,
                 note="as amp-fp16 without loss scaling"),
    RecipeLedger(name="pure-bf16", weights=2, gradients=2, master_weights=0, optimizer_states=4,
                 note="bf16 model; torch.optim keeps Adam's moments in the parameters' dtype"),
    RecipeLedger(name="pure-bf16-fp32-states", weights=2, gradients=2, master_weights=0, optimizer_states=8,
                 note="bf16 weights and gradients, fp32 Adam moments: 2 + 2 + 8 = 12 B/param"),
    RecipeLedger(name="zero-paper", weights=2, gradients=2, master_weights=4, optimizer_states=8,
                 note="Rajbhandari et al. 2019: fp16 params and grads, fp32 master, momentum, variance (K=12)"),
)}


# ============================================================================ training recipes' bytes
# The precision recipes of a training step (chapter 5), what `vramlab.memory`, `vramlab.activations`
# and every chapter after them take as `precision=`.
Precision = Literal["fp32", "bf16-mixed", "fp16-mixed", "bf16", "bf16-fp32-states", "fp16-fp32-master"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16-mixed", "fp16-mixed", "bf16", "bf16-fp32-states", "fp16-fp32-master")
# 16-bit models: pure bf16 (torch.optim keeps the states in bf16), bf16 with fp32 optimizer states
# (2 + 2 + 8 = 12 B/param), and the ZeRO paper's recipe: fp16
# weights and gradients with fp32 master weights, momentum and variance (2 + 2 + 12 = 16 B/param)
PURE_16BIT: tuple[str, ...] = ("bf16", "bf16-fp32-states", "fp16-fp32-master")
FP32_STATES: tuple[str, ...] = ("bf16-fp32-states", "fp16-fp32-master")  # 16-bit model, fp32 optimizer states

# Which dtype each saved tensor has, by recipe. Kinds of saved tensor:
#   "x"    the residual stream and what norms save: the parameter dtype (fp32 under AMP)
#   "half" inputs and outputs of matmuls: the compute dtype (bf16/fp16 under AMP)
#   "f32"  always fp32 (norm statistics, the loss's log-softmax, softmax under CUDA autocast)
#   "loss" the loss's log-softmax: fp32 (transformers' causal-LM loss upcasts the logits, autocast runs
#          log_softmax in fp32), but in the logits' dtype where a 16-bit model that is not a causal LM
#          (BERT, T5) hands them to CrossEntropyLoss itself
#   "mask" a dropout mask: 1 byte (bool) from CUDA's fused dropout; CPU dropout multiplies by a
#          mask of the input's dtype
def dtype_sizes(precision: Precision, device: str) -> dict[str, int]:
    half = 4 if precision == "fp32" else 2
    x = 2 if precision in PURE_16BIT else 4
    return {"x": x, "half": half, "f32": 4, "loss": 4, "mask": 1 if device == "cuda" else half, "i64": 8,
            "up32": 4 if precision in PURE_16BIT else 0}  # an fp32 copy that exists only under pure 16 bits


def loss_bytes(spec: "ModelSpec", precision: Precision) -> int:
    """Bytes per element of the loss's log-softmax (kind "loss")."""
    return 2 if precision in PURE_16BIT and not spec.is_causal_lm else 4


# ============================================================================ FP8 training recipes
# What each published FP8 training recipe keeps, in bytes per parameter, as the Ultra-Scale Playbook tabulates
# them (Tazi et al. 2025, "Mixed precision training > FP8 pretraining"), with the two bf16 baselines it compares
# them with. The Playbook's totals are stored beside the parts (`published_total`) and the tests check that the
# parts add up to them. What the table leaves out is modelled here too: the bytes of a linear layer's input saved
# for its backward, and the scale tensors each recipe's scaling needs (`fp8_scale_bytes`).
FP8Scaling = Literal["none", "delayed", "dynamic", "block"]


@dataclass(frozen=True, kw_only=True)
class FP8Recipe:
    name: str
    label: str
    source: str  # who published it, and where
    gemm: str  # the matmuls' input format: "bf16" or "fp8"
    master_weights: float  # bytes per parameter
    accumulated_gradients: float
    weights: float
    gradients: float
    first_moment: float
    second_moment: float
    saved_input: float  # bytes per element of a linear layer's input saved for its backward
    scaling: FP8Scaling
    published_total: float  # the Playbook's total, bytes per parameter
    note: str = ""
    amax_history: int = 0  # delayed scaling: amaxes kept per scaled operand (0: no history)

    def __post_init__(self) -> None:
        _checks.text("name", self.name)
        for k in ("master_weights", "accumulated_gradients", "weights", "gradients", "first_moment", "second_moment",
                  "saved_input", "published_total"):
            object.__setattr__(self, k, _checks.number(k, getattr(self, k), lo=0, hi=64))
        _checks.one_of("scaling", self.scaling, ("none", "delayed", "dynamic", "block"))
        _checks.one_of("gemm", self.gemm, ("bf16", "fp8"))
        object.__setattr__(self, "amax_history", _checks.whole("amax_history", self.amax_history, lo=0, hi=1 << 20))

    @property
    def optimizer_states(self) -> float:
        return self.first_moment + self.second_moment

    @property
    def total(self) -> float:
        """Bytes per parameter of the model states: the Playbook's sum."""
        return (self.master_weights + self.accumulated_gradients + self.weights + self.gradients
                + self.optimizer_states)

    def parts(self) -> dict[str, float]:
        return {"master weights": self.master_weights, "accumulated gradients": self.accumulated_gradients,
                "weights": self.weights, "gradients": self.gradients, "first moment": self.first_moment,
                "second moment": self.second_moment}


FP8_RECIPES: dict[str, FP8Recipe] = {r.name: r for r in (
    FP8Recipe(name="bf16-baseline", label="BF16 with FP32 mixed precision", gemm="bf16", master_weights=4,
              accumulated_gradients=4, weights=2, gradients=2, first_moment=4, second_moment=4, saved_input=2,
              scaling="none", published_total=20,
              source="Ultra-Scale Playbook's baseline (Megatron-LM / nanotron bf16 training)",
              note="bf16 weights and gradients, fp32 master weights, fp32 gradient accumulation, fp32 Adam moments"),
    FP8Recipe(name="bf16-no-fp32-accum", label="the same without FP32 gradient accumulation", gemm="bf16",
              master_weights=4, accumulated_gradients=0, weights=2, gradients=2, first_moment=4, second_moment=4,
              saved_input=2, scaling="none", published_total=16, source="Ultra-Scale Playbook",
              note="the ZeRO paper's 16 B/param (Rajbhandari et al. 2019): gradients accumulate in bf16"),
    FP8Recipe(name="transformer-engine", label="Transformer Engine", gemm="fp8", master_weights=0,
              accumulated_gradients=0, weights=4, gradients=4, first_moment=4, second_moment=4, saved_input=1,
              scaling="delayed", published_total=16, amax_history=1024,
              source="NVIDIA Transformer Engine (fp8_autocast with DelayedScaling), as the Playbook tabulates it",
              note="fp32 weights are the master copy; the fp8 casts of weights and inputs are made per step, the "
                   "input's kept for the backward; each GEMM operand has an amax history and a scale"),
    FP8Recipe(name="fp8-lm-o3", label="FP8-LM's O3 level", gemm="fp8", master_weights=2, accumulated_gradients=2,
              weights=1, gradients=1, first_moment=1, second_moment=2, saved_input=1, scaling="delayed",
              published_total=9, amax_history=1, source="Peng et al. 2023, FP8-LM (arXiv:2310.18313), level O3",
              note="fp16 master weights with a tensor scale, fp8 gradients and first moment, fp16 second moment"),
    FP8Recipe(name="deepseek-v3", label="DeepSeek-V3", gemm="fp8", master_weights=4, accumulated_gradients=4,
              weights=1, gradients=2, first_moment=2, second_moment=2, saved_input=1, scaling="block",
              published_total=15, source="DeepSeek-AI 2024, DeepSeek-V3 technical report (arXiv:2412.19437), §3.3",
              note="fp8 weights with one scale per 128x128 block, inputs with one per 1x128 tile; bf16 gradients "
                   "and Adam moments, fp32 master weights and gradient accumulation"),
    FP8Recipe(name="nanotron-fp8", label="nanotron's FP8", gemm="fp8", master_weights=2, accumulated_gradients=4,
              weights=1, gradients=1, first_moment=1, second_moment=1, saved_input=1, scaling="delayed",
              published_total=10, amax_history=1, source="Hugging Face nanotron's FP8 training (nanotron PR #70), as the Playbook "
                                         "tabulates it",
              note="bf16 master weights, fp32 accumulation, fp8 weights, gradients and both moments"),
)}
FP8_BLOCK = 128  # DeepSeek-V3's tiles: 1x128 for activations, 128x128 for weights
TE_AMAX_HISTORY = 1024  # Transformer Engine's DelayedScaling(amax_history_len=1024) default
TE_FWD_SLOTS, TE_BWD_SLOTS = 3, 2  # per GEMM: input, weight, output forward; grad-output, grad-input backward


def fp8_recipe(name: str | FP8Recipe) -> FP8Recipe:
    """A recipe by name (FP8_RECIPES' keys), or a recipe as it is."""
    if isinstance(name, FP8Recipe):
        return name
    return FP8_RECIPES[_checks.one_of("FP8 recipe", name, FP8_RECIPES)]


def fp8_scale_bytes(recipe: str | FP8Recipe, shapes, *, amax_history: int | None = None) -> int:
    """Bytes of the scale tensors a recipe keeps for the weights of the matmuls whose weight shapes are `shapes`
    (each (out, in); the scaled GEMMs' weights), beyond the table's bytes per parameter.
    - delayed: Transformer Engine's layout, per GEMM 3 forward and 2 backward operands, each an fp32 amax history
      of `amax_history` entries (default: the recipe's; Transformer Engine's DelayedScaling keeps 1024), a scale and
      its inverse. FP8-LM (MS-AMP's ScalingMeta, window 1) and nanotron (FP8Meta) keep such a meta per fp8 tensor
      rather than per operand slot: counted the same way, at their window of 1 -- a few bytes a tensor either way;
    - dynamic (per-tensor, computed from the current amax: torchao's tensorwise float8): one fp32 scale per operand;
    - block (DeepSeek-V3): one fp32 scale per 128x128 weight block (the inputs' 1x128 scales are per token:
      `fp8_saved_input_bytes`);
    - none: 0."""
    r = fp8_recipe(recipe)
    amax_history = r.amax_history if amax_history is None else _checks.whole("amax_history", amax_history, lo=1,
                                                                             hi=1 << 20)
    shapes = [tuple(_checks.wholes("shape", s, lo=1)) for s in shapes]
    for s in shapes:
        if len(s) != 2:
            raise ValueError(f"a GEMM weight's shape has 2 dimensions (out, in), got {s}")
    if r.scaling == "none":
        return 0
    if r.scaling == "delayed":
        return len(shapes) * (TE_FWD_SLOTS + TE_BWD_SLOTS) * (amax_history + 2) * 4
    if r.scaling == "dynamic":
        return len(shapes) * (TE_FWD_SLOTS + TE_BWD_SLOTS) * 4
    return sum(-(-o // FP8_BLOCK) * -(-i // FP8_BLOCK) for o, i in shapes) * 4


def fp8_saved_input_bytes(recipe: str | FP8Recipe, tokens: int, width: int) -> int:
    """Bytes of one linear layer's input (tokens x width) kept for its backward under `recipe`: its fp8 (or bf16)
    values, plus DeepSeek-V3's one fp32 scale per 1x128 tile."""
    r = fp8_recipe(recipe)
    tokens = _checks.whole("tokens", tokens, lo=0, hi=1 << 40)
    width = _checks.whole("width", width, lo=1, hi=1 << 24)
    values = int(tokens * width * r.saved_input)
    return values + (tokens * -(-width // FP8_BLOCK) * 4 if r.scaling == "block" else 0)


def fp8_model_states(recipe: str | FP8Recipe, n_params: int) -> dict[str, int]:
    """Bytes of each part of the model states of `n_params` parameters under `recipe` (its `parts()`), and
    their total."""
    r = fp8_recipe(recipe)
    n = _checks.whole("n_params", n_params, lo=0, hi=1 << 50)
    out = {k: int(v * n) for k, v in r.parts().items()}
    out["total"] = sum(out.values())
    return out
