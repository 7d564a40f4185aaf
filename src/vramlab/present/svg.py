"""Small SVG charts drawn in pure Python, so that the same figure comes out of CPython (the book's
pre-rendered calculators, Jupyter) and Pyodide (the live calculators in the browser).
No dependencies; every chart is one self-contained <svg> string with a viewBox (it scales to its box).

Legible at any width: every chart takes a `width` (the viewBox's, in px at scale 1) and lays itself
out for it. Below `NARROW` (a phone's column) a chart changes its layout rather than shrinking: bars
turn horizontal, legends go below the plot, titles wrap. No text is smaller than `MIN_FONT` units,
and each <svg> carries a CSS `min-width` (the width at which that text renders at 9 px): in a box
narrower than that the chart keeps its size and the box scrolls, instead of shrinking text into
illegibility. The calculators draw each chart twice, at `WIDE` and at `PHONE`, and the book's CSS
shows the one that fits its container (`responsive`)."""

from __future__ import annotations

import math
import re
from html import escape
from typing import Callable, Sequence

FONT = 'font-family="system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif"'
MIN_FONT = 11  # the smallest text in any chart, in viewBox units
LEGIBLE_PX = 9  # the smallest text a reader should get, in CSS px
NARROW = 480  # a chart narrower than this uses its phone layout
PHONE = 360  # the narrow variant's width: a 390 px phone's column, drawn at about 1:1
WIDE = 640
CHAR = 0.6  # a character's average advance, in ems (system-ui digits and lower case)


def _text_width(text: str, size: float = MIN_FONT) -> float:
    return len(text) * size * CHAR


def min_width(width: float, smallest_font: float = MIN_FONT) -> int:
    """The narrowest a chart drawn `width` wide may be shown with its `smallest_font` text at 9 px."""
    return math.ceil(width * LEGIBLE_PX / smallest_font)


def _svg_open(width: float, height: float, title: str, font_size: int = MIN_FONT,
              smallest_font: float = MIN_FONT) -> list[str]:
    return [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width:g} {height:g}" role="img" {FONT} '
            f'font-size="{font_size}" style="min-width:{min_width(width, smallest_font)}px">',
            f'<title>{escape(title)}</title>']


def _title(title: str, x: float, width: float) -> tuple[list[str], float]:
    """The title (12 units, bold) wrapped to the width: its <text> and the y below it."""
    lines = _wrap(title, max(12, int((width - x - 4) / (12 * 0.62)))) if title else []
    out = [f'<text x="{x:g}" y="{16 + 15 * k}" font-size="12" font-weight="600">{escape(t)}</text>'
           for k, t in enumerate(lines)]
    return out, 16 + 15 * max(len(lines) - 1, 0)


def _legend(items: Sequence[tuple[str, str]], *, x0: float, y0: float, width: float) -> tuple[list[str], float]:
    """Swatches and their names flowed left to right in rows within `width`; each item is
    (swatch markup with its top-left at (0, 0), 12 units wide and 10 high; name). Returns the
    markup and the y below the last row."""
    out, x, y = [], x0, y0
    for swatch, name in items:
        w = 16 + _text_width(name) + 14
        if x > x0 and x + w > x0 + width:
            x, y = x0, y + 16
        out.append(f'<g transform="translate({x:.1f},{y:.1f})">{swatch}</g>'
                   f'<text x="{x + 16:.1f}" y="{y + 9:.1f}">{escape(name)}</text>')
        x += w
    return out, y + 16


def _box(fill: str, stroke: str = "") -> str:
    return f'<rect width="12" height="10" fill="{fill}"{f" stroke={chr(34)}{stroke}{chr(34)}" if stroke else ""}/>'


def responsive(draw: Callable[..., str], *args, wide: int = WIDE, narrow: int = PHONE, **kwargs) -> str:
    """A chart drawn twice, at `wide` and at `narrow`: the book's CSS (book.css, a container query on
    .vl-chart and .vl-figure) shows the one that fits the box it is in."""
    return (f'<div class="vl-wide">{draw(*args, width=wide, **kwargs)}</div>'
            f'<div class="vl-narrow">{draw(*args, width=narrow, **kwargs)}</div>')


def _nice_step(span: float, ticks: int = 5) -> float:
    raw = span / max(ticks, 1)
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    for m in (1, 2, 2.5, 5, 10):
        if m * mag >= raw:
            return m * mag
    return 10 * mag


