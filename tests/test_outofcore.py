"""Chapter 6's pinned DataLoader and out-of-core (ZeRO-Infinity's NVMe tier) estimates in
`vramlab.offload` against what really happens on this CPU: a real DataLoader's batches in flight
(counted by its workers), layers streamed from files on disk through a forward and backward (peak
resident memory from the kernel's VmHWM, bytes from /proc/self/io), and DeepSpeed's own config
model and estimators for the placements and the generated config."""

from __future__ import annotations

import warnings

import pytest

from vramlab import offload as O

torch = pytest.importorskip("torch")
from vramlab.measure import offload as M  # noqa: E402


# ----------------------------------------------------------------------------- the DataLoader
@pytest.mark.slow
@pytest.mark.parametrize("num_workers, prefetch_factor", [(0, None), (1, 2), (2, 2), (2, 3), (1, 4)])
def test_batches_in_flight_are_what_a_real_dataloader_makes_ahead(num_workers, prefetch_factor):
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = M.loader_in_flight(num_workers=num_workers, prefetch_factor=prefetch_factor, batches=16,
                                 consumer_seconds=0.04)
    pred = O.loader_memory([4096], num_workers=num_workers, prefetch_factor=prefetch_factor)
    assert got["in_flight_max"] == pred.batches_in_flight
    # the loop's own batch is pinned beside them (with pin_memory=True)
    assert pred.pinned_batches == pred.batches_in_flight + 1


def test_pinned_memory_needs_an_accelerator_here():
    ok, why = M.pinned_memory_available()
    if not torch.cuda.is_available():
        assert not ok and "pin" in why.lower()  # so the pinned side is measured on a GPU only (gpu_campaign)


# ----------------------------------------------------------------------------- layers streamed from disk
@pytest.mark.slow
@pytest.mark.parametrize("layers, d, buffers", [(4, 1024, 2), (8, 1024, 1), (6, 768, 3), (3, 1536, 2)])
def test_streaming_from_disk_holds_what_disk_streaming_predicts(tmp_path, layers, d, buffers):
    r = M.run_isolated("stream_from_disk", folder=str(tmp_path), layers=layers, d=d, buffers=buffers, steps=2)
    est = r["estimate"]
    assert r["gradient_matches_autograd"] is True  # the streamed step computes the real gradient
    assert r["most_layers_resident"] == min(buffers, layers)
    # the kernel's storage counters, not the code's own count: every layer read twice a step, each
    # gradient written once (O_DIRECT: nothing comes from the page cache)
    if r["o_direct"]:
        # (beyond them, only pages of the process's own libraries read back after the kernel dropped them under
        # memory pressure, each major fault at most a 512 KiB readahead window; on a quiet machine none)
        extra = r["kernel_read_bytes"] - 2 * est["read_bytes"]
        assert -0.01 * 2 * est["read_bytes"] <= extra <= 0.01 * 2 * est["read_bytes"] + r["major_faults"] * 512 * 1024, r
        assert r["kernel_written_bytes"] == pytest.approx(2 * est["write_bytes"], rel=0.01)
    # peak resident memory above the start: the buffers, the saved outputs, one gradient; on top, a
    # few MiB that the estimate leaves out (the backward's rows x d temporaries, the math library's
    # buffers), whatever the number of layers or buffers (test_more_buffers_cost_one_layer_each)
    extra = r["peak_rss_above_start_bytes"] - est["peak_bytes"]
    assert -(512 << 10) <= extra <= 6 << 20, extra / 2**20
    if layers >= 2 * buffers + 2:  # a model several times the buffers: memory well below its size
        assert r["peak_rss_above_start_bytes"] < 0.85 * r["model_bytes"]


@pytest.mark.slow
def test_more_layers_cost_their_saved_outputs_only(tmp_path):
    """16 more layers on disk add 16 saved outputs (rows x d fp32) in memory, not 16 layers."""
    few = M.run_isolated("stream_from_disk", folder=str(tmp_path), layers=8, d=1024, rows=256, buffers=2, steps=1)
    many = M.run_isolated("stream_from_disk", folder=str(tmp_path), layers=24, d=1024, rows=256, buffers=2, steps=1)
    grew = many["peak_rss_above_start_bytes"] - few["peak_rss_above_start_bytes"]
    assert grew == pytest.approx(16 * 256 * 1024 * 4, rel=0.1, abs=512 << 10)
    assert many["model_bytes"] - few["model_bytes"] == 16 * 1024 * 1024 * 4  # 64 MiB more on disk


