"""Small SVG charts drawn in pure Python, so that the same figure comes out of CPython (the book's
pre-rendered calculators, Jupyter) and Pyodide (the live calculators in the browser).
No dependencies; every chart is one self-contained <svg> string with a viewBox (it scales to its box)."""

from __future__ import annotations

import math
import re
from html import escape
from typing import Sequence

FONT = 'font-family="system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif"'


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
                 line: tuple[float, str] | None = None, width: int = 640, height: int = 300) -> str:
    """Stacked vertical bars. `bars`: (label, [(segment name, value in `unit`, colour), ...]); `line`:
    (value, label) drawn across, e.g. a GPU's usable memory. A legend lists the segments once."""
    left, right, top, bottom = 56, 170, 30, 52
    pw, ph = width - left - right, height - top - bottom
    ymax = max([sum(v for _, v, _ in segs) for _, segs in bars] + [line[0] if line else 0] + [1e-9]) * 1.08
    step = _nice_step(ymax)
    y = lambda v: top + ph - ph * v / ymax  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" role="img" {FONT} font-size="11">',
           f'<title>{escape(title)}</title>',
           f'<text x="{left}" y="16" font-size="12" font-weight="600">{escape(title)}</text>']
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
        lines = _wrap(label, max(4, int(slot / 6.2)))  # ~6 px a character at 11 px: labels never run into each other
        tspans = "".join(f'<tspan x="{x0 + bw / 2:.1f}" dy="{0 if k == 0 else 12}">{escape(t)}</tspan>'
                         for k, t in enumerate(lines))
        out.append(f'<text y="{top + ph + 16}" text-anchor="middle">{tspans}</text>'
                   f'<text x="{x0 + bw / 2:.1f}" y="{y(acc) - 4:.1f}" text-anchor="middle" font-size="10">{acc:.3g}</text>')
    if line:
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y(line[0]):.1f}" y2="{y(line[0]):.1f}" stroke="#222" '
                   f'stroke-dasharray="5 3"/><text x="{left + pw - 4}" y="{y(line[0]) - 4:.1f}" text-anchor="end" '
                   f'font-size="10">{escape(line[1])}</text>')
    for j, (name, color) in enumerate(legend.items()):
        ly = top + 4 + 16 * j
        out.append(f'<rect x="{left + pw + 14}" y="{ly}" width="10" height="10" fill="{color}"/>'
                   f'<text x="{left + pw + 29}" y="{ly + 9}">{escape(name)}</text>')
    out.append("</svg>")
    return "".join(out)


