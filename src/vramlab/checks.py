"""One vocabulary for checking arguments, shared by every public entry point.

Every check takes the argument's own name first and returns the value as a plain Python type, or
raises one `ValueError` that names the argument and says what it must be:

- `whole(name, v, lo=1, hi=MAX_COUNT)`: a whole number in [lo, hi] (ints and numpy integers;
  never a bool, a float or a string);
- `number(name, v, lo=0, hi=None, ...)`: a finite real number (ints, floats, numpy scalars;
  never a bool, a string, NaN or an infinity), with open or closed bounds;
- `positive(name, v)` (> 0), `fraction(name, v)` (in (0, 1]), `share(name, v)` (in [0, 1]);
- `one_of(name, v, choices)`, `flag(name, v)` (True or False, numpy's too);
- `numbers(name, vs, ...)` and `wholes(name, vs, ...)`: non-empty sequences of the above;
- `positions(spec, seq_len)`, `divides_heads(spec, tp)`, `has_decoder(spec, what)`: what a model
  allows.

Pure Python (no numpy import: numpy's scalars are recognised through the `numbers` ABCs and
`__index__`), so it runs in the browser as in CPython. `argtype` adapts a check for argparse and
`Parser` is an ArgumentParser whose errors are one line (exit 2): the lab commands use both.
"""

from __future__ import annotations

import argparse
import math
import numbers as _numbers
import operator
from typing import Any, Callable, Iterable, NoReturn

# A count (sequences in a batch, tokens, layers, ranks...) far beyond any real run, small enough to stay
# exact and fast: 10^35 is a typo, not a question.
MAX_COUNT = 1 << 31
# bounds for counts larger than MAX_COUNT: parameters (10^15 is 1,000x any model) and bytes (an exbibyte)
MAX_PARAMS = 10**15
MAX_BYTES = 1 << 60


def is_bool(value) -> bool:
    """True for Python's and numpy's booleans, which are never a count, a number or a choice."""
    return isinstance(value, bool) or type(value).__name__ in ("bool_", "bool")  # numpy.bool_ too


def index(value) -> int | None:
    """An int or a numpy integer, as an int; None for anything else (a bool, a float, a string)."""
    if is_bool(value):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _same_kind(a, b) -> bool:
    if isinstance(a, _numbers.Integral) and isinstance(b, _numbers.Integral):
        return True
    if isinstance(a, _numbers.Number) or isinstance(b, _numbers.Number):
        return type(a) is type(b) or (isinstance(a, float) and isinstance(b, float))
    return True


def show(value) -> str:
    """The value as Python writes it, cut short: an error is one line."""
    r = repr(value)
    return r if len(r) <= 60 else r[:40] + "..." + r[-12:]


def _fmt(value) -> str:
    return f"{value:,}" if isinstance(value, int) else f"{value:g}"


def whole(name: str, value, *, lo: int = 1, hi: int = MAX_COUNT) -> int:
    """A whole number in [lo, hi] (an int or a numpy integer), as an int; else a ValueError naming
    `name`. Bools, floats (even 2.0) and strings are refused: a count is never a truth value or a
    measurement."""
    v = index(value)
    if v is None or not lo <= v <= hi:
        if v is not None and v > hi and hi == MAX_COUNT:
            raise ValueError(f"{name} must be at most {hi:,}, got {v:,}")
        if hi == MAX_COUNT:
            what = "a positive integer" if lo == 1 else f"a whole number >= {lo:,}"
        else:
            what = f"a whole number from {lo:,} to {hi:,}"
        raise ValueError(f"{name} must be {what}, got {show(value)}")
    return v


