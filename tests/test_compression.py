"""vramlab.compression against peft (LoRA counts, on the meta device), torch (quantization done
with torch's own quantized tensors or written out in torch), bitsandbytes' layout and the papers'
figures, CPU measurements of peft LoRA training, and the H100 reproduction of the seeds' mT5 LoRA."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from pathlib import Path

import pytest
import torch

from vramlab import compression as C
from vramlab.specs import from_config, preset, preset_names

ROOT = Path(__file__).resolve().parents[1]
LAB = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
       "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 32, "vocab_size": 512,
       "max_position_embeddings": 256, "tie_word_embeddings": False, "hidden_act": "silu"}


def test_compression_is_pure_python(assert_pure_python):
    assert_pure_python("import vramlab.compression as c; c.quant_error([[1.0, -2.0], [0.5, 3.0]]); "
                       "c.peft_training('mt5-base', batch_size=1, seq_len=8); c.weight_bytes('gpt2', 'nf4-dq'); "
                       "c.prune('llama-3.2-1b', heads=16)")


# ---------------------------------------------------------------------------- LoRA against peft
def _peft_trainable(spec, rank: int, targets) -> int:
    from peft import LoraConfig, get_peft_model

    from vramlab.measure.models import build_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(build_model(spec, device="meta"), LoraConfig(r=rank, target_modules=targets))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.slow
@pytest.mark.parametrize("name", preset_names())
def test_lora_count_equals_peft_for_every_preset(name):
    spec = preset(name)
    assert C.lora_params(spec, rank=8) == _peft_trainable(spec, 8, None)  # peft's default targets
    assert C.lora_params(spec, rank=4, targets="all-linear") == _peft_trainable(spec, 4, "all-linear")


@pytest.mark.parametrize("name, targets", [("llama-3.2-1b", ["o_proj", "down_proj"]), ("mt5-base", ["k", "wo"]),
                                           ("gpt2", ["c_proj"]), ("bert-base", ["dense"]), ("opt-125m", ["fc1"])])
def test_lora_count_equals_peft_for_named_targets(name, targets):
    spec = preset(name)
    assert C.lora_params(spec, rank=16, targets=targets) == _peft_trainable(spec, 16, targets)


def test_lora_mt5_base_is_the_seeds_884736():
    assert C.lora_params("mt5-base", rank=8, targets=("q", "v")) == 884_736  # the course's source article


def test_lora_bad_targets_and_rank_say_what_is_wrong():
    with pytest.raises(ValueError, match="target 'q_proj' matches no linear layer of gpt2; its layers are named c_attn"):
        C.lora_params("gpt2", targets="q_proj")
    with pytest.raises(ValueError, match="rank must be a whole number"):
        C.lora_params("gpt2", rank=0)
    with pytest.raises(ValueError, match="no longer parameter-efficient"):
        C.peft_training("gpt2", rank=100_000, targets="all-linear", batch_size=1, seq_len=8)


# ---------------------------------------------------------------------------- quantization against torch
def _weights(rows=48, cols=200, seed=0, outlier_rows=(3, 17)):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g, dtype=torch.float64) * 0.02
    for r in outlier_rows:  # output channels 40x larger, as trained LLMs have
        w[r] *= 40
    return w


def test_per_tensor_and_per_row_equal_torch_quantized_tensors():
    w = _weights()
    amax = w.abs().max().item()
    tq = torch.quantize_per_tensor(w.float(), amax / 127, 0, torch.qint8)
    row_amax = w.abs().amax(dim=1).float()
    rq = torch.quantize_per_channel(w.float(), (row_amax / 127).double(), torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
    for scheme, t in (("per-tensor", tq), ("per-row", rq)):
        mine = C.quantize(w.tolist(), scheme=scheme)
        ref = t.int_repr().to(torch.int64)
        ours = torch.tensor(mine.q)
        assert (ours - ref).abs().max() <= 1 and (ours != ref).float().mean() < 1e-3  # fp32 vs fp64 ties only
        err = C.quant_error(w.tolist(), scheme=scheme)
        ref_err = (t.dequantize().double() - w)
        assert err.max_abs == pytest.approx(ref_err.abs().max().item(), rel=1e-3)
        assert err.rms == pytest.approx(ref_err.pow(2).mean().sqrt().item(), rel=1e-3)
        # storage: one int8 a weight and fp32 scales (torch keeps its per-channel scales in fp64)
        assert err.nbytes == ref.to(torch.int8).nbytes + 4 * (1 if scheme == "per-tensor" else w.shape[0])


def test_per_group_equals_torch_written_out():
    w = _weights(cols=300)
    g = 128
    pad = torch.nn.functional.pad(w, (0, 3 * g - 300))  # 300 -> 384 = 3 groups (zeros change no absmax)
    blocks = pad.view(w.shape[0], 3, g)
    scale = blocks.abs().amax(dim=2, keepdim=True) / 7  # 4 bits: qmax = 7
    deq = (torch.round(blocks / scale).clamp(-7, 7) * scale).view(w.shape[0], -1)[:, :300]
    err = C.quant_error(w.tolist(), scheme="per-group", bits=4, group_size=g)
    assert err.max_abs == pytest.approx((deq - w).abs().max().item(), rel=1e-9)
    assert err.nbytes == w.numel() // 2 + 4 * w.shape[0] * 3


def test_per_row_beats_per_tensor_when_rows_differ():
    """BMInf's finding on a matrix with outlier rows: one scale for the matrix squeezes the other
    rows into a few levels; one a row keeps them."""
    w = _weights()
    t, r = (C.quant_error(w.tolist(), scheme=s) for s in ("per-tensor", "per-row"))
    assert t.rms > 4 * r.rms and t.nbytes < r.nbytes  # 48 scales cost 188 bytes more
    # per-row error is bounded by half a step of each row's own scale
    q = C.quantize(w.tolist(), scheme="per-row")
    for row, back, s in zip(w.tolist(), q.dequantize(), q.scales):
        assert max(abs(a - b) for a, b in zip(row, back)) <= s / 2 + 1e-12


def test_quant_bytes_exact_and_zero_rows():
    assert C.quant_bytes(4096, 4096, scheme="per-row") == 4096 * 4096 + 4 * 4096
    assert C.quant_bytes(4096, 4096, scheme="per-tensor") == 4096 * 4096 + 4
    assert C.quant_bytes(3, 5, scheme="per-group", bits=4, group_size=2) == math.ceil(15 / 2) + 4 * 3 * 3
    q = C.quantize([[0.0, 0.0], [1.0, -1.0]], scheme="per-row")
    assert q.q == ((0, 0), (127, -127)) and q.dequantize()[0] == [0.0, 0.0]


@pytest.mark.parametrize("bad, needle", [([], "non-empty"), ([[1.0], [1.0, 2.0]], "same length"),
                                         ([[float("nan")]], "finite"), ("abc", "non-empty matrix|a matrix")])
def test_quantize_rejects_bad_weights(bad, needle):
    with pytest.raises(ValueError, match=needle):
        C.quantize(bad)


def test_quantize_rejects_bad_scheme_and_bits():
    with pytest.raises(ValueError, match="unknown quantization scheme 'per-col'"):
        C.quantize([[1.0]], scheme="per-col")
    with pytest.raises(ValueError, match="bits must be a whole number from 2 to 8"):
        C.quant_bytes(2, 2, bits=16)


def test_llm_int8_decomposition_against_torch():
    """LLM.int8(): an outlier feature (one input column ~ 60) ruins vector-wise INT8; multiplying
    that column in 16-bit restores the product. The reference product is torch's."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 32, generator=g, dtype=torch.float64)
    x[:, 5] *= 60
    w = torch.randn(16, 32, generator=g, dtype=torch.float64) * 0.1
    exact = x @ w.T
    dec = C.llm_int8(x.tolist(), w.tolist(), threshold=6.0)
    plain = C.llm_int8(x.tolist(), w.tolist(), threshold=1e9)  # no outliers: everything in INT8
    assert dec["outlier_columns"] == [5] and plain["outlier_columns"] == []
    e_dec = (torch.tensor(dec["y"], dtype=torch.float64) - exact).abs().max().item()
    e_plain = (torch.tensor(plain["y"], dtype=torch.float64) - exact).abs().max().item()
    assert e_dec < e_plain / 10
    assert dec["stored_bytes"] == 16 * 32 + 4 * 16 and dec["fp16_bytes"] == 2 * 1 * (6 + 16)


