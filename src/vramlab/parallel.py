"""Data, tensor and pipeline parallelism: memory per device, the pipeline bubble, communication.
Pure Python: no torch import.

A layout is `dp` data-parallel replicas x `tp` tensor-parallel ranks x `pp` pipeline stages
(dp * tp * pp devices), optionally with sequence parallelism (`sp`, Korthikanti et al. 2022) and
`micro_batches` micro-batches per step run by a pipeline schedule.

- Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, arXiv:1909.08053) splits each block's
  matrices by t: the first linear of the MLP and the q/k/v projections by columns (output features,
  i.e. attention heads) with their biases, the second linear of the MLP and the attention's output
  projection by rows (input features; their biases are replicated); the word embedding and the LM
  head by vocabulary. Norms and learned position embeddings are replicated.
- Pipeline parallelism splits the blocks into contiguous stages; the first stage also holds the
  embeddings, the last the final norm and the LM head (a tied head: the last stage keeps its own copy
  of the embedding matrix, whose gradient Megatron all-reduces with the first stage's).
- Bubble: GPipe's fraction of the step's total time, (p-1)/(m+p-1), or Megatron's (Narayanan et
  al. 2021, arXiv:2104.04473) relative to the ideal time, (p-1)/m; interleaved 1F1B with v model
  chunks per device divides the bubble by v. `bubble_fraction(..., of=...)` says which.
"""

from __future__ import annotations

import collections.abc as _abc
import dataclasses
import functools
import math
import numbers as _numbers
import operator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

from . import checks as _checks
from . import collectives as _coll
from . import memory as _mem
from . import specs as _specs
from . import precision as _prec
from . import fitting as _fitting
from . import activations as _act
from . import moe as _moe
from . import zero as _zero
from .specs import ModelSpec

