"""Matplotlib figures of the calculators: stacked breakdowns, sweeps, predicted vs measured.
matplotlib is imported when a function is called, never at `import vramlab`."""

from __future__ import annotations

import textwrap
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
        ax.text(-0.45, capacity / GiB, f" {capacity_label}", va="bottom", ha="left", fontsize=8)
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("GiB")
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)  # beside, never over, the bars
    ax.grid(axis="y", alpha=0.3)
    return ax


def predicted_vs_measured(rows: Iterable[tuple[str, int, int]], *, ax=None, title: str = "Predicted vs measured"):
    """Grouped bars: (label, predicted bytes, measured bytes) per row, in GiB, with the error in %."""
    import matplotlib.pyplot as plt

    rows = list(rows)
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.2))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [p / GiB for _, p, _ in rows], width=0.4, label="predicted (vramlab)", color="#4C72B0")
    ax.bar([x + 0.2 for x in xs], [m / GiB for _, _, m in rows], width=0.4, label="measured", color="#C44E52")
    for x, (_, p, m) in zip(xs, rows):
        ax.text(x, max(p, m) / GiB, f"{100 * (p - m) / m:+.1f}%", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [textwrap.fill(r[0], 14) for r in rows], fontsize=7)  # wrapped, never clipped
    ax.set_ylabel("GiB")
    ax.set_title(title)
    ax.legend(fontsize=8, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    ax.figure.tight_layout()
    return ax


def rank_grid(grid, *, ax=None, title: str = ""):
    """One row per rank, one column per chunk; a cell shows what the rank holds for that chunk."""
    import matplotlib.pyplot as plt

    n_ranks, n_chunks = len(grid), len(grid[0])
    if ax is None:
        _, ax = plt.subplots(figsize=(0.6 * n_chunks + 1, 0.45 * n_ranks + 0.6))
    palette = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]
    for r, row in enumerate(grid):
        for c, label in enumerate(row):
            full = label.startswith("Σ")
            partial = label and not full and len(label.rstrip("0123456789")) > 1
            color = "#2F2F2F" if full else ("#BBBBBB" if partial else (palette[ord(label[0]) - 97] if label else "white"))
            ax.add_patch(plt.Rectangle((c, n_ranks - 1 - r), 0.95, 0.9, color=color, ec="#888888", lw=0.5))
            ax.text(c + 0.47, n_ranks - 0.55 - r, label, ha="center", va="center", fontsize=7,
                    color="white" if full or (label and not partial) else "black")
    ax.set_xlim(0, n_chunks)
    ax.set_ylim(0, n_ranks)
    ax.set_yticks([n_ranks - 0.55 - r for r in range(n_ranks)], [f"rank {r}" for r in range(n_ranks)], fontsize=7)
    ax.set_xticks([])
    ax.set_title(title, fontsize=8)
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    return ax
