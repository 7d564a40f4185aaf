"""vramlab.parallel's and vramlab.pipeline's arguments (one ValueError naming the argument; numpy
scalars accepted; bools, strings, NaN and infinities refused) and their fast paths: the closed forms
of `simulate` and the pipeline points of `estimate_layout`, checked against the event simulation
they replace."""

from __future__ import annotations

import dataclasses
import math
import random
from fractions import Fraction

import numpy as np
import pytest

import vramlab
from vramlab import parallel as P
from vramlab import pipeline as PIPE


# ----------------------------------------------------------------------------- the references
def _simulate_reference(p, m, schedule, v=1, forward=Fraction(1), backward=Fraction(2)):
    """pipeline._simulate as it was: replay every operation in integer ticks, then count each
    device's activations in flight from the events' end times. Returns (ops, makespan, in_flight,
    bubble), ops as plain tuples."""
    forward, backward = Fraction(forward), Fraction(backward)
    unit = Fraction(1, v * forward.denominator * backward.denominator)
    tf, tb = int(forward / v / unit), int(backward / v / unit)
    orders = PIPE._orders(p, m, schedule, v)
    ticks = PIPE.replay_orders(orders, [[tf if kind == "F" else tb for kind, _, _ in order] for order in orders],
                            what=f"the {schedule} schedule")
    in_flight = []
    for d in range(p):  # a forward's activations are held from its end to its backward's end
        events = sorted((end, 1 if kind == "F" else -1) for dd, kind, _, _, _, end in ticks if dd == d)
        held = peak = 0
        for _, delta in events:
            held += delta
            peak = max(peak, held)
        in_flight.append(peak)
    ops = tuple((d, kind, i, c, start * unit, end * unit)
                for d, kind, i, c, start, end in sorted(ticks, key=lambda x: (x[0], x[4])))
    makespan = max(x[5] for x in ticks) * unit
    busy = sum(end - start for *_, start, end in ops)
    return ops, makespan, tuple(in_flight), 1 - busy / (p * makespan)


def _interleaved_points_reference(p, m, v, stage, received_inputs, sends_pend):
    """pipeline.interleaved_points as it was: walk the stage's order operation by operation."""
    last = p * v - 1
    alive = [0] * v
    pending, best = 0, {}
    for kind, _, c in PIPE._orders(p, m, "interleaved", v)[stage]:
        if kind == "F":
            alive[c] += 1
            continue
        n = sum(alive)
        got = (n - (alive[0] if stage == 0 else 0)) if received_inputs else 0
        sends = pending if sends_pend else 0
        if n not in best or sends - got > best[n][1] - best[n][0]:
            best[n] = (got, sends)
        alive[c] -= 1
        pending += int(c * p + stage > 0) + int(c * p + stage < last)
    if not sends_pend:
        n = max(best)
        return ((n, *best[n]),)
    hull = []
    for n in sorted(best):
        e = best[n][1] - best[n][0]
        while len(hull) >= 2 and ((hull[-1][0] - hull[-2][0]) * (e - hull[-2][1])
                                  - (hull[-1][1] - hull[-2][1]) * (n - hull[-2][0])) >= 0:
            hull.pop()
        hull.append((n, e))
    top = max(hull)
    return tuple((n, *best[n]) for n, e in reversed(hull) if n == top[0] or e > top[1])


def _cases(p_max, m_max, chunks):
    for p in range(1, p_max + 1):
        for m in range(1, m_max + 1):
            for schedule in PIPE.SCHEDULES:
                for v in (chunks if schedule == "interleaved" else (1,)):
                    if schedule == "interleaved" and (p == 1 or m % p):
                        continue
                    yield p, m, schedule, v


def _same_run(p, m, schedule, v, forward=1, backward=2, ops=False):
    run = PIPE.simulate(p, m, schedule, chunks=v, forward=forward, backward=backward)
    ref_ops, makespan, in_flight, bubble = _simulate_reference(p, m, schedule, v, Fraction(forward), Fraction(backward))
    assert (run.makespan, run.in_flight, run.bubble) == (makespan, in_flight, bubble), (p, m, schedule, v, forward, backward)
    if ops:
        assert tuple(dataclasses.astuple(o) for o in run.ops) == ref_ops, (p, m, schedule, v)


