"""Collective communication: what each operation does, what it moves, and how long it takes.
Pure Python: no torch import.

Conventions follow nccl-tests (doc/PERFORMANCE.md): `size` S is the buffer in bytes as nccl-tests
reports it (all-reduce: the buffer; all-gather: the gathered output; reduce-scatter: the input),
algorithm bandwidth algbw = S / t, and bus bandwidth busbw = algbw x factor(op, n), the factor that
makes busbw comparable with the link's peak whatever n is.

Time model: alpha-beta (Hockney): a step that moves m bytes over a link costs alpha + m / B.
Ring algorithms (Thakur, Rabenseifner and Gropp 2005; Patarasuk and Yuan 2009):
    all-gather, reduce-scatter   (n-1) (alpha + S/(nB))
    all-reduce                   2 (n-1) (alpha + S/(nB))      = reduce-scatter + all-gather
    broadcast, reduce (pipelined chain, S split into k chunks)  (n-1+k-1)(alpha + S/(kB))
Tree (binary, pipelining ignored): all-reduce 2 ceil(log2 n) (alpha + S/B).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Iterable, Literal, Sequence

from . import checks as _checks

Op = Literal["broadcast", "reduce", "all_reduce", "reduce_scatter", "all_gather", "all_to_all"]
OPS: tuple[str, ...] = ("broadcast", "reduce", "all_reduce", "reduce_scatter", "all_gather", "all_to_all")
Algorithm = Literal["ring", "tree"]

# What each collective does, for the book's figures: (before, after) per rank r of n, chunks c.
SEMANTICS = {
    "broadcast": "the root's buffer is copied to every rank",
    "reduce": "the element-wise sum of all ranks' buffers lands on the root",
    "all_reduce": "every rank ends with the element-wise sum of all ranks' buffers",
    "reduce_scatter": "rank r ends with chunk r of the element-wise sum (1/n of the buffer)",
    "all_gather": "every rank ends with the concatenation of all ranks' chunks",
    "all_to_all": "rank r sends its chunk j to rank j and receives chunk r from every rank",
}


ALGORITHMS: tuple[str, ...] = ("ring", "tree")
SCHEMES: tuple[str, ...] = ("all_reduce", "parameter_server", "sharded_parameter_server")
MAX_FIGURE_RANKS = 26  # the figures letter the ranks a, b, c, ...


def _check(op: str, n: int, *, hi: int = _checks.MAX_COUNT) -> tuple[str, int]:
    """(op, n) checked: a known collective and a positive whole number of ranks (numpy's too)."""
    _checks.one_of("collective op", op, OPS)
    return op, _checks.whole("n", n, hi=hi)


def _size(size_bytes, name: str = "size_bytes"):
    """A finite number of bytes >= 0 (int stays int)."""
    return _checks.number(name, size_bytes, lo=0, what="a finite number of bytes >= 0")


def as_link(lk, name: str = "lk") -> "Link":
    """A Link, or a preset's name (`link`)."""
    if isinstance(lk, str):
        return link(lk)
    if not isinstance(lk, Link):
        raise ValueError(f"{name} must be a Link or one of {', '.join(LINKS)}, got {_checks.show(lk)}")
    return lk


def _measured(name: str, values, *, lo_open: bool, what: str) -> list:
    """A sequence of measurements (numpy arrays too; not a string or a mapping), each checked."""
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, Iterable):
        raise ValueError(f"{name} must be a list of numbers, got {_checks.show(values)}")
    return [_checks.number(f"{name}[{i}]", v, lo=0, lo_open=lo_open, what=what) for i, v in enumerate(values)]


def busbw_factor(op: Op, n: int) -> Fraction:
    """nccl-tests' bus-bandwidth factor: all-reduce 2(n-1)/n; reduce-scatter, all-gather and
    all-to-all (n-1)/n; broadcast and reduce 1. Exact, as a Fraction."""
    op, n = _check(op, n)
    if op == "all_reduce":
        return Fraction(2 * (n - 1), n)
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return Fraction(n - 1, n)
    return Fraction(1)


def algbw(size_bytes: int, seconds: float) -> float:
    """Algorithm bandwidth, bytes per second."""
    size_bytes = _size(size_bytes)
    return size_bytes / _checks.positive("seconds", seconds)


