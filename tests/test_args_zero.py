"""vramlab.zero, collectives and units check their arguments with `vramlab.checks`: numpy scalars
accepted where a number is meant, bools/strings/NaN/inf refused, one ValueError naming the argument."""

from __future__ import annotations

import math

import pytest

from vramlab import collectives as C
from vramlab import units as U
from vramlab import zero as Z

np = pytest.importorskip("numpy")


def one_line_error(call, needle):
    with pytest.raises(ValueError) as e:
        call()
    msg = str(e.value)
    assert "\n" not in msg and needle in msg, msg
    return msg


# ----------------------------------------------------------------------------- the cases

def test_communication_takes_numpy_bytes_per_value_and_names_a_bad_one():
    want = Z.communication(10**6, 4, 2, bytes_per_value=2)
    assert Z.communication(10**6, 4, 2, bytes_per_value=np.int64(2)) == want
    for bad in (2.0, "2", True, 0, 9, float("nan")):
        msg = one_line_error(lambda: Z.communication(10**6, 4, 2, bytes_per_value=bad), "bytes_per_value")
        assert msg.startswith("bytes_per_value") and "size" not in msg


@pytest.mark.parametrize("factor", [np.float64(1.5), np.float32(1.5)])
def test_deepspeed_estimate_takes_a_numpy_buffer_factor(factor):
    for stage, kw in ((2, {}), (2, dict(offload_optimizer=True)), (3, dict(offload_optimizer=True, largest_layer=10))):
        assert Z.deepspeed_estimate(10**6, stage, buffer_factor=factor, **kw) == Z.deepspeed_estimate(10**6, stage, **kw)


@pytest.mark.parametrize("bad", [True, "1.5", float("nan"), math.inf, 0, -1, 100])
def test_deepspeed_estimate_names_a_bad_buffer_factor(bad):
    one_line_error(lambda: Z.deepspeed_estimate(10**6, 2, buffer_factor=bad), "buffer_factor")


def test_collectives_take_numpy_integers_and_floats():
    n, S = np.int64(8), np.float64(2**20)
    for op in C.OPS:
        assert C.collective_time(op, n, S, "nvlink4") == C.collective_time(op, 8, 2**20, "nvlink4")
        assert C.bytes_sent_per_rank(op, n, np.int32(1024)) == C.bytes_sent_per_rank(op, 8, 1024)
        assert C.busbw_factor(op, np.int32(8)) == C.busbw_factor(op, 8)
        assert C.alpha_beta_coefficients(op, n) == C.alpha_beta_coefficients(op, 8)
    assert C.collective_time("broadcast", 8, 1 << 20, "nvlink4", chunks=np.int64(4)) == \
        C.collective_time("broadcast", 8, 1 << 20, "nvlink4", chunks=4)
    assert C.busbw("all_reduce", n, np.int64(10**9), np.float32(0.5)) == C.busbw("all_reduce", 8, 10**9, 0.5)
    assert C.before_after("all_gather", np.int64(3)) == C.before_after("all_gather", 3)
    assert C.ring_all_reduce_steps(np.int64(3)) == C.ring_all_reduce_steps(3)
    assert C.data_parallel_sync(np.int64(10**6), n, "ib-ndr", bytes_per_grad=np.int64(2)) == \
        C.data_parallel_sync(10**6, 8, "ib-ndr", bytes_per_grad=2)
    sizes, times = np.array([1e3, 1e6, 1e8]), np.array([1e-5, 3e-5, 2e-3])
    assert C.fit_alpha_beta("all_reduce", n, sizes, times) == C.fit_alpha_beta("all_reduce", 8, list(sizes), list(times))
    lk = C.Link(name="x", bandwidth_GBps=np.float32(25.0), latency_us=np.int64(5))
    assert lk == C.Link(name="x", bandwidth_GBps=25.0, latency_us=5) and type(lk.bandwidth_GBps) is float