# ----------------------------------------------------------------------------- B: the fast paths
@pytest.mark.slow
def test_simulate_is_the_event_simulation_for_every_small_case():
    """p <= 8, m <= 32, every schedule, chunks 1 to 4 (interleaved: m a multiple of p), the default
    backward = 2 forward: makespan, micro-batches in flight and bubble are the replay's."""
    for p, m, schedule, v in _cases(8, 32, (1, 2, 3, 4)):
        _same_run(p, m, schedule, v, ops=p * m * v <= 64)


@pytest.mark.slow
@pytest.mark.parametrize("forward, backward", [(1, 1), (3, 1), (1, 7), (Fraction(2, 3), Fraction(5, 7)), (0.1, 0.3),
                                               (20, 1), (1, 20)])
def test_simulate_is_the_event_simulation_for_any_durations(forward, backward):
    """Backwards shorter than forwards, much longer, fractional, floats: the closed forms hold."""
    for p, m, schedule, v in _cases(6, 12, (1, 2, 3)):
        _same_run(p, m, schedule, v, forward, backward, ops=p * m * v <= 24)


def test_simulate_many_chunks_and_random_larger_cases():
    for p, m, v in ((2, 2, 64), (2, 4, 33), (3, 6, 17), (4, 4, 64), (8, 8, 16)):
        _same_run(p, m, "interleaved", v)
    rng = random.Random(29)
    for _ in range(12):
        schedule = rng.choice(PIPE.SCHEDULES)
        p = rng.randint(2, 24)
        v = rng.choice((1, 2, 3, 5, 8)) if schedule == "interleaved" else 1
        m = p * rng.randint(1, 4) if schedule == "interleaved" else rng.randint(1, 64)
        f, b = Fraction(rng.randint(1, 9), rng.randint(1, 9)), Fraction(rng.randint(1, 9), rng.randint(1, 9))
        _same_run(p, m, schedule, v, f, b)


def test_simulate_answers_its_whole_range():
    """p = 256, m = 1024, 64 chunks: the closed forms (the event simulation took minutes)."""
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 1), ("interleaved", 64)):
        run = PIPE.simulate(256, 1024, schedule, chunks=v)
        assert run.bubble == PIPE.bubble_fraction(256, 1024, schedule, chunks=v)
        assert len(run.in_flight) == 256
    assert PIPE.simulate(256, 1024, "1f1b").in_flight == tuple(min(256 - s, 1024) for s in range(256))
    assert PIPE.simulate(256, 1024, "interleaved", chunks=2).in_flight[0] == 2 * 255 + 256 + 1


def test_interleaved_points_are_the_walk():
    """The moments of an interleaved stage that may peak, in closed form, for every stage of every
    small interleaved schedule, with and without receive buffers and pending sends."""
    for p in range(2, 7):
        for m in range(p, 25, p):
            for v in (1, 2, 3, 5):
                for stage in range(p):
                    for received, pend in ((False, False), (True, False), (True, True)):
                        assert PIPE.interleaved_points(p, m, v, stage, received, pend) == \
                            _interleaved_points_reference(p, m, v, stage, received, pend), (p, m, v, stage, received, pend)
    rng = random.Random(7)
    for _ in range(8):
        p, v = rng.randint(2, 12), rng.randint(1, 12)
        m = p * rng.randint(1, 6)
        stage = rng.randrange(p)
        for received, pend in ((True, False), (True, True)):
            assert PIPE.interleaved_points(p, m, v, stage, received, pend) == \
                _interleaved_points_reference(p, m, v, stage, received, pend), (p, m, v, stage, received, pend)


def test_interleaved_estimate_is_unchanged(monkeypatch):
    """estimate_layout with the closed-form points equals estimate_layout with the walk."""
    spec = vramlab.specs.from_config(dict(model_type="gpt_neox", hidden_size=256, intermediate_size=1024,
                                          num_hidden_layers=8, num_attention_heads=8, vocab_size=4096,
                                          max_position_embeddings=512), name="neox")
    kw = dict(micro_batch_size=2, seq_len=128, precision="fp32")
    layouts = [P.Layout(pp=4, micro_batches=8, schedule="interleaved", chunks=2),
               P.Layout(pp=2, micro_batches=6, schedule="interleaved", chunks=4, tp=2),
               P.Layout(pp=2, micro_batches=4, schedule="interleaved", chunks=1)]
    runs = [(lay, device, keep) for lay in layouts for device in ("cpu", "cuda") for keep in (True, False)]
    fast = [P.estimate_layout(spec, lay, device=device, keep_stage_output=keep, **kw) for lay, device, keep in runs]
    monkeypatch.setattr(PIPE, "interleaved_points", _interleaved_points_reference)
    slow = [P.estimate_layout(spec, lay, device=device, keep_stage_output=keep, **kw) for lay, device, keep in runs]
    assert [[s.to_dict() for s in x] for x in fast] == [[s.to_dict() for s in x] for x in slow]