def busbw(op: Op, n: int, size_bytes: int, seconds: float) -> float:
    """Bus bandwidth, bytes per second: algbw x busbw_factor."""
    factor = float(busbw_factor(op, n))
    return algbw(size_bytes, seconds) * factor


def bytes_sent_per_rank(op: Op, n: int, size_bytes: int, *, algorithm: Algorithm = "ring") -> float:
    """Bytes each rank sends (and receives) for one collective on `size_bytes`, by the ring
    algorithm (broadcast/reduce: a pipelined chain, every non-terminal rank forwards S). The tree
    (algorithm="tree") is modelled for all_reduce only, as in `collective_time`."""
    op, n = _check(op, n)
    size_bytes = _size(size_bytes)
    _checks.one_of("algorithm", algorithm, ALGORITHMS)
    if algorithm == "tree" and op != "all_reduce":
        raise ValueError(f"algorithm='tree' is modelled for all_reduce only, got op {op!r}")
    if n == 1:
        return 0.0
    if algorithm == "tree" and op == "all_reduce":
        return 2.0 * size_bytes  # up the tree and down again
    return float(busbw_factor(op, n)) * size_bytes


@dataclass(frozen=True, kw_only=True)
class Link:
    """A link's per-direction bandwidth (decimal GB/s) and per-message latency (microseconds).
    Presets are vendor peak figures; latencies are typical orders of magnitude (measure yours:
    lab 2 fits them)."""

    name: str
    bandwidth_GBps: float
    latency_us: float

    def __post_init__(self):
        _checks.text("name", self.name)
        object.__setattr__(self, "bandwidth_GBps", _checks.positive("bandwidth_GBps", self.bandwidth_GBps))
        object.__setattr__(self, "latency_us", _checks.number("latency_us", self.latency_us, lo=0))

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_GBps * 1e9

    @property
    def alpha_s(self) -> float:
        return self.latency_us * 1e-6


LINKS: dict[str, Link] = {lk.name: lk for lk in (
    Link(name="pcie4-x16", bandwidth_GBps=32.0, latency_us=5.0),      # PCI-SIG: 16 GT/s x 16 lanes
    Link(name="pcie5-x16", bandwidth_GBps=64.0, latency_us=5.0),      # 32 GT/s x 16 lanes
    Link(name="nvlink3", bandwidth_GBps=300.0, latency_us=3.0),       # A100: 600 GB/s bidirectional
    Link(name="nvlink4", bandwidth_GBps=450.0, latency_us=3.0),       # H100 SXM: 900 GB/s bidirectional
    Link(name="ib-hdr", bandwidth_GBps=25.0, latency_us=5.0),         # InfiniBand HDR 200 Gb/s
    Link(name="ib-ndr", bandwidth_GBps=50.0, latency_us=5.0),         # InfiniBand NDR 400 Gb/s
    Link(name="ethernet-100g", bandwidth_GBps=12.5, latency_us=20.0),  # 100 GbE
)}


def link(name: str) -> Link:
    """A preset link by name."""
    return LINKS[_checks.one_of("link", name, LINKS)]


def collective_time(op: Op, n: int, size_bytes: int, lk: Link | str, *, algorithm: Algorithm = "ring",
                    chunks: int = 1) -> float:
    """Seconds for one collective by the alpha-beta model (formulas in the module docstring)."""
    op, n = _check(op, n)
    size_bytes = _size(size_bytes)
    _checks.one_of("algorithm", algorithm, ALGORITHMS)
    chunks = _checks.whole("chunks", chunks)
    lk = as_link(lk)
    a, B, S = lk.alpha_s, lk.bytes_per_s, size_bytes
    if n == 1:
        return 0.0
    if algorithm == "tree":
        if op != "all_reduce":
            raise ValueError(f"algorithm='tree' is modelled for all_reduce only, got op {op!r}")
        return 2 * math.ceil(math.log2(n)) * (a + S / B)
    if op in ("broadcast", "reduce"):  # pipelined chain of k chunks
        k = max(1, chunks)
        return (n - 2 + k) * (a + S / (k * B))
    ca, cb = alpha_beta_coefficients(op, n)  # all-to-all: n-1 pairwise exchanges of S/n
    return ca * a + cb * S / B


