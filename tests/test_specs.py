"""Parameter counts must equal sum(p.numel()) of the real transformers model, built offline on the
meta device (no memory, no download), for the presets and for configs of unseen sizes. The families'
tensors, name by name, are tests/test_weights.py's."""

import dataclasses
import json
import random

import pytest

from vramlab import fitting, specs
from vramlab.specs import SpecError, from_config, gpu, preset, preset_names

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from vramlab.measure.models import build_model, count_parameters  # noqa: E402


def real_count(spec) -> int:
    return count_parameters(build_model(spec, device="meta"))


def test_required_presets_exist():
    for name in ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "bert-base", "bert-large", "mt5-base",
                 "llama-3.1-8b", "llama-3.1-70b", "mistral-7b", "qwen2.5-7b"]:
        assert name in preset_names()


# --- configs of sizes never tried: random, but each built by transformers itself --------------

def _rand_configs(seed: int):
    r = random.Random(seed)
    heads = r.choice([2, 4, 8])
    h = heads * r.choice([8, 16, 24])
    kv = r.choice([k for k in (1, 2, heads) if heads % k == 0])
    L, V, I = r.randint(1, 3), r.randint(100, 900), r.choice([32, 48, 96, 112])
    b = r.random() < 0.5
    return [
        transformers.GPT2Config(n_embd=h, n_head=heads, n_layer=L, vocab_size=V, n_positions=r.randint(16, 200),
                                n_inner=r.choice([None, I]), tie_word_embeddings=b),
        transformers.GPTNeoXConfig(hidden_size=h, num_attention_heads=heads, num_hidden_layers=L, vocab_size=V,
                                   intermediate_size=I, attention_bias=b, tie_word_embeddings=not b),
        transformers.OPTConfig(hidden_size=h, num_attention_heads=heads, num_hidden_layers=L, vocab_size=V, ffn_dim=I,
                               max_position_embeddings=r.randint(16, 200), enable_bias=b,
                               word_embed_proj_dim=r.choice([h, h // 2]), layer_norm_elementwise_affine=r.random() < 0.7),
        transformers.LlamaConfig(hidden_size=h, num_attention_heads=heads, num_key_value_heads=kv, num_hidden_layers=L,
                                 vocab_size=V, intermediate_size=I, attention_bias=b, mlp_bias=not b,
                                 tie_word_embeddings=r.random() < 0.5, head_dim=r.choice([None, 16])),
        transformers.MistralConfig(hidden_size=h, num_attention_heads=heads, num_key_value_heads=kv, num_hidden_layers=L,
                                   vocab_size=V, intermediate_size=I, head_dim=h // heads),
        transformers.Qwen2Config(hidden_size=h, num_attention_heads=heads, num_key_value_heads=kv, num_hidden_layers=L,
                                 vocab_size=V, intermediate_size=I, tie_word_embeddings=b),
        transformers.BertConfig(hidden_size=h, num_attention_heads=heads, num_hidden_layers=L, vocab_size=V,
                                intermediate_size=I, type_vocab_size=r.randint(1, 3), max_position_embeddings=64),
        transformers.T5Config(d_model=h, d_kv=r.choice([8, 16]), num_heads=heads, num_layers=L,
                              num_decoder_layers=r.randint(1, 3), d_ff=I, vocab_size=V,
                              feed_forward_proj=r.choice(["relu", "gated-gelu"]),
                              relative_attention_num_buckets=r.choice([8, 32])),
        transformers.MT5Config(d_model=h, d_kv=16, num_heads=heads, num_layers=L, d_ff=I, vocab_size=V),
    ]


def _hf_model(cfg):
    auto = {"bert": transformers.AutoModelForMaskedLM, "t5": transformers.AutoModelForSeq2SeqLM,
            "mt5": transformers.AutoModelForSeq2SeqLM}.get(cfg.model_type, transformers.AutoModelForCausalLM)
    with torch.device("meta"):
        return auto.from_config(cfg)


@pytest.mark.parametrize("seed", range(6))
def test_unseen_configs_exact(seed):
    for cfg in _rand_configs(seed):
        expected = sum(p.numel() for p in _hf_model(cfg).parameters())
        assert from_config(cfg).params == expected, (cfg.model_type, cfg.to_dict())
        # the same config read back from a config.json, as the CLI does
        assert from_config(json.loads(cfg.to_json_string())).params == expected


def test_config_json_path(tmp_path):
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=2, vocab_size=300, intermediate_size=96)
    cfg.save_pretrained(tmp_path)
    spec = from_config(tmp_path / "config.json")
    assert spec.params == sum(p.numel() for p in _hf_model(cfg).parameters())
    assert from_config(tmp_path).params == spec.params  # a folder works too


def test_what_if_replace_rebuilds():
    spec = dataclasses.replace(preset("gpt2"), num_layers=3, hidden_size=128, num_heads=4, num_kv_heads=4,
                               head_dim=32, intermediate_size=512)
    assert spec.params == real_count(spec)
    with pytest.raises(SpecError, match="replace them together"):
        dataclasses.replace(preset("gpt2"), num_heads=4)


@pytest.mark.parametrize("bad, match", [
    ({"model_type": "gpt2", "n_embd": 100, "n_head": 12}, "divide"),
    ({"model_type": "llama", "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 4}, "multiple"),
    ({"model_type": "mamba"}, "unsupported model_type"),
    ({"n_embd": 10}, "unsupported model_type"),
    ({"model_type": "bert", "num_hidden_layers": 0}, "num_hidden_layers: expected a whole number from 1"),
    ({"model_type": "gpt2", "n_embd": "wide"}, "n_embd: expected a whole number .* got 'wide'"),
])
def test_bad_configs(bad, match):
    with pytest.raises(SpecError, match=match):
        from_config(bad)


def test_bad_files(tmp_path):
    with pytest.raises(SpecError, match="cannot read"):
        from_config(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(SpecError, match="not valid JSON"):
        from_config(tmp_path / "x.json")


def test_gpu_catalogue():
    for name in ["t4", "rtx-3090", "rtx-4090", "a100-40gb", "a100-80gb", "h100", "h200", "gtx-1060-6gb"]:
        g = gpu(name)
        assert g.memory_bytes > 0 and g.bandwidth_GBps > 0 and g.peak_tflops_16 > 0
    assert gpu("A100-80GB") is specs.GPUS["a100-80gb"]
    assert gpu("h100").memory_bytes < 80 * 2**30 < gpu("h200").memory_bytes  # 80 GB (decimal) < 80 GiB
    with pytest.raises(SpecError, match="unknown GPU"):
        gpu("voodoo2")


def test_every_gpu_argument_takes_a_gpuspec_or_a_name():
    """specs.gpu passes a GPUSpec through, so every function with a `gpu` argument takes either:
    checkpointing.evaluate used to refuse a preset GPUSpec ("a GPU is named by a catalogue name")."""
    from vramlab import checkpointing, offload, specs

    h100 = specs.gpu("h100")
    assert specs.gpu(h100) is h100
    kw = dict(batch_size=1, seq_len=64)
    assert checkpointing.evaluate("gpt2", "full", gpu=h100, **kw) == checkpointing.evaluate("gpt2", "full", gpu="h100", **kw)
    assert fitting.fit("gpt2", h100, seq_len=64) == fitting.fit("gpt2", "h100", seq_len=64)
    assert offload.host_link_GBps(h100) == offload.host_link_GBps("h100")
    with pytest.raises(ValueError, match="custom_gpu"):
        fitting.fit("gpt2", 80, seq_len=64)


@pytest.mark.parametrize("device, memory, want", [
    ("Tesla T4", None, "t4"), ("NVIDIA A100-SXM4-40GB", None, "a100-40gb"), ("NVIDIA A100-SXM4-80GB", None, "a100-80gb"),
    ("NVIDIA A100 80GB PCIe", None, "a100-80gb"), ("NVIDIA A100-PCIE", 42_000_000_000, "a100-40gb"),
    ("NVIDIA H100 80GB HBM3", None, "h100-80gb"), ("NVIDIA H100 PCIe", None, "h100-80gb"), ("NVIDIA H200", None, "h200"),
    ("NVIDIA GeForce RTX 4090", None, "rtx-4090"), ("NVIDIA GeForce RTX 3090", None, "rtx-3090"),
    ("NVIDIA GeForce GTX 1060 6GB", None, "gtx-1060-6gb"), ("NVIDIA L4", None, None), ("NVIDIA A10G", None, None),
    ("NVIDIA RTX A6000", None, None), ("NVIDIA L40S", None, None)])
def test_gpu_for_device_reads_torchs_device_names(device, memory, want):
    """Lab 6 predicted every GPU as an H100 (a Colab T4's PCIe 3.0 is a quarter of its link);
    the device torch reports is looked up, and one the catalogue lacks is None, not a guess."""
    from vramlab.specs import gpu_for_device

    got = gpu_for_device(device, memory)
    assert (got.name if got else None) == want


def test_one_resolver_with_one_moe_policy():
    """specs.resolve is the only resolver: a name or a ModelSpec; a mixture of experts refused in one line by the
    dense-only calculators and passed with moe=True (one device's training, inference, `moe`, expert parallelism,
    serving), the same spec either way; the old per-module resolvers are gone."""
    import vramlab.activations as A
    import vramlab.memory as M
    import vramlab.moe as MOE
    import vramlab.step as STEP
    from vramlab.specs import preset, resolve

    with pytest.raises(ValueError, match="mixture of experts is not modelled yet by this calculator"):
        resolve("mixtral-8x7b")
    spec = resolve("mixtral-8x7b", moe=True)
    assert spec == preset("mixtral-8x7b") and resolve(spec, moe=True) is spec and spec.is_moe
    assert resolve("gpt2", moe=True) == resolve("gpt2") == preset("gpt2")
    with pytest.raises(ValueError, match="model must be a ModelSpec or a preset name, got 3"):
        resolve(3, moe=True)
    assert not any(hasattr(m, n) for m in (A, M, MOE, STEP) for n in ("resolve_moe", "_resolve_any", "inference_spec"))