def number(name: str, value, *, lo: float | None = 0, hi: float | None = None, lo_open: bool = False,
           hi_open: bool = False, what: str | None = None) -> float:
    """A finite real number within the bounds (None: unbounded on that side), as a float (an int
    stays an int, so byte counts stay exact); else a ValueError naming `name`. Bools, strings,
    NaN and infinities are refused."""
    ok = not is_bool(value) and isinstance(value, _numbers.Real)
    if ok:
        v = value if isinstance(value, int) else (int(value) if isinstance(value, _numbers.Integral) else float(value))
        ok = abs(v) < 10**300 if isinstance(v, int) else math.isfinite(v)  # beyond a float's range is a typo
        if ok and lo is not None:
            ok = v > lo if lo_open else v >= lo
        if ok and hi is not None:
            ok = v < hi if hi_open else v <= hi
    if not ok:
        if what is None:
            if lo is not None and hi is not None:
                what = f"a number in {'(' if lo_open else '['}{_fmt(lo)}, {_fmt(hi)}{')' if hi_open else ']'}"
            elif lo is not None:
                what = "a positive number" if (lo == 0 and lo_open) else f"a number {'>' if lo_open else '>='} {_fmt(lo)}"
            elif hi is not None:
                what = f"a number {'<' if hi_open else '<='} {_fmt(hi)}"
            else:
                what = "a number"
            what = f"a finite {what[2:]}" if what.startswith("a ") else what
        raise ValueError(f"{name} must be {what}, got {show(value)}")
    return v


def positive(name: str, value, *, hi: float | None = None) -> float:
    """A finite number > 0."""
    return number(name, value, lo=0, lo_open=True, hi=hi)


def fraction(name: str, value) -> float:
    """A number in (0, 1]: a share of something that cannot be nothing (an efficiency, a utilisation)."""
    return number(name, value, lo=0, lo_open=True, hi=1)


def share(name: str, value) -> float:
    """A number in [0, 1]."""
    return number(name, value, lo=0, hi=1)


def one_of(name: str, value, choices: Iterable) -> Any:
    """`value` if it is one of `choices` (a bool never stands for 1 or 0), else a ValueError listing them."""
    choices = tuple(choices)
    if type(value) is str and value in choices:  # the common case: a string among strings
        return value
    if not is_bool(value):
        for c in choices:
            try:
                # equal and of the same kind: 2.0 is not the choice 2, True is not 1, "2" is not 2
                if value == c and _same_kind(value, c):
                    return c  # the choice itself: a numpy integer comes back as the plain int it matched
            except (TypeError, ValueError):  # an array, or something whose == gives no truth value
                break
    raise ValueError(f"unknown {name} {show(value)}; choose from {', '.join(str(c) for c in choices)}")


def flag(name: str, value) -> bool:
    """True or False (numpy's too), as a bool; 1, 'yes' and None are refused."""
    if not is_bool(value):
        raise ValueError(f"{name} must be True or False, got {show(value)}")
    return bool(value)


def numbers(name: str, values, *, lo: float | None = 0, hi: float | None = None, lo_open: bool = False,
            empty: bool = False) -> list:
    """A sequence (not a string or a mapping) of finite numbers within the bounds, as a list."""
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, Iterable):
        raise ValueError(f"{name} must be a list of numbers, got {show(values)}")
    out = list(values)
    if not out and not empty:
        raise ValueError(f"{name} must not be empty")
    for i, v in enumerate(out):
        if type(v) is float and math.isfinite(v) and (lo is None or (v > lo if lo_open else v >= lo)) \
                and (hi is None or v <= hi):
            continue  # the common case
        out[i] = number(f"{name}[{i}]", v, lo=lo, hi=hi, lo_open=lo_open)
    return out


def wholes(name: str, values, *, lo: int = 0, hi: int = MAX_COUNT, empty: bool = False) -> list[int]:
    """A sequence (not a string or a mapping) of whole numbers in [lo, hi], as a list of ints."""
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, Iterable):
        raise ValueError(f"{name} must be a list of whole numbers, got {show(values)}")
    out = list(values)
    if not out and not empty:
        raise ValueError(f"{name} must not be empty")
    if all(type(v) is int and lo <= v <= hi for v in out):  # the common case, in one pass
        return out
    return [whole(f"{name}[{i}]", v, lo=lo, hi=hi) for i, v in enumerate(out)]


def text(name: str, value) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{name} must be a non-empty string, got {show(value)}")
    return value


# What a model allows. `spec` is a specs.ModelSpec (not imported: specs imports this module).

