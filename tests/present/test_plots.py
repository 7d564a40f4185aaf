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


def test_predicted_vs_measured_draws_one_sorted_bar_of_error_per_case():
    import matplotlib.pyplot as plt

    rows = [(f"case {i}", GiB + i * GiB // 100, GiB) for i in range(33)] + [("far off", 2 * GiB, GiB)]
    ax = plots.predicted_vs_measured(rows, band=3)
    bars = [p for p in ax.patches if p.get_height() == pytest.approx(0.6)]  # the band is a polygon, not a bar
    assert len(bars) == 34  # every case, not a sample
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert len(labels) == 34 and labels[0] == "case 0" and labels[-1] == "far off"  # sorted, largest error at the bottom
    widths = sorted(round(b.get_width(), 6) for b in bars)
    assert widths[-1] == pytest.approx(100.0) and widths[0] == pytest.approx(0.0)  # error in % of measured
    assert {"+100.00 %", "+5.00 %"} <= {t.get_text() for t in ax.texts}  # every bar says its value
    legend = {t.get_text() for t in ax.get_legend().get_texts()}
    assert any("within" in t for t in legend) and any("outside" in t for t in legend)
    assert all(t.get_fontsize() >= 9 for t in ax.get_yticklabels() + ax.texts)
    with pytest.raises(ValueError, match="no measured bytes"):
        plots.predicted_vs_measured([("empty", GiB, 0)])
    plt.close("all")


def test_rank_grid_draws_every_cell_with_a_legend_of_its_colours():
    import matplotlib.pyplot as plt

    ax = plots.rank_grid([["a0", "Σ1"], ["", "ab1"]], title="grid")
    assert len(ax.patches) == 4 and {t.get_text() for t in ax.texts} == {"a0", "Σ1", "", "ab1"}
    assert all(t.get_fontsize() >= 10 for t in ax.texts)
    colours = {p.get_facecolor()[:3] for p in ax.patches}
    handles = plots.rank_grid_handles()
    assert {h.get_facecolor()[:3] for h in handles} <= colours | {(1.0, 1.0, 1.0)}
    assert len(handles) == 3 and all(h.get_label() for h in handles)
    plt.close("all")