def test_layout_limits_are_layouts():
    """An interleaved layout Layout allows (m up to 16,384) is estimated: no `simulate` limit on m."""
    lay = P.Layout(pp=2, micro_batches=2048, schedule="interleaved", chunks=2)
    assert P.in_flight(lay) == (2 * 1 + 2 + 1, 2 + 1)
    (first, last) = P.estimate_layout("gpt2", lay, micro_batch_size=1, seq_len=128)
    assert first.total > 0 and last.total > 0
    big = P.Layout(pp=4, micro_batches=16384, schedule="interleaved", chunks=3)
    assert P.in_flight(big) == tuple(2 * (4 - s - 1) + 2 * 4 + 1 for s in range(4))
    with pytest.raises(ValueError, match="^micro_batches must be a whole number from 1 to 16,384, got 16386"):
        P.Layout(pp=2, micro_batches=16386, schedule="interleaved")


# ----------------------------------------------------------------------------- A: the cases
def test_numpy_scalars_are_numbers():
    ref = PIPE.simulate(4, 8)
    assert PIPE.simulate(4, 8, forward=np.int64(1)) == ref
    assert PIPE.simulate(np.int64(4), np.int64(8), chunks=np.int64(1), backward=np.float64(2.0)) == ref
    assert PIPE.simulate(4, 8, forward=np.float32(0.5), backward=np.float32(1.0)).makespan == 11 * Fraction(3, 2)
    sizes = [4 * n for _, n in vramlab.preset("gpt2").param_tensors()]
    assert P.ddp_buckets(sizes, bucket_cap_mb=np.int64(25)) == P.ddp_buckets(sizes)
    assert P.ddp_buckets(np.array(sizes), first_bucket_mb=np.float32(1.0)) == P.ddp_buckets(sizes)
    buckets = P.ddp_buckets(sizes)
    want = P.ddp_overlap(buckets, n=8, backward_seconds=0.5, link="nvlink4")
    assert P.ddp_overlap(buckets, n=8, backward_seconds=np.float64(0.5), link="nvlink4") == want
    assert P.ddp_overlap(np.array(buckets), n=np.int64(8), backward_seconds=np.float32(0.5), link="nvlink4") == want
    assert PIPE.bubble_fraction(np.int64(4), np.int64(8), chunks=np.int64(1)) == PIPE.bubble_fraction(4, 8)
    assert P.korthikanti_layer_activations(s=np.int64(8), b=np.int64(1), h=np.int64(4), a=np.int64(2), t=np.int64(2),
                                           sp=np.bool_(True)) == P.korthikanti_layer_activations(s=8, b=1, h=4, a=2, t=2, sp=True)
    assert P.Layout(tp=2, sp=np.bool_(True)).sp is True
    assert P.Layout(dp=2, zero=np.int64(1)).zero == 1
    assert P.stage_layers(np.int64(12), np.int64(5)) == P.stage_layers(12, 5)
    assert P.rank_params("gpt2", P.Layout(pp=2), np.int64(1)) == P.rank_params("gpt2", P.Layout(pp=2), 1)
    kw = dict(micro_batch_size=2, seq_len=128)
    npkw = dict(micro_batch_size=np.int64(2), seq_len=np.int64(128))
    assert P.layer_activation_bytes("gpt2", **npkw, tp=np.int64(2)) == P.layer_activation_bytes("gpt2", **kw, tp=2)
    lay = P.Layout(pp=2, micro_batches=4)
    assert P.estimate_layout("gpt2", lay, **npkw, stages=np.array([1])) == P.estimate_layout("gpt2", lay, **kw, stages=(1,))
    assert P.communication("gpt2", lay, **npkw) == P.communication("gpt2", lay, **kw)
    assert P.fits("gpt2", lay, "h100", **npkw, max_search=np.int64(8)) == P.fits("gpt2", lay, "h100", **kw, max_search=8)
    plan = dict(seq_len=1024, global_batch=16)
    a = P.plan_layouts("llama-3.2-1b", np.int64(8), "h100", seq_len=np.int64(1024), global_batch=np.int64(16),
                       mfu=np.float32(0.5), gpus_per_node=np.int64(8), micro_batch_size=np.int64(1))
    b = P.plan_layouts("llama-3.2-1b", 8, "h100", mfu=float(np.float32(0.5)), **plan)
    assert [(x.name, x.tokens_per_s, x.fit.needed) for x in a] == [(x.name, x.tokens_per_s, x.fit.needed) for x in b]


