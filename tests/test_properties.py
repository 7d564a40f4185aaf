"""Property tests (hypothesis) over the pure modules and the live calculators: random valid inputs
give finite, non-negative whole byte counts and the monotonicity each chapter teaches; random
invalid inputs give a ValueError (or, in a calculator, one error line) and nothing else.

Examples are drawn with a fixed seed (`derandomize`), so a run is repeatable; no deadline: these
tests assert behaviour, never time."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from vramlab import checkpointing, memory, offload, optimizers, parallel, pipeline, precision, specs, zero
from vramlab.present import calculators

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

SMALL = ("gpt2", "opt-125m", "pythia-160m", "bert-base", "t5-small", "llama-3.2-1b")
LARGE = ("llama-3.1-8b", "llama-3.1-70b", "qwen2.5-7b", "mistral-7b", "gpt2-xl")
DECODERS = tuple(m for m in SMALL + LARGE if specs.preset(m).family not in ("bert",))


def _whole_bytes(x) -> None:
    assert isinstance(x, int) and not isinstance(x, bool), x
    assert x >= 0, x


def _breakdown_ok(m: memory.MemoryBreakdown) -> None:
    _whole_bytes(m.total)
    for k, v in m.to_dict().items():
        _whole_bytes(v)


def _seq(model: str, s: int) -> int:
    limit = specs.preset(model).max_position_embeddings
    return min(s, limit) if limit and specs.preset(model).family != "t5" else s


# -------------------------------------------------------------- valid input: whole bytes, monotone

@SETTINGS
@given(model=st.sampled_from(SMALL + LARGE), b=st.integers(1, 64), s=st.sampled_from((1, 7, 64, 128, 512, 1024, 4096)),
       precision=st.sampled_from(precision.PRECISIONS), optimizer=st.sampled_from(optimizers.SHARDED),
       recompute=st.sampled_from(("none", "full")))
def test_training_memory_grows_with_the_batch_and_the_sequence(model, b, s, precision, optimizer, recompute):
    s = _seq(model, s)
    kw = dict(precision=precision, optimizer=optimizer, recompute=recompute)
    m = memory.estimate_training(model, batch_size=b, seq_len=s, **kw)
    _breakdown_ok(m)
    assert memory.estimate_training(model, batch_size=b + 1, seq_len=s, **kw).total >= m.total
    if s > 1:
        assert memory.estimate_training(model, batch_size=b, seq_len=s - 1, **kw).total <= m.total


@SETTINGS
@given(model=st.sampled_from(DECODERS), b=st.integers(1, 32), s=st.integers(1, 512), new=st.integers(1, 256),
       dtype=st.sampled_from(("fp32", "bf16", "fp16")))
def test_inference_memory_grows_with_the_batch_and_the_tokens(model, b, s, new, dtype):
    limit = specs.preset(model).max_position_embeddings
    assume(specs.preset(model).family == "t5" or s + new + 1 <= limit)
    m = memory.estimate_inference(model, batch_size=b, seq_len=s, new_tokens=new, dtype=dtype)
    _breakdown_ok(m)
    assert memory.estimate_inference(model, batch_size=b + 1, seq_len=s, new_tokens=new, dtype=dtype).total >= m.total
    assert memory.estimate_inference(model, batch_size=b, seq_len=s, new_tokens=new + 1, dtype=dtype).total >= m.total


@SETTINGS
@given(model=st.sampled_from(("gpt2", "opt-125m", "llama-3.2-1b", "llama-3.1-8b", "t5-small")),
       stage=st.sampled_from((0, 1, 2, 3, "fsdp2")), n=st.integers(1, 63), more=st.integers(1, 64),
       b=st.integers(1, 8), s=st.sampled_from((64, 256, 1024)),
       recipe=st.sampled_from(sorted(zero.RECIPES)))
def test_more_zero_ranks_never_more_memory_per_rank(model, stage, n, more, b, s, recipe):
    if stage == "fsdp2":
        stage, impl = 3, "fsdp2"
    else:
        impl = "deepspeed"
    s = _seq(model, s)
    kw = dict(micro_batch_size=b, seq_len=s, recipe=recipe, implementation=impl)
    few = zero.estimate_rank(model, n, stage, **kw)
    many = zero.estimate_rank(model, n + more, stage, **kw)
    _breakdown_ok(few), _breakdown_ok(many)
    assert many.total <= few.total, (n, n + more, few.total, many.total)


@SETTINGS
@given(n=st.integers(1, 24), data=st.data(), gbps=st.floats(1, 64), buffers=st.integers(1, 4))
def test_more_resident_layers_never_less_gpu_memory(n, data, gbps, buffers):
    """Equal layers (a transformer's blocks, as stream_model streams them). With unequal layers the
    property does not hold, and the model says why: the buffers are as large as the largest streamed
    layer, so keeping a small layer resident can free a whole buffer's worth (`least_memory`)."""
    sizes = [data.draw(st.integers(1, 10**9))] * n
    secs = data.draw(st.lists(st.floats(0, 0.05), min_size=n, max_size=n))
    streamed = data.draw(st.sets(st.integers(0, n - 1)))
    if not streamed:
        return
    drop = data.draw(st.sampled_from(sorted(streamed)))  # one more layer resident
    fewer_resident = offload.stream_layers(sizes, secs, streamed=sorted(streamed), link_GBps=gbps, buffers=buffers,
                                           passes=2)
    more_resident = offload.stream_layers(sizes, secs, streamed=sorted(streamed - {drop}), link_GBps=gbps,
                                          buffers=buffers, passes=2)
    _whole_bytes(fewer_resident.gpu_bytes), _whole_bytes(more_resident.gpu_bytes)
    assert more_resident.gpu_bytes >= fewer_resident.gpu_bytes
    assert math.isfinite(fewer_resident.seconds) and fewer_resident.seconds >= fewer_resident.compute_seconds * (1 - 1e-9)


@SETTINGS
@given(model=st.sampled_from(("gpt2", "opt-125m", "llama-3.2-1b", "pythia-160m", "t5-small", "bert-base")),
       b=st.integers(1, 16), s=st.sampled_from((64, 256, 512)), data=st.data())
def test_more_checkpointing_never_more_memory(model, b, s, data):
    """Checkpointing more blocks (first-N with a larger N; every block) never raises the peak."""
    spec = specs.preset(model)
    n_blocks = spec.num_layers + spec.num_decoder_layers
    k = data.draw(st.integers(0, n_blocks - 1))
    kw = dict(batch_size=b, seq_len=_seq(model, s))
    none = checkpointing.evaluate(model, "none", **kw).peak.total
    fewer = checkpointing.evaluate(model, f"first-{k}", **kw).peak.total if k else none
    more = checkpointing.evaluate(model, f"first-{k + 1}", **kw).peak.total
    full = checkpointing.evaluate(model, "full", **kw).peak.total
    for x in (none, fewer, more, full):
        _whole_bytes(x)
    assert full <= more <= fewer <= none


@SETTINGS
@given(p=st.integers(1, 32), m=st.integers(1, 64), schedule=st.sampled_from(("gpipe", "1f1b")))
def test_pipeline_bubble_is_a_fraction_and_shrinks_with_more_micro_batches(p, m, schedule):
    f = pipeline.bubble_fraction(p, m, schedule)
    assert 0 <= f < 1
    assert pipeline.bubble_fraction(p, m + 1, schedule) <= f


# -------------------------------------------------------------- invalid input: ValueError, nothing else

JUNK_COUNT = st.one_of(st.just(0), st.integers(-10**6, -1), st.just(True), st.just(False), st.just(1.5), st.just(2.0),
                       st.just("4"), st.just(None), st.just(float("nan")), st.just(float("inf")), st.just(10**40),
                       st.just([1]), st.just(np.float64(3.5)))
JUNK_NUMBER = st.one_of(st.integers(-10**6, -1), st.just(True), st.just("0.5"), st.just(None), st.just(float("nan")),
                        st.just(float("inf")), st.just(-float("inf")), st.just(10**400), st.just([1.0]), st.just({}))
JUNK_CHOICE = st.one_of(st.just("bogus"), st.just(True), st.just(3), st.just(None), st.just(""), st.just(["bf16"]))
JUNK_STAGE = st.one_of(st.just("bogus"), st.just(True), st.just(2.0), st.just("2"), st.just(7), st.just(-1), st.just(None))

# (call, valid keyword arguments, {argument: kind of junk}) for public entry points of the newer modules
CASES = [
    (memory.estimate_training, dict(model="gpt2", batch_size=2, seq_len=64),
     dict(batch_size=JUNK_COUNT, seq_len=JUNK_COUNT, precision=JUNK_CHOICE, optimizer=JUNK_CHOICE,
          attention=JUNK_CHOICE, model=JUNK_CHOICE)),
    (memory.estimate_inference, dict(model="gpt2", batch_size=2, seq_len=64, new_tokens=4),
     dict(batch_size=JUNK_COUNT, seq_len=JUNK_COUNT, new_tokens=JUNK_COUNT.filter(lambda v: v is not None and not (type(v) is int and v == 0)),
          dtype=JUNK_CHOICE)),
    (checkpointing.evaluate, dict(model="gpt2", recompute="full", batch_size=2, seq_len=64, gpu="H100"),
     dict(batch_size=JUNK_COUNT, seq_len=JUNK_COUNT, mfu=JUNK_NUMBER, recompute=JUNK_CHOICE)),
    (checkpointing.cheapest_plan, dict(model="gpt2", budget_bytes=4 << 30, batch_size=2, seq_len=64),
     dict(budget_bytes=JUNK_NUMBER.filter(lambda v: v is not None), batch_size=JUNK_COUNT)),
    (zero.estimate_rank, dict(model="gpt2", n_ranks=4, stage=2, micro_batch_size=2, seq_len=64),
     dict(n_ranks=JUNK_COUNT, stage=JUNK_STAGE, micro_batch_size=JUNK_COUNT, reduce_bucket=JUNK_COUNT,
          recipe=JUNK_CHOICE)),
    (zero.communication, dict(n_params=10**9, n_ranks=8, stage=2),
     dict(n_params=JUNK_COUNT.filter(lambda v: not (type(v) is int and v == 0)), n_ranks=JUNK_COUNT,
          bytes_per_value=JUNK_COUNT)),
    (parallel.estimate_layout, dict(model="gpt2", layout=parallel.Layout(tp=2, pp=2, micro_batches=4),
                                    micro_batch_size=2, seq_len=64),
     dict(micro_batch_size=JUNK_COUNT, seq_len=JUNK_COUNT, model=JUNK_CHOICE)),
    (pipeline.simulate, dict(p=4, m=8), dict(p=JUNK_COUNT, m=JUNK_COUNT, forward=JUNK_NUMBER, backward=JUNK_NUMBER,
                                             schedule=JUNK_CHOICE)),
    (pipeline.bubble_fraction, dict(p=4, m=8), dict(p=JUNK_COUNT, m=JUNK_COUNT, schedule=JUNK_CHOICE)),
    (offload.transfer_seconds, dict(nbytes=10**9, gpu="H100"), dict(nbytes=JUNK_NUMBER)),
    (offload.stream_layers, dict(layer_bytes=[10**6] * 4, layer_seconds=[1e-3] * 4, streamed=[1, 3], link_GBps=16),
     dict(link_GBps=JUNK_NUMBER, buffers=JUNK_COUNT, layer_bytes=JUNK_NUMBER, streamed=JUNK_NUMBER)),
    (offload.stream_model, dict(model="gpt2", gpu="H100"), dict(tokens=JUNK_COUNT, weight_bytes=JUNK_COUNT,
                                                                 buffers=JUNK_COUNT, mfu=JUNK_NUMBER)),
]


def _name(case) -> str:
    return f"{case[0].__module__.rsplit('.', 1)[-1]}.{case[0].__name__}"


@pytest.mark.parametrize("case", CASES, ids=_name)
def test_invalid_input_is_one_value_error(case):
    call, valid, junk = case

    @SETTINGS
    @given(arg=st.sampled_from(sorted(junk)), data=st.data())
    def check(arg, data):
        value = data.draw(junk[arg], label=arg)
        kwargs = dict(valid, **{arg: value})
        with pytest.raises(ValueError) as e:
            call(**kwargs)
        msg = str(e.value)
        assert "\n" not in msg and msg.strip(), msg

    call(**valid)  # the valid arguments really are valid
    check()


# -------------------------------------------------------------- the live calculators

def _valid_value(i: calculators.Input):
    if i.kind == "file":  # no file (the built-in example), or a snapshot as bytes or as the page's data URL
        import base64

        small = calculators.example_snapshot(batch_size=2)
        return st.sampled_from([None, "", small, "data:application/octet-stream;base64," + base64.b64encode(small).decode()])
    if i.kind == "choice":
        return st.sampled_from(i.choices)
    if i.kind == "int":
        return st.integers(int(i.min), int(i.max))
    return st.floats(i.min, i.max, allow_nan=False)


def _invalid_value(i: calculators.Input):
    if i.kind == "file":  # (None and "" are no file: the built-in example)
        return st.sampled_from([True, "abc", 1.5, [1], {}, b"not a pickle", "data:text/plain;base64,aGVsbG8="])
    bad = [True, None, "", "abc", float("nan"), float("inf"), "inf", "1e400", [1], {}]
    if i.kind != "choice":
        bad += [i.min - 1, i.max * 10 + 1]
        if i.kind == "int":
            bad += [1.5]
    else:
        bad += ["no-such-choice"]
    return st.sampled_from(bad)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(calculators.CALCULATORS))
def test_calculators_answer_every_valid_input_with_finite_numbers(name):
    calc = calculators.get(name)

    @settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
    @given(st.fixed_dictionaries({i.name: _valid_value(i) for i in calc.inputs}))
    def check(values):
        r = calc.run(**values)  # never raises
        assert "\n" not in r.error
        if not r.error:
            for k, (v, shown) in r.numbers.items():
                assert isinstance(v, (int, float)) and not math.isnan(v), (k, v)
                # only the precision calculator may answer inf: a value beyond fp16's range overflows
                assert math.isfinite(v) or name == "precision", (k, v)

    check()


@pytest.mark.parametrize("name", sorted(calculators.CALCULATORS))
def test_calculators_answer_every_invalid_input_with_one_line(name):
    calc = calculators.get(name)

    @settings(max_examples=20, deadline=None, derandomize=True)
    @given(st.sampled_from(calc.inputs).flatmap(lambda i: st.tuples(st.just(i.name), _invalid_value(i))))
    def check(pair):
        arg, value = pair
        r = calc.run(**{arg: value})
        assert r.error and "\n" not in r.error, (arg, value, r.error)
        assert not r.text

    check()