def test_nf4_matches_qlora():
    """QLoRA §3: double quantization cuts the constants from 32/64 = 0.5 to 8/64 + 32/(64*256) =
    0.127 bits a parameter."""
    assert C.nf4_bits_per_param(double_quant=False) == 4.5
    assert C.nf4_bits_per_param() == pytest.approx(4.127, abs=5e-4)
    n = 64 * 256 * 10
    tables = 16 * 4  # the NF4 levels, fp32
    assert C.nf4_bytes(n) == n // 2 + n // 64 + 4 * 10 + 4 + 256 * 4 + tables
    assert C.nf4_bytes(n, double_quant=False) == n // 2 + 4 * n // 64 + tables
    assert C.nf4_bits_per_param() == pytest.approx(8 * C.nf4_bytes(10**11) / 10**11, abs=1e-6)


@pytest.mark.parametrize("double_quant", [True, False])
def test_nf4_bytes_equal_bitsandbytes_params4bit(double_quant):
    """What bitsandbytes' Params4bit really stores (CPU backend): its packed codes and every tensor
    of its quantization state, storage by storage, for a tensor that is not a whole number of blocks."""
    bnb = pytest.importorskip("bitsandbytes")
    w = torch.randn(300, 1000, dtype=torch.bfloat16)
    p = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4", compress_statistics=double_quant).to("cpu")
    real = _distinct_storage_bytes([p.data] + [getattr(qs, a) for qs in (p.quant_state, p.quant_state.state2)
                                               if qs is not None for a in ("absmax", "code", "offset")])
    assert real == C.nf4_bytes(300 * 1000, double_quant=double_quant)


