"""vramlab.present.svg: the calculators' charts, pure Python (they are drawn in the reader's browser
too). Each is well-formed SVG, escapes what it is given, and draws what it is asked to."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from vramlab import offload, pipeline
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
    run = pipeline.simulate(2, 4, "1f1b")
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


def test_interleaved_gantt_names_every_chunk_and_numbers_its_boxes():
    """The second model chunk had no legend entry and the boxes no micro-batch numbers."""
    run = pipeline.simulate(4, 8, "interleaved", chunks=2)
    for width in (680, svg.PHONE):
        root = _parse(svg.gantt(run.ops, devices=4, makespan=run.makespan, chunks=2, title="interleaved", width=width))
        texts = [t.text for t in root.iter(f"{NS}text")]
        for c in (0, 1):
            assert f"chunk {c}: forward" in texts and f"chunk {c}: backward" in texts
        if width == 680:  # every box wide enough for its number carries it
            numbers = [t for t in texts if t and t.isdigit()]
            assert set(numbers) == {str(m) for m in range(8)} and len(numbers) >= len(run.ops) // 2


def _sizes(root: ET.Element) -> list[float]:
    return [float(e.get("font-size")) for e in root.iter() if e.get("font-size")]


def test_charts_have_a_phone_layout_and_no_text_under_the_minimum():
    bars = [(f"plan {i}", [("weights", 2.0 + i, "#111"), ("optimizer states", 1.0, "#222")]) for i in range(8)]
    run = pipeline.simulate(4, 8, "1f1b")
    s = offload.stream_layers([10**8] * 4, [1e-3] * 4, streamed=[1, 2, 3], link_GBps=25)
    for width in (svg.WIDE, svg.PHONE):
        charts = [svg.stacked_bars(bars, title="a long title that has to wrap on a phone's column, twice or more",
                                   line=(9.0, "GPU usable"), width=width),
                  svg.loglog_lines([("ring", [(1e3, 1e-5), (1e9, 1e-1)], "#333", True)], title="t", xlabel="bytes",
                                   ylabel="s", vline=1e6, width=width),
                  svg.gantt(run.ops, devices=4, makespan=run.makespan, width=width),
                  svg.streams(s.events, makespan=s.seconds, title="stream", width=width)]
        for text in charts:
            root = _parse(text)
            assert root.get("viewBox").split()[2] == str(width)
            assert min(_sizes(root)) >= svg.MIN_FONT
            # shown no narrower than the width at which its smallest text is 9 px: its box scrolls instead
            assert f"min-width:{svg.min_width(width)}px" in root.get("style")
    phone = _parse(svg.stacked_bars(bars, line=(9.0, "GPU usable"), width=svg.PHONE))
    texts = _texts(phone)
    assert all(f"plan {i}" in texts for i in range(8)) and "GPU usable: 9 GiB" in texts  # the line's meaning, in the legend
    segs = [r for r in phone.iter(f"{NS}rect") if r.find(f"{NS}title") is not None]
    assert len({r.get("y") for r in segs}) == 8  # horizontal bars: one row each


def test_responsive_gives_both_layouts():
    bars = [("x", [("s", 1.0, "#111")])]
    html = svg.responsive(svg.stacked_bars, bars, title="t")
    assert html.startswith('<div class="vl-wide"><svg') and '<div class="vl-narrow"><svg' in html
    assert f'viewBox="0 0 {svg.WIDE} ' in html and f'viewBox="0 0 {svg.PHONE} ' in html