def _fmt(v: float) -> str:
    return f"{v:g}" if abs(v) < 1e4 else f"{v:.0f}"


def _wrap(label: str, width: int) -> list[str]:
    """Split a label after hyphens or at spaces into lines of at most `width` characters (where it can)."""
    lines, cur = [], ""
    for piece in re.findall(r"[^\s-]+-?|-", label) if len(label) > width else [label]:
        joined = cur + (" " if cur and not cur.endswith("-") else "") + piece
        if cur and len(joined) > width:
            lines.append(cur)
            cur = piece
        else:
            cur = joined
    return lines + [cur]


def stacked_bars(bars: Sequence[tuple[str, Sequence[tuple[str, float, str]]]], *, title: str = "", unit: str = "GiB",
                 line: tuple[float, str] | None = None, width: int = WIDE, height: int = 300,
                 horizontal: bool = False) -> str:
    """Stacked bars. `bars`: (label, [(segment name, value in `unit`, colour), ...]); `line`:
    (value, label) drawn across, e.g. a GPU's usable memory. A legend lists the segments once.
    Vertical bars with the legend beside them; below `NARROW` wide, or `horizontal` (many bars),
    horizontal bars (a row each, its label above it) with the legend below."""
    if width < NARROW or horizontal:
        return _hbars(bars, title=title, unit=unit, line=line, width=width)
    left, right, bottom = 56, 170, 52
    heads, ty = _title(title, left, width)
    top = ty + 14
    height += ty - 16
    pw, ph = width - left - right, height - top - bottom
    ymax = max([sum(v for _, v, _ in segs) for _, segs in bars] + [line[0] if line else 0] + [1e-9]) * 1.08
    step = _nice_step(ymax)
    y = lambda v: top + ph - ph * v / ymax  # noqa: E731
    out = _svg_open(width, height, title) + heads
    t = 0.0
    while t <= ymax:
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y(t):.1f}" y2="{y(t):.1f}" stroke="#ddd"/>'
                   f'<text x="{left - 6}" y="{y(t) + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
        t += step
    out.append(f'<text x="14" y="{top + ph / 2:.0f}" transform="rotate(-90 14 {top + ph / 2:.0f})" '
               f'text-anchor="middle">{escape(unit)}</text>')
    slot = pw / max(len(bars), 1)
    bw = min(90.0, slot * 0.6)
    legend: dict[str, str] = {}
    for i, (label, segs) in enumerate(bars):
        x0, acc = left + slot * i + (slot - bw) / 2, 0.0
        for name, v, color in segs:
            if v <= 0:
                continue
            out.append(f'<rect x="{x0:.1f}" y="{y(acc + v):.1f}" width="{bw:.1f}" height="{y(acc) - y(acc + v):.1f}" '
                       f'fill="{color}"><title>{escape(name)}: {v:.3g} {escape(unit)}</title></rect>')
            acc += v
            legend.setdefault(name, color)
        lines = _wrap(label, max(4, int(slot / (MIN_FONT * CHAR))))  # labels never run into each other
        tspans = "".join(f'<tspan x="{x0 + bw / 2:.1f}" dy="{0 if k == 0 else 13}">{escape(t)}</tspan>'
                         for k, t in enumerate(lines))
        out.append(f'<text y="{top + ph + 16}" text-anchor="middle">{tspans}</text>'
                   f'<text x="{x0 + bw / 2:.1f}" y="{y(acc) - 4:.1f}" text-anchor="middle">{acc:.3g}</text>')
    if line:
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y(line[0]):.1f}" y2="{y(line[0]):.1f}" stroke="#222" '
                   f'stroke-dasharray="5 3"/><text x="{left + pw - 4}" y="{y(line[0]) - 4:.1f}" text-anchor="end">'
                   f'{escape(line[1])}</text>')
    for j, (name, color) in enumerate(legend.items()):
        ly = top + 4 + 16 * j
        out.append(f'<rect x="{left + pw + 14}" y="{ly}" width="10" height="10" fill="{color}"/>'
                   f'<text x="{left + pw + 29}" y="{ly + 9}">{escape(name)}</text>')
    out.append("</svg>")
    return "".join(out)


