"""Measurement: trace mode equals real tensor tracking; frozen (PEFT) parameters work; the
breakdown's fixed categories hold what they should."""

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from vramlab import estimate_training, preset  # noqa: E402
from vramlab.measure import measure_inference, measure_training  # noqa: E402
from vramlab.models import build_model  # noqa: E402

TINY = dict(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=4, head_dim=32, intermediate_size=512)


def tiny(name="gpt2", **extra):
    return dataclasses.replace(preset(name), **{**TINY, **extra})


def test_trace_equals_real_cpu_tracking():
    spec = tiny()
    kw = dict(batch_size=2, seq_len=64)
    real = measure_training(spec, mode="cpu", **kw)
    fake = measure_training(spec, mode="trace", **kw)
    assert abs(real.total - fake.total) <= 1 << 20  # within 1 MiB
    assert real.breakdown.parameters == fake.breakdown.parameters == 4 * spec.params


def test_categories():
    spec = tiny()
    m = measure_training(spec, batch_size=1, seq_len=16, mode="trace")  # tiny batch: the step is the peak
    bd = m.breakdown
    assert bd.parameters == 4 * spec.params
    assert bd.optimizer_states >= 8 * spec.params  # Adam m and v (+ step counters)
    assert bd.inputs == 16 * 8  # the int64 token ids (labels share them)
    big = measure_training(spec, batch_size=8, seq_len=256, mode="trace", attention="eager")
    assert big.breakdown.activations > big.breakdown.parameters


def test_trace_mode_measures_gpu_sized_models_quickly():
    import time

    spec = dataclasses.replace(preset("llama-3.1-8b"), num_layers=1)  # 1.3 B params incl. embeddings
    t = time.perf_counter()
    m = measure_training(spec, batch_size=1, seq_len=256, mode="trace", precision="bf16-mixed")
    assert time.perf_counter() - t < 60
    assert m.breakdown.parameters == 4 * spec.params  # 5 GiB of fp32 weights that were never allocated


def test_frozen_parameters_peft():
    peft = pytest.importorskip("peft")
    spec = tiny()

    def lora(model):
        cfg = peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True)
        return peft.get_peft_model(model, cfg)

    m = measure_training(spec, batch_size=2, seq_len=32, mode="cpu", model_hook=lora)
    n_lora = 2 * 4 * (128 + 3 * 128)  # two layers, r (d_in + d_out) each (Hu+21)
    assert m.breakdown.optimizer_states < 8 * n_lora + 4096  # Adam states for the adapters only
    assert m.breakdown.gradients <= 4 * n_lora
    assert m.breakdown.parameters == 4 * (spec.params + n_lora)
    est = estimate_training(spec, batch_size=2, seq_len=32, trainable_params=n_lora, device="cpu")
    assert est.optimizer_states == 8 * n_lora


def test_inference_prefill_keeps_kv_cache():
    spec = tiny("llama-3.2-1b", num_kv_heads=2, vocab_size=1000)
    m = measure_inference(spec, batch_size=2, seq_len=64, mode="trace", precision="bf16")
    kv = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 64 * 2 * 2
    assert m.breakdown.parameters == 2 * spec.params
    assert m.breakdown.activations >= kv  # the cache (held by the output) is tracked as activations


def test_build_model_modes():
    spec = tiny()
    m = build_model(spec, device="meta")
    assert sum(p.numel() for p in m.parameters()) == spec.params and m.training
    assert not build_model(spec, device="meta", train=False).training


def test_cuda_mode_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        measure_training(tiny(), batch_size=1, seq_len=8, mode="cuda")
