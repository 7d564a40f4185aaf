"""FP8's range and its scales, on the CPU with torch's float8 dtypes (chapter 5's FP8 section). Imports torch.

An fp8 tensor is stored as 8-bit values q and a scale s: q = fp8(x * s), and x is read back as q / s. The scale
maps the tensor's largest magnitude (its amax) near the format's max (448 for e4m3, 57344 for e5m2), so that the
values use the format's few binades (Micikevicius et al. 2022, arXiv:2209.05433). Where the scale comes from is
what the recipes differ in:
- current (dynamic, just-in-time) scaling: s = max / amax of the tensor being cast (torchao's tensorwise float8);
- delayed scaling (Transformer Engine's `DelayedScaling`): s = max / (the max of the amax history of the last H
  steps) / 2^margin, computed before this step's tensor is seen — one pass over the data fewer, but stale when
  the amax jumps;
- block scaling (DeepSeek-V3, arXiv:2412.19437, §3.3): one scale per 1x128 tile of an activation (per 128x128
  block of a weight), so an outlier takes only its own tile's range.

Every function here runs the real casts (`tensor.to(torch.float8_e4m3fn)`) on the CPU and returns plain data
(floats, lists, dicts) for a table or a plot; each takes well under a second. The casts saturate (values beyond
the format's max are clamped to it first, as torchao's casts do), so no result depends on how torch's own cast
treats overflow (`agreement_with_pure` records that too).

Known limitations: no fp8 matrix multiply runs here (CPU torch has none to measure, and the accumulation in
higher precision is not modelled), the tensors are synthetic (seeded), and nothing here measures memory: the
bytes of each recipe are `vramlab.precision.FP8_RECIPES`'.
"""

from __future__ import annotations

import math
from collections import deque

import torch

from .. import precision as P

DTYPES = {"fp8-e4m3": torch.float8_e4m3fn, "fp8-e5m2": torch.float8_e5m2}


def _format(fmt: str) -> tuple[P.Format, torch.dtype]:
    if fmt not in DTYPES:
        raise ValueError(f"fmt must be one of {sorted(DTYPES)}, got {fmt!r}")
    return P.fmt(fmt), DTYPES[fmt]


def amax_scale(amax: float, fmt: str = "fp8-e4m3", *, margin: int = 0) -> float:
    """The scale that maps `amax` to the format's max, divided by 2^margin (Transformer Engine's `margin`): a
    margin of m leaves m binades of headroom above amax. An amax of 0 (or not finite) gives 1."""
    f, _ = _format(fmt)
    if not (amax > 0 and math.isfinite(amax)):
        return 1.0
    return f.max / amax / 2.0**margin


def quantise(x: torch.Tensor, fmt: str = "fp8-e4m3", *, scale: float | torch.Tensor) -> torch.Tensor:
    """The fp8 values of x * scale (a float or a tensor that broadcasts against x), saturated at the format's max
    and cast with torch; a float8 tensor."""
    f, dt = _format(fmt)
    return (x.float() * scale).clamp(-f.max, f.max).to(dt)


