"""What every chapter's calculator is made of: `Input` (one control, checked), `Result` (text, key numbers and
an SVG chart), `Calculator` (a declaration: inputs and the pure function that computes), and what several
chapters share (the categories' colours, the GPU, sequence and model choices). Pure Python, as the calculators.
"""

from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from .. import parallel as PAR
from .. import specs
from . import svg as SVG

Kind = Literal["choice", "int", "float", "file"]


@dataclass(frozen=True, kw_only=True)
class Input:
    """One control. choice: one of `choices`; int: min..max; float: min..max, on a log scale if `log`;
    file: a file's bytes (`check` gives bytes, or None for "no file": the calculator's built-in example);
    `choices` then lists the file names it accepts (".pickle")."""

    name: str
    label: str
    kind: Kind
    default: Any
    choices: tuple = ()
    min: float | None = None
    max: float | None = None
    log: bool = False
    unit: str = ""

    def check(self, value: Any) -> Any:
        """The value converted to the input's type, or ValueError with one line that says why."""
        if self.kind == "file":
            return _file_bytes(self.label, value)
        if self.kind == "choice":
            for c in self.choices:  # choices may be numbers; the browser sends strings (True is not 1 here)
                if not isinstance(value, bool) and (value == c or str(value) == str(c)):
                    return c
            raise ValueError(f"{self.label}: {value!r} is not one of {', '.join(map(str, self.choices))}")
        if isinstance(value, bool):
            raise ValueError(f"{self.label}: expected a number, got {value!r}")
        try:
            v = float(value.strip() if isinstance(value, str) else value)  # '1e9' and ' 16 ' are numbers
        except (TypeError, ValueError):
            raise ValueError(f"{self.label}: expected a number, got {value!r}") from None
        except OverflowError:  # a whole number too large for a float
            raise ValueError(f"{self.label}: expected a finite number, got {value!r}") from None
        if v != v:
            raise ValueError(f"{self.label}: expected a number, got {value!r}")
        if math.isinf(v):  # inf, "inf", JSON's Infinity, 1e400
            raise ValueError(f"{self.label}: expected a finite number, got {value!r}")
        if self.kind == "int":
            if v != int(v):
                raise ValueError(f"{self.label}: expected a whole number, got {value!r}")
            v = int(v)
        if not (self.min <= v <= self.max):
            raise ValueError(f"{self.label}: {v:g}{' ' + self.unit if self.unit else ''} is out of range: "
                             f"it must be between {self.min:.4g} and {self.max:.4g}{' ' + self.unit if self.unit else ''}")
        return v


def _file_bytes(label: str, value: Any) -> bytes | None:
    """A file input's value as bytes: bytes-like as is (Jupyter's FileUpload); the browser's string, a data
    URL (FileReader.readAsDataURL: "data:<type>;base64,<data>") or bare base64; "" or None: no file (None)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if not isinstance(value, str):
        raise ValueError(f"{label}: expected a file's bytes or base64 text, got {type(value).__name__}")
    text = value.strip()
    if text.startswith("data:"):  # "data:," is an empty file; "data:text/plain;base64,aGk=" a file
        head, sep, text = text.partition(",")
        if not sep or (text and not head.endswith(";base64")):
            raise ValueError(f"{label}: a data URL without base64 data")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{label}: the page sent no readable file (not base64)") from None


@dataclass(frozen=True, kw_only=True)
class Result:
    """What a calculator shows: monospace `text`, `numbers` (name -> (value, shown as)), an `svg`."""

    text: str
    numbers: dict[str, tuple[float, str]] = field(default_factory=dict)
    svg: str = ""
    svg_narrow: str = ""  # the same chart laid out for a phone's column (svg.PHONE wide); the book shows the one that fits
    error: str = ""
    invalid: tuple[str, ...] = ()  # the inputs the error is about

    def to_dict(self) -> dict:
        return {"text": self.text, "numbers": {k: [v, s] for k, (v, s) in self.numbers.items()}, "svg": self.svg,
                "svg_narrow": self.svg_narrow, "error": self.error, "invalid": list(self.invalid)}



def both(draw: Callable[..., str], *args: Any, wide: int | None = None, **kwargs: Any) -> tuple[str, str]:
    """A chart at its own width (or `wide`) and at a phone's (svg.PHONE)."""
    return (draw(*args, **kwargs) if wide is None else draw(*args, width=wide, **kwargs),
            draw(*args, width=SVG.PHONE, **kwargs))


@dataclass(frozen=True, kw_only=True)
class Calculator:
    name: str
    title: str
    inputs: tuple[Input, ...]
    compute: Callable[..., Result]
    number_labels: dict[str, str] = field(default_factory=dict)

    def run(self, **values: Any) -> Result:
        """Validate `values` (missing ones take their defaults) and compute. Bad input gives a Result
        whose `error` says what is wrong in one line, never an exception."""
        unknown = set(values) - {i.name for i in self.inputs}
        if unknown:
            return Result(text="", error=f"unknown input {', '.join(sorted(unknown))}")
        checked = {}
        for i in self.inputs:
            try:
                checked[i.name] = i.check(values.get(i.name, i.default))
            except ValueError as e:
                return Result(text="", error=str(e.args[0]), invalid=(i.name,))
        try:
            return self.compute(**checked)
        except (ValueError, KeyError) as e:
            return Result(text="", error=str(e.args[0]) if e.args else str(e))


def refused(error: str, *inputs: str) -> Result:
    """A result that refuses the inputs: `error` in one line, naming the controls it is about."""
    return Result(text="", error=error, invalid=inputs)


# ----------------------------------------------------------------------------- what several chapters share

COLORS = {"parameters": "#4C72B0", "gradients": "#DD8452", "optimizer_states": "#55A868", "activations": "#C44E52",
          "temporaries": "#8172B3", "kv_cache": "#937860", "inputs": "#DA8BC3", "other": "#8C8C8C"}
GPU_CHOICES = tuple(specs.GPUS)
SEQ_CHOICES = (128, 256, 512, 1024, 2048, 4096, 8192)
DECODER_PRESETS = tuple(n for n in specs.preset_names() if specs.preset(n).family in PAR.DECODER_FAMILIES)
MOE_SEQ_CHOICES = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
CAPACITIES = ("dropless", "1.0", "1.25", "1.5", "2.0")


def capacity_factor(value: str) -> float | None:
    """A capacity-factor choice (CAPACITIES) as the library takes it: None for dropless."""
    return None if value == "dropless" else float(value)
