"""Pipeline schedules: the bubble, a schedule simulated (its makespan, what each device holds in flight,
its operations replayed), any per-device order replayed, and the moments of an interleaved stage that may
peak. Pure Python: no torch import.

- Bubble: GPipe's fraction of the step's total time, (p-1)/(m+p-1), or Megatron's (Narayanan et
  al. 2021, arXiv:2104.04473) relative to the ideal time, (p-1)/m; interleaved 1F1B with v model
  chunks per device divides the bubble by v. `bubble_fraction(..., of=...)` says which.
- `simulate` runs GPipe, 1F1B or Megatron's interleaved 1F1B on p devices; `parallel.estimate_layout`
  takes its counts of micro-batches in flight (`in_flight_counts`) and an interleaved stage's moments
  (`interleaved_points`) for a layout's stages.
"""

from __future__ import annotations

import collections.abc as _abc
import functools
import numbers as _numbers
import operator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

from . import checks as _checks

Schedule = Literal["gpipe", "1f1b", "interleaved"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")
MAX_STAGES = 1 << 20  # pipeline stages: as parallel.MAX_DEVICES
MAX_MICRO_BATCHES = 1 << 14


def check_schedule(schedule, p: int, m: int, v: int, *, names: tuple[str, str, str] = ("p", "m", "chunks")) -> str:
    """The one rule for a schedule and its counts, used by `parallel.Layout`, `bubble_fraction` and `simulate`
    (each names p, m and v as its caller wrote them): the interleaved schedule needs p > 1 and runs
    micro-batches in groups of p (m a multiple of p); chunks (v) apply to it only."""
    P_, M_, V_ = names
    schedule = str(_checks.one_of("schedule", schedule, SCHEDULES))
    if schedule == "interleaved":
        if p == 1:
            raise ValueError(f"{P_} must be at least 2 for the interleaved schedule (it needs {P_} > 1), got 1")
        if m % p:
            raise ValueError(f"{M_} must be a multiple of {P_} ({p}) under the interleaved schedule, which runs "
                             f"micro-batches in groups of {P_}, got {m}")
    elif v != 1:
        raise ValueError(f"{V_} must be 1 under the {schedule} schedule (model chunks per device apply to the "
                         f"interleaved schedule only), got {v}")
    return schedule


def _time(name: str, value) -> Fraction:
    """A positive finite duration (ints, floats, Fractions, numpy scalars; `checks.number`), kept exact
    as a Fraction: an int or a Fraction stays what it is, a float is its exact binary value."""
    _checks.positive(name, value)
    if isinstance(value, (int, Fraction)):
        return Fraction(value)
    if isinstance(value, _numbers.Integral):  # numpy integers
        return Fraction(operator.index(value))
    return Fraction(float(value))  # floats (numpy's float32 too: float() is exact)


# ============================================================================ the bubble
def bubble_fraction(p: int, m: int, schedule: Schedule = "1f1b", *, chunks: int = 1,
                    of: Literal["total", "ideal"] = "total") -> Fraction:
    """The pipeline bubble with equal stages and no communication time. `of="total"`: the share of
    the step's time a device idles (GPipe's convention): (p-1)/(m+p-1), interleaved (p-1)/(vm+p-1).
    `of="ideal"`: bubble time over ideal time (Megatron's): (p-1)/m, interleaved (p-1)/(vm).
    GPipe and 1F1B have the same bubble; 1F1B holds fewer micro-batches in flight."""
    p, m = _checks.whole("p", p, hi=MAX_STAGES), _checks.whole("m", m, hi=MAX_MICRO_BATCHES)
    v = _checks.whole("chunks", chunks, hi=1024)
    check_schedule(schedule, p, m, v)
    if _checks.is_bool(of) or not isinstance(of, str) or of not in ("total", "ideal"):
        raise ValueError(f"of must be 'total' or 'ideal', got {_checks.show(of)}")
    if of == "ideal":
        return Fraction(p - 1, v * m)
    return Fraction(p - 1, v * m + p - 1)


@dataclass(frozen=True)
class Op:
    device: int
    kind: str  # "F" or "B"
    micro: int
    chunk: int  # model chunk on the device (0 unless interleaved)
    start: Fraction
    end: Fraction


@dataclass(frozen=True)
class PipelineRun:
    """A simulated schedule: every forward and backward with its start and end (in units of one
    micro-batch's forward through one device's whole share of the model). `makespan`, `in_flight`
    and `bubble` come from closed forms; `ops` is replayed when first read."""

    p: int
    m: int
    schedule: str
    chunks: int
    makespan: Fraction
    in_flight: tuple[int, ...]  # per device, the most (micro-batch, chunk) activations held at once
    forward: Fraction = Fraction(1)
    backward: Fraction = Fraction(2)

    @functools.cached_property
    def ops(self) -> tuple[Op, ...]:
        """Every forward and backward, by device and then by start (2 p m v of them)."""
        return _replay_ops(self.p, self.m, self.schedule, self.chunks, self.forward, self.backward)

    @property
    def bubble(self) -> Fraction:
        """Idle share of the total device time: each device is busy m (forward + backward) of the
        makespan (what the replayed ops add up to)."""
        return 1 - self.m * (self.forward + self.backward) / self.makespan


def _orders(p: int, m: int, schedule: str, v: int) -> list[list[tuple[str, int, int]]]:
    """Each device's sequence of (kind, micro-batch, chunk)."""
    orders = []
    for d in range(p):
        if schedule == "gpipe":
            orders.append([("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)])
        elif schedule == "1f1b":
            warm = min(p - d - 1, m)
            seq = [("F", i, 0) for i in range(warm)]
            f, bk = warm, 0
            while f < m:  # steady state: one forward, one backward
                seq += [("F", f, 0), ("B", bk, 0)]
                f, bk = f + 1, bk + 1
            seq += [("B", i, 0) for i in range(bk, m)]
            orders.append(seq)
        else:  # Megatron's interleaved 1F1B: micro-batches in groups of p, chunk by chunk
            total = m * v

            def fwd(k):
                return ("F", (k // (p * v)) * p + k % p, (k // p) % v)

            def bwd(k):
                return ("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

            warm = _warmup(p, m, v, d)
            seq = [fwd(k) for k in range(warm)]
            for k in range(total - warm):
                seq += [fwd(warm + k), bwd(k)]
            seq += [bwd(k) for k in range(total - warm, total)]
            orders.append(seq)
    return orders


def _warmup(p: int, m: int, v: int, d: int) -> int:
    """Forwards device d runs before its first backward under the interleaved schedule (Megatron-LM)."""
    return min((p - d - 1) * 2 + (v - 1) * p, m * v)


def simulate(p: int, m: int, schedule: Schedule = "1f1b", *, chunks: int = 1, forward: float = 1,
             backward: float = 2) -> PipelineRun:
    """Run a schedule on p devices: each device executes its ops in its schedule's order, each op as
    soon as its input exists (a forward needs the previous stage's forward of that micro-batch; a
    backward needs the next stage's backward, or, on the last stage, its own forward). A forward of
    one micro-batch through one device's share takes `forward`, a backward `backward` (about twice
    as long: two matmuls per matmul), divided by v under interleaving. Communication is free.

    The answer's numbers are closed forms of that replay (equal to it for every input; tested
    against the event simulation): the makespan (m + p - 1)(f + b) for GPipe and 1F1B, (vm + p - 1)
    (f + b)/v interleaved; per device the most activations in flight, which a device's own order
    fixes (its ends come one after another); the ops themselves are replayed when first read."""
    p, m = _checks.whole("p", p, hi=256), _checks.whole("m", m, hi=1024)
    v = _checks.whole("chunks", chunks, hi=64)
    schedule = check_schedule(schedule, p, m, v)
    return _simulate(p, m, schedule, v, _time("forward", forward), _time("backward", backward))


def replay_orders(orders: list[list[tuple[str, int, int]]], took: list[list], *, what: str = "these operations"
                  ) -> list[tuple[int, str, int, int, Any, Any]]:
    """Run each device's operations in its given order, each as soon as its input exists: a forward
    of micro-batch i needs the previous virtual stage's forward of i; a backward needs the next
    virtual stage's backward of i or, on the last one, its own forward. orders[d] holds (kind "F" or
    "B", micro-batch, chunk) with virtual stage chunk * p + d; took[d][k] is how long device d's k-th
    operation takes. Returns (device, kind, micro-batch, chunk, start, end) in the order they were
    placed; a ValueError when a device waits for an operation no device runs."""
    _checks.text("what", what)
    if isinstance(orders, (str, bytes, dict)) or not isinstance(orders, _abc.Sequence) or not orders:
        raise ValueError(f"orders must be a non-empty list (one per device) of lists of (kind, micro-batch, chunk), "
                         f"got {_checks.show(orders)}")
    if isinstance(took, (str, bytes, dict)) or not isinstance(took, _abc.Sequence) or len(took) != len(orders):
        raise ValueError(f"took must be a list of {len(orders)} lists of durations (one per device, as orders), "
                         f"got {_checks.show(took)}")
    clean_orders, clean_took = [], []
    for d, (order, times) in enumerate(zip(orders, took)):
        if isinstance(order, (str, bytes, dict)) or not isinstance(order, _abc.Iterable):
            raise ValueError(f"orders[{d}] must be a list of (kind, micro-batch, chunk), got {_checks.show(order)}")
        order = list(order)
        ops = []
        for k, op in enumerate(order):
            if isinstance(op, (str, bytes, dict)) or not isinstance(op, _abc.Iterable) or len(op := tuple(op)) != 3:
                raise ValueError(f"orders[{d}][{k}] must be (kind, micro-batch, chunk), got {_checks.show(op)}")
            kind = _checks.one_of(f"orders[{d}][{k}] kind", op[0], ("F", "B"))
            ops.append((str(kind), _checks.whole(f"orders[{d}][{k}] micro-batch", op[1], lo=0),
                        _checks.whole(f"orders[{d}][{k}] chunk", op[2], lo=0, hi=1 << 20)))
        if isinstance(times, (str, bytes, dict)) or not isinstance(times, _abc.Iterable):
            raise ValueError(f"took[{d}] must be a list of durations, got {_checks.show(times)}")
        times = list(times)
        if len(times) != len(ops):
            raise ValueError(f"took[{d}] must hold one duration per operation of orders[{d}] ({len(ops)}), "
                             f"got {len(times)}")
        for k, x in enumerate(times):
            _checks.number(f"took[{d}][{k}]", x, lo=0)  # checked; the value itself is kept (a Fraction stays exact)
        clean_orders.append(ops)
        clean_took.append(times)
    return _replay(clean_orders, clean_took, what)


def _replay(orders: list[list[tuple[str, int, int]]], took: list[list], what: str
            ) -> list[tuple[int, str, int, int, Any, Any]]:
    p = len(orders)
    stages = p * (1 + max((c for order in orders for _, _, c in order), default=0))
    done: dict[tuple[str, int, int], Any] = {}
    pos, free, ticks = [0] * p, [0] * p, []
    while any(pos[d] < len(orders[d]) for d in range(p)):
        progressed = False
        for d in range(p):
            if pos[d] == len(orders[d]):
                continue
            kind, i, c = orders[d][pos[d]]
            stage = c * p + d
            if kind == "F":
                need = [("F", i, stage - 1)] if stage > 0 else []
            else:
                need = [("B", i, stage + 1)] if stage < stages - 1 else [("F", i, stage)]
            if all(n in done for n in need):
                start = max([free[d], *(done[n] for n in need)])
                end = start + took[d][pos[d]]
                done[(kind, i, stage)] = end
                ticks.append((d, kind, i, c, start, end))
                free[d], pos[d], progressed = end, pos[d] + 1, True
        if not progressed:
            raise ValueError(f"{what} cannot be replayed: a stage waits for an operation no stage runs")
    return ticks


def in_flight_counts(p: int, m: int, schedule: str, v: int) -> tuple[int, ...]:
    """Per device, the most (micro-batch, chunk) activations held at once: held from a forward's end
    to its backward's end. A device's operations end one after another in its own order, so its
    peak is its order's: the forwards before its first backward, plus the one that precedes it in
    the steady state (all of them when there is none)."""
    if schedule == "gpipe":
        return (m,) * p
    if schedule == "1f1b":
        return tuple(min(p - d, m) for d in range(p))
    return tuple(min((p - d - 1) * 2 + (v - 1) * p + 1, m * v) for d in range(p))


@functools.lru_cache(maxsize=256)
def _simulate(p: int, m: int, schedule: str, v: int, forward: Fraction, backward: Fraction) -> PipelineRun:
    # the critical path: the first micro-batch's forward down the pipeline, the last stage's forwards
    # and backwards back to back, the last backward up the pipeline; interleaved, each device's share
    # is v chunks of 1/v the time, and the pipeline is filled and drained by one chunk's worth. The
    # replay waits no longer, whatever the durations (tests/test_args_parallel.py checks it against
    # the event simulation)
    if schedule == "interleaved":
        makespan = Fraction(v * m + p - 1, v) * (forward + backward)
    else:
        makespan = (m + p - 1) * (forward + backward)
    return PipelineRun(p, m, schedule, v, makespan, in_flight_counts(p, m, schedule, v), forward, backward)


def _replay_ops(p: int, m: int, schedule: str, v: int, forward: Fraction, backward: Fraction) -> tuple[Op, ...]:
    """The schedule's operations, replayed (`replay_orders`) in integer ticks (fast in the browser
    too): one tick = 1/(v * the durations' denominators)."""
    unit = Fraction(1, v * forward.denominator * backward.denominator)
    tf, tb = int(forward / v / unit), int(backward / v / unit)
    orders = _orders(p, m, schedule, v)
    ticks = _replay(orders, [[tf if kind == "F" else tb for kind, _, _ in order] for order in orders],
                    f"the {schedule} schedule")
    return tuple(Op(d, kind, i, c, start * unit, end * unit)
                 for d, kind, i, c, start, end in sorted(ticks, key=lambda x: (x[0], x[4])))


@functools.lru_cache(maxsize=4096)
def interleaved_points(p: int, m: int, v: int, stage: int, received_inputs: bool,
                        sends_pend: bool) -> tuple[tuple[int, int, int], ...]:
    """Before each of the stage's backwards, in its order (`_orders`): the pairs in flight, those whose
    input is a receive buffer, the sends still pending; for each count in flight the first moment
    with the most pending over received. Counted in closed form, not walked: forward k runs chunk
    (k // p) % v, backward k chunk v - 1 - (k // p) % v, so chunk counts repeat every p v operations.
    In the steady state (a forward, then a backward) the pairs in flight stay warm-up + 1; pending -
    received never falls and grows over any p v backwards (on stage 0 it may stay level: the first
    of the level tail counts), and without pending sends it repeats every p v (stage 0) or stays
    level. The drain's backwards each have their own count in flight."""
    pv, total = p * v, m * v
    warm = _warmup(p, m, v, stage)
    steady = total - warm

    def count(n: int, r: int) -> int:  # operations j < n whose (j // p) % v == r
        q, rem = divmod(n, pv)
        return q * p + min(max(rem - r * p, 0), p)

    def point(k: int) -> tuple[int, int, int]:  # before backward k
        forwards = min(warm + k + 1, total)
        n = forwards - k
        alive0 = count(forwards, 0) - count(k, v - 1)  # chunk 0's pairs in flight
        got = (n - (alive0 if stage == 0 else 0)) if received_inputs else 0
        # each backward done sent its chunk's input gradient (all but virtual stage 0) and had sent its
        # output (all but the last virtual stage): backwards of chunk 0 are those with (j // p) % v == v - 1
        pending = 2 * k - (count(k, v - 1) if stage == 0 else 0) - (count(k, 0) if stage == p - 1 else 0)
        return n, got, pending if sends_pend else 0

    if not sends_pend:  # only the most in flight counts: the steady state's (the drain's first if none)
        ks = range(min(steady, pv)) if steady and received_inputs and stage == 0 else (0,)
    elif not steady:
        ks = range(total)
    else:
        k = steady - 1  # the steady state's last backward, or the first of its level tail (stage 0)
        if stage == 0:
            _, got, sends = point(k)
            while k > 0:
                _, got_before, sends_before = point(k - 1)
                if sends_before - got_before != sends - got:
                    break
                k -= 1
        ks = (k, *range(steady, total))
    best: dict[int, tuple[int, int]] = {}
    for k in ks:
        n, got, sends = point(k)
        if n not in best or sends - got > best[n][1] - best[n][0]:
            best[n] = (got, sends)
    if not sends_pend:  # a pair in flight weighs more than its received input: the most in flight
        n = max(best)
        return ((n, *best[n]),)
    # the stage's memory grows linearly in both (pairs in flight, sends - received), so only the
    # corners of the upper hull of those points can be its peak (fewer in flight with more pending)
    hull: list[tuple[int, int]] = []
    for n in sorted(best):
        e = best[n][1] - best[n][0]
        while len(hull) >= 2 and ((hull[-1][0] - hull[-2][0]) * (e - hull[-2][1])
                                  - (hull[-1][1] - hull[-2][1]) * (n - hull[-2][0])) >= 0:
            hull.pop()
        hull.append((n, e))
    top = max(hull)
    return tuple((n, *best[n]) for n, e in reversed(hull) if n == top[0] or e > top[1])


__all__ = ["SCHEDULES", "bubble_fraction", "simulate", "PipelineRun", "Op", "replay_orders", "check_schedule",
           "in_flight_counts", "interleaved_points"]