def cast_stats(x: torch.Tensor, fmt: str = "fp8-e4m3", *, scale: float | torch.Tensor | None = None,
               margin: int = 0, where: torch.Tensor | None = None) -> dict[str, float]:
    """Cast `x` to fp8 with `scale` (None: the current scale, max / amax / 2^margin) and read it back. Returns
    - amax, scale: the tensor's largest magnitude and the scale used (for a tensor of scales, the smallest);
    - rel_error: ||x' - x|| / ||x|| (x' the value read back); dominated by the largest values;
    - mean_rel_error: the mean over non-zero elements of |x' - x| / |x| (a flushed element counts 1);
    - underflow: the share of non-zero elements read back as 0 (flushed below half the smallest subnormal);
    - saturated: the share of elements that lie, once scaled, beyond what rounds to the format's max (at least max
      plus half its ulp: an unsaturated cast would overflow them); they are clamped to max.
    `where` (a bool mask) restricts the shares and errors to some elements (the scale still comes from all)."""
    x = x.float()
    amax = float(x.abs().max()) if x.numel() else 0.0
    if scale is None:
        scale = amax_scale(amax, fmt, margin=margin)
    f, _ = _format(fmt)
    q = quantise(x, fmt, scale=scale)
    back = q.float() / scale
    top_ulp = 2.0 ** (math.floor(math.log2(f.max)) - f.mantissa_bits)
    beyond = (x * scale).abs() >= f.max + top_ulp / 2  # what a cast would not round back to max: clamped
    if where is not None:
        x, back, beyond = x[where], back[where], beyond[where]
    live = x != 0
    n_live = max(int(live.sum()), 1)
    err = (back - x).abs()
    return {
        "amax": amax,
        "scale": float(scale.min()) if isinstance(scale, torch.Tensor) else float(scale),
        "rel_error": float(err.norm() / x.norm()) if float(x.norm()) > 0 else 0.0,
        "mean_rel_error": float((err[live] / x[live].abs()).sum()) / n_live,
        "underflow": float((live & (back == 0)).sum()) / n_live,
        "saturated": float(beyond.float().mean()) if x.numel() else 0.0,
    }


# ----------------------------------------------------------------------------- current against delayed scaling

def drifting_tensors(*, steps: int = 32, numel: int = 8192, growth: float = 1.5, grow_steps: int = 8,
                     spike_step: int = 14, spike: float = 100.0, seed: int = 0) -> list[torch.Tensor]:
    """A seeded sequence of activation-like tensors whose magnitude drifts and spikes: Laplace values (heavier
    tails than a normal's, a steady amax from step to step) that grow `growth` times a step for `grow_steps` steps,
    then stay, with one step (`spike_step`) `spike` times larger."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        u = torch.rand(numel, generator=g)
        x = torch.sign(u - 0.5) * -torch.log1p(-(2 * u - 1).abs())  # Laplace(0, 1) by inversion
        gain = growth ** min(step, grow_steps) * (spike if step == spike_step else 1.0)
        out.append(x * gain)
    return out


def scaling_demo(tensors: list[torch.Tensor] | None = None, fmt: str = "fp8-e4m3", *,
                 histories: tuple[int, ...] = (1, 16), margin: int = 0) -> dict:
    """Cast each step's tensor with the current scale ("dynamic") and with delayed scaling for each amax-history
    length H in `histories` ("delayed H=..."): the scale of step t is max / max(amax of steps t-H .. t-1) /
    2^margin, as Transformer Engine's `DelayedScaling(amax_compute_algo="max")` computes it after each step. The
    histories start with the first step's amax (a calibrated start; Transformer Engine's first scale is 1).
    Returns {"steps", "amax", "fmt", "recipes": {name: {"scale", "saturated", "underflow", "rel_error",
    "mean_rel_error"} as lists by step}}."""
    tensors = drifting_tensors() if tensors is None else tensors
    f, _ = _format(fmt)
    amaxes = [float(x.abs().max()) for x in tensors]
    recipes: dict[str, dict[str, list[float]]] = {}

    def record(name: str, stats: dict) -> None:
        r = recipes.setdefault(name, {k: [] for k in ("scale", "saturated", "underflow", "rel_error",
                                                      "mean_rel_error")})
        for k in r:
            r[k].append(stats[k])

    for x in tensors:
        record("dynamic", cast_stats(x, fmt, margin=margin))
    for h in histories:
        if not (isinstance(h, int) and h >= 1):
            raise ValueError(f"an amax history has at least 1 step, got {h!r}")
        history: deque[float] = deque([amaxes[0]], maxlen=h)
        for x, a in zip(tensors, amaxes):
            record(f"delayed H={h}", cast_stats(x, fmt, scale=amax_scale(max(history), fmt, margin=margin)))
            history.append(a)
    return {"fmt": fmt, "max": f.max, "steps": list(range(len(tensors))), "amax": amaxes, "recipes": recipes}


# ----------------------------------------------------------------------------- per-tensor against 1x128 tiles

def outlier_activations(*, tokens: int = 64, width: int = 1024, outlier_channels: tuple[int, ...] = (100, 700),
                        ratio: float = 1e4, seed: int = 0) -> torch.Tensor:
    """A seeded (tokens, width) activation: standard normal values, with the channels in `outlier_channels`
    `ratio` times larger (the outlier features of trained transformers; Dettmers et al. 2022)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, width, generator=g)
    x[:, list(outlier_channels)] *= ratio
    return x