def _hbars(bars, *, title: str, unit: str, line: tuple[float, str] | None, width: int) -> str:
    """stacked_bars' phone layout: one row per bar (its label and total above it), the axis below,
    the legend (and the dashed line's meaning) under the axis."""
    pad = 8
    heads, ty = _title(title, pad, width)
    x0, x1 = pad, width - pad
    xmax = max([sum(v for _, v, _ in segs) for _, segs in bars] + [line[0] if line else 0] + [1e-9]) * 1.04
    X = lambda v: x0 + (x1 - x0) * v / xmax  # noqa: E731
    top = ty + 12
    y, body, legend = top, [], {}
    for label, segs in bars:
        total = sum(v for _, v, _ in segs if v > 0)
        value = f"{total:.3g} {unit}"
        name = label if _text_width(label + value) + 12 < x1 - x0 else _wrap(label, int((x1 - x0 - _text_width(value) - 12)
                                                                                       / (MIN_FONT * CHAR)))[0] + "…"
        body.append(f'<text x="{x0}" y="{y + 11}">{escape(name)}</text>'
                    f'<text x="{x1}" y="{y + 11}" text-anchor="end" font-weight="600" paint-order="stroke" stroke="#fff" '
                    f'stroke-width="3">{escape(value)}</text>')
        acc = 0.0
        for seg, v, color in segs:
            if v <= 0:
                continue
            body.append(f'<rect x="{X(acc):.1f}" y="{y + 15}" width="{max(X(acc + v) - X(acc), 0.5):.1f}" height="13" '
                        f'fill="{color}"><title>{escape(seg)}: {v:.3g} {escape(unit)}</title></rect>')
            acc += v
            legend.setdefault(seg, color)
        y += 36
    bottom = y
    out = list(heads)
    step = _nice_step(xmax, 4)
    t = 0.0
    while t <= xmax:
        out.append(f'<line x1="{X(t):.1f}" x2="{X(t):.1f}" y1="{top}" y2="{bottom}" stroke="#e4e4e4"/>'
                   f'<text x="{X(t):.1f}" y="{bottom + 13}" text-anchor="{"start" if t == 0 else "middle"}">'
                   f'{_fmt(t)}</text>')
        t += step
    out.append(f'<text x="{x1}" y="{bottom + 27}" text-anchor="end">{escape(unit)}</text>')
    items = [(_box(color), name) for name, color in legend.items()]
    if line:
        out.append(f'<line x1="{X(line[0]):.1f}" x2="{X(line[0]):.1f}" y1="{top}" y2="{bottom}" stroke="#222" '
                   f'stroke-dasharray="5 3"/>')
        items.append(('<line x1="0" x2="12" y1="5" y2="5" stroke="#222" stroke-dasharray="4 2"/>',
                      f"{line[1]}: {line[0]:.3g} {unit}"))
    out += body  # over the dashed line: the totals' white halo keeps them readable
    marks, end = _legend(items, x0=pad, y0=bottom + 36, width=width - 2 * pad)
    return "".join(_svg_open(width, end + 4, title) + out + marks + ["</svg>"])


