"""The estimator against the seeds' and papers' worked examples (REFERENCES.md) and against
independent computations. Traced-peak accuracy is in test_accuracy.py."""

import dataclasses
import subprocess
import sys

import pytest

from vramlab import MemoryBreakdown, checkpoint_bytes, estimate_inference, estimate_training, fit, gpu, preset
from vramlab.memory import activation_bytes, kv_cache_bytes, layer_saved, model_states, optimizer_state_bytes
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
    # Dettmers+21: 1 byte each for m, v + an fp32 scale per 2048-value block ~ 2.004 B/param
    n = 2048 * 1000
    assert optimizer_state_bytes("adamw-8bit", n, "fp32") / n == pytest.approx(2.0039, abs=1e-4)


# --- Korthikanti+22 Table 2: sbh(34 + 5as/h) per layer (16-bit, 1-byte masks) ------------------

def test_korthikanti_per_layer_activations():
    # A GPT layer as the paper counts it: 16-bit activations, CUDA bool dropout masks, exact GeLU
    # (saves its input only), scores materialised (no FlashAttention). Layer-norm statistics
    # (2 fp32 per token per norm) are the only extra the paper leaves out.
    spec = dataclasses.replace(preset("gpt2"), activation="gelu", hidden_dropout=0.1, attention_dropout=0.1)
    s, b, h, a = 1024, 4, spec.hidden_size, spec.num_heads
    saved = layer_saved(spec, attention="eager", device="cuda", precision="bf16")
    nbytes = {"x": 2, "half": 2, "f32": 4, "mask": 1, "i64": 8}
    total = sum(x.width * nbytes[x.kind] * (b * a * s * s if x.per_score else b * s) for x in saved)
    stats = 2 * 2 * 4 * s * b
    assert total - stats == s * b * h * (34 + 5 * a * s / h)
    # FlashAttention-style kernels drop the 5as/h term (and keep the output and log-sum-exp)
    flash = layer_saved(spec, attention="sdpa", device="cuda", precision="bf16")
    assert not any(x.per_score for x in flash)


def test_full_recompute_keeps_layer_inputs():
    spec = preset("gpt2")
    kw = dict(batch_size=4, seq_len=512, precision="bf16")
    full = activation_bytes(spec, recompute="full", **kw)
    assert full["layers"] == spec.num_layers * 4 * 512 * spec.hidden_size * 2  # 2sbh per layer
    none = activation_bytes(spec, **kw)
    assert none["layers"] > 10 * full["layers"]


def test_activations_scale_with_batch_and_sequence():
    spec = preset("gpt2")
    a1 = activation_bytes(spec, batch_size=1, seq_len=512, attention="eager")
    a4 = activation_bytes(spec, batch_size=4, seq_len=512, attention="eager")
    assert a4["layers"] == 4 * a1["layers"]  # linear in b
    s1 = activation_bytes(spec, batch_size=1, seq_len=256, attention="eager")["layers"]
    s2 = activation_bytes(spec, batch_size=1, seq_len=512, attention="eager")["layers"]
    assert s2 > 2 * s1  # the s^2 scores make it superlinear in s
    f1 = activation_bytes(spec, batch_size=1, seq_len=256)["layers"]
    f2 = activation_bytes(spec, batch_size=1, seq_len=512)["layers"]
    assert f2 == 2 * f1  # flash attention: linear in s


def test_seeds_crude_formula_is_one_score_matrix():
    # "Seq_Length^2 x Attention_Heads x Precision" = the softmax probabilities of ONE layer, batch 1
    spec = preset("bert-base")
    s, a = 512, spec.num_heads
    crude = s * s * a * 4
    est = activation_bytes(spec, batch_size=1, seq_len=s, attention="eager", device="cuda")
    assert est["layers"] + est["outside"] > 10 * crude


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


