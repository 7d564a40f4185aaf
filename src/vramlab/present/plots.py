"""Matplotlib figures of the calculators: stacked breakdowns, sweeps, predicted vs measured.
matplotlib is imported when a function is called, never at `import vramlab`."""

from __future__ import annotations

from typing import Iterable, Sequence

from ..memory import CATEGORIES, MemoryBreakdown
from ..units import GiB

# one colour per category, fixed across the whole course
COLORS = {"parameters": "#4C72B0", "gradients": "#DD8452", "optimizer_states": "#55A868", "activations": "#C44E52",
          "temporaries": "#8172B3", "kv_cache": "#937860", "inputs": "#DA8BC3", "other": "#8C8C8C"}


def _label(category: str) -> str:
    return category.replace("_", " ")


def stacked(breakdowns: Sequence[MemoryBreakdown], labels: Sequence[str], *, ax=None, title: str = "",
            capacity: int | None = None, capacity_label: str = "GPU memory", xlabel: str = ""):
    """Stacked bars, one per breakdown, in GiB; an optional horizontal line at `capacity` bytes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.6))
    used = [c for c in CATEGORIES if any(getattr(b, c) for b in breakdowns)]
    bottoms = [0.0] * len(breakdowns)
    xs = range(len(breakdowns))
    for c in used:
        vals = [getattr(b, c) / GiB for b in breakdowns]
        ax.bar(xs, vals, bottom=bottoms, color=COLORS[c], label=_label(c), width=0.7)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    if capacity:
        ax.axhline(capacity / GiB, color="black", ls="--", lw=1)
        ax.text(-0.45, capacity / GiB, f" {capacity_label}", va="bottom", ha="left", fontsize=9)
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("GiB")
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)  # beside, never over, the bars
    ax.grid(axis="y", alpha=0.3)
    return ax


def predicted_vs_measured(rows: Iterable[tuple[str, int, int]], *, ax=None, title: str = "Predicted vs measured",
                          band: float | None = 3.0, sort: bool = True):
    """One horizontal bar per row, (label, predicted bytes, measured bytes): the estimate's error in % of
    the measured bytes, labels on the y axis (sorted by error unless `sort=False`), the value at each
    bar's end and, with `band`, a shaded ±band % region. Reads at any number of rows: the figure grows
    with them (about a quarter inch a row) when `ax` is not given."""
    import matplotlib.pyplot as plt

    rows = list(rows)
    for label, _, m in rows:
        if not m or m <= 0:
            raise ValueError(f"predicted_vs_measured: row {label!r} has no measured bytes ({m!r})")
    errs = [(label, 100 * (p - m) / m) for label, p, m in rows]
    if sort:
        errs.sort(key=lambda t: t[1])
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 1.1 + 0.27 * len(errs)))
    ys = list(range(len(errs)))[::-1]  # the first row on top
    worst = max((abs(e) for _, e in errs), default=0.0)
    lim = max(worst * 1.6, (band or 0) * 1.2, 1.0)  # room for the value beside the longest bar
    if band:
        ax.axvspan(-band, band, color="#55A868", alpha=0.15, label=f"±{band:g} % band")
    inside = [(y, e) for y, (_, e) in zip(ys, errs) if band is None or abs(e) <= band]
    outside = [(y, e) for y, (_, e) in zip(ys, errs) if band is not None and abs(e) > band]
    for pts, color, label in ((inside, "#4C72B0", "error of the estimate" + (f", within ±{band:g} %" if band else "")),
                              (outside, "#C44E52", f"error, outside ±{band:g} %")):
        if pts:
            ax.barh([y for y, _ in pts], [e for _, e in pts], color=color, height=0.6, label=label)
    for y, (_, e) in zip(ys, errs):
        ax.text(e + (0.02 if e >= 0 else -0.02) * lim, y, f"{e:+.2f} %", va="center", ha="left" if e >= 0 else "right",
                fontsize=9)
    ax.axvline(0, color="black", lw=0.6)
    ax.set_yticks(ys, [label for label, _ in errs], fontsize=9)
    ax.set_ylim(-0.7, len(errs) - 0.3)
    ax.set_xlim(-lim, lim)
    ax.set_xlabel("(estimate − measured) / measured, %")
    ax.set_title(title)
    from matplotlib.transforms import offset_copy

    # below the x label, a fixed distance whatever the figure's height: never over a bar
    ax.legend(fontsize=9, frameon=False, loc="upper center", ncol=2, bbox_to_anchor=(0.5, 0),
              bbox_transform=offset_copy(ax.transAxes, fig=ax.figure, y=-0.5, units="inches"))
    ax.grid(axis="x", alpha=0.3)
    ax.figure.tight_layout()
    return ax


RANK_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]


def rank_grid_handles():
    """Legend handles for `rank_grid`'s colours: a rank's own chunk, a partial sum, the complete sum."""
    from matplotlib.patches import Patch

    return [Patch(color=RANK_COLORS[0], label="a rank's own chunk (one colour per rank)"),
            Patch(color="#BBBBBB", label="partial sum (e.g. ab0 = a0 + b0)"),
            Patch(color="#2F2F2F", label="complete sum Σ over all ranks")]


def rank_grid(grid, *, ax=None, title: str = "", fontsize: float = 10):
    """One row per rank, one column per chunk; a cell shows what the rank holds for that chunk
    (`rank_grid_handles()` gives a legend of its colours)."""
    import matplotlib.pyplot as plt

    n_ranks, n_chunks = len(grid), len(grid[0])
    if ax is None:
        _, ax = plt.subplots(figsize=(0.6 * n_chunks + 1, 0.45 * n_ranks + 0.6))
    palette = RANK_COLORS
    for r, row in enumerate(grid):
        for c, label in enumerate(row):
            full = label.startswith("Σ")
            partial = label and not full and len(label.rstrip("0123456789")) > 1
            color = "#2F2F2F" if full else ("#BBBBBB" if partial else (palette[ord(label[0]) - 97] if label else "white"))
            ax.add_patch(plt.Rectangle((c, n_ranks - 1 - r), 0.95, 0.9, color=color, ec="#888888", lw=0.5))
            ax.text(c + 0.47, n_ranks - 0.55 - r, label, ha="center", va="center", fontsize=fontsize,
                    color="white" if full or (label and not partial) else "black")
    ax.set_xlim(0, n_chunks)
    ax.set_ylim(0, n_ranks)
    ax.set_yticks([n_ranks - 0.55 - r for r in range(n_ranks)], [f"rank {r}" for r in range(n_ranks)], fontsize=fontsize)
    ax.set_xticks([])
    ax.set_title(title, fontsize=fontsize)
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    return ax
