"""The ipywidgets front end of the calculators declared in `vramlab.present.calculators` (Jupyter, Colab):
one control per declared input, the same result (numbers, SVG chart, text) as the online book's.
ipywidgets is imported when a widget is made, never at `import vramlab`."""

from __future__ import annotations

from typing import Any

from .calculators import Input, result_html, get, page_html


def _control(i: Input, value: Any):
    import ipywidgets as W

    style = {"description_width": "120px"}
    desc = i.label + (f" ({i.unit})" if i.unit else "")
    if i.kind == "file":  # the file's bytes stay in the kernel: nothing is uploaded anywhere else
        return W.FileUpload(accept=",".join(i.choices), multiple=False, description=desc)
    if i.kind == "choice":
        return W.Dropdown(options=list(i.choices), value=value, description=desc, style=style)
    if i.kind == "int":
        return W.BoundedIntText(value=value, min=int(i.min), max=int(i.max), description=desc, style=style)
    if i.log:
        import math

        lo, hi = math.log10(i.min), math.log10(i.max)
        return W.FloatLogSlider(value=value, base=10, min=lo, max=hi, step=(hi - lo) / 200, description=desc,
                                style=style, readout_format=".3g")
    return W.BoundedFloatText(value=value, min=i.min, max=i.max, description=desc, style=style)


def _value(w) -> Any:
    """A control's value as the calculator takes it: a FileUpload's file as bytes (None before one is picked)."""
    import ipywidgets as W

    if isinstance(w, W.FileUpload):
        files = w.value  # ipywidgets 8: a tuple of {"name", "type", "size", "content": memoryview, ...}
        return bytes(files[-1]["content"]) if files else None
    return w.value


def calculator_widget(name: str, **values: Any):
    """Calculator `name` as ipywidgets: moving a control recomputes with the same function the book's
    page runs in the browser."""
    import ipywidgets as W

    calc = get(name)
    start = {i.name: i.check(values.get(i.name, i.default)) for i in calc.inputs}
    controls = {i.name: _control(i, start[i.name]) for i in calc.inputs}
    files = {i.name: start[i.name] for i in calc.inputs if i.kind == "file"}  # a file given to the call, until one is picked
    out = W.HTML()

    def value(k: str, w) -> Any:
        v = _value(w)
        return files.get(k) if v is None and k in files else v

    def update(*_):
        # one chart, at its full width: Jupyter's and Colab's output area is not a phone's column
        out.value = result_html(calc, calc.run(**{k: value(k, w) for k, w in controls.items()}), narrow=False)

    for w in controls.values():
        w.observe(update, names="value")
    update()
    boxes = list(controls.values())
    half = (len(boxes) + 1) // 2
    return W.VBox([W.HTML(f"<strong>{calc.title}</strong>"), W.HBox([W.VBox(boxes[:half]), W.VBox(boxes[half:])]), out])


def training_calculator(**values: Any):
    """Chapter 1: model, batch, sequence, precision, optimizer, attention, recompute, GPU."""
    return calculator_widget("training", **values)


def collectives_calculator(**values: Any):
    """Chapter 2: collective, ranks, message size (MiB), link."""
    return calculator_widget("collectives", **values)


def explain_calculator(**values: Any):
    """Chapter 1: a memory snapshot (`torch.cuda.memory._dump_snapshot()`'s pickle) explained byte by byte."""
    return calculator_widget("explain", **values)


def precision_calculator(**values: Any):
    """Chapter 5: a value rounded in every format, and the training peak of each precision recipe."""
    return calculator_widget("precision", **values)


class _Shown:
    """Both front ends in one output: Jupyter/Colab draw the ipywidget, the book the HTML (its
    builder is told to prefer text/html over widget views)."""

    def __init__(self, name: str, values: dict[str, Any]):
        self.name, self.values = name, values
        self._widget = None

    def _repr_mimebundle_(self, include=None, exclude=None):
        bundle = {"text/plain": f"<vramlab calculator {self.name}>", "text/html": page_html(self.name, **self.values)}
        try:
            self._widget = calculator_widget(self.name, **self.values)
            wb = self._widget._repr_mimebundle_(include=include, exclude=exclude)
            bundle.update({k: v for k, v in (wb or {}).items() if k != "text/plain"})
        except ImportError:  # no ipywidgets: the static HTML is all there is
            pass
        return bundle


def show(name: str, **values: Any) -> _Shown:
    """Display calculator `name` with these starting values (see `CALCULATORS[name].inputs`)."""
    r = get(name).run(**values)  # fail here, at the call, on bad values
    if r.error:
        raise ValueError(f"calculator {name}: {r.error}")
    return _Shown(name, values)
