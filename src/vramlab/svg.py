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
