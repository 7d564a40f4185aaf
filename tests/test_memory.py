"""The estimator against the seeds' and papers' worked examples (REFERENCES.md) and against
independent computations. Traced-peak accuracy is in test_accuracy.py."""

import dataclasses
import subprocess
import sys

import pytest

from vramlab import MemoryBreakdown, checkpoint_bytes, estimate_inference, estimate_training, fit, preset
from vramlab.memory import kv_cache_bytes, model_states, optimizer_state_bytes
from vramlab.specs import custom_gpu
from vramlab.units import GiB, MiB


# --- the seeds' worked examples -------------------------------------------------------------

def test_bert_checkpoint_size():
    # 110,000,000 params x 4 bytes / 1024^3 = 0.40978 GiB = 419.62 MiB
    assert checkpoint_bytes(110_000_000) / MiB == pytest.approx(419.62, abs=0.005)
    assert checkpoint_bytes(110_000_000) / GiB == pytest.approx(0.40978, abs=1e-5)


def test_mt5_checkpoint_and_adam_states():
    # mT5-base ~582 M params: 2.168 GiB in fp32; weights + grads + Adam m, v = 4x = 8.672 GiB
    assert checkpoint_bytes(582_000_000) / GiB == pytest.approx(2.168, abs=0.0005)
    spec = preset("mt5-base")
    states = model_states(spec, optimizer="adam").total
    assert states == 16 * spec.params  # 4 copies of 4 bytes
    assert states / GiB == pytest.approx(8.672 * spec.params / 582e6, rel=1e-3)
    assert not fit(spec, custom_gpu(8 * 10**9), batch_size=32, seq_len=10, optimizer="adam").fits  # "an 8 GB card cannot"


def test_mixed_precision_adam_is_16_bytes_per_param():
    # ZeRO (Rajbhandari+19): 2 + 2 + 12 = 16 B/param; PyTorch AMP: 4 (fp32 model) + 4 (grads) + 8 (m, v) = 16
    n = preset("gpt2").params
    assert model_states("gpt2", precision="bf16-mixed").total == 16 * n
    # pure bf16: 2 + 2 + 4 (PyTorch keeps m and v in the parameters' dtype)
    assert model_states("gpt2", precision="bf16").total == 8 * n
    # ZeRO paper's own recipe, 2 + 2 + 12: 7.5 B params -> 120 GB of model states with plain data parallelism
    zero = model_states("gpt2", precision="fp16-fp32-master")
    assert (zero.parameters, zero.gradients, zero.optimizer_states) == (2 * n, 2 * n, 12 * n)
    spec75 = dataclasses.replace(preset("gpt2"), num_layers=1)  # any model: the bytes scale with the params
    assert model_states(spec75, precision="fp16-fp32-master").total / spec75.params * 7.5e9 == 120e9
    # bf16 weights and gradients with fp32 Adam moments: 2 + 2 + 8
    assert model_states("gpt2", precision="bf16-fp32-states").total == 12 * n


def test_8bit_adam_state():
    # Dettmers+21 used 2048-value blocks (~2.004 B/param); bitsandbytes 0.50 keeps an fp32 absmax per 256 values of
    # m and of v, and two 256-entry fp32 maps for the optimizer: 2 + 8/256 B/param + 2 KiB (the real storage)
    n = 2048 * 1000
    assert optimizer_state_bytes("adamw-8bit", n, "fp32") == 2 * n + 2 * 4 * n // 256 + 2 * 256 * 4
    assert optimizer_state_bytes("adamw-8bit", 4095, "fp32") == 8 * 4095  # under min_8bit_size: fp32 moments


# --- Korthikanti+22 Table 2: sbh(34 + 5as/h) per layer (16-bit, 1-byte masks) ------------------


# --- inference ----------------------------------------------------------------------------------

def test_kv_cache_opt13b_800kb_per_token():
    # vLLM paper (Kwon+23): OPT-13B ~ 800 KB per token in fp16: 2 * 40 layers * 5120 * 2 bytes
    from vramlab.specs import from_config

    opt13b = from_config({"model_type": "opt", "hidden_size": 5120, "num_hidden_layers": 40,
                          "num_attention_heads": 40, "ffn_dim": 20480, "vocab_size": 50272})
    per_token = kv_cache_bytes(opt13b, batch_size=1, seq_len=1, dtype="fp16")
    assert per_token == 2 * 40 * 5120 * 2 == 819_200