def loglog_lines(series: Sequence[tuple[str, Sequence[tuple[float, float]], str, bool]], *, title: str = "",
                 xlabel: str = "", ylabel: str = "", vline: float | None = None, width: int = 640,
                 height: int = 300) -> str:
    """Lines on log-log axes. `series`: (name, [(x, y), ...], colour, emphasised)."""
    left, right, top, bottom = 62, 150, 30, 42
    pw, ph = width - left - right, height - top - bottom
    xs = [x for _, pts, _, _ in series for x, _ in pts if x > 0]
    ys = [v for _, pts, _, _ in series for _, v in pts if v > 0]
    lx0, lx1 = math.floor(math.log10(min(xs))), math.ceil(math.log10(max(xs)))
    ly0, ly1 = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))
    lx1, ly1 = max(lx1, lx0 + 1), max(ly1, ly0 + 1)
    X = lambda v: left + pw * (math.log10(v) - lx0) / (lx1 - lx0)  # noqa: E731
    Y = lambda v: top + ph - ph * (math.log10(v) - ly0) / (ly1 - ly0)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" role="img" {FONT} font-size="11">',
           f'<title>{escape(title)}</title>',
           f'<text x="{left}" y="16" font-size="12" font-weight="600">{escape(title)}</text>',
           f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#bbb"/>']
    every = max(1, (lx1 - lx0) // 8)
    for k in range(lx0, lx1 + 1, every):
        out.append(f'<line x1="{X(10**k):.1f}" x2="{X(10**k):.1f}" y1="{top}" y2="{top + ph}" stroke="#eee"/>'
                   f'<text x="{X(10**k):.1f}" y="{top + ph + 14}" text-anchor="middle">1e{k}</text>')
    every = max(1, (ly1 - ly0) // 6)
    for k in range(ly0, ly1 + 1, every):
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{Y(10**k):.1f}" y2="{Y(10**k):.1f}" stroke="#eee"/>'
                   f'<text x="{left - 6}" y="{Y(10**k) + 4:.1f}" text-anchor="end">1e{k}</text>')
    out.append(f'<text x="{left + pw / 2:.0f}" y="{height - 6}" text-anchor="middle">{escape(xlabel)}</text>'
               f'<text x="14" y="{top + ph / 2:.0f}" transform="rotate(-90 14 {top + ph / 2:.0f})" '
               f'text-anchor="middle">{escape(ylabel)}</text>')
    for j, (name, pts, color, strong) in enumerate(series):
        path = " ".join(f"{'M' if i == 0 else 'L'}{X(x):.1f},{Y(v):.1f}" for i, (x, v) in enumerate(pts) if x > 0 and v > 0)
        out.append(f'<path d="{path}" fill="none" stroke="{color}" stroke-width="{2.5 if strong else 1.2}"/>')
        ly = top + 4 + 15 * j
        weight = ' font-weight="600"' if strong else ""
        out.append(f'<line x1="{left + pw + 12}" x2="{left + pw + 26}" y1="{ly + 5}" y2="{ly + 5}" stroke="{color}" '
                   f'stroke-width="{2.5 if strong else 1.2}"/><text x="{left + pw + 30}" y="{ly + 9}"{weight}>'
                   f'{escape(name)}</text>')
    if vline and vline > 0:
        out.append(f'<line x1="{X(vline):.1f}" x2="{X(vline):.1f}" y1="{top}" y2="{top + ph}" stroke="#222" '
                   f'stroke-dasharray="3 3"/>')
    out.append("</svg>")
    return "".join(out)


def gantt(ops: Sequence, *, devices: int, makespan: float, title: str = "", chunks: int = 1, width: int = 680,
          row: int = 26) -> str:
    """A pipeline schedule: one row per device, forwards (light) and backwards (dark) labelled with
    their micro-batch (and model chunk when there are several), idle time (the bubble) hatched.
    `ops`: objects with device, kind ("F"/"B"), micro, chunk, start, end (vramlab.parallel.Op)."""
    left, right, top = 74, 12, 30
    pw = width - left - right
    height = top + devices * row + 40
    X = lambda t: left + pw * float(t) / float(makespan)  # noqa: E731
    palette = [("#9ecae1", "#3182bd"), ("#a1d99b", "#31a354"), ("#fdae6b", "#e6550d"), ("#bcbddc", "#756bb1")]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" role="img" {FONT} font-size="10">',
           f'<title>{escape(title)}</title>',
           '<defs><pattern id="vl-idle" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">'
           '<rect width="6" height="6" fill="#f4f4f4"/><line x1="0" y1="0" x2="0" y2="6" stroke="#d33" '
           'stroke-width="1.2" opacity="0.45"/></pattern></defs>',
           f'<text x="{left}" y="16" font-size="12" font-weight="600">{escape(title)}</text>']
    for d in range(devices):
        y = top + d * row
        out.append(f'<rect x="{left}" y="{y + 2}" width="{pw}" height="{row - 4}" fill="url(#vl-idle)"/>'
                   f'<text x="{left - 6}" y="{y + row / 2 + 4:.1f}" text-anchor="end">device {d}</text>')
    for o in ops:
        light, dark = palette[o.chunk % len(palette)]
        y = top + o.device * row
        x0, x1 = X(o.start), X(o.end)
        fill, ink = (light, "#000") if o.kind == "F" else (dark, "#fff")
        label = f"{o.micro}" + (f"·{o.chunk}" if chunks > 1 else "")
        out.append(f'<rect x="{x0:.1f}" y="{y + 2}" width="{max(x1 - x0 - 0.6, 0.5):.1f}" height="{row - 4}" '
                   f'fill="{fill}"/>')
        if x1 - x0 > 6 * len(label) + 3:
            out.append(f'<text x="{(x0 + x1) / 2:.1f}" y="{y + row / 2 + 3.5:.1f}" text-anchor="middle" '
                       f'fill="{ink}">{escape(label)}</text>')
    ly = top + devices * row + 18
    light, dark = palette[0]
    out.append(f'<rect x="{left}" y="{ly - 9}" width="12" height="10" fill="{light}"/>'
               f'<text x="{left + 16}" y="{ly}">forward</text>'
               f'<rect x="{left + 80}" y="{ly - 9}" width="12" height="10" fill="{dark}"/>'
               f'<text x="{left + 96}" y="{ly}">backward (2x a forward)</text>'
               f'<rect x="{left + 250}" y="{ly - 9}" width="12" height="10" fill="url(#vl-idle)" stroke="#ccc"/>'
               f'<text x="{left + 266}" y="{ly}">idle: the bubble</text>'
               f'<text x="{left + pw}" y="{ly}" text-anchor="end">time →</text>')
    out.append("</svg>")
    return "".join(out)