def tile_scales(x: torch.Tensor, fmt: str = "fp8-e4m3", *, block: int = P.FP8_BLOCK) -> torch.Tensor:
    """One current scale per 1 x `block` tile of a (rows, cols) tensor (DeepSeek-V3's activations: per token, per
    128 channels), expanded to x's shape. cols must be a multiple of `block`."""
    rows, cols = x.shape
    if cols % block:
        raise ValueError(f"the width {cols} is not a multiple of the tile {block}")
    f, _ = _format(fmt)
    amax = x.float().abs().reshape(rows, cols // block, block).amax(-1, keepdim=True)
    scale = torch.where(amax > 0, f.max / amax, torch.ones_like(amax))
    return scale.expand(rows, cols // block, block).reshape(rows, cols)


def block_scaling_demo(*, ratios: tuple[float, ...] = (10.0, 1e2, 1e3, 1e4, 1e5), fmt: str = "fp8-e4m3",
                       tokens: int = 64, width: int = 1024, outlier_channels: tuple[int, ...] = (100, 700),
                       block: int = P.FP8_BLOCK, seed: int = 0) -> list[dict]:
    """For each outlier `ratio`, cast `outlier_activations` per tensor and per 1 x `block` tile (current scales)
    and report, on the ordinary (non-outlier) values: the share flushed to zero and the mean relative error, for
    both; and the share of tiles that hold an outlier channel (the tiles whose ordinary values still share a
    scale with an outlier). One dict per ratio: {"ratio", "per_tensor": {...}, "tiled": {...},
    "tiled_clean": {...} (tiles without an outlier), "tiles_with_outlier"}."""
    rows = []
    ordinary = torch.ones(tokens, width, dtype=torch.bool)
    ordinary[:, list(outlier_channels)] = False
    dirty_tiles = {c // block for c in outlier_channels}
    clean = ordinary.clone()
    for t in dirty_tiles:
        clean[:, t * block:(t + 1) * block] = False
    for ratio in ratios:
        x = outlier_activations(tokens=tokens, width=width, outlier_channels=outlier_channels, ratio=ratio, seed=seed)
        s = tile_scales(x, fmt, block=block)
        keep = ("underflow", "mean_rel_error", "saturated")
        rows.append({
            "ratio": float(ratio),
            "per_tensor": {k: v for k, v in cast_stats(x, fmt, where=ordinary).items() if k in keep},
            "tiled": {k: v for k, v in cast_stats(x, fmt, scale=s, where=ordinary).items() if k in keep},
            "tiled_clean": {k: v for k, v in cast_stats(x, fmt, scale=s, where=clean).items() if k in keep},
            "tiles_with_outlier": len(dirty_tiles) / (width // block),
        })
    return rows


# ----------------------------------------------------------------------------- e4m3 against e5m2 for gradients

def gradient_like(*, spread: float, numel: int = 65536, center: float = -20.0, seed: int = 0) -> torch.Tensor:
    """Seeded gradient-like values: random signs, log2 of the magnitudes normal with mean `center` and standard
    deviation `spread` (in binades): the wider the spread, the more range a format needs."""
    g = torch.Generator().manual_seed(seed)
    sign = torch.randint(0, 2, (numel,), generator=g).float() * 2 - 1
    return sign * torch.exp2(center + spread * torch.randn(numel, generator=g))


def formats_demo(*, spreads: tuple[float, ...] = (1.0, 2.0, 3.0, 4.0, 5.0), numel: int = 65536,
                 seed: int = 0) -> list[dict]:
    """e4m3 (more precision) against e5m2 (more range) on `gradient_like` tensors of growing `spread`, each cast
    with its current per-tensor scale. One dict per spread: {"spread", "fp8-e4m3": {...}, "fp8-e5m2": {...}}
    with cast_stats' underflow, mean_rel_error and rel_error."""
    rows = []
    for spread in spreads:
        x = gradient_like(spread=spread, numel=numel, seed=seed)
        row: dict = {"spread": float(spread)}
        for fmt in DTYPES:
            s = cast_stats(x, fmt)
            row[fmt] = {k: s[k] for k in ("underflow", "mean_rel_error", "rel_error")}
        rows.append(row)
    return rows


def binades(fmt: str) -> dict[str, float]:
    """The format's range in binades (powers of 2): normal (max / smallest normal) and with the subnormals."""
    f, _ = _format(fmt)
    return {"normal": math.log2(f.max / f.smallest_normal), "with_subnormals": math.log2(f.max / f.smallest_subnormal)}


# ----------------------------------------------------------------------------- torch's cast against the pure model

def probe_values(fmt: str = "fp8-e4m3", *, n_random: int = 4096, seed: int = 0) -> list[float]:
    """Values to cast: every finite value of the format, the midpoints between neighbours (ties), just above and
    below each midpoint, seeded random values over the whole range (subnormals to beyond the max, both signs),
    the overflow thresholds, zeros, the infinities and NaN. All are exact in fp32."""
    f, dt = _format(fmt)
    codes = torch.arange(256, dtype=torch.uint8).view(dt).float()
    grid = sorted({v for v in codes.tolist() if math.isfinite(v) and v >= 0})
    mids = [(a + b) / 2 for a, b in zip(grid, grid[1:])]
    top_ulp = 2.0 ** (math.floor(math.log2(f.max)) - f.mantissa_bits)
    near = [m * (1 + s * 2.0**-12) for m in mids for s in (-1, 1)]
    edges = [f.max, f.max + top_ulp / 2, f.max + top_ulp / 2 * (1 - 2.0**-12), f.max + top_ulp, 2 * f.max, 1e30,
             f.smallest_subnormal / 2, f.smallest_subnormal / 2 * (1 + 2.0**-12), f.smallest_subnormal / 4]
    g = torch.Generator().manual_seed(seed)
    lo, hi = math.log2(f.smallest_subnormal) - 3, math.log2(f.max) + 2
    rnd = torch.exp2(lo + (hi - lo) * torch.rand(n_random, generator=g)).tolist()
    pos = grid + mids + near + edges + rnd
    vals = torch.tensor(pos + [-v for v in pos], dtype=torch.float32).tolist()  # exact in fp32
    return vals + [0.0, -0.0, math.inf, -math.inf, math.nan]


def agreement_with_pure(fmt: str = "fp8-e4m3", *, n_random: int = 4096, seed: int = 0) -> dict:
    """torch's own cast (`tensor.to(float8)`, no clamp) against `vramlab.precision.round_to` on `probe_values`:
    {"fmt", "values", "mismatches", "examples": [(x, torch, pure)] (the first 5), and what torch gives for
    "inf", "nan" and "twice_max"}. A mismatch is a different value, or a zero of a different sign."""
    _, dt = _format(fmt)
    xs = probe_values(fmt, n_random=n_random, seed=seed)
    got = torch.tensor(xs, dtype=torch.float32).to(dt).float().tolist()
    bad = []
    for x, t in zip(xs, got):
        p = P.round_to(x, fmt)
        same = (math.isnan(t) and math.isnan(p)) or (t == p and math.copysign(1, t) == math.copysign(1, p))
        if not same:
            bad.append((x, t, p))
    f, _ = _format(fmt)
    special = torch.tensor([math.inf, math.nan, 2 * f.max]).to(dt).float().tolist()
    return {"fmt": fmt, "values": len(xs), "mismatches": len(bad), "examples": bad[:5], "inf": special[0],
            "nan": special[1], "twice_max": special[2], "torch": torch.__version__}