@pytest.mark.parametrize("call", [
    lambda: P.fits("gpt2", P.Layout(), "h100", micro_batch_size=1, seq_len=128, bogus=1),
    lambda: P.fits("gpt2", P.Layout(), "h100", micro_batch_size=1, seq_len=128, gpu_count=2, bogus=1),
], ids=["one", "two"])
def test_fits_names_unknown_arguments(call):
    with pytest.raises(ValueError, match=r"^fits: unknown arguments? .*bogus"):
        call()


def test_one_interleaving_rule():
    """bubble_fraction, simulate and Layout refuse the same interleaved combinations, each naming
    the arguments as its caller wrote them."""
    with pytest.raises(ValueError, match=r"^m must be a multiple of p \(4\) under the interleaved schedule.*got 6$"):
        PIPE.bubble_fraction(4, 6, "interleaved", chunks=2)
    with pytest.raises(ValueError, match=r"^m must be a multiple of p \(4\)"):
        PIPE.simulate(4, 6, "interleaved", chunks=2)
    with pytest.raises(ValueError, match=r"^micro_batches must be a multiple of pp \(4\)"):
        P.Layout(pp=4, micro_batches=6, schedule="interleaved", chunks=2)
    with pytest.raises(ValueError, match=r"^p must be at least 2 for the interleaved schedule"):
        PIPE.bubble_fraction(1, 4, "interleaved")
    with pytest.raises(ValueError, match=r"^chunks must be 1 under the 1f1b schedule"):
        PIPE.simulate(4, 8, "1f1b", chunks=2)
    with pytest.raises(ValueError, match=r"^chunks must be 1 under the gpipe schedule"):
        PIPE.bubble_fraction(4, 8, "gpipe", chunks=2)


def test_what_the_model_allows():
    gpt2 = vramlab.preset("gpt2")
    with pytest.raises(ValueError, match="positions|heads"):
        P.layer_activation_bytes(gpt2, micro_batch_size=1, seq_len=5000, tp=5)
    with pytest.raises(ValueError, match="reads at most 1,024 positions; seq_len 5,000"):
        P.layer_activation_bytes(gpt2, micro_batch_size=1, seq_len=5000)
    with pytest.raises(ValueError, match=r"^tp=5 must divide gpt2's 12 heads"):
        P.layer_activation_bytes(gpt2, micro_batch_size=1, seq_len=128, tp=5)
    with pytest.raises(ValueError, match="reads at most 1,024 positions; seq_len 5,000"):
        P.communication("gpt2", P.Layout(tp=2), micro_batch_size=1, seq_len=5000)
    with pytest.raises(ValueError, match="reads at most 1,024 positions"):
        P.plan_layouts("gpt2", 8, "h100", seq_len=2048, global_batch=16)
    with pytest.raises(ValueError, match=r"^tp=8 must divide gpt2's 12 heads"):
        P.rank_params("gpt2", P.Layout(tp=8), 0)
    with pytest.raises(ValueError, match=r"^pp x chunks must be at most 12"):
        P.rank_params("gpt2", P.Layout(pp=8, micro_batches=8, schedule="interleaved", chunks=2), 0)


def test_one_micro_batch_limit_named_as_written():
    """The interleaved estimate used to go through simulate's own m <= 1,024 ("m must be ...")."""
    lay = P.Layout(pp=2, micro_batches=2048, schedule="interleaved")
    assert len(P.estimate_layout("gpt2", lay, micro_batch_size=1, seq_len=128)) == 2
    with pytest.raises(ValueError, match=r"^micro_batches must be a whole number from 1 to 16,384, got 20000"):
        P.Layout(micro_batches=20000)
    with pytest.raises(ValueError, match=r"^global_batch must be at most 16,384 micro-batches"):
        P.plan_layouts("llama-3.2-1b", 8, "h100", seq_len=128, global_batch=40000)