def test_fit_and_largest_batch():
    spec = preset("gpt2")
    t4 = gpu("t4")
    r = fit(spec, t4, batch_size=4, seq_len=1024, precision="bf16-mixed")
    assert r.max_batch_size >= 1
    need = lambda b: fit(spec, t4, batch_size=b, seq_len=1024, precision="bf16-mixed").needed
    assert need(r.max_batch_size) <= t4.usable_bytes < need(r.max_batch_size + 1)  # the search finds the boundary
    # the terms: the estimate at batch 4 (T4: 8 MiB + 128 KiB cuBLAS workspaces), 3 %, the freed bf16 logits, the context
    est = estimate_training(spec, batch_size=4, seq_len=1024, precision="bf16-mixed", gpu=t4)
    assert r.estimate == est.total and r.margin == int(0.03 * est.total)
    assert r.fragmentation == 4 * 1024 * 50257 * 2 and r.needed == r.estimate + r.reserve
    assert t4.usable_bytes < t4.memory_bytes  # cudaMemGetInfo's total is below nvidia-smi's
    assert fit("llama-3.1-70b", "t4", seq_len=128).max_batch_size == 0
    assert "does NOT fit" in str(fit("llama-3.1-70b", "t4", seq_len=128))


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


def test_calculators_do_not_import_torch_and_are_fast():
    code = ("import sys, time, vramlab\n"
            "s = vramlab.preset('llama-3.1-8b')\n"
            "t = time.perf_counter()\n"
            "for _ in range(200): vramlab.estimate_training(s, batch_size=4, seq_len=4096, precision='bf16-mixed')\n"
            "dt = (time.perf_counter() - t) / 200\n"
            "vramlab.fit(s, 'h100', seq_len=4096); vramlab.estimate_inference(s, batch_size=1, seq_len=8)\n"
            "print('torch' in sys.modules, dt)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "False"
    assert float(out[1]) < 1e-3  # well under a millisecond per estimate


@pytest.mark.parametrize("truth", [0, 1, 2, 7, 97, 104, 1000, 65536])
@pytest.mark.parametrize("start", [1, 16, 97, 120, 5000])
def test_largest_true_finds_the_boundary_with_few_probes(truth, start):
    from vramlab.memory import largest_true

    calls = []

    def fits(n):
        calls.append(n)
        assert 1 <= n <= 65536, n
        return n <= truth

    assert largest_true(fits, start=start, limit=65536) == truth
    assert len(calls) <= 2 * 17 + 2  # galloping + bisection: logarithmic


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


def test_t5_self_attention_on_cuda_keeps_one_mask_for_the_batch():
    """T5's self-attention mask is the relative-position bias (it needs a gradient). On CUDA under the
    pinned transformers the memory-efficient kernel takes it and keeps the (1, heads, s, s) mask, which
    the batch broadcasts (one per block, whatever the batch); the CPU's math path keeps the
    b x heads x s x s probabilities (tests/test_gpu_truth.py measures both versions on an H100)."""
    from vramlab.memory import _saved_bytes

    spec = preset("t5-small")
    s, a = 256, spec.num_heads
    for precision, nb in (("fp32", 4), ("bf16", 2), ("bf16-mixed", 2)):
        cuda = layer_saved(spec, device="cuda", precision=precision)
        masks = [x for x in cuda if x.per_score]
        assert len(masks) == 1 and masks[0].shared_batch
        nbytes = {"half": nb}
        for b in (1, 8):
            assert _saved_bytes(masks[0], tokens=b * s, scores=b * a * s * s, nbytes=nbytes, batch=b) == a * s * s * nb
        cpu = layer_saved(spec, device="cpu", precision=precision)
        assert any(x.per_score and not x.shared_batch for x in cpu)  # the probabilities
    # the bias's share of a step: activations grow with the batch except the masks, one a block
    one = activation_bytes(spec, batch_size=1, seq_len=s, device="cuda")["layers"]
    eight = activation_bytes(spec, batch_size=8, seq_len=s, device="cuda")["layers"]
    blocks = spec.num_layers + spec.num_decoder_layers
    assert 8 * one - eight == 7 * blocks * a * s * s * 4
