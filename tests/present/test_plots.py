"""vramlab.present.plots: the book's matplotlib figures draw what they are given (bars in GiB,
one per breakdown, a capacity line; predicted beside measured), without a display."""

from __future__ import annotations

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from vramlab import estimate_training, gpu  # noqa: E402
from vramlab.present import plots  # noqa: E402
from vramlab.units import GiB  # noqa: E402


def test_stacked_bars_sum_to_each_breakdown_and_draw_the_capacity():
    import matplotlib.pyplot as plt

    ests = [estimate_training("gpt2", batch_size=b, seq_len=512, precision="bf16-mixed") for b in (1, 4)]
    t4 = gpu("t4")
    ax = plots.stacked(ests, ["1", "4"], capacity=t4.memory_bytes, title="gpt2")
    tops = {}
    for patch in ax.patches:
        x = round(patch.get_x() + patch.get_width() / 2)
        tops[x] = max(tops.get(x, 0), patch.get_y() + patch.get_height())
    assert [pytest.approx(tops[i], rel=1e-9) for i in (0, 1)] == [e.total / GiB for e in ests]
    assert any(abs(line.get_ydata()[0] - t4.memory_bytes / GiB) < 1e-9 for line in ax.get_lines())
    assert {t.get_text() for t in ax.get_legend().get_texts()} >= {"parameters", "activations"}
    plt.close("all")


def test_predicted_vs_measured_and_rank_grid_draw_without_a_display():
    import matplotlib.pyplot as plt

    ax = plots.predicted_vs_measured([("a", 2 * GiB, GiB), ("b", GiB, GiB)])
    assert len(ax.patches) == 4  # two bars a row
    ax = plots.rank_grid([["a0", "Σ1"], ["", "b1"]], title="grid")
    assert len(ax.patches) == 4 and {t.get_text() for t in ax.texts} == {"a0", "Σ1", "", "b1"}
    plt.close("all")