def loglog_lines(series: Sequence[tuple[str, Sequence[tuple[float, float]], str, bool]], *, title: str = "",
                 xlabel: str = "", ylabel: str = "", vline: float | None = None, width: int = WIDE,
                 height: int = 300) -> str:
    """Lines on log-log axes. `series`: (name, [(x, y), ...], colour, emphasised). The legend sits
    beside the plot, or below it when the chart is narrower than `NARROW`."""
    narrow = width < NARROW
    left, right, bottom = (44, 10, 42) if narrow else (62, 150, 42)
    heads, ty = _title(title, 8 if narrow else left, width)
    top = ty + 14
    pw = width - left - right
    ph = (220 if narrow else height - 30 - bottom)
    xs = [x for _, pts, _, _ in series for x, _ in pts if x > 0]
    ys = [v for _, pts, _, _ in series for _, v in pts if v > 0]
    lx0, lx1 = math.floor(math.log10(min(xs))), math.ceil(math.log10(max(xs)))
    ly0, ly1 = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))
    lx1, ly1 = max(lx1, lx0 + 1), max(ly1, ly0 + 1)
    X = lambda v: left + pw * (math.log10(v) - lx0) / (lx1 - lx0)  # noqa: E731
    Y = lambda v: top + ph - ph * (math.log10(v) - ly0) / (ly1 - ly0)  # noqa: E731
    out = heads + [f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#bbb"/>']
    every = max(1, math.ceil((lx1 - lx0) / (pw / 40)))  # an x label every 40 units at least
    for k in range(lx0, lx1 + 1, every):
        out.append(f'<line x1="{X(10**k):.1f}" x2="{X(10**k):.1f}" y1="{top}" y2="{top + ph}" stroke="#eee"/>'
                   f'<text x="{X(10**k):.1f}" y="{top + ph + 14}" text-anchor="{"end" if k + every > lx1 else "middle"}">'
                   f'1e{k}</text>')
    every = max(1, math.ceil((ly1 - ly0) / (ph / 30)))
    for k in range(ly0, ly1 + 1, every):
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{Y(10**k):.1f}" y2="{Y(10**k):.1f}" stroke="#eee"/>'
                   f'<text x="{left - 5}" y="{Y(10**k) + 4:.1f}" text-anchor="end">1e{k}</text>')
    out.append(f'<text x="{left + pw / 2:.0f}" y="{top + ph + 32}" text-anchor="middle">{escape(xlabel)}</text>'
               f'<text x="12" y="{top + ph / 2:.0f}" transform="rotate(-90 12 {top + ph / 2:.0f})" '
               f'text-anchor="middle">{escape(ylabel)}</text>')
    items = []
    for j, (name, pts, color, strong) in enumerate(series):
        path = " ".join(f"{'M' if i == 0 else 'L'}{X(x):.1f},{Y(v):.1f}" for i, (x, v) in enumerate(pts) if x > 0 and v > 0)
        out.append(f'<path d="{path}" fill="none" stroke="{color}" stroke-width="{2.5 if strong else 1.2}"/>')
        swatch = f'<line x1="0" x2="12" y1="5" y2="5" stroke="{color}" stroke-width="{2.5 if strong else 1.2}"/>'
        if narrow:
            items.append((swatch, name + (" ◀" if strong else "")))
            continue
        ly = top + 4 + 15 * j
        weight = ' font-weight="600"' if strong else ""
        out.append(f'<g transform="translate({left + pw + 12},{ly})">{swatch}</g><text x="{left + pw + 30}" '
                   f'y="{ly + 9}"{weight}>{escape(name)}</text>')
    if vline and vline > 0:
        out.append(f'<line x1="{X(vline):.1f}" x2="{X(vline):.1f}" y1="{top}" y2="{top + ph}" stroke="#222" '
                   f'stroke-dasharray="3 3"/>')
    end = top + ph + bottom
    if narrow:
        marks, end = _legend(items, x0=8, y0=top + ph + 42, width=width - 16)
        out += marks
    return "".join(_svg_open(width, max(end, height if not narrow else 0), title) + out + ["</svg>"])


