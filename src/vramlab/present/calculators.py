"""Each chapter's calculator, declared once: its inputs (with their choices or ranges and defaults)
and the pure function that turns them into the result — text, key numbers and an SVG chart. Pure
Python, no torch, no matplotlib: it runs the same in CPython and in the reader's browser (Pyodide).

Two front ends read these declarations: `vramlab.present.widgets` (ipywidgets, in Jupyter and Colab) and
`page_html` (the HTML of the online book, made live by book/_static/live.mjs, which runs this
module in a Web Worker). `vramlab.present.widgets.show(name, ...)` gives both at once: Jupyter draws the
widget, the book the HTML.

The declarations live by chapter (`calc_memory`, `calc_snapshot`, `calc_parallel`, `calc_zero`, `calc_precision`,
`calc_offload`, `calc_checkpointing`, `calc_compression`, on the types of `calc_base`); this module is their
registry (`CALCULATORS`, `get`), the browser's entry points (`run_json`, `run_html`) and the book's HTML.
"""

from __future__ import annotations

import json
import math
from html import escape
from typing import Any

from .calc_base import COLORS, Calculator, Input, Result  # noqa: F401 (the types, as this module always gave them)
from .calc_checkpointing import CHECKPOINTING, NO_PLAN_FITS  # noqa: F401
from .calc_compression import COMPRESSION, COMPRESSION_METHODS, OPTIMIZERS  # noqa: F401
from .calc_memory import MOE, SERVING, TRAINING
from .calc_offload import OFFLOAD, STREAMING
from .calc_parallel import COLLECTIVES, CONTEXT, EXPERTS, LAYOUTS, PARALLEL
from .calc_precision import PRECISION
from .calc_snapshot import EXAMPLE, EXPLAIN, NO_GPU, NO_MODEL, example_snapshot  # noqa: F401
from .calc_zero import ZERO

CALCULATORS: dict[str, Calculator] = {c.name: c for c in (TRAINING, MOE, SERVING, COLLECTIVES, PRECISION, PARALLEL, CONTEXT, EXPERTS,
                                                           LAYOUTS, ZERO,
                                                           OFFLOAD, STREAMING, CHECKPOINTING, COMPRESSION, EXPLAIN,
                                                           OPTIMIZERS)}


def get(name: str) -> Calculator:
    if name not in CALCULATORS:
        raise ValueError(f"unknown calculator {name!r}; known: {', '.join(CALCULATORS)}")
    return CALCULATORS[name]


def run_json(name: str, values_json: str) -> str:
    """The browser's entry point: JSON in, JSON out (a Result's dict)."""
    try:
        values = json.loads(values_json)
        return json.dumps(get(name).run(**values).to_dict())
    except (ValueError, TypeError) as e:
        return json.dumps(Result(text="", error=str(e)).to_dict())


def run_html(name: str, values_json: str) -> str:
    """The live page's entry point (book/_static/live-worker.mjs): JSON values in, JSON out with
    the result area's HTML (the same markup the build pre-rendered) and the numbers."""
    try:
        calc = get(name)
        r = calc.run(**json.loads(values_json))
    except (ValueError, TypeError) as e:
        calc, r = None, Result(text="", error=str(e))
    html = result_html(calc, r) if calc else f'<p class="vl-error">{escape(r.error)}</p>'
    return json.dumps({"html": html, "error": r.error, "invalid": list(r.invalid),
                       "numbers": {k: v for k, (v, _) in r.numbers.items()}})


# ----------------------------------------------------------------------------- the book's front end

def _control(i: Input, value: Any, cid: str) -> str:
    """Disabled until the page's script enables it: without JavaScript no control can disagree
    with the pre-rendered numbers."""
    common = f'id="{cid}-{i.name}" data-input="{i.name}" disabled'
    label = f'<label for="{cid}-{i.name}">{escape(i.label)}{" (" + i.unit + ")" if i.unit else ""}</label>'
    if i.kind == "file":  # read in the page (FileReader, live.mjs): nothing is uploaded
        return (f'<div class="vl-field vl-file">{label}<input type="file" {common} accept="{escape(",".join(i.choices))}" '
                f'data-file=""><small class="vl-file-name">{"the built-in example" if value is None else "a file"}'
                '; pick or drop a file: it is read in this page, never uploaded</small></div>')
    if i.kind == "choice":
        opts = "".join(f'<option value="{escape(str(c))}"{" selected" if str(c) == str(value) else ""}>'
                       f'{escape(str(c))}</option>' for c in i.choices)
        return f'<div class="vl-field">{label}<select {common}>{opts}</select></div>'
    if i.log:  # a log-scale slider: positions 0..1000 map to min..max geometrically (live.mjs: the same map)
        pos = round(1000 * math.log(value / i.min) / math.log(i.max / i.min))
        return (f'<div class="vl-field">{label}<input type="range" {common} min="0" max="1000" step="1" value="{pos}" '
                f'data-log-min="{i.min!r}" data-log-max="{i.max!r}"><output>{value:.4g}</output></div>')
    return (f'<div class="vl-field">{label}<input type="number" {common} min="{i.min:g}" max="{i.max:g}" step="1" '
            f'value="{value}"></div>')


def result_html(calc: Calculator, r: Result, *, narrow: bool = True) -> str:
    """The result area: the numbers, the chart and the text; an error is one line in the error's
    style (role="alert"). With `narrow`, the chart comes twice (wide, and laid out for a phone) and
    the book's CSS shows the one that fits the column (book.css: .vl-chart's container query)."""
    if r.error:
        return f'<p class="vl-error" role="alert">{escape(r.error)}</p>'
    nums = " · ".join(f'<span class="vl-number">{escape(calc.number_labels.get(k, k))} <strong data-key="{k}" '
                      f'data-value="{v!r}">{escape(s)}</strong></span>' for k, (v, s) in r.numbers.items())
    chart = (f'<div class="vl-wide">{r.svg}</div><div class="vl-narrow">{r.svg_narrow}</div>' if narrow and r.svg_narrow
             else r.svg)
    return f'<p class="vl-numbers">{nums}</p><div class="vl-chart">{chart}</div><pre class="vl-text">{escape(r.text)}</pre>'


def page_html(name: str, **values: Any) -> str:
    """The calculator as the online book shows it: its controls (disabled until the page's script
    takes over), the result pre-rendered by CPython at build time, and a status line: 'snapshot',
    then 'loading', then 'live' (Python running in this page, in a Web Worker), or 'error' (the
    inputs were refused: nothing computed for them) or 'failed' (Python could not start)."""
    calc = get(name)
    r = calc.run(**values)
    if r.error:
        raise ValueError(f"calculator {name}: {r.error}")
    checked = {i.name: i.check(values.get(i.name, i.default)) for i in calc.inputs}
    cid = f"vl-{name}"
    controls = "".join(_control(i, checked[i.name], cid) for i in calc.inputs)
    return (f'<div class="vramlab-calc" id="{cid}" data-calc="{name}" data-state="snapshot">'
            f'<div class="vl-head"><strong>{escape(calc.title)}</strong> '
            f'<span class="vl-status" role="status">snapshot: computed when this page was built</span></div>'
            f'<div class="vl-controls">{controls}</div>'
            f'<div class="vl-result" aria-live="polite">{result_html(calc, r)}</div></div>')