Schedule = Literal["gpipe", "1f1b", "interleaved"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")
RECOMPUTE: tuple[str, ...] = ("none", "selective", "full")
MAX_DEVICES = 1 << 20
MAX_MICRO_BATCHES = 1 << 14


def check_count(name: str, value, *, lo: int = 1, hi: int = MAX_DEVICES) -> int:
    """A whole number in [lo, hi] (numpy integers too), or a ValueError naming the argument."""
    return _checks.whole(name, value, lo=lo, hi=hi)


def _check_schedule(schedule, p: int, m: int, v: int, *, names: tuple[str, str, str] = ("p", "m", "chunks")) -> str:
    """The one rule for a schedule and its counts, used by `Layout`, `bubble_fraction` and `simulate`
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


def _byte_counts(name: str, values, *, hint: str = "") -> list[int]:
    """A non-empty sequence (a list, a tuple, a numpy array; not a string or a mapping) of whole byte
    counts, as ints; `checks.whole` names a bad element by its index."""
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, _abc.Iterable):
        raise ValueError(f"{name} must be a non-empty list of byte counts{hint}, got {_checks.show(values)}")
    out = list(values)
    if not out:
        raise ValueError(f"{name} must be a non-empty list of byte counts{hint}, got an empty one")
    return [_checks.whole(f"{name}[{i}]", n, lo=0, hi=1 << 50) for i, n in enumerate(out)]


def _check_layout(layout) -> "Layout":
    if not isinstance(layout, Layout):
        raise ValueError(f"layout must be a vramlab.parallel.Layout, got {_checks.show(layout)}")
    return layout


@dataclass(frozen=True, kw_only=True)
class Layout:
    """dp x tp x pp devices. `micro_batches` (m) per step and per data-parallel replica; `chunks`
    (v) model chunks per device for the interleaved schedule."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    sp: bool = False
    micro_batches: int = 1
    schedule: Schedule = "1f1b"
    chunks: int = 1
    zero: int = 0  # 1: the optimizer states sharded over the dp replicas (ZeRO-1, Megatron's distributed optimizer)

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            object.__setattr__(self, name, check_count(name, getattr(self, name)))
        object.__setattr__(self, "micro_batches", check_count("micro_batches", self.micro_batches, hi=MAX_MICRO_BATCHES))
        object.__setattr__(self, "chunks", check_count("chunks", self.chunks, hi=1024))
        object.__setattr__(self, "sp", _checks.flag("sp", self.sp))
        try:
            zero = _checks.whole("zero", self.zero, lo=0, hi=1)
        except ValueError:
            raise ValueError(f"zero must be 0 or 1 (ZeRO-1: optimizer states sharded over dp), "
                             f"got {_checks.show(self.zero)}") from None
        object.__setattr__(self, "zero", zero)
        object.__setattr__(self, "schedule", _check_schedule(self.schedule, self.pp, self.micro_batches, self.chunks,
                                                             names=("pp", "micro_batches", "chunks")))
        if self.sp and self.tp == 1:
            raise ValueError("sp=True needs tp > 1: sequence parallelism splits along the tensor-parallel group")
        if self.zero and self.dp == 1:
            raise ValueError("zero=1 needs dp > 1: ZeRO-1 shards the optimizer states over the data-parallel replicas")
        if self.devices > MAX_DEVICES:
            raise ValueError(f"dp x tp x pp must be at most {MAX_DEVICES:,} devices (what this calculator models), "
                             f"got {self.devices:,}")

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp


# ============================================================================ activations (Korthikanti+22)
def korthikanti_layer_activations(*, s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                                  recompute: str = "none") -> Fraction:
    """Bytes of activations one transformer layer keeps per tensor-parallel rank, exactly as in
    Korthikanti et al. 2022 (arXiv:2205.05198) Table 2: 16-bit values, 1-byte dropout masks, the
    attention scores materialised (no FlashAttention).
        none, t = 1        sbh (34 + 5as/h)
        TP                 sbh (10 + 24/t + 5as/(ht))
        TP + SP            sbh/t (34 + 5as/h)
        TP + selective     sbh (10 + 24/t)          (+ SP: 34 sbh/t)
        full recompute     2 sbh
    An exact Fraction (t need not divide the terms)."""
    s, b, h, a = (check_count(n, v, hi=1 << 40) for n, v in (("s", s), ("b", b), ("h", h), ("a", a)))
    t = check_count("t", t)
    _checks.one_of("recompute", recompute, RECOMPUTE)
    sp = _checks.flag("sp", sp)
    if sp and t == 1:
        raise ValueError("sp=True needs t > 1: sequence parallelism splits along the tensor-parallel group")
    sbh = Fraction(s * b * h)
    if recompute == "full":
        return 2 * sbh
    scores = 0 if recompute == "selective" else Fraction(5 * a * s, h)
    if sp:
        return sbh / t * (34 + scores)
    return sbh * (10 + Fraction(24, t) + scores / t)


# ============================================================================ the bubble
def bubble_fraction(p: int, m: int, schedule: Schedule = "1f1b", *, chunks: int = 1,
                    of: Literal["total", "ideal"] = "total") -> Fraction:
    """The pipeline bubble with equal stages and no communication time. `of="total"`: the share of
    the step's time a device idles (GPipe's convention): (p-1)/(m+p-1), interleaved (p-1)/(vm+p-1).
    `of="ideal"`: bubble time over ideal time (Megatron's): (p-1)/m, interleaved (p-1)/(vm).
    GPipe and 1F1B have the same bubble; 1F1B holds fewer micro-batches in flight."""
    p, m = check_count("p", p), check_count("m", m, hi=MAX_MICRO_BATCHES)
    v = check_count("chunks", chunks, hi=1024)
    _check_schedule(schedule, p, m, v)
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
    p, m = check_count("p", p, hi=256), check_count("m", m, hi=1024)
    v = check_count("chunks", chunks, hi=64)
    schedule = _check_schedule(schedule, p, m, v)
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


def _in_flight(p: int, m: int, schedule: str, v: int) -> tuple[int, ...]:
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
    return PipelineRun(p, m, schedule, v, makespan, _in_flight(p, m, schedule, v), forward, backward)


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


# ============================================================================ parameters per device
_COLUMN = ("c_attn", "q_proj", "k_proj", "v_proj", "query_key_value", "c_fc", "gate_proj", "up_proj", "fc1",
           "dense_h_to_4h")
_ROW = ("attn.c_proj", "o_proj", "out_proj", "attention.dense", "down_proj", "fc2", "dense_4h_to_h", "mlp.c_proj")
_VOCAB = ("wte", "embed_tokens", "embed_in", "lm_head")
_FIRST = ("wte", "wpe", "embed_tokens", "embed_in", "embed_positions", "project_in")
DECODER_FAMILIES = ("gpt2", "llama", "opt", "gpt_neox")


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    for k, part in enumerate(parts[:-1]):
        if part in ("h", "layers") and parts[k + 1].isdigit():
            return int(parts[k + 1])
    return None


def _tp_numel(name: str, numel: int, t: int, vocab: int) -> int:
    """One rank's share of a tensor: column- and row-parallel weights (and column-parallel biases)
    divided by t; vocabulary-parallel matrices by rows, ceil(V/t) of them (the largest rank); the
    rest whole."""
    if any(name.startswith(k) for k in _VOCAB):
        return -(-vocab // t) * (numel // vocab)
    last = name.rsplit(".", 1)[-1]
    if any(k in name for k in _COLUMN) or (last == "weight" and any(k in name for k in _ROW)):
        return numel // t
    return numel


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """Contiguous blocks per stage; the first num_layers % pp stages take one more."""
    num_layers, pp = check_count("num_layers", num_layers, hi=_checks.MAX_COUNT), check_count("pp", pp)
    return list(_stage_layers(num_layers, pp))


@functools.lru_cache(maxsize=256)
def _stage_layers(num_layers: int, pp: int) -> tuple[range, ...]:
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for k in range(pp):
        n = base + (1 if k < extra else 0)
        out.append(range(start, start + n))
        start += n
    return tuple(out)


def _check_tp(spec: ModelSpec, t: int, name: str = "tp") -> int:
    """Megatron splits attention by heads (and key/value heads) and the MLP by its width: t divides them."""
    _checks.divides_heads(spec, t, name=name)
    if spec.intermediate_size % t:
        raise ValueError(f"{name}={t} must divide {spec.name}'s MLP width ({spec.intermediate_size})")
    return t


def _check_layout_model(spec: ModelSpec, layout: Layout) -> None:
    _check_layout(layout)
    if spec.family not in DECODER_FAMILIES:
        raise ValueError(f"tensor and pipeline layouts are modelled for decoder-only LMs ({', '.join(DECODER_FAMILIES)}); "
                         f"{spec.name} is {spec.family}")
    _check_tp(spec, layout.tp)
    if spec.num_layers < layout.pp * layout.chunks:
        raise ValueError(f"pp x chunks must be at most {spec.num_layers} ({spec.name} has {spec.num_layers} blocks, "
                         f"fewer than pp x chunks = {layout.pp * layout.chunks} stages)")


def rank_params(model: ModelSpec | str, layout: Layout, stage: int) -> int:
    """Parameters held by one tensor-parallel rank of pipeline stage `stage` (the largest rank
    when the vocabulary does not divide by t). Interleaved: the device's v chunks."""
    return sum(stage_tensors(model, layout, stage))


def stage_tensors(model: ModelSpec | str, layout: Layout, stage: int) -> tuple[int, ...]:
    """Element counts of the parameter tensors one tensor-parallel rank of pipeline stage `stage`
    holds, in the model's order: its blocks' shares, the embeddings on the first stage, the final
    norm and head on the last (and, tied, its own copy of the embedding)."""
    spec = _specs.resolve(model)
    _check_layout_model(spec, layout)
    stage = check_count("stage", stage, lo=0, hi=layout.pp - 1)
    return _stage_tensors(spec, layout.tp, layout.pp, layout.chunks, stage)


def _placement(spec: ModelSpec, name: str) -> tuple[int, bool]:
    """Where a parameter tensor sits: (its block, or -1 before the blocks, -2 after them; whether it is a
    tied vocabulary matrix)."""
    i = _layer_index(name)
    where = i if i is not None else (-1 if any(name.startswith(k) for k in _FIRST) else -2)
    return where, where == -1 and spec.tie_word_embeddings and name.split(".")[0] in _VOCAB


def _copies_on_stage(where: int, tied: bool, stage: int, p: int, mine) -> int:
    """Copies of a tensor placed at `where` (`_placement`) that pipeline stage `stage` of `p` holds (`mine`:
    its blocks): its block's stage; the embeddings on the first, the final norm and head on the last, and
    the last stage's own copy of a tied embedding."""
    if where >= 0:
        return int(where in mine)
    if where == -1:
        return int(stage == 0) + int(stage == p - 1 and p > 1 and tied)
    return int(stage == p - 1)


@functools.lru_cache(maxsize=64)
def _tensor_table(spec: ModelSpec, t: int) -> tuple[tuple[int, int, bool], ...]:
    """Per parameter tensor: (its block, or -1 before the blocks, -2 after them; one tensor-parallel
    rank's elements; whether it is a tied vocabulary matrix)."""
    out = []
    for name, numel in spec.param_tensors():
        where, tied = _placement(spec, name)
        out.append((where, _tp_numel(name, numel, t, spec.vocab_size), tied))
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def _stage_tensors(spec: ModelSpec, t: int, p: int, v: int, stage: int) -> tuple[int, ...]:
    chunks = _stage_layers(spec.num_layers, p * v)
    mine = {i for c in range(v) for i in chunks[c * p + stage]}
    return tuple(n for where, n, tied in _tensor_table(spec, t)
                 for _ in range(_copies_on_stage(where, tied, stage, p, mine)))


# ============================================================================ activations per device
def layer_activation_bytes(spec: ModelSpec, *, micro_batch_size: int, seq_len: int, tp: int = 1, sp: bool = False,
                           precision: str = "fp32", attention: str = "sdpa", device: str = "cuda") -> int:
    """One block's saved tensors on one tensor-parallel rank, from `memory`'s ledger (the tensors
    PyTorch really saves for this model), split as Megatron splits them (`activations.tp_split`); with
    sequence parallelism the replicated part is split along the sequence too."""
    spec = _specs.resolve(spec)
    b, s = check_count("micro_batch_size", micro_batch_size, hi=_checks.MAX_COUNT), check_count("seq_len", seq_len, hi=_checks.MAX_COUNT)
    _checks.positions(spec, s)
    tp = _check_tp(spec, check_count("tp", tp))
    sp = _checks.flag("sp", sp)
    if sp and tp == 1:
        raise ValueError("sp=True needs tp > 1: sequence parallelism splits along the tensor-parallel group")
    _checks.one_of("precision", precision, _prec.PRECISIONS)
    _checks.one_of("attention", attention, _act.ATTENTIONS)
    _checks.one_of("device", device, ("cuda", "cpu"))
    share = _act.DeviceShare(tp=tp, sp=sp, blocks=(0, 1), first=False, last=False)
    return _act.activation_bytes(spec, batch_size=b, seq_len=s, precision=precision,
                                 attention=attention, device=device, share=share)["one_layer"]


IMPLEMENTATIONS: tuple[str, ...] = ("megatron", "dtensor")


def in_flight(layout: Layout) -> tuple[int, ...]:
    """Per stage, the most (micro-batch, chunk) activations held at once: GPipe m on every stage,
    1F1B min(p - s, m) on stage s (Narayanan+21), interleaved min(2(p - s - 1) + (v - 1)p + 1, vm)
    (what `simulate` counts, for every layout)."""
    layout = _check_layout(layout)
    p, m = layout.pp, layout.micro_batches
    if p == 1:
        return (1,)
    return _in_flight(p, m, layout.schedule, layout.chunks)


def _schedule_points(layout: Layout, stage: int, held: int, received_inputs: bool,
                     sends_pend: bool = True) -> list[tuple[int, int, int]]:
    """The moments of a stage's backward that may peak, as (micro-batch-chunk pairs in flight, those
    whose input is a receive buffer, sent tensors still held). GPipe and 1F1B hold the most at one
    moment with nothing pending (torch's single-stage schedules wait on each send before the next).
    torch's `ScheduleInterleaved1F1B` waits on its sends only at the end of the step, and gloo's send
    work holds its tensor until then (`sends_pend`): the outputs and input gradients it sent
    accumulate, so a later backward with fewer micro-batches in flight may hold more; every moment
    that can be the peak is returned. ProcessGroupNCCL hands a completed send's tensors back at the
    group's next call (its watchdog moves them to the group's shelves): on CUDA nothing accumulates."""
    if layout.schedule != "interleaved":
        return [(held, held if received_inputs and stage > 0 else 0, 0)]
    return list(_interleaved_points(layout.pp, layout.micro_batches, layout.chunks, stage, received_inputs,
                                    received_inputs and sends_pend))


@functools.lru_cache(maxsize=4096)
def _interleaved_points(p: int, m: int, v: int, stage: int, received_inputs: bool,
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


def estimate_layout(model: ModelSpec | str, layout: Layout, *, micro_batch_size: int, seq_len: int,
                    precision: str = "bf16-mixed", optimizer: str = "adamw", optimizer_impl: str = "foreach",
                    attention: str = "sdpa", recompute: str = "none", device: str = "cuda",
                    gradient_as_bucket_view: bool = False, keep_stage_output: bool = True,
                    keep_gradients: bool = True, implementation: str = "megatron",
                    gpu=None, stages: "tuple[int, ...] | None" = None) -> list[_mem.MemoryBreakdown]:
    """Peak memory of one device of each pipeline stage (index = stage): the largest of
    `memory.training_phases` for that device's share (`activations.DeviceShare`) -- its parameters,
    gradients and optimizer states, the activations of the micro-batches the schedule holds in
    flight on it (from `simulate`), the logits and loss on the last stage, the embedding's backward
    on the first, the optimizer's step. A 1 x 1 x 1 layout with keep_gradients=False is
    `memory.estimate_training` exactly.

    - keep_gradients: the gradients stay allocated between steps (Megatron-LM's contiguous gradient
      buffer, `zero_grad(set_to_none=False)`); False: set_to_none=True, as `estimate_training`.
    - keep_stage_output: a stage keeps the output it sent to the next stage (b x s x h) until that
      micro-batch's backward, the last stage the model's output (the logits), and every stage a
      receive buffer per micro-batch and chunk for the activations and the gradients it is sent,
      as torch.distributed.pipelining does (a received input is its buffer; on gloo the interleaved
      schedule's sends hold their tensors until the step ends: `_schedule_points`); Megatron-LM frees
      a sent output (`deallocate_output_tensor`), its last stage keeps only the loss: pass False for it.
    - With dp > 1, DDP's buckets: a flat copy of the gradients (counted with them) unless
      `gradient_as_bucket_view=True` makes the gradients views into the buckets. `layout.zero = 1`
      shards the optimizer states (and their step) over the dp replicas.
    - recompute: none, selective (Korthikanti+22: the attention core) or full (every block keeps its input).
    - implementation: "megatron" (vocabulary-parallel embedding, V/t x e gradient) or "dtensor"
      (PyTorch's `parallelize_module`, whose vocabulary-parallel embedding's backward builds the full
      V x e gradient on every rank before keeping its shard).
    - stages: only these stages (the list then holds theirs, in this order): the first and the last
      are the fullest (the most micro-batches in flight; the logits), which a planner needs."""
    spec = _specs.resolve(model)
    _check_layout_model(spec, layout)
    b, s = check_count("micro_batch_size", micro_batch_size, hi=_checks.MAX_COUNT), check_count("seq_len", seq_len, hi=_checks.MAX_COUNT)
    _checks.positions(spec, s)
    for name, value, choices in (("precision", precision, _prec.PRECISIONS), ("optimizer", optimizer, _mem.OPTIMIZERS),
                                 ("optimizer_impl", optimizer_impl, _mem.OPTIMIZER_IMPLS),
                                 ("attention", attention, _act.ATTENTIONS), ("recompute", recompute, RECOMPUTE),
                                 ("device", device, ("cuda", "cpu")), ("implementation", implementation, IMPLEMENTATIONS)):
        _checks.one_of(name, value, choices)
    gradient_as_bucket_view = _checks.flag("gradient_as_bucket_view", gradient_as_bucket_view)
    keep_stage_output = _checks.flag("keep_stage_output", keep_stage_output)
    keep_gradients = _checks.flag("keep_gradients", keep_gradients)
    gpu = _mem.gpu_or_none(gpu)
    p, v, t = layout.pp, layout.chunks, layout.tp
    if stages is not None:
        stages = _checks.wholes("stages", stages, lo=0, hi=p - 1)
    plan = _act.recompute_plan(recompute, spec)  # once (training_phases takes the plan as it is)
    chunks = _stage_layers(spec.num_layers, p * v)
    held = in_flight(layout)
    # torch.distributed.pipelining's receive buffers, allocated for every micro-batch and kept: the
    # activations a stage receives and the gradients sent back to it, b x s x h each
    x = _prec.dtype_sizes(precision, device)["x"]
    recv = layout.micro_batches * -(-b * s * spec.hidden_size * x // (t if layout.sp else 1))
    out = []
    torch_pp = keep_stage_output and p > 1  # torch.distributed.pipelining's buffers and sends
    for stage in (range(p) if stages is None else stages):
        mine = [chunks[c * p + stage] for c in range(v)]
        largest = max(mine, key=len)
        # a receive buffer for each virtual stage's input (all but the first) and for the gradient of
        # its output (all but the last)
        directions = sum(int(c * p + stage > 0) + int(c * p + stage < p * v - 1) for c in range(v))
        share = dict(  # a DeviceShare, built once per moment of the schedule (its checks read every tensor)
            blocks=(largest.start, largest.stop), first=stage == 0, last=stage == p - 1, tp=t, sp=layout.sp,
            param_tensors=_stage_tensors(spec, t, p, v, stage),
            stage_output=torch_pp, keep_gradients=keep_gradients, buffers=recv * directions if torch_pp else 0,
            gradient_copies=2 if layout.dp > 1 and not gradient_as_bucket_view else 1,
            optimizer_shards=layout.dp if layout.zero else 1, embedding_grad="dense" if implementation == "dtensor" else "sharded",
            others_at_end=v == 1, loss_parallel=implementation == "dtensor" and t > 1)
        # the stage's peak over the moments of its schedule that can hold the most
        peak = max((phase for n, got, sends in _schedule_points(layout, stage, held[stage], torch_pp,
                                                                 sends_pend=device == "cpu")
                    for phase in _mem.training_phases(
                        spec, batch_size=b, seq_len=s, precision=precision, optimizer=optimizer,
                        optimizer_impl=optimizer_impl, attention=attention, recompute=plan, device=device, gpu=gpu,
                        share=_act.DeviceShare(**share, in_flight=n, received=got, pending_sends=sends))),
                   key=lambda x: x.total)
        label = (f"{spec.name} stage {stage} of {p}, tp {t}" + (" + sp" if layout.sp else "")
                 + (" + ZeRO-1" if layout.zero else "") + f", {layout.schedule} m={layout.micro_batches}")
        out.append(dataclasses.replace(peak, label=label))
    return out


# ============================================================================ communication
def communication(model: ModelSpec | str, layout: Layout, *, micro_batch_size: int, seq_len: int,
                  precision: str = "bf16-mixed", dp_link: str = "ib-ndr", tp_link: str = "nvlink4",
                  pp_link: str = "ib-ndr") -> dict[str, dict[str, float]]:
    """What each kind of parallelism sends in one training step, and how long it takes on its link
    (alpha-beta model, `collectives`):
    - dp: one ring all-reduce of the device's gradients over the dp replicas (DDP overlaps it with
      the backward: see `ddp_overlap`);
    - tp: per block and micro-batch, two all-reduces of the b x s x h activations in the forward
      and two in the backward (with SP: all-gathers and reduce-scatters of the same volume);
    - pp: per micro-batch, one activation tensor forward and one gradient backward across each stage
      boundary (point to point)."""
    spec = _specs.resolve(model)
    _check_layout_model(spec, layout)
    b, s = check_count("micro_batch_size", micro_batch_size, hi=_checks.MAX_COUNT), check_count("seq_len", seq_len, hi=_checks.MAX_COUNT)
    _checks.positions(spec, s)
    _checks.one_of("precision", precision, _prec.PRECISIONS)
    links = {k: _coll.LINKS[_checks.one_of(f"{k}_link", v, _coll.LINKS)]
             for k, v in (("dp", dp_link), ("tp", tp_link), ("pp", pp_link))}
    grad = max(rank_params(spec, layout, k) for k in {0, layout.pp - 1}) * _mem.param_bytes(precision)  # the fullest stages
    act = b * s * spec.hidden_size * _prec.dtype_sizes(precision, "cuda")["half"]
    m, L = layout.micro_batches, spec.num_layers
    per_stage_layers = -(-L // layout.pp)
    tp_calls = 4 * per_stage_layers * m
    out = {"dp": {"bytes": grad, "calls": 1, "seconds": _coll.collective_time("all_reduce", layout.dp, grad, links["dp"])},
           "tp": {"bytes": act, "calls": tp_calls,
                  "seconds": tp_calls * _coll.collective_time("all_reduce", layout.tp, act, links["tp"])},
           "pp": {"bytes": act, "calls": 2 * m * (layout.pp - 1) * layout.chunks,
                  "seconds": 0.0 if layout.pp == 1 else 2 * m * layout.chunks * (links["pp"].alpha_s + act / links["pp"].bytes_per_s)}}
    return out


def ddp_buckets(param_bytes: list[int], *, bucket_cap_mb: float = 25, first_bucket_mb: float = 1) -> list[int]:
    """DDP's gradient buckets (torch.nn.parallel.DistributedDataParallel) once it has rebuilt them
    after the first iteration (before that, with the default find_unused_parameters=False, all
    gradients share one bucket): parameters in the order their gradients become ready in backward
    (here: the reverse of model.parameters()), each added to the open bucket, which is closed once it
    holds at least its cap; the first bucket's cap is `first_bucket_mb` (torch's
    _DEFAULT_FIRST_BUCKET_BYTES, 1 MiB) so that communication starts early. Returns bucket bytes, in
    the order they are all-reduced."""
    sizes = _byte_counts("param_bytes", param_bytes)
    bucket_cap_mb, first_bucket_mb = (
        _checks.number(name, cap, lo=0, lo_open=True, hi=1 << 20, hi_open=True,
                       what="a positive number of MiB (below 1,048,576)")
        for name, cap in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb)))
    buckets, current, cap = [], 0, int(first_bucket_mb * 2**20)
    for n in reversed(sizes):
        current += n
        if current >= cap:
            buckets.append(current)
            current, cap = 0, int(bucket_cap_mb * 2**20)
    if current:
        buckets.append(current)
    return buckets


def ddp_overlap(buckets: list[int], *, n: int, backward_seconds: float, link: str | _coll.Link) -> dict[str, float]:
    """How much of DDP's gradient all-reduce hides behind the backward pass: bucket k is ready when
    the backward has produced its share of the gradients (gradients assumed to appear at a constant
    rate), all-reduces run one at a time on the link. Returns the communication time, the time it
    exceeds the backward by (exposed), and the share hidden."""
    buckets = _byte_counts("buckets", buckets, hint=" (see ddp_buckets)")
    n = check_count("n", n, hi=_checks.MAX_COUNT)
    backward_seconds = _checks.number("backward_seconds", backward_seconds, lo=0)
    if not isinstance(link, _coll.Link):
        link = _coll.LINKS[_checks.one_of("link", link, _coll.LINKS)]
    total = sum(buckets)
    ready, t_link, comm = 0, 0.0, 0.0
    for size in buckets:
        ready += size
        t_ready = backward_seconds * ready / total if total else backward_seconds
        dt = _coll.collective_time("all_reduce", n, size, link)
        t_link = max(t_link, t_ready) + dt
        comm += dt
    exposed = max(0.0, t_link - backward_seconds)
    return {"communication_s": comm, "exposed_s": exposed, "hidden_share": 1 - exposed / comm if comm else 1.0}


def _stage_fit(spec: ModelSpec, layout: Layout, gpu, *, micro_batch_size: int, seq_len: int,
               expandable_segments: bool, kw: dict) -> "tuple[_fitting.Fit, _mem.MemoryBreakdown]":
    """`fitting.device_fit` of the layout's fullest device at this micro-batch size, and that device's peak."""
    ends = tuple(sorted({0, layout.pp - 1}))  # the fullest stages: the most in flight, and the logits
    stages = estimate_layout(spec, layout, micro_batch_size=micro_batch_size, seq_len=seq_len, gpu=gpu, stages=ends, **kw)
    i = max(range(len(stages)), key=lambda j: stages[j].total)
    k, t, dense = ends[i], layout.tp, kw.get("implementation", "megatron") == "dtensor"
    share = _act.DeviceShare(first=k == 0, last=k == layout.pp - 1, tp=t, embedding_grad="dense" if dense else "sharded",
                             blocks=(0, 1))
    largest = _fitting.fragmentation_bytes(spec, batch_size=micro_batch_size, seq_len=seq_len, share=share,
                                        precision=kw.get("precision", "bf16-mixed"), attention=kw.get("attention", "sdpa"))
    return _fitting.device_fit(stages[i], gpu, largest_tensor=largest, expandable_segments=expandable_segments), stages[i]


# what `fits` passes on to `estimate_layout` (it sets the rest itself)
_ESTIMATE_OPTIONS = ("precision", "optimizer", "optimizer_impl", "attention", "recompute", "device",
                     "gradient_as_bucket_view", "keep_stage_output", "keep_gradients", "implementation")


def fits(model: ModelSpec | str, layout: Layout, gpu, *, micro_batch_size: int, seq_len: int,
         expandable_segments: bool = False, max_search: int = 1 << 12, **kw) -> "_fitting.Fit":
    """Does the layout fit on GPUs of type `gpu`, and what is the largest micro-batch size that does?
    `fitting.fit`'s definition (`fitting.device_fit`) applied to the fullest device of `estimate_layout`
    (whose keyword arguments `kw` are): estimate + margin + fragmentation + CUDA context <= usable."""
    from .specs import gpu as _gpu

    spec = _specs.resolve(model)
    _check_layout(layout)
    g = _gpu(gpu)
    micro_batch_size = check_count("micro_batch_size", micro_batch_size, hi=_checks.MAX_COUNT)
    max_search = check_count("max_search", max_search, hi=_checks.MAX_COUNT)
    expandable_segments = _checks.flag("expandable_segments", expandable_segments)
    _checks.no_unknown("fits", kw, _ESTIMATE_OPTIONS)
    if kw.get("device", "cuda") != "cuda":
        raise ValueError(f"device must be 'cuda' here (fits() answers for a GPU), got {_checks.show(kw['device'])}")

    def verdict(b: int, **found) -> "_fitting.Fit":
        return dataclasses.replace(_stage_fit(spec, layout, g, micro_batch_size=b, seq_len=seq_len,
                                              expandable_segments=expandable_segments, kw=kw)[0], **found)

    here = verdict(micro_batch_size)  # checks every argument before the search
    lo = _fitting.largest_true(lambda b: verdict(b).fits, limit=max_search, start=micro_batch_size)
    return dataclasses.replace(here, max_batch_size=lo, capped=lo >= max_search)


# ============================================================================ planning a cluster
@dataclass(frozen=True)
class LayoutPlan:
    """One candidate layout for `plan_layouts`: its fullest device (`peak`), `fitting.device_fit`'s
    verdict, and the step's estimated time and throughput."""

    layout: Layout
    recompute: str
    peak: _mem.MemoryBreakdown
    fit: "_fitting.Fit"
    bubble: Fraction  # of the ideal time (Megatron's convention)
    recompute_fraction: float  # extra FLOPs over the step's
    step_seconds: float
    tokens_per_s: float

    @property
    def name(self) -> str:
        L = self.layout
        extras = [x for x, on in (("SP", L.sp), ("ZeRO-1", L.zero), (f"recompute {self.recompute}", self.recompute != "none"))
                  if on]
        return f"dp {L.dp} x tp {L.tp} x pp {L.pp}" + (" + " + ", ".join(extras) if extras else "")


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def plan_layouts(model: ModelSpec | str, gpus: int, gpu, *, seq_len: int, global_batch: int, micro_batch_size: int = 1,
                 gpus_per_node: int = 8, precision: str = "bf16-mixed", mfu: float = 0.4,
                 recomputes: tuple[str, ...] = RECOMPUTE) -> list[LayoutPlan]:
    """Every dp x tp x pp layout of `gpus` GPUs (tp within a node: at most `gpus_per_node`, dividing
    the heads, KV heads and MLP width; pp at most the blocks), with and without sequence parallelism
    and ZeRO-1 over dp, under each recompute plan in `recomputes`, for a global batch of
    `global_batch` sequences of `seq_len` tokens (m = global_batch / (dp x micro_batch_size)
    micro-batches, 1F1B). Each is checked with `fits` (the fullest device by `fitting.device_fit`) and
    timed (with a fused optimizer step, as Megatron-LM's FusedAdam): the step's FLOPs plus the
    recompute's at `mfu` of the GPU's dense 16-bit peak, shared by
    tp x pp devices, stretched by the bubble (p-1)/m, plus the tensor-parallel all-reduces on NVLink
    (not overlapped) and the pipeline's sends; data parallelism's all-reduce is taken as hidden behind
    the backward. A recompute plan that saves no memory over a cheaper one (selective recompute
    under SDPA, which keeps no scores) is left out. The list holds the layouts that fit, fastest
    first, then those that do not, smallest need first.

    Known limitations: the time model is a roofline with one MFU for every layout (real MFU falls
    with small per-device matrices, i.e. with large tp); the exposed part of the dp all-reduce is
    left out."""
    from . import checkpointing as _ck
    from .specs import gpu as _gpu

    spec = _specs.resolve(model)
    g = _gpu(gpu)
    n = check_count("gpus", gpus)
    node = check_count("gpus_per_node", gpus_per_node, hi=1024)
    b, s = check_count("micro_batch_size", micro_batch_size, hi=_checks.MAX_COUNT), check_count("seq_len", seq_len, hi=_checks.MAX_COUNT)
    _checks.positions(spec, s)
    gb = check_count("global_batch", global_batch, hi=_checks.MAX_COUNT)
    if gb > MAX_MICRO_BATCHES * b:  # a layout with one replica would run gb / b micro-batches
        raise ValueError(f"global_batch must be at most {MAX_MICRO_BATCHES:,} micro-batches of micro_batch_size={b} "
                         f"({MAX_MICRO_BATCHES * b:,} sequences), got {gb:,}")
    _checks.one_of("precision", precision, _prec.PRECISIONS)
    mfu = _checks.fraction("mfu", mfu)
    if g.peak_tflops_16 <= 0:
        raise ValueError(f"gpu must have a FLOP/s figure ({g.name} has none): pass a GPU preset")
    if isinstance(recomputes, (str, bytes, dict)) or not isinstance(recomputes, _abc.Iterable):
        raise ValueError(f"recomputes must be a list of recompute plans ({', '.join(RECOMPUTE)}), "
                         f"got {_checks.show(recomputes)}")
    recomputes = tuple(str(_checks.one_of(f"recomputes[{i}]", r, RECOMPUTE)) for i, r in enumerate(recomputes))
    if not recomputes:
        raise ValueError(f"recomputes must name at least one recompute plan ({', '.join(RECOMPUTE)}), got none")
    if spec.family not in DECODER_FAMILIES:
        raise ValueError(f"layouts are planned for decoder-only LMs ({', '.join(DECODER_FAMILIES)}); {spec.name} is {spec.family}")
    f = _ck.flops(spec, batch_size=b, seq_len=s)
    extra = {r: _ck.recompute_flops(spec, r, batch_size=b, seq_len=s) for r in recomputes}
    peak_flops = (g.peak_tflops_fp32 if precision == "fp32" else g.peak_tflops_16) * 1e12 * mfu
    plans = []
    for tp in _divisors(n):
        if tp > node or any(x % tp for x in (spec.num_heads, spec.num_kv_heads, spec.intermediate_size)):
            continue
        for pp in _divisors(n // tp):
            dp = n // (tp * pp)
            if pp > spec.num_layers or gb % (dp * b):
                continue
            m = gb // (dp * b)
            for sp in ((False, True) if tp > 1 else (False,)):
                for zero in ((0, 1) if dp > 1 else (0,)):
                    layout = Layout(dp=dp, tp=tp, pp=pp, sp=sp, zero=zero, micro_batches=m)
                    comm = communication(spec, layout, micro_batch_size=b, seq_len=s, precision=precision)
                    kept: list[LayoutPlan] = []
                    for r in sorted(recomputes, key=extra.get):  # least recompute first
                        verdict, peak = _stage_fit(spec, layout, g, micro_batch_size=b, seq_len=s, expandable_segments=False,
                                                   kw=dict(precision=precision, recompute=r, optimizer_impl="fused"))
                        bubble = Fraction(pp - 1, m)
                        compute = m * (f["step"] + extra[r]) / (tp * pp) / peak_flops
                        seconds = compute * (1 + bubble) + comm["tp"]["seconds"] + comm["pp"]["seconds"]
                        if any(k.peak.total <= peak.total for k in kept):
                            continue  # more recompute for no less memory (selective under SDPA: no scores to drop)
                        kept.append(LayoutPlan(layout=layout, recompute=r, peak=peak, fit=verdict, bubble=bubble,
                                               recompute_fraction=extra[r] / f["step"], step_seconds=seconds,
                                               tokens_per_s=gb * s / seconds))
                    plans += kept
    return sorted(plans, key=lambda x: (not x.fit.fits, -x.tokens_per_s if x.fit.fits else x.fit.needed))


__all__ = ["Layout", "SCHEDULES", "korthikanti_layer_activations", "bubble_fraction", "simulate", "PipelineRun",
           "rank_params", "stage_layers", "layer_activation_bytes", "estimate_layout", "communication",
           "ddp_buckets", "ddp_overlap", "fits", "stage_tensors", "plan_layouts", "LayoutPlan"]


# ============================================================================ context parallelism
# Context parallelism (CP) splits every sequence over cp ranks; each rank runs the whole model on its
# s/cp tokens, so everything the ledger saves per token shrinks by cp. Attention alone needs the other
# ranks' tokens:
# - ring attention (Liu et al. 2023, arXiv:2310.01889; Megatron-LM's context parallelism): each rank's
#   K/V block travels round the ring, point to point, the next block received while the current one is
#   attended to; the partial outputs are merged by their log-sum-exp (online softmax). A rank saves
#   what a flash kernel saves on one device -- q, k, v at its own tokens, the merged output and its
#   log-sum-exp -- and in the backward sends K/V round again with their gradient accumulators, which
#   come home after cp steps. Zig-zag (load balance for causal attention): the sequence is cut into
#   2cp chunks and rank r holds chunks r and 2cp-1-r, so each rank attends to the same number of pairs;
# - Ulysses (Jacobs et al. 2023, arXiv:2309.14509, DeepSpeed-Ulysses): an all-to-all turns the
#   sequence-sharded q, k, v (all heads, s/cp tokens) into head-sharded ones (heads/cp, all s tokens),
#   attention runs on whole sequences, and a fourth all-to-all brings the output back; cp must divide
#   the heads and the key/value heads (GQA).
CP_METHODS: tuple[str, ...] = ("ring", "ulysses")
CP_RECOMPUTE: tuple[str, ...] = ("none", "full")  # the recompute plans priced with context parallelism
MAX_CP = 1 << 12


def cp_positions(seq_len: int, cp: int, rank: int, *, zigzag: bool = True) -> list[int]:
    """The global token positions rank `rank` of `cp` holds, in its order: zig-zag, chunks r and
    2cp-1-r of 2cp (seq_len a multiple of 2cp); otherwise the r-th contiguous s/cp tokens."""
    cp = check_count("cp", cp, hi=MAX_CP)
    s = check_count("seq_len", seq_len, hi=_checks.MAX_COUNT)
    rank = _checks.whole("rank", rank, lo=0, hi=cp - 1)
    zigzag = _checks.flag("zigzag", zigzag)
    parts = 2 * cp if zigzag else cp
    if s % parts:
        raise ValueError(f"seq_len {s:,} must be a multiple of {parts} to cut it into "
                         + (f"2 x cp = {parts} zig-zag chunks" if zigzag else f"cp = {cp} shards"))
    c = s // parts
    if not zigzag:
        return list(range(rank * c, (rank + 1) * c))
    return list(range(rank * c, (rank + 1) * c)) + list(range((parts - 1 - rank) * c, (parts - rank) * c))


def _ring_step_flops(b: int, n: int, qd: int, cp: int, zigzag: bool) -> list[Fraction]:
    """Forward attention FLOPs of each ring step on the busiest rank (2 x 2 b q k d per pair attended):
    zig-zag: every step half an n x n block (its own block causal: half; an earlier rank's: all rows x
    its first chunk; a later rank's: the second half of the rows x all its tokens); contiguous: the last
    rank attends to every earlier rank's whole block and to half of its own."""
    block = Fraction(4 * b * n * n * qd)
    if zigzag:
        return [block / 2] * cp
    return [block / 2] + [block] * (cp - 1)


# shard_states: `precision` -> (the `zero` recipe of FSDP2's policy, the engine's phases' precision)
_CP_FSDP_RECIPES: dict[str, tuple[str, str]] = {"fp32": ("fp32-adam", "fp32"),
                                                "bf16-mixed": ("mixed-adam", "bf16-fp32-states")}


def _cp_fsdp_moments(spec: ModelSpec, cp: int, totals: list, ddp_states: int, recipe: str, *, b: int, n: int,
                     L: int, device: str, gpu, optimizer_impl: str, recompute: str, loss: str,
                     loss_chunk_tokens: int | None, extra_saved: int, kept: int,
                     alive: dict[int, int] | None = None, made: int | None = None) -> tuple[list, dict[str, int]]:
    """`context_parallel`'s moments with the states sharded over the cp ranks by FSDP2: the step's phases are
    `zero.rank_phases(implementation="fsdp2")`'s at the rank's n tokens (Ulysses' saved all-to-all outputs added
    where the blocks' activations are alive, as with DDP), and each attention moment in `totals` (computed with
    DDP's whole states, `ddp_states` bytes) gets FSDP2's instead: the shards, the root unit and the last block
    gathered, in the backward the next block prefetched and the gradients made so far (under full recompute, at
    the block where the most is alive: `kept` bytes, a block's checkpointed input, freed per later block against
    its gradient shard kept). Under full recompute, `alive` (block -> bytes alive in its backward,
    `activation_bytes`' "backward") puts the last block's re-run backward right: FSDP2's phase keeps the last
    block's saved tensors (every block's checkpointed input is still alive), which the one-device phase it
    starts from (the block with the most gradients made) leaves out. `made`: "block_grads_made", the elements
    of the last block's gradients `zero.rank_phases` counts in its phase (taken out again to leave the head's). Every
    moment's shards are
    then set to their storage (each tensor's shard ceil(numel / cp), Adam's step counters). Returns (moments,
    states between steps)."""
    fph = _zero.rank_phases(spec, cp, 3, micro_batch_size=b, seq_len=n, recipe=recipe, implementation="fsdp2",
                            attention="sdpa", optimizer_impl=optimizer_impl, device=device, gpu=gpu,
                            recompute=recompute, loss=loss, loss_chunk_tokens=loss_chunk_tokens)
    between = _zero.model_states(spec, cp, 3, recipe=recipe, implementation="fsdp2")
    pb = _zero.RECIPES[recipe][0]  # the gathered copies' and unsharded gradients' bytes
    block, root = _zero.zero_units(spec)
    R, unit = root * pb, block * pb
    prefetch = unit if L >= 2 else 0
    # the last block's gradients made before its attention's backward: o_proj, the MLP, the second norm
    last = [(name, x) for name, x in spec.param_tensors() if _zero.block_index(name) == L - 1]
    before_attention = sum(x for name, x in last if not any(k in name for k in ("q_proj", "k_proj", "v_proj",
                                                                                  "input_layernorm", "qkv")))
    own = min(made * pb, block * pb) if made is not None else 0  # the last block's own, in `zero`'s phase
    grads_block = next(p.gradients - between.gradients for p in fph if "block" in p.phase) - own  # the head's
    grads_last = grads_block + before_attention * pb
    # the last block's down_proj gradient: its MmBackward0 runs first, and the non-reentrant checkpoint re-runs
    # the block's forward from inside it (seen on gloo ranks, cp-val: a (256, 256) fp32 gradient beside the
    # re-run attention)
    down = sum(x for name, x in last if "down_proj" in name) * pb
    fsdp = between.parameters + between.optimizer_states
    # in the forward FSDP2 keeps a unit's flat all-gather output until the next unit's copy-out
    # (`FSDPParamGroup.wait_for_unshard`, implicit prefetch), the last block's until the root's post-forward
    # (`FSDPState._post_forward`): beside the last block's parameters in its attention, alone in the loss's forward
    # (the root here runs the loss, as a model called with labels does). `zero.rank_phases` leaves it out (its runs
    # never peaked there). A recomputed block's re-run forward runs after its pre-backward hook, which gathered it
    # and prefetched the block before it (the non-reentrant checkpoint unpacks in the block's backward)
    held = unit if cp > 1 else 0
    out = []
    again = recompute == "full"
    # under full recompute an earlier block's attention may hold more than the last one's: each later block has
    # freed its checkpointed input (`kept`) but left its fp32 gradient shard, and the block after it its flat fp32
    # gradients until their reduce-scatter is waited on (measured: gloo ranks, 8 blocks); block 0 prefetches none
    shift = 0
    if again:
        shard_b, flat_g = -(-block // cp) * 4, block * 4 if cp > 1 else 0
        shift = max((L - 1 - i) * (shard_b - kept) + (flat_g if i < L - 1 else 0) - (prefetch if i == 0 else 0)
                    for i in range(L))
    for t, phase in totals:
        if phase.startswith("attention forward"):
            # (re-run in the backward: the gradients made so far are alive)
            out.append((t - ddp_states + fsdp + R + unit + (prefetch + grads_block + down + shift if again else held),
                        phase))
        elif phase.startswith("attention backward"):
            out.append((t - ddp_states + fsdp + grads_last + R + unit + prefetch + shift, phase))
    for p in fph:
        t = p.total + (held if p.phase.startswith(("forward", "loss forward")) else 0)
        if not (p.phase.startswith(("embedding", "optimizer", "root's")) or again):
            t += L * extra_saved
        if again and "recomputed block" in p.phase:
            t += extra_saved
            if alive:  # the last block's saved tensors, not those of the block the one-device phase names
                i = int(p.phase.rsplit("block ", 1)[1].rstrip(")"))
                t += max(alive.values()) - alive[i]
        out.append((t, p.phase))
    shard = [-(-x // cp) for _, x in spec.param_tensors()]
    states = {"parameters": 4 * sum(shard), "gradients": 0,
              "optimizer_states": 8 * sum(shard) + 4 * len(shard)}  # Adam's m, v and step count per tensor, fp32
    delta = states["parameters"] + states["optimizer_states"] - fsdp
    return [(t + delta, phase) for t, phase in out], states


def context_parallel(model: ModelSpec | str, *, cp: int, method: str = "ring", batch_size: int, seq_len: int,
                     precision: str = "bf16-mixed", device: str = "cuda", zigzag: bool = True,
                     link: str | _coll.Link = "nvlink4", gpu="h100", mfu: float = 0.4,
                     optimizer: str = "adamw", optimizer_impl: str = "foreach", recompute: str = "none",
                     loss: str = "whole", loss_chunk_tokens: int | None = None,
                     shard_states: bool = False) -> dict[str, Any]:
    """One CP rank of `cp` training on `batch_size` sequences of `seq_len` tokens (`method` "ring" or
    "ulysses"; `zigzag` for the ring's load balance; Ulysses uses contiguous shards).

    Memory (bytes):
    - saved_per_layer / activations: what one block / the whole model saves for backward on the rank,
      the ledger (`activations.activation_bytes`, under `recompute`) at its s/cp tokens -- ring attention
      saves what a flash kernel saves; Ulysses also keeps the all-to-all's output that feeds the attention's
      output projection (the projection saves its input; the kernel saves its own, head-sharded, output);
      `activations` counts the tensors outside the blocks as the whole loss saves them; `blocks_saved` is
      the blocks' alone (what CP divides, whatever the loss);
    - in_flight_forward / in_flight_backward: what CP holds on top during one block's attention, on
      the busiest rank. Ring: forward, the current and the next K/V blocks (receive buffers, 2 x 2 b
      (s/cp) kv_dim) and the partial outputs being merged (four b (s/cp) q_dim tensors, three
      log-sum-exps); backward, dq, the current and next K/V, the travelling dK/dV accumulators, and
      one step's block gradients or the accumulators' receive buffers, whichever is larger (from 3 ranks
      on, both). Ulysses:
      an all-to-all's send and receive buffers and its rearranged output (3 b (s/cp) q_dim), in the
      backward the gradients of q, k, v at once;
    - activation_peak: activations + the larger in-flight term;
    - peak, peak_phase, moments: the rank's whole training step, the largest of `moments` -- one
      device's phases at s/cp tokens (`memory.training_phases`: parameters, gradients kept between
      steps and all-reduced in place over the CP group, `optimizer` states, logits), with Ulysses'
      extra saved outputs where the blocks' activations are alive, and two moments inside the last
      block's attention: the states, the earlier blocks' saved tensors and the last block's up to
      its attention core, plus the in-flight bytes (and, backward, the gradient entering the block and the
      attention output's gradient; with a tied head, its gradient waiting for the embedding's).
      `recompute` "full" (activation checkpointing of every block, as long-context recipes run CP):
      each block keeps its input; the two moments are then inside the last block's recomputation
      (its forward re-run with the gradient entering it alive, then its backward), and the re-run
      forward sends its K/V round the ring (or through Ulysses' all-to-alls) again: `sent_per_layer`
      and `comm_seconds_per_layer` name it "recompute". `loss` / `loss_chunk_tokens`: the loss's
      implementation over the rank's tokens (`memory.training_phases`: whole, torchtune's chunked,
      Liger's fused), which sets the peak at the logits' gradient that long context meets first.

    Communication per layer and rank (bytes sent): ring forward (cp-1) K/V blocks; backward (cp-1)
    K/V blocks and cp dK/dV blocks (the accumulators' way home included). Ulysses: four all-to-alls
    forward (q, k, v, out) and four backward, each rank sending (cp-1)/cp of each buffer. Seconds:
    alpha-beta on `link` (`collectives`); attention's compute: 2 x 2 b s^2 q_dim FLOPs for the
    forward, halved for causal, over cp ranks (the busiest rank's share: zig-zag balances it,
    contiguous shards leave the last rank 2 - 1/cp times the mean), the backward twice the forward,
    at `mfu` of `gpu`'s peak. The ring overlaps each step's transfer with the step's attention
    ("hidden" when no step waits; `exposed_seconds` what the waits add); Ulysses' all-to-alls feed
    and follow attention, so they are exposed by construction.

    `shard_states`: the model states sharded over the cp ranks as well (FSDP2, torchtitan's dp_shard x cp
    mesh: `fully_shard` of every decoder block, then of the root -- embeddings, final norm, LM head -- over the
    CP group), instead of whole on every rank with gradients all-reduced. The step's moments are then
    `zero.rank_phases(implementation="fsdp2")`'s at s/cp tokens (under the same `recompute` and `loss`: the root
    gathered from the forward to the end of the backward, a block in use and the next prefetched, a block's
    unsharded gradients flat in fp32 until their reduce-scatter, the optimizer stepping shards; no gradients
    between steps), and the two attention moments hold, instead of DDP's states, the shards, the root and the
    last block gathered (the backward: the next block prefetched too, the head's gradients and those the last
    block has made after its attention -- o_proj, the MLP, its norm). `precision` "fp32" (FSDP2 in fp32) or
    "bf16-mixed", which here means FSDP2's `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`: fp32
    shards, bf16 gathered copies and activations (no autocast weight copies); `optimizer` adam or adamw.
    `states`: what a rank keeps between steps, exact against storage where cp divides each tensor's first
    dimension (each shard ceil(numel / cp) elements; FSDP2 pads by rows); `state_sync`: the step's collectives
    of the states per rank (FSDP2's all-gathers and reduce-scatter by `zero.communication`, all in the policy's
    parameter dtype; or DDP's all-reduce of every gradient), bytes sent and alpha-beta seconds on `link`.
    Validated on gloo ranks (`vramlab.measure.parallel cp --fsdp`, benchmarks/results/context_parallel/cpu.json):
    ring and Ulysses, 2 and 4 ranks, full recompute, chunked and fused losses, three models, with and without
    FSDP2; the shards exact, every rank's peak within -2 ... +0 %, CP's attention-backward moments within
    -0.6 ... 0 % and its attention-forward ones within -3.3 ... +0.8 % of the busiest rank's (the recomputed
    last block's moments traced tensor by tensor in the ranks' ledgers).

    Known limitations: ring attention's p2p and FSDP2's collectives share no buffers here, and
    neither's overlap with the other is priced; sharding over a dp x cp mesh (dp > 1) is cp x dp ranks of
    `zero` with CP's activations, not modelled here; FSDP2 measured in fp32 on gloo ranks only (its bf16
    policy is `zero`'s, validated there without CP); no reshard_after_forward=False (ZeRO-2-like) option."""
    spec = _specs.resolve(model)
    cp = check_count("cp", cp, hi=MAX_CP)
    shard_states = _checks.flag("shard_states", shard_states)
    method = str(_checks.one_of("method", method, CP_METHODS))
    b, s = check_count("batch_size", batch_size, hi=_checks.MAX_COUNT), check_count("seq_len", seq_len, hi=_checks.MAX_COUNT)
    _checks.positions(spec, s)
    _checks.one_of("precision", precision, _prec.PRECISIONS)
    _checks.one_of("device", device, ("cuda", "cpu"))
    _checks.one_of("optimizer", optimizer, _mem.OPTIMIZERS)
    _checks.one_of("optimizer_impl", optimizer_impl, _mem.OPTIMIZER_IMPLS)
    zigzag = _checks.flag("zigzag", zigzag)
    if not isinstance(recompute, str) or recompute not in CP_RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(CP_RECOMPUTE)} with context parallelism (every block "
                         f"checkpointed or none), got {_checks.show(recompute)}")
    _checks.one_of("loss", loss, _mem.LOSSES)
    mfu = _checks.number("mfu", mfu, lo=0, lo_open=True, hi=1, what="a fraction of the peak FLOP/s in (0, 1]")
    lk = _coll.LINKS[_checks.one_of("link", link, _coll.LINKS)] if not isinstance(link, _coll.Link) else link
    g = _specs.gpu(gpu)
    if shard_states:
        if precision not in _CP_FSDP_RECIPES:
            raise ValueError(f"precision must be {' or '.join(_CP_FSDP_RECIPES)} with shard_states=True (FSDP2 in fp32, "
                             f"or its bf16 MixedPrecisionPolicy with fp32 shards), got {_checks.show(precision)}")
        if optimizer not in ("adam", "adamw"):
            raise ValueError(f"optimizer must be adam or adamw with shard_states=True (FSDP2's sharded phases are "
                             f"Adam's), got {_checks.show(optimizer)}")
        fsdp_recipe, precision = _CP_FSDP_RECIPES[precision]  # the engine's phases in the policy's dtypes
    if spec.family not in DECODER_FAMILIES or not spec.is_causal_lm:
        raise ValueError(f"context parallelism is modelled for causal decoders ({', '.join(DECODER_FAMILIES)}), "
                         f"not {spec.name} ({spec.family})")
    if _act.uses_math_attention(spec, "sdpa", device, precision):
        raise ValueError(f"{spec.name} in {precision} on {device} runs SDPA's math path (it materialises the "
                         "s x s scores); CP here assumes a flash kernel (log-sum-exp merge)")
    a, kv = spec.num_heads, spec.num_kv_heads
    if method == "ulysses":
        zigzag = False  # Ulysses gathers whole sequences: contiguous shards, no imbalance
        if a % cp or kv % cp:
            raise ValueError(f"Ulysses shards attention by heads: cp {cp} must divide the {a} query heads and the "
                             f"{kv} key/value heads of {spec.name}")
    parts = 2 * cp if zigzag else cp
    if s % parts:
        raise ValueError(f"seq_len {s:,} must be a multiple of {parts} to cut it into "
                         + (f"2 x cp = {parts} zig-zag chunks" if zigzag else f"cp = {cp} equal shards"))
    n = s // cp
    nb = _prec.dtype_sizes(precision, device)
    xh, qd = nb["half"], spec.q_dim
    kvd = spec.kv_dim if device == "cpu" or precision != "fp32" or kv == 1 else qd  # as `layer_saved` keeps k, v
    L = spec.num_layers
    act = _act.activation_bytes(spec, batch_size=b, seq_len=n, precision=precision, attention="sdpa", device=device,
                                recompute=recompute)
    q_b, kv_b = b * n * qd * xh, b * n * kvd * xh  # one rank's q (or output) and k (or v)
    extra_saved = q_b if method == "ulysses" and cp > 1 else 0  # the all-to-all's output, o_proj's input
    saved_layer = act["one_layer"] + extra_saved
    activations = act["layers"] + act["outside"] + act["weight_copies"] + L * extra_saved
    if cp == 1:
        fwd_flight = bwd_flight = 0
    elif method == "ring":
        # the busiest rank: a merge may update all its rows (zig-zag: an earlier rank's block is seen by
        # every row); one step's block gradients are all rows x half the keys or half the rows x all keys
        fwd_flight = 2 * 2 * kv_b + 4 * q_b + 3 * b * a * n * 4
        grads = max(q_b + 2 * (kv_b // 2), q_b // 2 + 2 * kv_b) if zigzag else q_b + 2 * kv_b
        # dq, the current and next K/V, the dK/dV accumulators, and either one step's block gradients or
        # the accumulators' receive buffers; from 3 ranks on both at once (gloo ranks' ledgers, cp-val, ring,
        # 4 ranks: three pairs of K/V-sized receive buffers beside a step's block gradients; 2 ranks: two)
        bwd_flight = q_b + 3 * 2 * kv_b + (grads + 2 * kv_b if cp > 2 else max(grads, 2 * kv_b))
    else:
        fwd_flight = 3 * q_b
        bwd_flight = 2 * q_b + 2 * kv_b + 2 * q_b
    # communication
    if method == "ring":
        sent_f = (cp - 1) * 2 * kv_b
        sent_b = (cp - 1) * 2 * kv_b + (cp * 2 * kv_b if cp > 1 else 0)
        messages_f, messages_b = 2 * (cp - 1), 2 * (cp - 1) + (2 * cp if cp > 1 else 0)
        step_flops = _ring_step_flops(b, n, qd, cp, zigzag)
        peak_flops = (g.peak_tflops_fp32 if precision == "fp32" else g.peak_tflops_16) * 1e12 * mfu
        t_f = [float(f) / peak_flops for f in step_flops]
        kv_step = lk.alpha_s + 2 * kv_b / lk.bytes_per_s  # one K/V block, point to point
        comm_f = (cp - 1) * kv_step
        comm_b = (cp - 1) * kv_step + cp * kv_step
        # each step's transfer runs under that step's attention; the last forward step sends nothing
        exposed_f = sum(max(0.0, kv_step - t) for t in t_f[:-1])
        exposed_b = sum(max(0.0, (2 * kv_step if i < cp - 1 else kv_step) - 2 * t) for i, t in enumerate(t_f)) \
            if cp > 1 else 0.0
        compute_f = sum(t_f)
    else:
        sizes = (q_b, kv_b, kv_b, q_b)
        sent_f = sent_b = sum(z * (cp - 1) // cp for z in sizes)
        messages_f = messages_b = 4 * (cp - 1)
        comm_f = comm_b = sum(_coll.collective_time("all_to_all", cp, z, lk) for z in sizes)
        peak_flops = (g.peak_tflops_fp32 if precision == "fp32" else g.peak_tflops_16) * 1e12 * mfu
        compute_f = 2 * b * s * s * qd / cp / peak_flops  # causal: half of 2 x 2 b s^2 q_dim, over the heads
        exposed_f, exposed_b = comm_f, comm_b
    compute_b = 2 * compute_f
    if cp == 1:
        exposed_f = exposed_b = comm_f = comm_b = 0.0
    again = recompute == "full"  # the re-run forward of each block passes K/V (or its all-to-alls) once more
    # the rank's whole step: one device's phases at s/cp tokens (gradients kept between steps, all-reduced
    # in place), Ulysses' extra saved outputs wherever the blocks' activations are alive, and two moments
    # CP adds inside the last block's attention, where the most is alive: the states, every earlier block's
    # saved tensors and the last block's up to its attention core (what it saves after the core -- the
    # second norm, the MLP -- does not exist yet in the forward and was freed by its backward), plus CP's
    # in-flight bytes (and in the backward the gradient flowing into the block)
    phases = _mem.training_phases(spec, batch_size=b, seq_len=n, precision=precision, optimizer=optimizer,
                                  optimizer_impl=optimizer_impl, attention="sdpa", device=device,
                                  gpu=g if device == "cuda" else None, recompute=recompute, loss=loss,
                                  loss_chunk_tokens=loss_chunk_tokens, share=_act.DeviceShare(keep_gradients=True))
    block = _act.layer_saved(spec, attention="sdpa", device=device, precision=precision, batch_size=b)
    core = max(i for i, z in enumerate(block) if z.name == "logsumexp")  # a flash kernel's last saved tensor
    after_core = _act.ledger_bytes(block[core + 1:], tokens=b * n, scores=b * a * n * n,
                                    nbytes=dict(nb, loss=_prec.loss_bytes(spec, precision)), batch=b)
    # inside the last block's attention backward: the gradient entering the block (`block_grad_in`: one b x s x h
    # in a sequential pre-norm block, it also flows on down the residual) and the attention output's gradient
    # (o_proj's input gradient, b x n x q_dim: the attention kernel's `grad_out`, alive through every ring step).
    # Seen in the ledger of gloo ranks (cp-val, ring, 2 ranks, full recompute): an add (2, 512, 256) and an
    # mm (1024, 256) beside CP's own buffers; the re-run forward (under recompute) holds the first one only
    grads_in = act["block_grad_in"] + q_b
    # a tied head's gradient waits in autograd's input buffer for the embedding's (one AccumulateGrad node, two
    # incoming edges) through every block's backward, beside the kept gradients (seen on gloo ranks: an add
    # (6144, 256) in llama-gqa-val's attention backward; FSDP2's phases count the head's gradients themselves)
    # (cp 1 stays the one-device ledger, `memory.training_phases` with kept gradients, which leaves it out)
    pending = 0 if shard_states or cp == 1 or not spec.tie_word_embeddings else \
        spec.vocab_size * (spec.word_embed_proj_dim or spec.hidden_size) * (phases[0].gradients // spec.params)
    totals = []
    for ph in phases:
        t = ph.total
        if "embedding" in ph.phase or ph.phase.startswith("optimizer") or again:
            pass  # every block's activations are gone (under recompute a block keeps its input, not the output)
        else:
            t += L * extra_saved
        if again and ph.phase.startswith("backward of a recomputed block"):
            t += extra_saved  # the recomputed block's own all-to-all output, kept for its o_proj's backward
        if ph.phase.startswith(("backward of a recomputed block", "backward of the last block")):
            t += pending
        totals.append((t, ph.phase))
        if cp > 1 and not again and ph.phase.startswith("backward of the last block"):
            # the blocks run before the loss: the moments are those of the whole loss's forward end, less
            # everything outside the blocks
            end = next(x for x in (phases if loss == "whole" else _mem.training_phases(
                spec, batch_size=b, seq_len=n, precision=precision, optimizer=optimizer, optimizer_impl=optimizer_impl,
                attention="sdpa", device=device, gpu=g if device == "cuda" else None,
                share=_act.DeviceShare(keep_gradients=True))) if x.phase.startswith("forward end"))
            base = end.total - end.temporaries - end.kv_cache - (end.activations - act["layers"]) - after_core
            totals.append((base + (L - 1) * extra_saved + fwd_flight, "attention forward of the last block"))
            totals.append((base + L * extra_saved + grads_in + pending + bwd_flight,
                           "attention backward of the last block"))
        if cp > 1 and again and ph.phase.startswith("backward of a recomputed block"):
            # the last block re-run: the states, every block's input, the gradient entering the block and its
            # saved tensors up to the attention core (what it saves after the core is not made yet in the re-run
            # forward, and freed again by its backward before attention's), plus what CP holds in flight
            base = ph.total - ph.temporaries - ph.kv_cache - after_core + act["block_grad_in"] + pending
            # Ulysses' re-run forward holds one q-sized buffer more than the first forward's in-flight ones at its
            # peak (gloo ranks, cp-val, 2 and 4 ranks: the measured moment sat one q_b above, not identified further)
            totals.append((base + extra_saved + fwd_flight, "attention forward of the recomputed last block"))
            totals.append((base + q_b + extra_saved + bwd_flight, "attention backward of the recomputed last block"))
    ddp_states = phases[0].parameters + phases[0].gradients + phases[0].optimizer_states  # kept whole, all step
    states = {"parameters": phases[0].parameters, "gradients": phases[0].gradients,
              "optimizer_states": phases[0].optimizer_states}
    pb_sync = 4 if precision == "fp32" else 2
    if shard_states:
        totals, states = _cp_fsdp_moments(spec, cp, totals, ddp_states, fsdp_recipe, b=b, n=n, L=L, device=device,
                                          gpu=g if device == "cuda" else None, optimizer_impl=optimizer_impl,
                                          recompute=recompute, loss=loss, loss_chunk_tokens=loss_chunk_tokens,
                                          extra_saved=extra_saved, kept=max(act["kept"], default=0),
                                          alive=dict(act["backward"]), made=act["block_grads_made"])
        sync = _zero.communication(spec.params, cp, 3, bytes_per_value=pb_sync, link=lk, implementation="fsdp2",
                                   root_params=_zero.zero_units(spec)[1]) if cp > 1 else None
    else:
        G = states["gradients"]  # every gradient, all-reduced over the CP group
        sync = {"bytes_sent_per_rank": _coll.bytes_sent_per_rank("all_reduce", cp, G),
                "seconds": _coll.collective_time("all_reduce", cp, G, lk)} if cp > 1 else None
    peak, peak_phase = max(totals)
    return {"model": spec.name, "cp": cp, "method": method, "zigzag": zigzag, "tokens_per_rank": n,
            "shard_states": shard_states, "states": states,
            "state_sync": {"bytes_sent_per_rank": sync["bytes_sent_per_rank"], "seconds": sync["seconds"]} if sync
            else {"bytes_sent_per_rank": 0, "seconds": 0.0},
            "saved_per_layer": saved_layer, "activations": activations, "in_flight_forward": fwd_flight,
            "blocks_saved": act["layers"] + (0 if again else L * extra_saved),
            "in_flight_backward": bwd_flight, "activation_peak": activations + max(fwd_flight, bwd_flight),
            "peak": peak, "peak_phase": peak_phase, "moments": {phase: t for t, phase in totals},
            "recompute": recompute, "loss": loss,
            "sent_per_layer": {"forward": sent_f, "backward": sent_b, "recompute": sent_f if again else 0},
            "messages_per_layer": {"forward": messages_f, "backward": messages_b,
                                   "recompute": messages_f if again else 0},
            "comm_seconds_per_layer": {"forward": comm_f, "backward": comm_b, "recompute": comm_f if again else 0.0},
            "attention_seconds_per_layer": {"forward": compute_f, "backward": compute_b,
                                            "recompute": compute_f if again else 0.0},
            "exposed_seconds_per_layer": {"forward": exposed_f, "backward": exposed_b,
                                          "recompute": exposed_f if again else 0.0},
            "verdict": "hidden" if exposed_f + exposed_b == 0 else "exposed", "link": lk.name, "gpu": g.name}


# ============================================================================ expert parallelism
# Expert parallelism (EP; GShard, Lepikhin et al. 2020, arXiv:2006.16668; DeepSpeed-MoE, Rajbhandari et al.
# 2022, arXiv:2201.05596; Megatron-Core's MoE) splits each MoE layer's routed experts over ep ranks of the dp
# data-parallel ranks: a rank holds E/ep experts and everything dense whole. Tokens go to their experts and
# come back by two all-to-alls per MoE layer (dispatch, combine), two more in the backward. The experts'
# gradients are all-reduced over the expert-data-parallel group (edp = dp/ep ranks holding the same
# experts) only; the dense ones over all dp (Megatron-Core `parallel_state`'s expert-data-parallel group,
# DeepSpeed's `expert_data_parallel_group`), so ZeRO shards dense states over dp and expert states over edp.
MAX_EP = 1 << 12


def _is_routed_expert(name: str) -> bool:
    """A routed experts' parameter tensor (not a shared expert's, not the router's)."""
    return ".experts." in name and ".shared" not in name


def _moe_spec(model: "ModelSpec | str") -> ModelSpec:
    """The model's spec, refused in one line when it has no routed experts to split."""
    spec = _moe.resolve_moe(model)
    if not spec.is_moe:
        raise ValueError(f"{spec.name} is a dense model: expert parallelism needs routed experts (an MoE preset, "
                         f"e.g. {', '.join(_specs.moe_preset_names()[:2])})")
    return spec


def _ep_tensors(spec: ModelSpec, ep: int) -> tuple[list[int], list[int]]:
    """One EP rank's parameter tensors' element counts, (dense, experts), in `param_tensors` order: a routed
    experts' tensor (transformers 5 stores each layer's experts as one 3-D tensor, or one per expert in
    older layouts) counts 1/ep."""
    dense, experts = [], []
    for name, n in spec.param_tensors():
        if _is_routed_expert(name):
            experts.append(n // ep)
        else:
            dense.append(n)
    return dense, experts


def _greedy_shard(sizes: list[int], world: int, me: int) -> list[int]:
    """The tensors `torch.distributed.optim.ZeroRedundancyOptimizer` gives group rank `me` of `world`
    (`_partition_parameters`): whole tensors, largest first (a stable sort), each to the rank with the fewest
    elements so far (the lowest such rank)."""
    totals, mine = [0] * world, []
    for n in sorted(sizes, reverse=True):
        r = totals.index(min(totals))
        totals[r] += n
        if r == me:
            mine.append(n)
    return mine


def _ep_saved_dense_layer(h: int, a: int, kv: int, d: int, b: int, s: int, e: int) -> int:
    """Bytes one block of `measure.parallel`'s EP model saves for backward outside its MLP (read from its
    code, one rank, T = b s tokens, e bytes per activation): each RMSNorm (F.rms_norm) saves its input, its
    normalised input and the (T, 1) rstd; the output is saved by the projections after it; SDPA (CPU flash
    kernel) saves q, k, v, its output (o_proj's input, a view) and the (b, a, s) fp32 log-sum-exp."""
    T = b * s
    norms = 2 * (2 * T * h * e + T * e) + 2 * T * h * e  # two norms + their outputs
    return norms + T * (2 * a * d + 2 * kv * d) * e + 4 * b * a * s


def expert_parallel(model: "ModelSpec | str", *, ep: int, dp: int, batch_size: int, seq_len: int,
                    top_k: int | None = None, capacity_factor: float | None = None, precision: str = "bf16-mixed",
                    optimizer: str = "adamw", zero_stage: int = 0, link: "str | _coll.Link" = "nvlink4",
                    device: str = "cuda", received_rows: "tuple[int, ...] | None" = None,
                    kept_rows: "tuple[int, ...] | None" = None, home_rows: "tuple[int, ...] | None" = None,
                    zero_partition: str = "even",
                    rank: int = 0) -> dict[str, Any]:
    """One rank of `dp` data-parallel ranks training an MoE whose routed experts are split over `ep` of them
    (ep divides dp and num_experts; edp = dp/ep ranks hold the same experts), on its own `batch_size`
    sequences of `seq_len` tokens (T = b s tokens, k = top_k choices each).

    States (bytes; `memory.param_bytes` / `optimizer_state_bytes` per element, fp32 master as `memory` counts):
    dense tensors (attention, norms, embeddings, head, routers, shared experts) whole, routed experts E/ep per
    MoE layer; gradients likewise; ZeRO stage 1 shards optimizer states (2: and gradients) of dense tensors
    over dp, of experts over edp: `zero_partition` "even" (ceil division: Megatron's distributed optimizer
    pads its flat buffer) or "greedy" (whole tensors, as `ZeroRedundancyOptimizer` assigns them: the answer is
    for global rank `rank`, its dense shard at group rank `rank`, its expert shard at `rank // ep`, one
    optimizer per group, stepped one after the other). AdamW's step counts: 4 bytes per tensor held.

    Dispatch buffers per MoE layer, in the activation dtype (h values a row):
    - sent: dropless T k rows (each choice's copy of its token, sorted by expert); with a capacity factor
      the E x C padded buffer, C = `moe.expert_capacity(T, E, k, capacity_factor)` of the rank's own tokens;
    - received: dropless T k (E/ep)/E x ep = T k rows expected from a balanced router, worst ep T min(k, E/ep)
      (every token of the EP group picks this rank's experts); with a capacity (E/ep) C ep rows exactly.
    Communication per MoE layer (bytes leaving the rank): dispatch and combine forward, their two backward
    all-to-alls, each (ep-1)/ep of the buffer (a balanced router's share stays home); per step the experts'
    gradients all-reduced over edp and the dense ones over dp. Seconds: alpha-beta on `link` (`collectives`).

    Peak: for a step of `vramlab.measure.parallel`'s EP model (RMSNorm, SDPA attention, the transformers expert
    -- down(act(gate) * up) on 3-D gate_up/down tensors -- as a loop over the rank's experts (dropless) or two
    batched matmuls (capacity); derived from its code, validated fp32 on the CPU), the largest of three moments:
    - "loss": the states, every block's saved tensors (`_ep_saved_dense_layer`; a dense MLP 4 T I; the shared
      expert 4 T w and its gate; the router's fp32 probabilities, top-k ids and weights; the received rows
      regrouped by expert and per row 4 i for gate/up's output, act(gate), up and the product; the combine's
      weighted rows; the index tensors), the head's (final norm, lm_head input, fp32 log-softmax) and the logits;
    - "experts backward": inside the last MoE layer's experts' backward, the head's, shared expert's and
      combine's saved tensors freed, the residual's and the received rows' gradients alive, and the weight
      gradients the 3-D expert tensors get whole per expert (select's / bmm's backward: G = E/ep x 2i x h,
      D = E/ep x h x i; summed out of place across experts, 3 G at once), at a balanced expert's rows;
    - "optimizer step": foreach AdamW's one copy of the stepped parameters (per optimizer under greedy ZeRO).
    `received_rows` / `kept_rows` / `home_rows` (one per MoE layer: rows received, choices kept, rows routed to
    this rank's own experts) replace the balanced router's expectation with a run's real routing (dropless
    routing depends on the data: that is what the measured peaks and bytes are checked with).

    Known limitations: the activations are those of the measured model, not of a fused kernel (grouped GEMM,
    DeepEP) nor of another attention (MLA); activations are counted in the compute dtype throughout; no rotary
    embedding, dropout or auxiliary load-balancing loss; an unbalanced router's experts (more rows on one expert)
    are not modelled beyond `received_rows`; the all-to-all is priced as one collective of the whole buffer (no
    overlap with compute, no hierarchical intra/inter-node dispatch); the counts exchanged before a dropless
    dispatch (E/ep integers per peer) are not counted; ZeRO-2's gradient shards are the even split."""
    spec = _moe_spec(model)
    ep, dp = check_count("ep", ep, hi=MAX_EP), check_count("dp", dp)
    E = spec.num_experts
    if dp % ep:
        raise ValueError(f"ep must divide dp (the experts are split over ep of the dp ranks), got ep={ep}, dp={dp}")
    if E % ep:
        raise ValueError(f"ep must divide {spec.name}'s {E} routed experts, got ep={ep}")
    b, s = check_count("batch_size", batch_size, hi=_checks.MAX_COUNT), check_count("seq_len", seq_len, hi=_checks.MAX_COUNT)
    k = spec.num_experts_per_tok if top_k is None else _checks.whole("top_k", top_k, hi=E)
    if capacity_factor is not None:
        capacity_factor = _checks.number("capacity_factor", capacity_factor, lo=0, lo_open=True,
                                         hi=_moe.MAX_CAPACITY_FACTOR, what="a number > 0 (None: dropless)")
    _checks.one_of("precision", precision, _prec.PRECISIONS)
    _checks.one_of("optimizer", optimizer, _mem.OPTIMIZERS)
    _checks.one_of("device", device, ("cuda", "cpu"))
    zero_stage = _checks.one_of("zero_stage", zero_stage, (0, 1, 2))
    zero_partition = _checks.one_of("zero_partition", zero_partition, ("even", "greedy"))
    rank = _checks.whole("rank", rank, lo=0, hi=dp - 1)
    lk = link if isinstance(link, _coll.Link) else _coll.LINKS[_checks.one_of("link", link, _coll.LINKS)]
    edp, El, T = dp // ep, E // ep, b * s
    moe_layers = len(spec.moe_layer_ids)
    for name, rows in (("received_rows", received_rows), ("kept_rows", kept_rows), ("home_rows", home_rows)):
        if rows is not None and len(_checks.wholes(name, rows, lo=0)) != moe_layers:
            raise ValueError(f"{name} must hold one count per MoE layer ({moe_layers}), got {len(rows)}")
    # -- states
    dense_t, expert_t = _ep_tensors(spec, ep)
    n_dense, n_exp = sum(dense_t), sum(expert_t)
    pb = _mem.param_bytes(precision)
    params = {"dense": n_dense * pb, "experts": n_exp * pb}
    shard_d, shard_e = (dp, edp) if zero_stage >= 1 else (1, 1)
    if zero_stage and zero_partition == "greedy":  # ZeroRedundancyOptimizer: whole tensors, one optimizer per group
        own_d, own_e = _greedy_shard(dense_t, dp, rank), _greedy_shard(expert_t, edp, rank // ep)
    elif zero_stage:
        own_d, own_e = [-(-n_dense // shard_d)] * bool(dense_t), [-(-n_exp // shard_e)] * bool(expert_t)
        own_d, own_e = own_d and [own_d[0]] + [0] * (len(dense_t) - 1), own_e and [own_e[0]] + [0] * (len(expert_t) - 1)
    else:
        own_d, own_e = dense_t, expert_t
    opt_states = {"dense": _mem.optimizer_state_bytes(optimizer, sum(own_d), precision),
                  "experts": _mem.optimizer_state_bytes(optimizer, sum(own_e), precision)}
    if optimizer in ("adam", "adamw"):  # torch.optim keeps each tensor's step count as an fp32 scalar tensor
        opt_states = {"dense": opt_states["dense"] + 4 * len(own_d), "experts": opt_states["experts"] + 4 * len(own_e)}
    g_d, g_e = (dp, edp) if zero_stage >= 2 else (1, 1)
    grads = {"dense": -(-n_dense // g_d) * pb, "experts": -(-n_exp // g_e) * pb}
    states = sum(params.values()) + sum(grads.values()) + sum(opt_states.values())
    # -- dispatch buffers, one MoE layer
    nb = _prec.dtype_sizes(precision, device)
    e, h, i = nb["half"], spec.hidden_size, spec.moe_intermediate_size
    row = h * e
    if capacity_factor is None:
        C = None
        sent_rows, recv_expected, recv_worst = T * k, T * k, ep * T * min(k, El)
    else:
        C = _moe.expert_capacity(T, E, k, capacity_factor)
        sent_rows = recv_expected = recv_worst = E * C
    leave = Fraction(ep - 1, ep)
    a2a_sent = int(sent_rows * row * leave)  # one all-to-all's bytes leaving the rank
    sent = {"forward": 2 * a2a_sent, "backward": 2 * a2a_sent}
    sent_total = {d: moe_layers * v for d, v in sent.items()}
    if capacity_factor is None and home_rows is not None and received_rows is not None and ep > 1:
        # a run's routing: the dispatch sends all but the rows routed home, the combine returns all but those;
        # the backward's two all-to-alls carry the same rows' gradients the other way
        total = sum((T * k - m) + (r - m) for m, r in zip(home_rows, received_rows)) * row
        sent_total = {"forward": total, "backward": total}
        sent = {d: v // moe_layers for d, v in sent_total.items()}
    a2a_s = _coll.collective_time("all_to_all", ep, sent_rows * row, lk) if ep > 1 else 0.0
    grad_ar = {"dense": _coll.collective_time("all_reduce", dp, n_dense * pb, lk) if dp > 1 else 0.0,
               "experts": _coll.collective_time("all_reduce", edp, n_exp * pb, lk) if edp > 1 else 0.0}
    # -- activations of the measured model (read from `measure.parallel`'s EP model; e bytes each), per block
    a, kv, d, V = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size
    dense_layer = _ep_saved_dense_layer(h, a, kv, d, b, s, e)
    mlp_dense = T * 4 * spec.intermediate_size * e  # gate's output, act(gate), up's output, the product
    shared_w = spec.num_shared_experts * (spec.shared_expert_intermediate_size or i)
    # the shared expert as a dense MLP; its gate: sigmoid's output (T, 1) and the expert's output (T, h)
    shared = (T * 4 * shared_w * e + (T * e + T * h * e if spec.shared_expert_gate else 0)) if shared_w else 0
    # router: fp32 softmax output (T, E), top-k ids (int64), the weights' sum (T, 1) and top-k weights (T, k);
    # dropless also keeps the normalised weights (T k) for the combine, a capacity keeps the kept ones
    router = T * E * 4 + T * k * 8 + T * e + T * k * e
    moe, combine, recv = [], [], []
    for layer in range(moe_layers):
        R = received_rows[layer] if received_rows is not None else recv_expected
        experts = R * (h + 4 * i) * e  # received rows regrouped by expert (the experts' input), gate/up, act, product
        if capacity_factor is None:
            # the combine's weighted rows (T k, h) and weights; the sort order, its inverse; the regrouping, its inverse
            comb = T * k * h * e + T * k * e
            moe.append(router + experts + comb + 2 * T * k * 8 + 2 * R * 8)
        else:
            kept = kept_rows[layer] if kept_rows is not None else min(T * k, E * C)
            # index_copy's source rows, the processed rows gathered back and the weighted ones (index_add's source),
            # the kept weights; the kept choices, their slots, their tokens (int64)
            comb = 2 * kept * h * e + kept * e
            moe.append(router + experts + kept * h * e + comb + 3 * kept * 8)
        combine.append(comb)
        recv.append(R)
    head = 2 * T * h * e + T * e + T * h * e + T * V * 4 + T * 8 + 4  # final norm, lm_head's input, log-softmax, labels
    saved = (spec.num_layers * dense_layer + (spec.num_layers - moe_layers) * mlp_dense + moe_layers * shared
             + sum(moe) + head)
    ids = T * 8
    base = states + ids
    moments = {"loss": base + saved + T * V * 4}  # + the logits, alive while the log-softmax is computed
    if moe_layers:
        # the last MoE layer's experts in the backward: the head's, the shared expert's and the combine's saved
        # tensors are freed; the
        # residual's gradient (T, h) and the received rows' gradient (R, h) alive; the weights' gradients of the
        # 3-D expert tensors: select (dropless loop) or bmm (capacity) gives a whole (E/ep, ...) tensor, G for
        # gate_up, D for down, in the parameters' dtype
        R = recv[-1]
        G, D = El * 2 * i * h * pb, El * h * i * pb
        # (the shared expert runs after the routed ones: its backward, first, has freed its saved tensors)
        held = base + saved - head - combine[-1] - shared + T * h * e + R * h * e
        # the combine's backward all-to-all: its input (the rows sent home: T k, or E C with a capacity) and its
        # output (R) gradient buffers, which gloo's work may still hold when the experts' backward starts (seen on
        # some ranks, not others: freed when the work is released)
        in_flight = ((T * k if capacity_factor is None else E * C) + R) * h * e
        held += in_flight
        if capacity_factor is None:
            # the expert loop's backward, last expert first, Re rows each (balanced): in its product's backward
            # (the product freed; the gradients of the product, act(gate) and up), then at its gate_up weight
            # gradient (its saved tensors freed; the gradients of gate/up's output and of its input rows); the
            # next expert adds a second G that autograd sums out of place (3 G at once) and a second D (3 D)
            Re = -(-R // El)
            moments_e = [held + 2 * Re * i * e + D, held - Re * 4 * i * e + Re * (2 * i + h) * e + G + D]
            if El > 1:
                moments_e += [held - Re * 5 * i * e + Re * h * e + Re * i * e + G + 3 * D,
                              held - 2 * Re * 4 * i * e + 2 * Re * h * e + Re * 2 * i * e + 3 * G + D]
            moments["experts backward"] = max(moments_e)
        else:
            down = held + R * i * e + D  # bmm(down)'s backward: the product's gradient and D
            gate_up = held - 2 * R * i * e + R * (2 * i + h) * e + G  # bmm(gate_up)'s: act, product freed
            moments["experts backward"] = max(down, gate_up)
    # the step's foreach temporaries: one optimizer over the rank's tensors, or (greedy ZeRO) one per group in turn
    steps = [own_d, own_e] if zero_stage and zero_partition == "greedy" else [own_d + own_e]
    moments["optimizer step"] = base + max(_mem.optimizer_step_temporaries(optimizer, "foreach", t, sum(t), precision)
                                           for t in steps)
    peak_phase = max(moments, key=moments.get)
    return {"model": spec.name, "ep": ep, "dp": dp, "edp": edp, "experts_per_rank": El, "top_k": k,
            "capacity": C, "tokens_per_rank": T,
            "param_counts": {"dense": n_dense, "experts": n_exp},
            "expert_share": Fraction(n_exp * ep, n_exp * ep + n_dense) if n_exp else Fraction(0),
            "parameters": params, "gradients": grads, "optimizer_states": opt_states, "states": states,
            "dispatch_rows": {"sent": sent_rows, "received_expected": recv_expected, "received_worst": recv_worst},
            "dispatch_bytes": {"sent": sent_rows * row, "received_expected": recv_expected * row,
                               "received_worst": recv_worst * row},
            "sent_per_layer": sent, "sent_total": sent_total, "a2a_seconds_per_layer": {"forward": 2 * a2a_s, "backward": 2 * a2a_s},
            "grad_allreduce_bytes": {"dense": n_dense * pb, "experts": n_exp * pb},
            "grad_allreduce_seconds": grad_ar, "saved_activations": saved, "moe_layer_saved": moe,
            "dense_layer_saved": dense_layer,
            "peak": moments[peak_phase], "peak_phase": peak_phase, "moments": moments, "link": lk.name}


__all__ += ["expert_parallel", "MAX_EP"]
def context_fit(model: ModelSpec | str, gpu, *, cp: int, batch_size: int, seq_len: int,
                expandable_segments: bool = False, **kw) -> "tuple[dict[str, Any], _fitting.Fit]":
    """One CP rank (`context_parallel(model, cp=cp, ...)`, `kw` its options) and `fitting.device_fit` of its
    peak: the one definition of "fits" at s/cp tokens a rank (the allocator's block for the rank's largest
    tensor under the same precision, recompute and loss), as the context calculator and CLI use it.
    `shard_states=True` (in `kw`): the states sharded over the cp ranks by FSDP2 (`context_parallel`); the
    largest tensor is then also at least a block's flat all-gather output in the policy's dtype."""
    r = context_parallel(model, cp=cp, batch_size=batch_size, seq_len=seq_len, gpu=gpu, **kw)
    frag_kw = {k: kw[k] for k in ("precision", "recompute", "loss", "loss_chunk_tokens") if k in kw}
    largest = _fitting.fragmentation_bytes(model, batch_size=batch_size, seq_len=r["tokens_per_rank"],
                                           **{"precision": "bf16-mixed", **frag_kw})
    if r["shard_states"]:
        flat = _zero.zero_units(_specs.resolve(model))[0] * (4 if kw.get("precision", "bf16-mixed") == "fp32" else 2)
        largest = max(largest, flat)
    return r, _fitting.device_fit(r["peak"], gpu, largest_tensor=largest, expandable_segments=expandable_segments)


# ---------------------------------------------------------------------------- experts with tensor and pipeline parallelism
# Megatron-Core's "MoE parallel folding" (Liu et al. 2025, arXiv:2504.14960; megatron/core/parallel_state.py's
# expert groups, transformer/moe/experts.py): a pipeline stage's tp x dp ranks run its attention and dense
# layers as tp-way tensor parallelism replicated dp times, and the same ranks are re-folded for its MoE
# layers into etp x ep x edp: each rank holds E/ep routed experts, each split etp ways (gate/up by columns,
# down by rows), and the experts' optimizer states are sharded over the edp ranks holding the same ones.
_MLA_DUPLICATED = ("q_a_proj", "kv_a_proj_with_mqa", "q_a_layernorm", "kv_a_layernorm")  # MCore: "duplicated"
_MLA_COLUMN = ("q_b_proj", "kv_b_proj")


def _moe_tensor_share(spec: ModelSpec, name: str, numel: int, tp: int, ep: int, etp: int) -> tuple[str, int]:
    """(kind, elements one rank holds) of one parameter tensor: kind "experts" for the routed experts
    (E/ep of them, each 1/etp: transformers 5 keeps a layer's experts as 3-D tensors, E first), "dense" for
    the rest -- tensor-parallel as Megatron splits it (`_tp_numel`: heads, MLP widths, vocabulary rows;
    MLA's up-projections by columns, its down-projections and their norms duplicated; the router's E x h
    weight and the norms whole on every rank)."""
    if _is_routed_expert(name):
        return "experts", numel // ep // etp
    last = name.rsplit(".", 2)[-2] if name.endswith(".weight") or name.endswith(".bias") else name.rsplit(".", 1)[-1]
    if last in _MLA_DUPLICATED or name.endswith("mlp.gate.weight"):
        return "dense", numel
    if last in _MLA_COLUMN:
        return "dense", numel // tp
    return "dense", _tp_numel(name, numel, tp, spec.vocab_size)


def moe_layout_states(model: "ModelSpec | str", *, tp: int = 1, pp: int = 1, ep: int = 1, dp: int = 1,
                      etp: int = 1, zero_stage: int = 0, precision: str = "bf16-mixed",
                      optimizer: str = "adamw") -> dict[str, Any]:
    """Model states (bytes) one rank holds when an MoE trains on tp x pp x dp devices with its routed experts
    over ep ranks (Megatron-Core's parallel folding, above): per pipeline stage (`stage_layers`' even split;
    the first holds the embeddings, the last the final norm and head, and a tied embedding's copy), the
    dense tensors' tensor-parallel share (`_moe_tensor_share`) and E/ep of each MoE layer's experts, each
    1/etp. etp x ep must divide tp x dp (the stage's ranks); edp = tp dp / (etp ep) ranks hold the same
    experts. Gradients as the parameters; `zero_stage` 1 (Megatron's distributed optimizer, DeepSpeed ZeRO-1)
    shards the optimizer states (2: and the gradients) of the dense tensors over dp and of the experts over
    edp, evenly (ceil). Bytes per element as `memory` counts them (`param_bytes`, `optimizer_state_bytes`).

    Returns "stages" (one dict per stage: params/gradients/optimizer_states split into dense and experts,
    states, the stage's layers) and the busiest stage's "states", with the group sizes.

    Known limitations: states only (activations under TP/PP with experts, the dispatch under TP -- Megatron
    gathers a sequence-parallel shard's tokens before routing -- are not modelled here: `expert_parallel`
    prices one data-parallel rank's dispatch and step); no uneven first/last stages
    (`num_layers_in_first_pipeline_stage`), no context parallelism in the folding; fp32 gradient buffers
    (Megatron's `main_grad` under bf16 parameters) as `memory`'s precision says; MTP modules are not counted."""
    spec = _moe_spec(model)
    tp, pp, ep, dp, etp = (check_count(n, v, hi=MAX_EP if n in ("ep", "etp") else MAX_DEVICES)
                           for n, v in (("tp", tp), ("pp", pp), ("ep", ep), ("dp", dp), ("etp", etp)))
    if tp * pp * dp > MAX_DEVICES:
        raise ValueError(f"tp x pp x dp must be at most {MAX_DEVICES:,} devices, got {tp * pp * dp:,}")
    _checks.divides_heads(spec, tp)
    for name, width in (("MLP width", spec.intermediate_size), ("shared experts' width",
                        spec.shared_expert_intermediate_size or spec.moe_intermediate_size)):
        if width and width % tp:
            raise ValueError(f"tp={tp} must divide {spec.name}'s {name} ({width})")
    if spec.num_experts % ep:
        raise ValueError(f"ep must divide {spec.name}'s {spec.num_experts} routed experts, got ep={ep}")
    if spec.moe_intermediate_size % etp:
        raise ValueError(f"etp must divide {spec.name}'s expert width ({spec.moe_intermediate_size}), got etp={etp}")
    if (tp * dp) % (etp * ep):
        raise ValueError(f"etp x ep must divide tp x dp (the experts are re-folded over a stage's tp x dp ranks), "
                         f"got etp x ep = {etp * ep}, tp x dp = {tp * dp}")
    if pp > spec.num_layers:
        raise ValueError(f"pp must be at most {spec.name}'s {spec.num_layers} blocks, got {pp}")
    zero_stage = _checks.one_of("zero_stage", zero_stage, (0, 1, 2))
    _checks.one_of("precision", precision, _prec.PRECISIONS)
    _checks.one_of("optimizer", optimizer, _mem.OPTIMIZERS)
    edp = tp * dp // (etp * ep)
    layers = _stage_layers(spec.num_layers, pp)
    pb = _mem.param_bytes(precision)
    stages = []
    for k in range(pp):
        n = {"dense": 0, "experts": 0}
        count = {"dense": 0, "experts": 0}
        for name, numel in spec.param_tensors():
            if not _copies_on_stage(*_placement(spec, name), k, pp, layers[k]):
                continue
            kind, share = _moe_tensor_share(spec, name, numel, tp, ep, etp)
            n[kind] += share
            count[kind] += 1
        over = {"dense": dp, "experts": edp}
        own = {d: (-(-n[d] // over[d]) if zero_stage else n[d]) for d in n}
        opt = {d: _mem.optimizer_state_bytes(optimizer, own[d], precision)
               + (4 * count[d] if optimizer in ("adam", "adamw") and not zero_stage else 0) for d in n}
        grads = {d: (-(-n[d] // over[d]) if zero_stage >= 2 else n[d]) * pb for d in n}
        params = {d: n[d] * pb for d in n}
        stages.append({"stage": k, "layers": layers[k], "param_counts": n, "parameters": params,
                       "gradients": grads, "optimizer_states": opt,
                       "states": sum(params.values()) + sum(grads.values()) + sum(opt.values())})
    worst = max(stages, key=lambda x: x["states"])
    return {"model": spec.name, "tp": tp, "pp": pp, "ep": ep, "etp": etp, "dp": dp, "edp": edp,
            "devices": tp * pp * dp, "zero_stage": zero_stage, "precision": precision, "stages": stages,
            "states": worst["states"], "busiest_stage": worst["stage"]}


__all__ += ["moe_layout_states"]