def gantt(ops: Sequence, *, devices: int, makespan: float, title: str = "", chunks: int = 1, width: int = 680,
          row: int = 26) -> str:
    """A pipeline schedule: one row per device, forwards (light) and backwards (dark) labelled with
    their micro-batch, each model chunk in its own colour (the legend names them) when there are
    several, idle time (the bubble) hatched.
    `ops`: objects with device, kind ("F"/"B"), micro, chunk, start, end (vramlab.pipeline.Op)."""
    narrow = width < NARROW
    left, right = (46, 8) if narrow else (74, 12)
    heads, ty = _title(title, 8 if narrow else left, width)
    top = ty + 14
    pw = width - left - right
    X = lambda t: left + pw * float(t) / float(makespan)  # noqa: E731
    palette = [("#9ecae1", "#3182bd"), ("#a1d99b", "#31a354"), ("#fdae6b", "#e6550d"), ("#bcbddc", "#756bb1")]
    out = heads + ['<defs><pattern id="vl-idle" width="6" height="6" patternUnits="userSpaceOnUse" '
                   'patternTransform="rotate(45)"><rect width="6" height="6" fill="#f4f4f4"/><line x1="0" y1="0" x2="0" '
                   'y2="6" stroke="#d33" stroke-width="1.2" opacity="0.45"/></pattern></defs>']
    for d in range(devices):
        y = top + d * row
        out.append(f'<rect x="{left}" y="{y + 2}" width="{pw}" height="{row - 4}" fill="url(#vl-idle)"/>'
                   f'<text x="{left - 5}" y="{y + row / 2 + 4:.1f}" text-anchor="end">'
                   f'{"GPU" if narrow else "device"} {d}</text>')
    for o in ops:
        light, dark = palette[o.chunk % len(palette)]
        y = top + o.device * row
        x0, x1 = X(o.start), X(o.end)
        fill, ink = (light, "#000") if o.kind == "F" else (dark, "#fff")
        label = str(o.micro)  # the chunk is the box's colour
        out.append(f'<rect x="{x0:.1f}" y="{y + 2}" width="{max(x1 - x0 - 0.6, 0.5):.1f}" height="{row - 4}" '
                   f'fill="{fill}"><title>{"forward" if o.kind == "F" else "backward"} of micro-batch {o.micro}'
                   f'{f", chunk {o.chunk}" if chunks > 1 else ""} on device {o.device}</title></rect>')
        if x1 - x0 >= _text_width(label) + 2:
            out.append(f'<text x="{(x0 + x1) / 2:.1f}" y="{y + row / 2 + 4:.1f}" text-anchor="middle" '
                       f'fill="{ink}">{escape(label)}</text>')
    items = []
    for c in range(max(chunks, 1)):
        light, dark = palette[c % len(palette)]
        what = f"chunk {c}: " if chunks > 1 else ""
        items += [(_box(light), f"{what}forward"), (_box(dark), f"{what}backward" + ("" if chunks > 1 else " (2x a forward)"))]
    items.append((_box("url(#vl-idle)", "#ccc"), "idle: the bubble"))
    marks, end = _legend(items, x0=8 if narrow else left, y0=top + devices * row + 8, width=width - (16 if narrow else left + right))
    out += marks + [f'<text x="{left + pw}" y="{end + 8}" text-anchor="end">time → (numbers: micro-batches)</text>']
    return "".join(_svg_open(width, end + 14, title) + out + ["</svg>"])


def tensor_parallel_mlp(t: int = 2, width: int = 680) -> str:
    """Megatron's MLP on t devices: X (replicated) times A split by columns gives each device its
    slice of the hidden layer, GeLU runs on the slice (no communication), times B split by rows gives
    each device a partial Z; one all-reduce sums them. In the backward, the mirror all-reduce sits
    before A (Shoeybi et al. 2019, Figure 3). Drawn at 680 wide (`width` sets only the viewBox's)."""
    colors = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]
    width = max(width, 640)
    height = 40 + t * 64 + 40
    out = _svg_open(width, height, f"Tensor-parallel MLP on {t} devices") + [
        f'<text x="10" y="16" font-size="12" font-weight="600">Tensor-parallel MLP on {t} devices: Z = GeLU(X A) B</text>']
    for d in range(t):
        y = 40 + d * 64
        c = colors[d % len(colors)]
        out.append(f'<text x="10" y="{y + 32}">device {d}</text>'
                   # X, whole on every device
                   f'<rect x="70" y="{y + 8}" width="40" height="40" fill="#ddd" stroke="#666"/>'
                   f'<text x="90" y="{y + 32}" text-anchor="middle">X</text><text x="122" y="{y + 32}">×</text>'
                   # A: t columns, this device's shaded
                   + "".join(f'<rect x="{134 + 60 * k / t:.1f}" y="{y + 8}" width="{60 / t:.1f}" height="40" '
                             f'fill="{colors[k % len(colors)] if k == d else "#fff"}" stroke="#666" '
                             f'opacity="{0.85 if k == d else 1}"/>' for k in range(t))
                   + f'<text x="164" y="{y + 61}" text-anchor="middle">A by columns</text>'
                   f'<text x="202" y="{y + 32}">→ GeLU →</text>'
                   f'<rect x="262" y="{y + 8}" width="{40 / t:.1f}" height="40" fill="{c}" opacity="0.85" stroke="#666"/>'
                   f'<text x="{262 + 20 / t + 8:.1f}" y="{y + 61}">Y{d}</text><text x="312" y="{y + 32}">×</text>'
                   # B: t rows, this device's shaded
                   + "".join(f'<rect x="326" y="{y + 8 + 40 * k / t:.1f}" width="60" height="{40 / t:.1f}" '
                             f'fill="{colors[k % len(colors)] if k == d else "#fff"}" stroke="#666" '
                             f'opacity="{0.85 if k == d else 1}"/>' for k in range(t))
                   + f'<text x="356" y="{y + 61}" text-anchor="middle">B by rows</text>'
                   f'<text x="396" y="{y + 32}">=</text>'
                   f'<rect x="412" y="{y + 8}" width="40" height="40" fill="{c}" opacity="0.35" stroke="#666"/>'
                   f'<text x="432" y="{y + 32}" text-anchor="middle">Z{d}</text>')
    yb = 40 + t * 64
    out.append(f'<path d="M460,48 L490,48 L490,{yb - 16} L460,{yb - 16}" fill="none" stroke="#222" stroke-width="1.5"/>'
               f'<text x="498" y="{(48 + yb - 16) / 2 - 6:.0f}" font-weight="600">all-reduce</text>'
               f'<text x="498" y="{(48 + yb - 16) / 2 + 9:.0f}">Z = Z0 + … + Z{t - 1}</text>'
               f'<text x="10" y="{yb + 16}">Weights, their gradients and optimizer states: 1/{t} of A and B '
               f'per device.</text><text x="10" y="{yb + 32}">Forward: one all-reduce after B; backward: '
               f'one before A. Y is never gathered.</text>')
    out.append("</svg>")
    return "".join(out)


