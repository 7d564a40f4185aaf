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
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class Format:
    name: str
    bits: int
    exponent_bits: int  # 0 for integers
    mantissa_bits: int  # explicit fraction bits (the sign bit is separate)
    finite_only: bool = False  # fp8 e4m3fn: no infinity, max 448

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
    if isinstance(name, Format):
        return name
    if name not in FORMATS:
        raise ValueError(f"unknown format {name!r}; choose from {', '.join(FORMATS)}")
    return FORMATS[name]


def round_to(x: float, f: str | Format) -> float:
    """`x` rounded to the nearest value of format `f` (ties to even), as PyTorch's cast does.
    Overflow gives +-inf; fp8 e4m3fn has no infinity, and torch's cast saturates there to +-448
    (checked against torch in the tests). Small values go through the subnormals and flush to 0."""
    f = fmt(f)
    if isinstance(x, bool) or not isinstance(x, (int, float)) and not hasattr(x, "__float__"):
        raise ValueError(f"round_to needs a number, got {x!r}")
    x = float(x)
    if not f.is_float:
        if math.isnan(x):
            raise ValueError("int8 has no NaN: round_to(nan, 'int8') has no answer")
        return float(max(-128, min(127, round(x)))) if math.isfinite(x) else (127.0 if x > 0 else -128.0)
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
    w = round_to(weight, f)
    u = round_to(lr * grad, f)
    return round_to(w - u, f) != w


def min_loss_scale(grad: float, f: str | Format = "fp16") -> int:
    """The smallest power-of-two loss scale S for which grad x S does not flush to zero when cast
    to `f` (grad itself given in fp32)."""
    f = fmt(f)
    if isinstance(grad, bool) or not isinstance(grad, (int, float)) or not math.isfinite(grad):
        raise ValueError(f"grad must be a finite number, got {grad!r}")
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

    def update(self, found_inf: bool) -> bool:
        """Record one step; returns True when the optimizer step is taken (no overflow)."""
        if found_inf:
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