@pytest.mark.parametrize("call, needle", [
    (lambda: C.busbw_factor("all_reduce", True), "n must be"),
    (lambda: C.busbw_factor("all_reduce", 4.0), "n must be"),
    (lambda: C.busbw_factor("all_reduce", "4"), "n must be"),
    (lambda: C.busbw_factor(True, 4), "unknown collective op"),
    (lambda: C.busbw_factor(["all_reduce"], 4), "unknown collective op"),
    (lambda: C.collective_time("all_reduce", 4, float("nan"), "nvlink4"), "size_bytes"),
    (lambda: C.collective_time("all_reduce", 4, math.inf, "nvlink4"), "size_bytes"),
    (lambda: C.collective_time("all_reduce", 4, "1024", "nvlink4"), "size_bytes"),
    (lambda: C.collective_time("all_reduce", 4, True, "nvlink4"), "size_bytes"),
    (lambda: C.collective_time("all_reduce", 4, -1, "nvlink4"), "size_bytes"),
    (lambda: C.collective_time("all_reduce", 4, 1, "nvlink4", algorithm=True), "algorithm"),
    (lambda: C.collective_time("broadcast", 4, 1, "nvlink4", chunks=2.0), "chunks"),
    (lambda: C.collective_time("broadcast", 4, 1, "nvlink4", chunks=True), "chunks"),
    (lambda: C.collective_time("all_reduce", 4, 1, 450.0), "lk must be a Link"),
    (lambda: C.collective_time("all_reduce", 4, 1, None), "lk must be a Link"),
    (lambda: C.collective_time("all_gather", 4, 1, "nvlink4", algorithm="tree"), "all_reduce only"),
    (lambda: C.bytes_sent_per_rank("all_reduce", 4, 1, algorithm="mesh"), "algorithm"),
    (lambda: C.bytes_sent_per_rank("broadcast", 4, 1, algorithm="tree"), "all_reduce only"),
    (lambda: C.bytes_sent_per_rank("all_reduce", 4, float("nan")), "size_bytes"),
    (lambda: C.algbw(10, 0), "seconds"),
    (lambda: C.algbw(10, float("nan")), "seconds"),
    (lambda: C.algbw(10, "1"), "seconds"),
    (lambda: C.algbw("10", 1.0), "size_bytes"),
    (lambda: C.busbw("all_reduce", 4, 10, -1.0), "seconds"),
    (lambda: C.link(True), "unknown link"),
    (lambda: C.link(["nvlink4"]), "unknown link"),
    (lambda: C.Link(name="x", bandwidth_GBps=float("nan"), latency_us=1), "bandwidth_GBps"),
    (lambda: C.Link(name="x", bandwidth_GBps=0, latency_us=1), "bandwidth_GBps"),
    (lambda: C.Link(name="x", bandwidth_GBps=True, latency_us=1), "bandwidth_GBps"),
    (lambda: C.Link(name="x", bandwidth_GBps=10, latency_us=-1), "latency_us"),
    (lambda: C.Link(name="x", bandwidth_GBps=10, latency_us=math.inf), "latency_us"),
    (lambda: C.Link(name="", bandwidth_GBps=10, latency_us=1), "name"),
    (lambda: C.fit_alpha_beta("all_reduce", 2, [1, 2], [1e-3, math.inf]), "seconds[1]"),
    (lambda: C.fit_alpha_beta("all_reduce", 2, [1, float("nan")], [1e-3, 2e-3]), "sizes[1]"),
    (lambda: C.fit_alpha_beta("all_reduce", 2, [1, "2"], [1e-3, 2e-3]), "sizes[1]"),
    (lambda: C.fit_alpha_beta("all_reduce", 2, [1, 2], [1e-3, True]), "seconds[1]"),
    (lambda: C.fit_alpha_beta("all_reduce", 2, "12", [1e-3, 2e-3]), "sizes must be a list"),
    (lambda: C.fit_alpha_beta("all_reduce", 2, [1, 2, 3], [1e-3, 2e-3]), "equal length"),
    (lambda: C.fit_alpha_beta("all_reduce", 0, [1, 2], [1e-3, 2e-3]), "n must be"),
    (lambda: C.fit_alpha_beta("all_reduce", 2, [1, 2], [1e-3, 2e-3], error=True), "error"),
    (lambda: C.data_parallel_sync(10, 4, "nvlink4", scheme="gossip"), "unknown scheme"),
    (lambda: C.data_parallel_sync(10.5, 4, "nvlink4"), "n_params"),
    (lambda: C.data_parallel_sync(10, True, "nvlink4"), "n_workers"),
    (lambda: C.data_parallel_sync(10, 4, "nvlink4", bytes_per_grad="4"), "bytes_per_grad"),
    (lambda: C.data_parallel_sync(10, 4, 3), "lk must be a Link"),
    (lambda: C.before_after("all_reduce", 27), "n must be"),
    (lambda: C.ring_all_reduce_steps(10**6), "n must be"),
])
def test_collectives_refuse_junk_in_one_line(call, needle):
    one_line_error(call, needle)