def alpha_beta_coefficients(op: Op, n: int) -> tuple[float, float]:
    """(c_alpha, c_beta) with time = c_alpha * alpha + c_beta * S / B for the ring algorithm (broadcast
    and reduce: the chain in one chunk). c_alpha counts the steps: 2(n-1) for all-reduce, n-1 for the
    rest; c_beta, the bytes each rank sends per byte of S, is nccl-tests' bus-bandwidth factor, which
    is why busbw is comparable with a link's peak."""
    op, n = _check(op, n)
    return (2.0 if op == "all_reduce" else 1.0) * (n - 1), float(busbw_factor(op, n))


def fit_alpha_beta(op: Op, n: int, sizes: Sequence[int], seconds: Sequence[float], *,
                   error: Literal["relative", "absolute"] = "relative") -> Link:
    """Fit the ring model t = c_a alpha + c_b S / B to measured (size, time) pairs; returns the fitted
    Link (bandwidth in GB/s, latency in us).

    error="relative" (default) minimises the sum of squared *relative* residuals ((model - t) / t)^2:
    benchmark sizes span four or more orders of magnitude in time, and an ordinary (absolute) least-squares
    line is decided by the largest sizes alone, which leaves the latency term - the whole story for small
    messages - to their rounding errors. error="absolute" is the ordinary least-squares line."""
    op, n = _check(op, n)
    if not isinstance(error, str) or error not in ("relative", "absolute"):
        raise ValueError(f"error must be 'relative' or 'absolute', not {_checks.show(error)}")
    xs = [float(x) for x in _measured("sizes", sizes, lo_open=False, what="a finite number of bytes >= 0 (not NaN)")]
    ys = [float(t) for t in _measured("seconds", seconds, lo_open=True,
                                      what="a finite positive number of seconds (not NaN)")]
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"sizes and seconds must be two lists of equal length, at least two (size, time) pairs, "
                         f"got {len(xs)} and {len(ys)}")
    ca, cb = alpha_beta_coefficients(op, n)
    ws = [1.0 / y ** 2 for y in ys] if error == "relative" else [1.0] * len(ys)
    sw = sum(ws)
    mx, my = sum(w * x for w, x in zip(ws, xs)) / sw, sum(w * y for w, y in zip(ws, ys)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    if sxx == 0:
        raise ValueError("sizes must differ")
    slope = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)) / sxx  # seconds per byte
    intercept = my - slope * mx
    if slope <= 0:  # time that does not grow with size has no bandwidth to find
        raise ValueError("the times do not grow with the size: no finite bandwidth fits them "
                         "(measure larger sizes, or check the timings)")
    bandwidth = cb / slope
    return Link(name="fitted", bandwidth_GBps=bandwidth / 1e9, latency_us=max(intercept, 0.0) / ca * 1e6)


def data_parallel_sync(n_params: int, n_workers: int, lk: Link | str, *, bytes_per_grad: int = 4,
                       scheme: Literal["all_reduce", "parameter_server", "sharded_parameter_server"] = "all_reduce",
                       ) -> dict[str, float]:
    """One data-parallel gradient synchronisation of n_params gradients (S = n_params x
    bytes_per_grad bytes) across n_workers.
    all_reduce (ring): each worker sends 2(n-1)/n S bytes, whatever n is, in 2(n-1) steps.
    parameter_server (a single server on the same kind of link): every worker pushes its S bytes
      of gradients and pulls S bytes of parameters, so the server's link carries 2 n S bytes and
      the time grows with n — the straw man.
    sharded_parameter_server (Li et al. 2014; BytePS): the parameters are split over n server
      shards, one beside each worker; each worker pushes (n-1)/n S to the other shards and pulls as
      much back, and each shard serves the same: 2(n-1)/n S bytes per link, the ring's traffic, in
      two steps instead of 2(n-1)."""
    n_params = _checks.whole("n_params", n_params, lo=0, hi=10**15)
    n_workers = _checks.whole("n_workers", n_workers)
    bytes_per_grad = _checks.whole("bytes_per_grad", bytes_per_grad, hi=8)
    _checks.one_of("scheme", scheme, SCHEMES)
    lk = as_link(lk)
    S = n_params * bytes_per_grad
    if scheme == "all_reduce":  # every worker's link is equally busy
        sent = bytes_sent_per_rank("all_reduce", n_workers, S)
        return {"seconds": collective_time("all_reduce", n_workers, S, lk), "bytes_per_worker": sent,
                "bytes_busiest_link": sent}
    if scheme == "parameter_server":
        busiest = 2.0 * n_workers * S
        return {"seconds": 2 * lk.alpha_s + busiest / lk.bytes_per_s, "bytes_per_worker": 2.0 * S,
                "bytes_busiest_link": busiest}
    if scheme == "sharded_parameter_server":  # each direction of a link: push + serve = 2 (n-1)/n S
        per_link = 2.0 * (n_workers - 1) / n_workers * S
        return {"seconds": 2 * lk.alpha_s + per_link / lk.bytes_per_s, "bytes_per_worker": per_link,
                "bytes_busiest_link": per_link}
    raise ValueError(f"unknown scheme {scheme!r}; choose all_reduce, parameter_server or sharded_parameter_server")