# ----------------------------------------------------------------------------- A: every entry point
NAN, INF = float("nan"), float("inf")
LAY = P.Layout(pp=2, micro_batches=4)
EST = dict(micro_batch_size=1, seq_len=128)


@pytest.mark.parametrize("call, msg", [
    # Layout
    (lambda: P.Layout(dp=True), r"^dp must be a whole number from 1 to 1,048,576, got True"),
    (lambda: P.Layout(tp="2"), r"^tp must be"),
    (lambda: P.Layout(pp=2.0), r"^pp must be"),
    (lambda: P.Layout(micro_batches=np.float64(4)), r"^micro_batches must be"),
    (lambda: P.Layout(sp=1, tp=2), r"^sp must be True or False, got 1"),
    (lambda: P.Layout(schedule=True), r"^unknown schedule True"),
    (lambda: P.Layout(dp=2, zero=True), r"^zero must be 0 or 1"),
    (lambda: P.Layout(dp=2, zero=1.0), r"^zero must be 0 or 1"),
    (lambda: P.Layout(dp=1024, tp=1024, pp=4), r"^dp x tp x pp must be at most 1,048,576"),
    # korthikanti_layer_activations
    (lambda: P.korthikanti_layer_activations(s=True, b=1, h=1, a=1), r"^s must be"),
    (lambda: P.korthikanti_layer_activations(s=8, b=1, h="4", a=1), r"^h must be"),
    (lambda: P.korthikanti_layer_activations(s=8, b=1, h=4, a=1, recompute=None), r"^unknown recompute None"),
    (lambda: P.korthikanti_layer_activations(s=8, b=1, h=4, a=1, sp=True), r"^sp=True needs t > 1"),
    # bubble_fraction
    (lambda: PIPE.bubble_fraction(True, 4), r"^p must be"),
    (lambda: PIPE.bubble_fraction(4, "8"), r"^m must be"),
    (lambda: PIPE.bubble_fraction(4, 8, chunks=1.0), r"^chunks must be"),
    (lambda: PIPE.bubble_fraction(4, 8, "zigzag"), r"^unknown schedule 'zigzag'"),
    (lambda: PIPE.bubble_fraction(4, 8, of=True), r"^of must be 'total' or 'ideal', got True"),
    (lambda: PIPE.bubble_fraction(4, 8, of=["total"]), r"^of must be 'total' or 'ideal'"),
    # simulate
    (lambda: PIPE.simulate(4, 8, forward=NAN), r"^forward must be a finite positive number, got nan"),
    (lambda: PIPE.simulate(4, 8, backward=INF), r"^backward must be a finite positive number, got inf"),
    (lambda: PIPE.simulate(4, 8, forward=True), r"^forward must be"),
    (lambda: PIPE.simulate(4, 8, forward="1"), r"^forward must be"),
    (lambda: PIPE.simulate(4, 8, backward=0), r"^backward must be"),
    (lambda: PIPE.simulate(4, 8, backward=np.float32("nan")), r"^backward must be"),
    (lambda: PIPE.simulate(257, 8), r"^p must be a whole number from 1 to 256"),
    (lambda: PIPE.simulate(4, 1025), r"^m must be a whole number from 1 to 1,024"),
    (lambda: PIPE.simulate(4, 8, "interleaved", chunks=65), r"^chunks must be a whole number from 1 to 64"),
    # replay_orders
    (lambda: PIPE.replay_orders("FB", [[1, 2]]), r"^orders must be a non-empty list"),
    (lambda: PIPE.replay_orders([[("F", 0, 0)]], [[1, 2]]), r"^took\[0\] must hold one duration per operation"),
    (lambda: PIPE.replay_orders([[("F", 0, 0)]], [[NAN]]), r"^took\[0\]\[0\] must be"),
    (lambda: PIPE.replay_orders([[("X", 0, 0)]], [[1]]), r"^unknown orders\[0\]\[0\] kind 'X'"),
    (lambda: PIPE.replay_orders([[("F", -1, 0)]], [[1]]), r"^orders\[0\]\[0\] micro-batch must be"),
    (lambda: PIPE.replay_orders([[("F", 0)]], [[1]]), r"^orders\[0\]\[0\] must be \(kind, micro-batch, chunk\)"),
    (lambda: PIPE.replay_orders([[("F", 0, 0)]], [[1]], what=3), r"^what must be"),
    # stage_layers, rank_params, stage_tensors, in_flight
    (lambda: P.stage_layers(12, 0), r"^pp must be a whole number from 1 to 1,048,576, got 0"),
    (lambda: P.stage_layers(12.0, 2), r"^num_layers must be"),
    (lambda: P.stage_layers(12, True), r"^pp must be"),
    (lambda: P.rank_params("gpt2", LAY, True), r"^stage must be"),
    (lambda: P.stage_tensors("gpt2", LAY, 2), r"^stage must be a whole number from 0 to 1, got 2"),
    (lambda: P.stage_tensors(5, LAY, 0), r"^model must be"),
    (lambda: P.in_flight("dp=2"), r"^layout must be a vramlab.parallel.Layout"),
    # layer_activation_bytes
    (lambda: P.layer_activation_bytes("gpt2", micro_batch_size=True, seq_len=128), r"^micro_batch_size must be"),
    (lambda: P.layer_activation_bytes("gpt2", micro_batch_size=1, seq_len="128"), r"^seq_len must be"),
    (lambda: P.layer_activation_bytes("gpt2", micro_batch_size=1, seq_len=128, sp=True), r"^sp=True needs tp > 1"),
    (lambda: P.layer_activation_bytes("gpt2", micro_batch_size=1, seq_len=128, attention="flash"), r"^unknown attention"),
    (lambda: P.layer_activation_bytes("gpt2", micro_batch_size=1, seq_len=128, device="tpu"), r"^unknown device"),
    # estimate_layout
    (lambda: P.estimate_layout("gpt2", LAY, micro_batch_size=2.0, seq_len=128), r"^micro_batch_size must be"),
    (lambda: P.estimate_layout("gpt2", LAY, micro_batch_size=1, seq_len=np.float64(128)), r"^seq_len must be"),
    (lambda: P.estimate_layout("gpt2", LAY, **EST, optimizer="lion"), r"^unknown optimizer 'lion'"),
    (lambda: P.estimate_layout("gpt2", LAY, **EST, optimizer_impl="apex"), r"^unknown optimizer_impl 'apex'"),
    (lambda: P.estimate_layout("gpt2", LAY, **EST, recompute="sqrt"), r"^unknown recompute 'sqrt'"),
    (lambda: P.estimate_layout("gpt2", LAY, **EST, precision=True), r"^unknown precision True"),
    (lambda: P.estimate_layout("gpt2", LAY, **EST, gradient_as_bucket_view="no"), r"^gradient_as_bucket_view must be"),
    (lambda: P.estimate_layout("gpt2", LAY, **EST, stages=(2,)), r"^stages\[0\] must be a whole number from 0 to 1"),
    (lambda: P.estimate_layout("gpt2", LAY, **EST, stages="0"), r"^stages must be a list"),
    (lambda: P.estimate_layout("gpt2", LAY, **EST, stages=()), r"^stages must not be empty"),
    (lambda: P.estimate_layout("gpt2", LAY, **EST, gpu="h300"), r"unknown GPU 'h300'"),
    # communication
    (lambda: P.communication("gpt2", LAY, micro_batch_size=0, seq_len=128), r"^micro_batch_size must be"),
    (lambda: P.communication("gpt2", LAY, **EST, precision="int4"), r"^unknown precision 'int4'"),
    (lambda: P.communication("gpt2", LAY, **EST, dp_link="nope"), r"^unknown dp_link 'nope'"),
    (lambda: P.communication("gpt2", LAY, **EST, pp_link=None), r"^unknown pp_link None"),
    # ddp_buckets, ddp_overlap
    (lambda: P.ddp_buckets([]), r"^param_bytes must be a non-empty list of byte counts"),
    (lambda: P.ddp_buckets("1234"), r"^param_bytes must be a non-empty list of byte counts"),
    (lambda: P.ddp_buckets([100, True]), r"^param_bytes\[1\] must be"),
    (lambda: P.ddp_buckets([100], bucket_cap_mb=INF), r"^bucket_cap_mb must be a positive number of MiB"),
    (lambda: P.ddp_buckets([100], bucket_cap_mb="25"), r"^bucket_cap_mb must be"),
    (lambda: P.ddp_buckets([100], first_bucket_mb=NAN), r"^first_bucket_mb must be"),
    (lambda: P.ddp_overlap([100], n="8", backward_seconds=1, link="nvlink4"), r"^n must be"),
    (lambda: P.ddp_overlap([100], n=8, backward_seconds=INF, link="nvlink4"), r"^backward_seconds must be"),
    (lambda: P.ddp_overlap([100], n=8, backward_seconds=-1, link="nvlink4"), r"^backward_seconds must be"),
    (lambda: P.ddp_overlap([100], n=8, backward_seconds=True, link="nvlink4"), r"^backward_seconds must be"),
    (lambda: P.ddp_overlap([100], n=8, backward_seconds=1, link="carrier-pigeon"), r"^unknown link 'carrier-pigeon'"),
    # fits
    (lambda: P.fits("gpt2", LAY, "h100", **EST, max_search=0), r"^max_search must be"),
    (lambda: P.fits("gpt2", LAY, "h100", **EST, expandable_segments="yes"), r"^expandable_segments must be"),
    (lambda: P.fits("gpt2", "pp=2", "h100", **EST), r"^layout must be"),
    (lambda: P.fits("gpt2", LAY, "h100", micro_batch_size=1, seq_len=4096), r"reads at most 1,024 positions"),
    (lambda: P.fits("gpt2", LAY, "h100", **EST, precision="fp64"), r"^unknown precision 'fp64'"),
    # plan_layouts
    (lambda: P.plan_layouts("llama-3.2-1b", 8, "h100", seq_len=128, global_batch=16, mfu=NAN), r"^mfu must be"),
    (lambda: P.plan_layouts("llama-3.2-1b", 8, "h100", seq_len=128, global_batch=16, mfu="0.4"), r"^mfu must be"),
    (lambda: P.plan_layouts("llama-3.2-1b", 8, "h100", seq_len=128, global_batch=16, mfu=0), r"^mfu must be"),
    (lambda: P.plan_layouts("llama-3.2-1b", True, "h100", seq_len=128, global_batch=16), r"^gpus must be"),
    (lambda: P.plan_layouts("llama-3.2-1b", 8, "h100", seq_len=128, global_batch=16.0), r"^global_batch must be"),
    (lambda: P.plan_layouts("llama-3.2-1b", 8, "h100", seq_len=128, global_batch=16, precision="fp8"),
     r"^unknown precision 'fp8'"),
    (lambda: P.plan_layouts("llama-3.2-1b", 8, "h100", seq_len=128, global_batch=16, recomputes="full"),
     r"^recomputes must be a list of recompute plans"),
    (lambda: P.plan_layouts("llama-3.2-1b", 8, "h100", seq_len=128, global_batch=16, recomputes=()),
     r"^recomputes must name at least one"),
    (lambda: P.plan_layouts("llama-3.2-1b", 8, "h100", seq_len=128, global_batch=16, recomputes=("none", True)),
     r"^unknown recomputes\[1\] True"),
    (lambda: P.plan_layouts("llama-3.2-1b", 8, "h100", seq_len=128, global_batch=16, gpus_per_node=0),
     r"^gpus_per_node must be"),
])
def test_every_entry_point_refuses_with_one_named_value_error(call, msg):
    with pytest.raises(ValueError, match=msg) as e:
        call()
    assert "\n" not in str(e.value)


def test_valid_answers_unchanged_by_the_checks():
    """Plain Python inputs give what they gave: a float duration is its exact binary value, a
    Fraction stays exact, np.float64 (a float) was and is accepted."""
    run = PIPE.simulate(3, 5, forward=0.1, backward=Fraction(1, 3))
    assert run.makespan == 7 * (Fraction(0.1) + Fraction(1, 3))
    assert PIPE.simulate(3, 5, forward=np.float64(0.1), backward=Fraction(1, 3)) == run
    assert PIPE.bubble_fraction(4, 8, "interleaved", chunks=2, of="ideal") == Fraction(3, 16)
    assert math.isclose(P.ddp_overlap([1 << 20], n=2, backward_seconds=0, link="nvlink4")["hidden_share"], 0, abs_tol=1e-12)