@pytest.mark.parametrize("text", ["1e400", "inf", "-inf", "nan", "NaN GiB", "infinity", "1e300TB"])
def test_parse_bytes_refuses_what_is_not_a_finite_size(text):
    msg = one_line_error(lambda: U.parse_bytes(text), "text must be a finite size")
    assert repr(text) in msg


@pytest.mark.parametrize("bad", [5, None, b"16GiB", "", "   "])
def test_parse_bytes_wants_a_string(bad):
    one_line_error(lambda: U.parse_bytes(bad), "text")


def test_parse_bytes_names_its_argument():
    one_line_error(lambda: U.parse_bytes("lots"), "text must be a size")
    one_line_error(lambda: U.parse_bytes("-1GiB"), "text must not be a negative size")
    assert U.parse_bytes("1.5 KiB") == 1536 and U.parse_bytes(" 2tb ") == 2 * 10**12


@pytest.mark.parametrize("bad", [True, False, np.bool_(True), "3", None, float("nan"), math.inf, -math.inf, [1]])
def test_fmt_bytes_refuses_what_is_not_a_byte_count(bad):
    msg = one_line_error(lambda: U.fmt_bytes(bad), "n_bytes")
    assert msg.startswith("n_bytes")


def test_fmt_bytes_is_unchanged_for_numbers():
    for v in (0, 1, 512, 1023, 1024, 1536 * 1024, 3 * 2**30, 2**50, -2 * 2**20, 0.5, 1e12, 2.5 * 2**30):
        sign, n = ("-" if v < 0 else ""), abs(v)
        want = next((f"{sign}{n / s:.2f} {u}" for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if n >= s),
                    f"{sign}{int(n)} B")
        assert U.fmt_bytes(v) == want
    assert U.fmt_bytes(np.int64(3 * 2**30)) == U.fmt_bytes(np.float32(3 * 2**30)) == "3.00 GiB"
    assert U.fmt_bytes(np.float64(512.7)) == "512 B"
    assert U.fmt_bytes(3 * 2**30, digits=0) == "3 GiB" and U.fmt_bytes(3 * 2**30, digits=np.int64(1)) == "3.0 GiB"
    one_line_error(lambda: U.fmt_bytes(1, digits=-1), "digits")
    one_line_error(lambda: U.fmt_bytes(1, digits=2.0), "digits")
    assert U.to_gib(np.int64(2**31)) == 2.0 and U.to_mib(2**20) == 1.0
    one_line_error(lambda: U.to_gib("1"), "n_bytes")
    one_line_error(lambda: U.to_mib(float("nan")), "n_bytes")


# ----------------------------------------------------------------------------- zero.py, every public function

def test_zero_accepts_numpy_scalars_everywhere():
    i = np.int64
    assert Z.paper_per_rank(i(10**9), i(8), i(2), k=i(12), param_bytes=np.int32(2), grad_bytes=i(2)) == \
        Z.paper_per_rank(10**9, 8, 2)
    assert Z.deepspeed_estimate(i(10**9), i(3), gpus_per_node=i(8), nodes=i(2), largest_layer=i(10**6),
                                offload_optimizer=np.bool_(True), zero_init=np.bool_(False)) == \
        Z.deepspeed_estimate(10**9, 3, gpus_per_node=8, nodes=2, largest_layer=10**6, offload_optimizer=True,
                             zero_init=False)
    assert Z.persistent_params("gpt2", i(10**5)) == Z.persistent_params("gpt2", 10**5)
    for s in (1, 3):
        assert Z.model_states("gpt2", i(4), i(s), reduce_bucket=i(10**6), persistence_threshold=i(10**4)) == \
            Z.model_states("gpt2", 4, s, reduce_bucket=10**6, persistence_threshold=10**4)
    assert Z.partition_touches("gpt2", i(4)) == Z.partition_touches("gpt2", 4)
    assert Z.partition_touch("gpt2", np.int32(4)) == Z.partition_touch("gpt2", 4)
    kw = dict(micro_batch_size=2, seq_len=64)
    npkw = dict(micro_batch_size=i(2), seq_len=np.int32(64), reduce_bucket=i(Z.REDUCE_BUCKET),
                max_live_parameters=i(Z.MAX_LIVE), prefetch_bucket=i(Z.PREFETCH), max_reuse_distance=i(10**9),
                persistence_threshold=i(Z.PERSISTENCE), use_cache=np.bool_(False))
    for s in Z.STAGES:
        assert Z.estimate_rank("gpt2", i(4), i(s), **npkw) == Z.estimate_rank("gpt2", 4, s, **kw)
    assert Z.rank_phases("gpt2", i(2), i(3), implementation="fsdp2", **npkw) == \
        Z.rank_phases("gpt2", 2, 3, implementation="fsdp2", **kw)
    assert Z.communication(i(10**9), i(8), i(3), bytes_per_value=i(4), link="ib-ndr", implementation="deepspeed") == \
        Z.communication(10**9, 8, 3, bytes_per_value=4, link="ib-ndr", implementation="deepspeed")
    lk = C.link("ib-hdr")
    assert Z.communication(10**6, 4, 1, link=lk) == Z.communication(10**6, 4, 1, link="ib-hdr")
    got = Z.fits("gpt2", i(2), i(2), "h100", micro_batch_size=i(4), seq_len=i(128), max_search=i(64),
                 expandable_segments=np.bool_(True))
    assert got == Z.fits("gpt2", 2, 2, "h100", micro_batch_size=4, seq_len=128, max_search=64, expandable_segments=True)