def _distinct_storage_bytes(tensors) -> int:
    """What a set of tensors occupies: each storage once, by its address (None entries skipped)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if isinstance(t, torch.Tensor)}
    return sum(storages.values())


def test_weight_bytes_of_llama_8b_in_nf4_is_about_qlora_figure():
    """Linear layers of Llama-3.1-8B in NF4-DQ, the rest in bf16: 4.127 bits for 6.98 B linear weights."""
    w = C.weight_bytes("llama-3.1-8b", "nf4-dq")
    lin = 32 * (4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336)  # q, o, k, v, gate, up, down
    assert w["linear_params"] == lin
    assert w["linear"] == pytest.approx(lin * 4.127 / 8, rel=1e-3)
    assert w["other"] == 2 * (preset("llama-3.1-8b").params - lin)


# ---------------------------------------------------------------------------- 8-bit optimizer
def test_adam8bit_layout_as_bitsandbytes():
    """Optimizer2State.init_state: uint8 m and v, one fp32 absmax a 256-value block each, and one pair
    of 256-entry fp32 quantization maps for the optimizer; tensors under 4096 elements keep fp32
    states."""
    maps = 2 * 256 * 4
    assert C.adam8bit_state_bytes([1_000_000]) == 2_000_000 + 2 * 4 * 3907 + maps
    assert C.adam8bit_state_bytes([4095]) == 8 * 4095
    assert C.adam8bit_state_bytes([4096]) == 2 * 4096 + 2 * 4 * 16 + maps
    assert C.adam8bit_state_bytes([4096, 4096]) == 2 * (2 * 4096 + 2 * 4 * 16) + maps
    # the paper's blocks of 2048: ~2.004 bytes a parameter (REFERENCES.md)
    assert C.adam8bit_state_bytes([2048 * 100_000], block_size=2048) / (2048 * 100_000) == pytest.approx(2.0039, abs=1e-4)


def test_adam8bit_layout_equals_bitsandbytes_states():
    """The states bitsandbytes' AdamW8bit really allocates (CPU backend), storage by storage, for a
    model with tensors on both sides of min_8bit_size."""
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 1000), torch.nn.LayerNorm(1000), torch.nn.Linear(1000, 7))
    opt = bnb.optim.AdamW8bit(model.parameters())
    model(torch.randn(2, 300)).sum().backward()
    opt.step()
    real = _distinct_storage_bytes(v for state in opt.state.values() for v in state.values())
    assert real == C.adam8bit_state_bytes(p.numel() for p in model.parameters())


def test_full_finetune_with_8bit_adam_counts_small_tensors_in_fp32():
    spec = preset("gpt2")
    m = C.peft_training(spec, method="full", optimizer="adamw-8bit", batch_size=1, seq_len=64)
    sizes = [n for _, n in spec.param_tensors()]
    small = sum(n for n in sizes if n < 4096)  # GPT-2's biases and LayerNorms
    assert small > 0
    assert m.optimizer_states == 8 * small + sum(2 * n + 8 * -(-n // 256) for n in sizes if n >= 4096) + 2048


# ---------------------------------------------------------------------------- LoRA memory, measured
def test_mt5_lora_within_3_percent_of_the_h100():
    rows = [json.loads(x) for x in (ROOT / "benchmarks/results/h100/seeds_mt5_h100.jsonl").read_text().splitlines()]
    case = next(r for r in rows if r["case"].startswith("mt5-base lora"))
    est = C.peft_training("mt5-base", rank=8, targets=("q", "v"), batch_size=32, seq_len=10)
    assert case["trainable"] == 884_736
    assert abs(est.total - case["peak_allocated"]) / case["peak_allocated"] < 0.03


_GPT = dataclasses.replace(preset("gpt2"), num_layers=2, hidden_dropout=0.0, attention_dropout=0.0, vocab_size=2048,
                           max_position_embeddings=512)
_T5 = dataclasses.replace(preset("t5-small"), num_layers=2, num_decoder_layers=2, vocab_size=2048, hidden_dropout=0.0,
                          attention_dropout=0.0)


@pytest.mark.slow
@pytest.mark.parametrize("which, targets, b, s", [("lab", "default", 8, 128), ("lab", "all-linear", 8, 128),
                                                  ("gpt2", "default", 4, 256), ("gpt2", "all-linear", 4, 256),
                                                  ("t5", "default", 4, 128), ("t5", "all-linear", 4, 128)])
def test_lora_training_within_5_percent_of_a_cpu_measurement(which, targets, b, s):
    """A real peft LoRA step on the CPU (tensor tracking of the CPU kernels, not a GPU)."""
    from peft import LoraConfig, get_peft_model

    from vramlab.measure.memory import measure_training

    spec = {"lab": from_config(LAB, name="lab"), "gpt2": _GPT, "t5": _T5}[which]
    tm = None if targets == "default" else targets
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        meas = measure_training(spec, batch_size=b, seq_len=s, mode="cpu",
                                model_hook=lambda m: get_peft_model(m, LoraConfig(r=8, target_modules=tm)))
    est = C.peft_training(spec, rank=8, targets=targets, batch_size=b, seq_len=s, device="cpu")
    assert est.parameters == meas.breakdown.parameters  # K + N, exactly
    assert abs(est.total - meas.breakdown.total) / meas.breakdown.total < 0.05


def test_qlora_is_smaller_than_lora_and_full():
    kw = dict(batch_size=1, seq_len=256, precision="bf16-mixed")
    full, lora, q8, q4 = (C.peft_training("llama-3.1-8b", method=m, **kw).total for m in C.METHODS)
    assert q4 < q8 < lora < full
    # QLoRA's weights: the NF4 model plus fp32 adapters
    q = C.peft_training("llama-3.1-8b", method="qlora", **kw)
    assert q.parameters == C.weight_bytes("llama-3.1-8b", "nf4-dq")["total"] + 4 * C.lora_params("llama-3.1-8b")


# ---------------------------------------------------------------------------- pruning, sharing, factorising
def test_pruned_llama_spec_builds_a_model_with_its_count():
    from vramlab.measure.models import build_model

    spec = from_config(LAB, name="lab")
    small = C.prune(spec, heads=4, intermediate=200, layers=1)
    model = build_model(small, device="meta")
    assert sum(p.numel() for p in model.parameters()) == small.params
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.shape == (4 * 32, 256) and len(model.model.layers) == 3
    assert model.model.layers[0].mlp.up_proj.weight.shape == (504, 256)


def test_prune_gqa_and_refusals():
    small = C.prune("llama-3.2-1b", heads=16)  # 32 query heads, 8 KV heads -> 16 query heads
    assert (small.num_heads, small.num_kv_heads) == (16, 8)
    with pytest.raises(ValueError, match="must be a multiple of them"):
        C.prune("llama-3.2-1b", heads=3)
    with pytest.raises(ValueError, match="transformers' Llama needs hidden_size .256. to be a multiple"):
        C.prune(from_config(LAB, name="lab"), heads=2)
    with pytest.raises(ValueError, match="prune its MLP width"):
        C.prune("gpt2", heads=2)
    with pytest.raises(ValueError, match="layers must be a whole number from 0 to 11"):
        C.prune("gpt2", layers=12)


def test_shared_and_low_rank_counts_against_torch():
    from vramlab.measure.models import build_model

    spec = preset("bert-base")
    model = build_model(spec, device="meta")
    one_layer = sum(p.numel() for p in model.bert.encoder.layer[0].parameters())
    rest = sum(p.numel() for n, p in model.named_parameters() if ".encoder.layer." not in n)
    assert C.shared_layers_params(spec) == rest + one_layer  # ALBERT: one block for all twelve
    assert C.shared_layers_params(spec, groups=12) == spec.params
    k = 64
    saved = sum(m.weight.numel() - k * sum(m.weight.shape) for n, m in model.named_modules()
                if isinstance(m, torch.nn.Linear) and ".encoder.layer." in n)
    assert C.low_rank_params(spec, rank=k) == spec.params - saved


# ---------------------------------------------------------------------------- distillation, inference
def test_distillation_adds_teacher_and_soft_labels():
    t, s = preset("gpt2-medium"), preset("gpt2")
    d = C.distillation(t, s, batch_size=4, seq_len=256)
    alone = C.peft_training(s, method="full", batch_size=4, seq_len=256)
    assert d.total > alone.total + 4 * t.params  # the fp32 teacher, plus at least the soft labels
    with pytest.raises(ValueError, match="share a vocabulary"):
        C.distillation("gpt2", "llama-3.2-1b", batch_size=1, seq_len=8)


def test_quantized_inference_weights_and_bad_format():
    m = C.quantized_inference("llama-3.1-8b", fmt="int8", batch_size=1, seq_len=128)
    assert m.parameters == C.weight_bytes("llama-3.1-8b", "int8")["total"]
    bf16 = C.quantized_inference("llama-3.1-8b", fmt="bf16", batch_size=1, seq_len=128)
    assert bf16.parameters == 2 * preset("llama-3.1-8b").params
    with pytest.raises(ValueError, match="unknown weight format 'int3'"):
        C.weight_bytes("gpt2", "int3")


@pytest.mark.slow
@pytest.mark.parametrize("autocast, recompute", [(True, "none"), (False, "none"), (True, "full")])
def test_qlora_step_within_5_percent_of_bitsandbytes_on_cpu(autocast, recompute):
    """A real QLoRA step (bitsandbytes' NF4 Linear4bit base, CPU backend; fp32 peft adapters on every
    linear layer) against peft_training: under autocast, and in pure bf16 without it, where peft
    casts each adapter's input to fp32 (measured: about 50 % more activations); and with every block
    checkpointed, as QLoRA trained."""
    pytest.importorskip("bitsandbytes")
    from vramlab.measure import compression as complab

    cfg = {"method": "qlora", "targets": "all-linear", "batch_size": 8, "seq_len": 128, "mode": "cpu", "autocast": autocast,
           "recompute": recompute}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = complab._probe(cfg)["measured_bytes"]
    est = C.peft_training(complab.teacher_spec(), method="qlora", targets="all-linear", batch_size=8, seq_len=128,
                          device="cpu", autocast=autocast, recompute=recompute).total
    assert abs(est - got) <= 0.05 * got, (est, got)


def test_autocast_must_be_a_bool():
    with pytest.raises(ValueError, match="autocast must be True or False"):
        C.peft_training("gpt2", method="qlora", batch_size=1, seq_len=8, autocast="no")


def test_int4_g128_is_gptq_and_awq_storage():
    """GPTQ/AWQ keep an fp16 scale and a 4-bit zero point per group of 128 (4.16 bits a
    weight), not an fp32 scale alone. The expected bytes are AutoAWQ's packed tensors, built here on
    torch's meta device: qweight (in, out / 8) int32, qzeros (in / 128, out / 8) int32, scales
    (in / 128, out) fp16."""
    import torch

    for out, inp in ((4096, 4096), (14336, 4096), (4096, 14336), (1024, 256)):
        parts = [torch.empty(inp, out // 8, dtype=torch.int32, device="meta"),
                 torch.empty(inp // 128, out // 8, dtype=torch.int32, device="meta"),
                 torch.empty(inp // 128, out, dtype=torch.float16, device="meta")]
        assert C.gptq_bytes(out, inp) == sum(t.numel() * t.element_size() for t in parts)
    w = C.weight_bytes("llama-3.1-8b", "int4-g128")
    assert 8 * w["linear"] / w["linear_params"] == pytest.approx(4 + 16 / 128 + 4 / 128)


def test_compression_numbers_stay_finite_and_refuse_bad_blocks():
    """Huge weights gave inf/nan errors (their squares overflow); a block of 0 divided by
    zero and a negative one answered 3.87 bits."""
    e = C.quant_error([[1e300, 3e299]], bits=2)  # scale 1e300: codes 1 and 0
    assert e.max_abs == pytest.approx(3e299) and e.rms == pytest.approx(3e299 / math.sqrt(2))
    assert e.relative == pytest.approx(0.3 / math.sqrt(1 + 0.09))  # over sqrt((1e600 + 9e598) / 2)
    for bad in (dict(block_size=0), dict(block_size=-64), dict(block2=0), dict(block_size=1.5)):
        with pytest.raises(ValueError, match="block"):
            C.nf4_bits_per_param(**bad)


_LLAMA_GQA = from_config(dict(model_type="llama", hidden_size=384, intermediate_size=1024, num_hidden_layers=3,
                              num_attention_heads=6, num_key_value_heads=2, vocab_size=2048,
                              max_position_embeddings=512, tie_word_embeddings=False), name="llama-gqa")
_OPT = dataclasses.replace(preset("opt-125m"), num_layers=2, vocab_size=2048, hidden_dropout=0.0, attention_dropout=0.0)


def _peft_measured(spec, targets, rank, **kw):
    """One real peft LoRA step on the CPU (4 x 128 tokens; tensor tracking of the CPU kernels)."""
    from peft import LoraConfig, get_peft_model

    from vramlab.measure.memory import measure_training

    tm = None if targets == "default" else targets
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return measure_training(spec, batch_size=4, seq_len=128, mode="cpu",
                                model_hook=lambda m: get_peft_model(m, LoraConfig(r=rank, target_modules=tm)), **kw)


@pytest.mark.slow
@pytest.mark.parametrize("which, targets, rank", [("gpt2", "all-linear", 64), ("llama", "all-linear", 64),
                                                  ("llama", "default", 16), ("opt", "all-linear", 32)])
def test_lora_on_a_bf16_base_keeps_fp32_adapters_as_peft_does(which, targets, rank):
    """A LoRA base loaded in bf16 with peft's default fp32 adapters (autocast_adapter_dtype),
    no autocast: each adapter casts its input to fp32 and keeps that copy. Measured: a real peft step
    on the CPU (tensor tracking), families and ranks the lab does not use; adapters and their Adam
    states in fp32, exactly."""
    spec = {"gpt2": _GPT, "llama": _LLAMA_GQA, "opt": _OPT}[which]
    meas = _peft_measured(spec, targets, rank, precision="bf16")
    est = C.peft_training(spec, rank=rank, targets=targets, batch_size=4, seq_len=128, precision="bf16",
                          device="cpu", autocast=False)
    n = C.lora_params(spec, rank=rank, targets=targets)
    assert est.parameters == meas.breakdown.parameters == 2 * (spec.params) + 4 * n  # bf16 base, fp32 adapters
    assert abs(est.total - meas.breakdown.total) <= 0.05 * meas.breakdown.total, (est.total, meas.breakdown.total)
    assert not est.warning


def test_lora_under_bf16_mixed_says_its_base_is_fp32():
    """Bf16-mixed LoRA holds the frozen base in fp32 (GPT-3-size: 650 GiB of parameters);
    the estimate says so and what to do."""
    m = C.peft_training("llama-3.1-8b", method="lora", precision="bf16-mixed", batch_size=1, seq_len=512)
    assert m.parameters >= 4 * preset("llama-3.1-8b").params and "precision='bf16'" in m.warning
    assert "WARNING" in m.table()
    bf16 = C.peft_training("llama-3.1-8b", method="lora", precision="bf16", batch_size=1, seq_len=512)
    assert bf16.total < 0.5 * m.total and not bf16.warning
    with pytest.raises(ValueError, match="adapter dtype"):
        C.peft_training("gpt2", precision="bf16", adapter_dtype="fp8", batch_size=1, seq_len=8)


def test_sparse24_keeps_half_and_a_nibble_per_four():
    """2:4 semi-structured storage: the kept half of the values and 4 bits of metadata per group of
    four (two 2-bit positions), 56.25 % of a 16-bit matrix; rows must group in fours."""
    assert C.sparse24_bytes(4096, 4096) == 4096 * 2048 * 2 + 4096 * 4096 // 8
    assert C.sparse24_bytes(8, 16) / (2 * 8 * 16) == pytest.approx(0.5625)
    with pytest.raises(ValueError, match="divide by 4"):
        C.sparse24_bytes(8, 6)


@pytest.mark.slow
@pytest.mark.parametrize("which, targets, rank", [("gpt2", "default", 16), ("gpt2", "all-linear", 64),
                                                  ("llama", "default", 16), ("llama", "all-linear", 64),
                                                  ("opt", "default", 16), ("opt", "all-linear", 64)])
def test_lora_with_gradient_checkpointing_against_a_cpu_measurement(which, targets, rank):
    """LoRA with every block checkpointed (recompute="full", as QLoRA trained its 65 B
    model) against a real peft step on the CPU (tensor tracking, not a GPU), on three families the
    lab does not use, ranks up to 64. A checkpointed block keeps its input; its adapters' tensors
    exist while it is recomputed; the recomputed block's backward holds the block's backward
    temporaries too (memory.training_phases counted only its input gradient until this test).
    The adapters' gradients of the blocks whose backward has run are held at that moment."""
    spec = {"gpt2": _GPT, "llama": _LLAMA_GQA, "opt": _OPT}[which]
    meas, plain = _peft_measured(spec, targets, rank, recompute="full"), _peft_measured(spec, targets, rank)
    est = C.peft_training(spec, rank=rank, targets=targets, batch_size=4, seq_len=128, device="cpu", recompute="full")
    assert meas.breakdown.activations < 0.6 * plain.breakdown.activations  # the effect exists here
    assert abs(est.total - meas.breakdown.total) <= 0.05 * meas.breakdown.total, (est.total, meas.breakdown.total)
    assert est.total < C.peft_training(spec, rank=rank, targets=targets, batch_size=4, seq_len=128, device="cpu").total


def test_qlora_65b_fits_48_gb_with_gradient_checkpointing():
    """QLoRA's headline (Dettmers+23): LLaMA-65B fine-tuned on one 48 GB GPU (48 GiB: an RTX A6000
    shows 49,140 MiB), NF4 base, LoRA r = 64 on every linear layer, gradient checkpointing. Without
    recompute a 2,048-token sequence does not fit; with it, it does (paged optimizers, which QLoRA
    adds for the spikes, are not modelled)."""
    spec = from_config(dict(model_type="llama", hidden_size=8192, intermediate_size=22016, num_hidden_layers=80,
                            num_attention_heads=64, num_key_value_heads=64, vocab_size=32000,
                            max_position_embeddings=2048, tie_word_embeddings=False), name="llama-65b")
    kw = dict(method="qlora", rank=64, targets="all-linear", batch_size=1, seq_len=2048, optimizer_impl="for-loop")
    assert C.peft_training(spec, **kw).total > 48 * 2**30
    assert C.peft_training(spec, recompute="full", **kw).total < 48 * 2**30
    with pytest.raises(ValueError, match="recompute|plan"):
        C.peft_training(spec, recompute="bogus", **kw)