@pytest.mark.slow
def test_more_buffers_cost_one_layer_each(tmp_path):
    one = M.run_isolated("stream_from_disk", folder=str(tmp_path), layers=6, d=1024, buffers=1, steps=1)
    three = M.run_isolated("stream_from_disk", folder=str(tmp_path), layers=6, d=1024, buffers=3, steps=1)
    layer = 1024 * 1024 * 4
    grew = three["peak_rss_above_start_bytes"] - one["peak_rss_above_start_bytes"]
    assert grew == pytest.approx(2 * layer, rel=0.1)
    assert three["estimate"]["peak_bytes"] - one["estimate"]["peak_bytes"] == 2 * layer


def test_disk_bandwidth_is_measured(tmp_path):
    r = M.disk_bandwidth(tmp_path, nbytes=32 << 20, chunk=8 << 20)
    assert r["read_GBps"] > 0 and r["write_GBps"] > 0 and r["bytes"] == 32 << 20


# ----------------------------------------------------------------------------- DeepSpeed's own view
deepspeed = pytest.importorskip("deepspeed")


def _ds_config_models():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                       DeepSpeedZeroOffloadParamConfig)
    return DeepSpeedZeroConfig, DeepSpeedZeroOffloadParamConfig, DeepSpeedZeroOffloadOptimizerConfig


def test_the_buffer_defaults_are_deepspeeds():
    Z, P, OPT = _ds_config_models()
    p, o = P(), OPT()
    assert (p.buffer_count, p.buffer_size, p.max_in_cpu) == (O.DS_PARAM_BUFFER_COUNT, O.DS_PARAM_BUFFER_SIZE, O.DS_MAX_IN_CPU)
    assert o.buffer_count == O.DS_OPTIMIZER_BUFFER_COUNT
    assert Z().sub_group_size == O.DS_SUB_GROUP_SIZE


@pytest.mark.parametrize("model", ["mistral-7b", "llama-3.1-70b", "gpt2-xl"])
@pytest.mark.parametrize("placement", O.PLACEMENTS)
def test_generated_config_is_accepted_by_deepspeed(model, placement):
    Z, *_ = _ds_config_models()
    r = O.infinity(model, params=placement[0], optimizer=placement[1], batch_size=1, seq_len=1024)
    cfg = O.deepspeed_config(r, nvme_path="/local_nvme")
    z = Z(**cfg["zero_optimization"])  # DeepSpeed's own validation (pydantic)
    assert z.stage == (3 if placement[0] != "gpu" or placement[1] == "nvme" else 2)
    got = lambda sec: (str(getattr(getattr(z, sec), "device", "none") or "none").split(".")[-1])  # noqa: E731
    want = lambda tier: "none" if tier == "gpu" else tier  # noqa: E731
    assert got("offload_param") == want(placement[0]) and got("offload_optimizer") == want(placement[1])
    if placement[0] == "nvme":  # every parameter tensor fits one swap buffer
        from vramlab import specs
        assert z.offload_param.buffer_size >= max(n for _, n in specs.preset(model).param_tensors())


@pytest.mark.parametrize("model", ["mistral-7b", "llama-3.1-70b", "pythia-1b"])
def test_offloaded_host_states_equal_deepspeeds_estimator(model):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from vramlab import specs

    spec = specs.preset(model)
    block, _ = O.zero_units(spec)
    kw = dict(batch_size=1, seq_len=512)
    for params, cpu_params in (("gpu", False), ("cpu", True)):
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(spec.params, block, cpu_offload=True,
                                                            cpu_offload_params=cpu_params, additional_buffer_factor=1.0)
        assert O.infinity(spec, params=params, optimizer="cpu", **kw).host_bytes == cpu