_RANK = dict(model="gpt2", n_ranks=2, stage=1, micro_batch_size=1, seq_len=8)


@pytest.mark.parametrize("call, needle", [
    # stages: a whole number among the choices, listed
    (lambda: Z.paper_per_rank(10, 2, True), "unknown stage True; choose from 0, 1, 2, 3"),
    (lambda: Z.paper_per_rank(10, 2, 2.0), "unknown stage 2.0"),
    (lambda: Z.paper_per_rank(10, 2, "2"), "unknown stage '2'"),
    (lambda: Z.paper_per_rank(10, 2, 4), "choose from 0, 1, 2, 3"),
    (lambda: Z.paper_per_rank(10, 2, 1, k=1.5), "k must be"),
    (lambda: Z.paper_per_rank(10, 2, 1, param_bytes=True), "param_bytes"),
    (lambda: Z.paper_per_rank(10, 2, 1, grad_bytes="2"), "grad_bytes"),
    (lambda: Z.paper_per_rank(float("nan"), 2, 1), "n_params"),
    (lambda: Z.paper_per_rank(1e9, 2, 1), "n_params"),
    (lambda: Z.paper_per_rank(10, 2.0, 1), "n_ranks"),
    (lambda: Z.paper_per_rank(10, 10**9, 1), "n_ranks must be a whole number from 1 to 1,048,576"),
    # DeepSpeed's estimators
    (lambda: Z.deepspeed_estimate(10, 0), "stage must be 2 or 3"),
    (lambda: Z.deepspeed_estimate(10, True), "stage must be 2 or 3"),
    (lambda: Z.deepspeed_estimate(10, "3"), "stage must be 2 or 3"),
    (lambda: Z.deepspeed_estimate(10, 2, gpus_per_node=0), "gpus_per_node"),
    (lambda: Z.deepspeed_estimate(10, 2, nodes=1.5), "nodes"),
    (lambda: Z.deepspeed_estimate(10, 2, offload_optimizer=1), "offload_optimizer must be True or False"),
    (lambda: Z.deepspeed_estimate(10, 3, offload_optimizer=True, offload_params="yes"), "offload_params"),
    (lambda: Z.deepspeed_estimate(10, 3, zero_init=None), "zero_init"),
    (lambda: Z.deepspeed_estimate(10, 3, largest_layer=-1), "largest_layer"),
    (lambda: Z.deepspeed_estimate(10, 2, largest_layer="big"), "largest_layer"),
    (lambda: Z.deepspeed_estimate(10, 2, formula=True), "unknown formula"),
    (lambda: Z.deepspeed_estimate(10, 2, offload_params=True), "offload_params=True needs stage 3"),
    (lambda: Z.deepspeed_estimate(10, 3, offload_params=True), "offload_params=True needs offload_optimizer=True"),
    # a real model
    (lambda: Z.largest_layer_params(3), "model must be"),
    (lambda: Z.persistent_params("gpt2", threshold=1.5), "threshold"),
    (lambda: Z.persistent_params(None), "model must be"),
    (lambda: Z.model_states("gpt2", 2, 1, recipe=True), "unknown recipe"),
    (lambda: Z.model_states("gpt2", 2, 1, implementation=["paper"]), "unknown implementation"),
    (lambda: Z.model_states("gpt2", 2, 3, reduce_bucket=float("inf")), "reduce_bucket"),
    (lambda: Z.model_states("gpt2", 2, 1, persistence_threshold="1e5"), "persistence_threshold"),
    (lambda: Z.model_states("gpt2", 2, 2, implementation="fsdp2"), "stage must be 3 with implementation='fsdp2'"),
    (lambda: Z.partition_touches("gpt2", 0), "n_ranks"),
    (lambda: Z.partition_touch("gpt2", True), "n_ranks"),
    # one rank's step
    (lambda: Z.estimate_rank(**dict(_RANK, micro_batch_size=0)), "micro_batch_size must be"),
    (lambda: Z.estimate_rank(**dict(_RANK, micro_batch_size=2.0)), "micro_batch_size must be"),
    (lambda: Z.estimate_rank(**dict(_RANK, seq_len="8")), "seq_len must be"),
    (lambda: Z.estimate_rank(**dict(_RANK, seq_len=5000)), "1,024 positions"),
    (lambda: Z.estimate_rank(**dict(_RANK, stage=np.int64(7))), "unknown stage"),
    (lambda: Z.estimate_rank(**dict(_RANK, implementation="paper")), "unknown implementation 'paper'"),
    (lambda: Z.estimate_rank(**dict(_RANK, attention="flash")), "unknown attention"),
    (lambda: Z.estimate_rank(**dict(_RANK, optimizer_impl=True)), "unknown optimizer_impl"),
    (lambda: Z.estimate_rank(**dict(_RANK, device=None)), "unknown device"),
    (lambda: Z.estimate_rank(**dict(_RANK, use_cache="no")), "use_cache must be True or False"),
    (lambda: Z.estimate_rank(**dict(_RANK, reduce_bucket=0)), "reduce_bucket"),
    (lambda: Z.estimate_rank(**dict(_RANK, max_live_parameters=float("nan"))), "max_live_parameters"),
    (lambda: Z.estimate_rank(**dict(_RANK, prefetch_bucket=-1)), "prefetch_bucket"),
    (lambda: Z.estimate_rank(**dict(_RANK, max_reuse_distance=True)), "max_reuse_distance"),
    (lambda: Z.estimate_rank(**dict(_RANK, persistence_threshold=1.5)), "persistence_threshold"),
    (lambda: Z.rank_phases(**dict(_RANK, recipe="fp8")), "unknown recipe"),
    # communication
    (lambda: Z.communication(10, 2, 1, link=450), "link must be a Link"),
    (lambda: Z.communication(10, 2, 1, link="carrier-pigeon"), "unknown link"),
    (lambda: Z.communication(10, 2, 1, implementation=True), "unknown implementation"),
    (lambda: Z.communication(10, 2, 5), "unknown stage"),
    # fits
    (lambda: Z.fits("gpt2", 2, 1, "h100", micro_batch_size=1, seq_len=8, bogus=1), "zero.fits: unknown argument bogus"),
    (lambda: Z.fits("gpt2", 2, 1, "h100", micro_batch_size=1, seq_len=8, device="cpu"), "device must be 'cuda'"),
    (lambda: Z.fits("gpt2", 2, 1, "h100", micro_batch_size=1, seq_len=8, recipe="fp8"), "unknown recipe"),
    (lambda: Z.fits("gpt2", 2, 1, "h100", micro_batch_size=1, seq_len=8, attention=None), "unknown attention"),
    (lambda: Z.fits("gpt2", 2, 1, "h100", micro_batch_size=1, seq_len=8, max_search=0), "max_search"),
    (lambda: Z.fits("gpt2", 2, 1, "h100", micro_batch_size=True, seq_len=8), "micro_batch_size"),
    (lambda: Z.fits("gpt2", 2, 1, "h100", micro_batch_size=1, seq_len=8, expandable_segments="yes"),
     "expandable_segments"),
    (lambda: Z.fits("gpt2", 2, 1, "h100", micro_batch_size=1, seq_len=float("nan")), "seq_len"),
    (lambda: Z.fits("gpt2", 2.5, 1, "h100", micro_batch_size=1, seq_len=8), "n_ranks"),
])
def test_zero_refuses_junk_in_one_line_naming_the_argument(call, needle):
    one_line_error(call, needle)


def test_fits_passes_on_its_keyword_arguments():
    """Every keyword `fits` accepts is one that estimate_rank takes (and the reverse)."""
    import inspect

    taken = set(Z.RANK_OPTIONS + Z.STEP_OPTIONS) - {"model", "n_ranks", "stage", "micro_batch_size",
                                                                  "seq_len", "gpu"}
    assert taken == set(Z._ESTIMATE_OPTIONS)
    a = Z.fits("gpt2", 2, 3, "h100", micro_batch_size=2, seq_len=64, max_search=64, implementation="fsdp2",
               recipe="fp32-adam", attention="eager", optimizer_impl="foreach", use_cache=True)
    assert a.fits and a.max_batch_size >= 2