def tensor_parallel_mlp(t: int = 2, width: int = 680) -> str:
    """Megatron's MLP on t devices: X (replicated) times A split by columns gives each device its
    slice of the hidden layer, GeLU runs on the slice (no communication), times B split by rows gives
    each device a partial Z; one all-reduce sums them. In the backward, the mirror all-reduce sits
    before A (Shoeybi et al. 2019, Figure 3)."""
    colors = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]
    height = 40 + t * 64 + 36
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" role="img" {FONT} font-size="11">',
           f'<title>Tensor-parallel MLP on {t} devices</title>',
           f'<text x="10" y="16" font-size="12" font-weight="600">Tensor-parallel MLP on {t} devices: '
           'Z = GeLU(X A) B</text>']
    for d in range(t):
        y = 40 + d * 64
        c = colors[d % len(colors)]
        out.append(f'<text x="10" y="{y + 30}">device {d}</text>'
                   # X, whole on every device
                   f'<rect x="70" y="{y + 8}" width="40" height="40" fill="#ddd" stroke="#666"/>'
                   f'<text x="90" y="{y + 32}" text-anchor="middle">X</text><text x="122" y="{y + 32}">×</text>'
                   # A: t columns, this device's shaded
                   + "".join(f'<rect x="{134 + 60 * k / t:.1f}" y="{y + 8}" width="{60 / t:.1f}" height="40" '
                             f'fill="{colors[k % len(colors)] if k == d else "#fff"}" stroke="#666" '
                             f'opacity="{0.85 if k == d else 1}"/>' for k in range(t))
                   + f'<text x="164" y="{y + 60}" text-anchor="middle" font-size="9">A by columns</text>'
                   f'<text x="202" y="{y + 32}">→ GeLU →</text>'
                   f'<rect x="262" y="{y + 8}" width="{40 / t:.1f}" height="40" fill="{c}" opacity="0.85" stroke="#666"/>'
                   f'<text x="{262 + 20 / t + 8:.1f}" y="{y + 60}" font-size="9">Y{d}</text><text x="312" y="{y + 32}">×</text>'
                   # B: t rows, this device's shaded
                   + "".join(f'<rect x="326" y="{y + 8 + 40 * k / t:.1f}" width="60" height="{40 / t:.1f}" '
                             f'fill="{colors[k % len(colors)] if k == d else "#fff"}" stroke="#666" '
                             f'opacity="{0.85 if k == d else 1}"/>' for k in range(t))
                   + f'<text x="356" y="{y + 60}" text-anchor="middle" font-size="9">B by rows</text>'
                   f'<text x="396" y="{y + 32}">=</text>'
                   f'<rect x="412" y="{y + 8}" width="40" height="40" fill="{c}" opacity="0.35" stroke="#666"/>'
                   f'<text x="432" y="{y + 32}" text-anchor="middle">Z{d}</text>')
    yb = 40 + t * 64
    out.append(f'<path d="M460,48 L490,48 L490,{yb - 16} L460,{yb - 16}" fill="none" stroke="#222" stroke-width="1.5"/>'
               f'<text x="498" y="{(48 + yb - 16) / 2 - 6:.0f}" font-weight="600">all-reduce</text>'
               f'<text x="498" y="{(48 + yb - 16) / 2 + 9:.0f}">Z = Z0 + … + Z{t - 1}</text>'
               f'<text x="10" y="{yb + 14}" font-size="10">Weights, their gradients and optimizer states: 1/{t} of A and B '
               f'per device.</text><text x="10" y="{yb + 28}" font-size="10">Forward: one all-reduce after B; backward: '
               f'one before A. Y is never gathered.</text>')
    out.append("</svg>")
    return "".join(out)