def positions(spec, seq_len: int, *, name: str = "seq_len") -> int:
    """A model reads at most max_position_embeddings tokens (its learned position table, or the
    context its rotary embedding was trained for); T5's relative positions have no such limit."""
    limit = spec.max_position_embeddings
    if spec.family != "t5" and limit and seq_len > limit:
        raise ValueError(f"{spec.name} reads at most {limit:,} positions; {name} {seq_len:,} is longer")
    return seq_len


def divides_heads(spec, tp: int, *, name: str = "tp") -> int:
    """Tensor parallelism splits attention by heads (and key/value heads): `tp` must divide both."""
    kv = getattr(spec, "num_kv_heads", None) or spec.num_heads
    if spec.num_heads % tp or kv % tp:
        heads = f"{spec.num_heads} heads" + (f" and {kv} key/value heads" if kv != spec.num_heads else "")
        raise ValueError(f"{name}={tp} must divide {spec.name}'s {heads}")
    return tp


def has_decoder(spec, what: str = "generation") -> None:
    """Generation needs a decoder: an encoder-only model (BERT) has no next token to produce."""
    if spec.family == "bert":
        raise ValueError(f"{spec.name} is encoder-only: it has no decoder, so {what} does not apply")


def no_unknown(where: str, given: dict, known: Iterable[str]) -> None:
    """For functions that pass **kwargs on: an unknown keyword is named in one ValueError."""
    extra = sorted(set(given) - set(known))
    if extra:
        raise ValueError(f"{where}: unknown argument{'s' if len(extra) > 1 else ''} {', '.join(extra)}")


# The command line: argparse adapters, one line per error.

def argtype(check: Callable, parse: Callable[[str], Any] = int, **kwargs) -> Callable[[str], Any]:
    """An argparse `type=` from a check: `argtype(whole, lo=1, hi=64)` reads an int and checks it;
    `argtype(number, float, lo=0, lo_open=True)` a float. The error line names the option."""

    def convert(text_value: str):
        try:
            value = parse(text_value)
        except (TypeError, ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"cannot read {text_value!r}") from None
        try:
            return check("the value", value, **kwargs)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix("the value ")) from None

    convert.__name__ = getattr(check, "__name__", "value")
    return convert


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose every error is one line on stderr and exit status 2 (argparse prints
    the whole usage first; `--help` still shows it)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def fail(prog: str, message: str) -> NoReturn:
    """One line on stderr, exit 2: for checks a command makes after parsing, before starting work."""
    import sys

    sys.stderr.write(f"{prog}: error: {message}\n")
    raise SystemExit(2)


def output_path(prog: str, path, *, make_folder: bool = False) -> None:
    """Fail before the work, not after it: `path` (--out) must be a file that can be written. With
    `make_folder` (the command makes the folder when it writes) a missing folder is made now;
    without, it must exist. None, "" and "-" (stdout) pass. One line on stderr, exit 2 otherwise."""
    import os

    if path is None or str(path) in ("", "-"):
        return
    path = str(path)
    folder = os.path.dirname(os.path.abspath(path))
    above = folder
    while not os.path.exists(above) and os.path.dirname(above) != above:
        above = os.path.dirname(above)
    if os.path.exists(above) and not os.path.isdir(above):  # afile/x.json: afile is no folder
        fail(prog, f"--out {path!r}: {above!r} is a file, not a folder")
    if os.path.isdir(path):
        fail(prog, f"--out {path!r} is a folder, not a file")
    if make_folder:
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            fail(prog, f"cannot write --out {path!r}: {e.strerror or e}")
    if not os.path.isdir(folder):
        fail(prog, f"--out {path!r}: the folder {folder!r} does not exist")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        fail(prog, f"--out {path!r} cannot be written")
    probe = os.path.join(folder, f".vramlab-out-{os.getpid()}.tmp")  # what os.access cannot see (root, mounts)
    try:
        with open(probe, "w"):
            pass
        os.unlink(probe)
    except OSError as e:
        fail(prog, f"cannot write --out {path!r}: {e.strerror or e}")
