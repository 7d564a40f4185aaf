"""Byte units. Memory is reported in binary units (KiB, MiB, GiB = 2**10, 2**20, 2**30 bytes);
decimal GB (10**9) appears only when quoting a vendor's figure."""

from __future__ import annotations

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
GB = 10**9  # decimal, vendor data sheets only

_BINARY = (("GiB", GiB), ("MiB", MiB), ("KiB", KiB))


def to_gib(n_bytes: int | float) -> float:
    return n_bytes / GiB


def to_mib(n_bytes: int | float) -> float:
    return n_bytes / MiB


def fmt_bytes(n_bytes: int | float, *, digits: int = 2) -> str:
    """Human-readable binary size: fmt_bytes(3 * 2**30) == '3.00 GiB'. Negative values keep their sign."""
    sign = "-" if n_bytes < 0 else ""
    n = abs(n_bytes)
    for name, size in _BINARY:
        if n >= size:
            return f"{sign}{n / size:.{digits}f} {name}"
    return f"{sign}{int(n)} B"


def parse_bytes(text: str) -> int:
    """Parse '16GiB', '16 GB', '512MiB', '1024' (bytes) into integer bytes."""
    units = {"b": 1, "kib": KiB, "mib": MiB, "gib": GiB, "tib": 1 << 40,
             "kb": 10**3, "mb": 10**6, "gb": GB, "tb": 10**12}
    s = text.strip().lower().replace(" ", "")
    for suffix in sorted(units, key=len, reverse=True):
        if s.endswith(suffix):
            number = s[: -len(suffix)]
            break
    else:
        suffix, number = "b", s
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"cannot read a size from {text!r}: expected e.g. '16GiB' or '512MiB'") from None
    if value < 0:
        raise ValueError(f"a size cannot be negative: {text!r}")
    return int(round(value * units[suffix]))