def test_kv_cache_uses_kv_heads():
    spec = preset("llama-3.1-8b")  # 32 query heads, 8 KV heads
    gqa = kv_cache_bytes(spec, batch_size=1, seq_len=8192, dtype="bf16")
    mha = 2 * spec.num_layers * spec.hidden_size * 8192 * 2  # the hidden-size formula
    assert mha == 4 * gqa
    assert gqa == 2 * 32 * 8 * 128 * 8192 * 2  # 1 GiB
    assert kv_cache_bytes(spec, batch_size=1, seq_len=8192, dtype="int8") == gqa // 2


def test_inference_breakdown():
    est = estimate_inference("llama-3.1-8b", batch_size=4, seq_len=4096)
    assert est.parameters == 2 * preset("llama-3.1-8b").params
    assert est.kv_cache == 4 * GiB // 8 * 4  # 4 sequences x 4096 tokens x 128 KiB
    assert est.gradients == est.optimizer_states == 0
    assert estimate_inference("bert-base", batch_size=1, seq_len=128).kv_cache == 0


# --- phases, fit, validation ------------------------------------------------------------------

def test_peak_phase_moves_with_batch():
    small = estimate_training("gpt2", batch_size=1, seq_len=64)
    large = estimate_training("gpt2", batch_size=32, seq_len=1024)
    assert "optimizer" in small.phase or "embedding" in small.phase
    assert "backward" in large.phase and large.activations > large.parameters


def test_optimizer_implementations():
    kw = dict(batch_size=1, seq_len=32)
    n = preset("pythia-160m").params  # untied: the step is the peak with every implementation
    foreach = estimate_training("pythia-160m", optimizer_impl="foreach", **kw)
    fused = estimate_training("pythia-160m", optimizer_impl="fused", **kw)
    assert foreach.total - fused.total == 4 * n  # foreach: one fp32 copy of all parameters


def test_peft_trainable_params():
    full = estimate_training("gpt2", batch_size=2, seq_len=128)
    lora = estimate_training("gpt2", batch_size=2, seq_len=128, trainable_params=294_912)
    assert lora.gradients <= 294_912 * 4 and lora.optimizer_states == 2 * 294_912 * 4
    assert lora.total < full.total


@pytest.mark.parametrize("kw, match", [
    (dict(batch_size=0, seq_len=8), "batch_size"),
    (dict(batch_size=-1, seq_len=8), "batch_size"),
    (dict(batch_size=1, seq_len=0), "seq_len"),
    (dict(batch_size=1, seq_len=8, precision="fp8"), "precision"),
    (dict(batch_size=1, seq_len=8, optimizer="lion"), "optimizer"),
    (dict(batch_size=1, seq_len=8, attention="flash3"), "attention"),
])
def test_bad_inputs(kw, match):
    with pytest.raises(ValueError, match=match):
        estimate_training("gpt2", **kw)


def test_breakdown_arithmetic_and_table():
    a = MemoryBreakdown(parameters=10 * MiB, activations=30 * MiB, label="a")
    b = MemoryBreakdown(parameters=10 * MiB, activations=25 * MiB, temporaries=1 * MiB, label="b")
    d = a - b
    assert d.total == 4 * MiB and d.activations == 5 * MiB and d.temporaries == -MiB
    assert a.to_dict()["activations"] == 30 * MiB and a.total == 40 * MiB
    table = a.table()
    assert "30.00 MiB" in table and "40.00 MiB" in table and "75.0%" in table
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.parameters = 0


def test_calculators_do_not_import_torch():
    """The estimates run where torch is absent (the browser): importing and calling them loads no torch.
    How fast they are is speed, measured by benchmarks/calculator_speed.py, never asserted here."""
    code = ("import sys, vramlab\n"
            "s = vramlab.preset('llama-3.1-8b')\n"
            "vramlab.estimate_training(s, batch_size=4, seq_len=4096, precision='bf16-mixed')\n"
            "vramlab.fit(s, 'h100', seq_len=4096); vramlab.estimate_inference(s, batch_size=1, seq_len=8)\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False"]


def test_subtraction_says_when_it_is_not_like_with_like():
    """README's old example subtracted a bf16 CUDA estimate from an fp32 CPU trace: -17 GiB of 'error'."""
    amp = estimate_training("gpt2", batch_size=8, seq_len=1024, precision="bf16-mixed")
    fp32_cpu = estimate_training("gpt2", batch_size=8, seq_len=1024, device="cpu")
    diff = amp - fp32_cpu
    assert diff.warning == "not like with like: precision bf16-mixed vs fp32; device cuda vs cpu"
    assert "WARNING: not like with like" in diff.table()
    same = amp - estimate_training("gpt2", batch_size=4, seq_len=1024, precision="bf16-mixed")
    assert same.warning == "" and "WARNING" not in same.table()
    assert (MemoryBreakdown(parameters=3) - MemoryBreakdown(parameters=1)).warning == ""  # unlabelled: silent
