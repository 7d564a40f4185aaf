"""Byte units. Memory is reported in binary units (KiB, MiB, GiB = 2**10, 2**20, 2**30 bytes);
decimal GB (10**9) appears only when quoting a vendor's figure."""

from __future__ import annotations

import math

from . import checks as _checks

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
GB = 10**9  # decimal, vendor data sheets only

_BINARY = (("GiB", GiB), ("MiB", MiB), ("KiB", KiB))


def to_gib(n_bytes: int | float) -> float:
    return _checks.number("n_bytes", n_bytes, lo=None) / GiB


def to_mib(n_bytes: int | float) -> float:
    return _checks.number("n_bytes", n_bytes, lo=None) / MiB


def fmt_bytes(n_bytes: int | float, *, digits: int = 2) -> str:
    """Human-readable binary size: fmt_bytes(3 * 2**30) == '3.00 GiB'. Negative values keep their sign.
    A byte count is a finite number (numpy's too): a bool, a string, NaN or an infinity is a ValueError."""
    n_bytes = _checks.number("n_bytes", n_bytes, lo=None, what="a finite number of bytes")
    digits = _checks.whole("digits", digits, lo=0, hi=20)
    sign = "-" if n_bytes < 0 else ""
    n = abs(n_bytes)
    for name, size in _BINARY:
        if n >= size:
            return f"{sign}{n / size:.{digits}f} {name}"
    return f"{sign}{int(n)} B"


def parse_bytes(text: str) -> int:
    """Parse '16GiB', '16 GB', '512MiB', '1024' (bytes) into integer bytes."""
    _checks.text("text", text)
    units = {"b": 1, "kib": KiB, "mib": MiB, "gib": GiB, "tib": 1 << 40,
             "kb": 10**3, "mb": 10**6, "gb": GB, "tb": 10**12}
    s = text.strip().lower().replace(" ", "")
    for suffix in sorted(units, key=len, reverse=True):
        if s.endswith(suffix):
            number = s[: -len(suffix)]
            break
    else:
        suffix, number = "b", s
    shown = text if len(text) <= 40 else text[:30] + "..."
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"text must be a size such as '16GiB' or '512MiB', got {shown!r}") from None
    if not math.isfinite(value) or not math.isfinite(value * units[suffix]) or value * units[suffix] >= 10**300:
        raise ValueError(f"text must be a finite size such as '16GiB', got {shown!r}")
    if value < 0:
        raise ValueError(f"text must not be a negative size, got {shown!r}")
    return int(round(value * units[suffix]))
