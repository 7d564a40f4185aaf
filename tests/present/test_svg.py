"""vramlab.present.svg: the calculators' charts, pure Python (they are drawn in the reader's browser
too). Each is well-formed SVG, escapes what it is given, and draws what it is asked to."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from vramlab import offload, parallel
from vramlab.present import svg

NS = "{http://www.w3.org/2000/svg}"


def _parse(text: str) -> ET.Element:
    root = ET.fromstring(text)  # well-formed, or this raises
    assert root.tag == f"{NS}svg" and root.get("viewBox")
    return root


def _texts(root: ET.Element) -> str:
    return " ".join("".join(e.itertext()) for e in root.iter(f"{NS}text"))


def test_stacked_bars_draw_each_segment_once_in_the_legend_and_escape_labels():
    bars = [("a <b>", [("weights", 2.0, "#111"), ("grads", 1.0, "#222")]), ("c & d", [("weights", 3.0, "#111")])]
    text = svg.stacked_bars(bars, title="T <1>", line=(4.0, "GPU"))
    root = _parse(text)
    assert "<b>" not in text and "a &lt;b&gt;" in text and "c &amp; d" in text
    rects = [r for r in root.iter(f"{NS}rect") if r.find(f"{NS}title") is not None]
    assert len(rects) == 3  # one per non-zero segment
    legend = [t for t in root.iter(f"{NS}text") if t.text in ("weights", "grads")]
    assert sorted(t.text for t in legend) == ["grads", "weights"]
    assert "GPU" in _texts(root)


def test_stacked_bar_heights_are_proportional_to_values():
    root = _parse(svg.stacked_bars([("x", [("s", 1.0, "#111")]), ("y", [("s", 3.0, "#111")])]))
    h = [float(r.get("height")) for r in root.iter(f"{NS}rect") if r.find(f"{NS}title") is not None]
    assert abs(h[1] / h[0] - 3.0) < 1e-6


def test_gantt_draws_every_operation_of_a_schedule_with_a_legend():
    run = parallel.simulate(2, 4, "1f1b")
    root = _parse(svg.gantt(run.ops, devices=2, makespan=run.makespan, title="1F1B"))
    boxes = [r for r in root.iter(f"{NS}rect") if r.get("fill", "").startswith("#") and r.get("height") == "22"]
    assert len(run.ops) == 2 * 4 * 2 and len(boxes) == len(run.ops)  # a box per forward and backward
    assert "forward" in _texts(root) and "backward" in _texts(root) and "bubble" in _texts(root)


def test_loglog_lines_and_streams_and_tp_figure_are_well_formed():
    _parse(svg.loglog_lines([("ring", [(1e3, 1e-5), (1e9, 1e-1)], "#333", True)], title="t", xlabel="bytes",
                            ylabel="s", vline=1e6))
    s = offload.stream_layers([10**8] * 4, [1e-3] * 4, streamed=[1, 2, 3], link_GBps=25)
    _parse(svg.streams(s.events, makespan=s.seconds, title="stream"))
    _parse(svg.tensor_parallel_mlp(2))