def streams(events: Sequence, *, makespan: float, title: str = "", width: int = 680, row: int = 26,
            max_labels: int = 64) -> str:
    """Two CUDA streams over one pass: the copy stream (host to GPU, one box per layer copied) above
    the compute stream (one box per layer); compute waiting for a copy shows as a hatched gap.
    `events`: (kind "copy" | "compute", layer, start, end) in seconds, as vramlab.offload.Streaming's."""
    left, right, top = 74, 12, 30
    pw = width - left - right
    height = top + 2 * row + 40
    span = max(float(makespan), 1e-12)
    X = lambda t: left + pw * min(max(float(t), 0.0), span) / span  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" role="img" {FONT} font-size="10">',
           f'<title>{escape(title)}</title>',
           '<defs><pattern id="vl-wait" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">'
           '<rect width="6" height="6" fill="#f4f4f4"/><line x1="0" y1="0" x2="0" y2="6" stroke="#d33" '
           'stroke-width="1.2" opacity="0.45"/></pattern></defs>',
           f'<text x="{left}" y="16" font-size="12" font-weight="600">{escape(title)}</text>']
    rows = {"copy": (0, "#fdae6b", "#000", "copy stream"), "compute": (1, "#3182bd", "#fff", "compute")}
    for kind, (r, _, _, name) in rows.items():
        y = top + r * row
        fill = "url(#vl-wait)" if kind == "compute" else "#fafafa"
        out.append(f'<rect x="{left}" y="{y + 2}" width="{pw}" height="{row - 4}" fill="{fill}"/>'
                   f'<text x="{left - 6}" y="{y + row / 2 + 4:.1f}" text-anchor="end">{name}</text>')
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
        if labelled and x1 - x0 > 6 * len(label) + 3:
            out.append(f'<text x="{(x0 + x1) / 2:.1f}" y="{y + row / 2 + 3.5:.1f}" text-anchor="middle" '
                       f'fill="{ink}">{escape(label)}</text>')
    ly = top + 2 * row + 18
    out.append(f'<rect x="{left}" y="{ly - 9}" width="12" height="10" fill="#fdae6b"/>'
               f'<text x="{left + 16}" y="{ly}">a layer copied in</text>'
               f'<rect x="{left + 120}" y="{ly - 9}" width="12" height="10" fill="#3182bd"/>'
               f'<text x="{left + 136}" y="{ly}">a layer computed</text>'
               f'<rect x="{left + 240}" y="{ly - 9}" width="12" height="10" fill="url(#vl-wait)" stroke="#ccc"/>'
               f'<text x="{left + 256}" y="{ly}">compute waiting for a copy</text>'
               f'<text x="{left + pw}" y="{ly}" text-anchor="end">{1e3 * span:.3g} ms →</text>')
    out.append("</svg>")
    return "".join(out)