def streams(events: Sequence, *, makespan: float, title: str = "", width: int = 680, row: int = 26,
            max_labels: int = 64) -> str:
    """Two CUDA streams over one pass: the copy stream (host to GPU, one box per layer copied) above
    the compute stream (one box per layer); compute waiting for a copy shows as a hatched gap.
    `events`: (kind "copy" | "compute", layer, start, end) in seconds, as vramlab.offload.Streaming's."""
    narrow = width < NARROW
    left, right = (62, 8) if narrow else (84, 12)
    heads, ty = _title(title, 8 if narrow else left, width)
    top = ty + 14
    pw = width - left - right
    span = max(float(makespan), 1e-12)
    X = lambda t: left + pw * min(max(float(t), 0.0), span) / span  # noqa: E731
    out = heads + ['<defs><pattern id="vl-wait" width="6" height="6" patternUnits="userSpaceOnUse" '
                   'patternTransform="rotate(45)"><rect width="6" height="6" fill="#f4f4f4"/><line x1="0" y1="0" x2="0" '
                   'y2="6" stroke="#d33" stroke-width="1.2" opacity="0.45"/></pattern></defs>']
    rows = {"copy": (0, "#fdae6b", "#000", "copy" if narrow else "copy stream"), "compute": (1, "#3182bd", "#fff", "compute")}
    for kind, (r, _, _, name) in rows.items():
        y = top + r * row
        fill = "url(#vl-wait)" if kind == "compute" else "#fafafa"
        out.append(f'<rect x="{left}" y="{y + 2}" width="{pw}" height="{row - 4}" fill="{fill}"/>'
                   f'<text x="{left - 5}" y="{y + row / 2 + 4:.1f}" text-anchor="end">{name}</text>')
    labelled = len(events) <= max_labels
    for kind, layer, s, e in events:
        if kind not in rows or e <= 0 or s >= span:
            continue
        r, fill, ink, _ = rows[kind]
        y = top + r * row
        x0, x1 = X(s), X(e)
        out.append(f'<rect x="{x0:.1f}" y="{y + 2}" width="{max(x1 - x0 - 0.6, 0.5):.1f}" height="{row - 4}" fill="{fill}" '
                   f'stroke="#fff" stroke-width="0.3"/>')
        label = str(layer)
        if labelled and x1 - x0 >= _text_width(label) + 2:
            out.append(f'<text x="{(x0 + x1) / 2:.1f}" y="{y + row / 2 + 4:.1f}" text-anchor="middle" '
                       f'fill="{ink}">{escape(label)}</text>')
    items = [(_box("#fdae6b"), "a layer copied in"), (_box("#3182bd"), "a layer computed"),
             (_box("url(#vl-wait)", "#ccc"), "compute waiting for a copy")]
    marks, end = _legend(items, x0=8 if narrow else left, y0=top + 2 * row + 8, width=width - (16 if narrow else left + right))
    out += marks + [f'<text x="{left + pw}" y="{end + 8}" text-anchor="end">{1e3 * span:.3g} ms →</text>']
    return "".join(_svg_open(width, end + 14, title) + out + ["</svg>"])