# ----------------------------------------------------------------------------- for the figures

def before_after(op: Op, n: int) -> tuple[list[list[str]], list[list[str]]]:
    """What rank r holds before and after `op`, as n rows of n chunk labels: 'a2' is rank a's
    chunk 2 (ranks lettered a, b, c, ...), 'Σ2' the sum over ranks of chunk 2, '' nothing."""
    op, n = _check(op, n, hi=MAX_FIGURE_RANKS)
    rk = [chr(ord("a") + r) for r in range(n)]
    own = [[f"{rk[r]}{c}" for c in range(n)] for r in range(n)]
    total = [f"Σ{c}" for c in range(n)]
    empty = [[""] * n for _ in range(n)]
    if op == "broadcast":
        return [own[0]] + empty[1:], [own[0][:] for _ in range(n)]
    if op == "reduce":
        return own, [total] + empty[1:]
    if op == "all_reduce":
        return own, [total[:] for _ in range(n)]
    if op == "reduce_scatter":
        return own, [[total[c] if c == r else "" for c in range(n)] for r in range(n)]
    if op == "all_gather":
        before = [[own[r][c] if c == r else "" for c in range(n)] for r in range(n)]
        return before, [[own[c][c] for c in range(n)] for _ in range(n)]
    # all_to_all: rank r's chunk j goes to rank j, into slot r
    return own, [[own[c][r] for c in range(n)] for r in range(n)]


def ring_all_reduce_steps(n: int) -> list[tuple[str, list[list[str]]]]:
    """The ring all-reduce's state after each step: (title, n x n grid of what each rank holds for
    each chunk; a partial sum of ranks {a, b} of chunk 2 is 'ab2', the full sum 'Σ2')."""
    _, n = _check("all_reduce", n, hi=MAX_FIGURE_RANKS)
    rk = [chr(ord("a") + r) for r in range(n)]
    hold = [[(frozenset([r]), c) for c in range(n)] for r in range(n)]

    def label(h):
        who, c = h
        return f"Σ{c}" if len(who) == n else "".join(rk[r] for r in sorted(who)) + str(c)

    states = [("start", [[label(h) for h in row] for row in hold])]
    for step in range(n - 1):  # reduce-scatter: rank r sends chunk (r - step) to rank r + 1, which adds
        sends = [(r, (r - step) % n, hold[r][(r - step) % n][0]) for r in range(n)]
        for r, c, who in sends:
            dst = (r + 1) % n
            hold[dst][c] = (hold[dst][c][0] | who, c)
        states.append((f"reduce-scatter {step + 1}/{n - 1}", [[label(h) for h in row] for row in hold]))
    for step in range(n - 1):  # all-gather: rank r forwards its complete chunk (r + 1 - step)
        sends = [(r, (r + 1 - step) % n, hold[r][(r + 1 - step) % n]) for r in range(n)]
        for r, c, h in sends:
            hold[(r + 1) % n][c] = h
        states.append((f"all-gather {step + 1}/{n - 1}", [[label(h) for h in row] for row in hold]))
    return states
