"""vramlab.moe: where an MoE model's parameters sit, by role, against the tensors of the transformers model;
and its KV cache per token against what transformers' own cache holds after a CPU forward with
use_cache=True (DeepSeek: the multi-head latent attention latent, not 2 x heads x head_dim)."""

import random

import pytest

from vramlab import moe
from vramlab.specs import from_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

from .test_moe_specs import _hf_model, _rand_moe_configs  # noqa: E402


def test_param_breakdown_matches_the_module_tree():
    """Each role's count equals the tensors of that role in the real model (DeepSeek-V3 and Qwen2-MoE:
    MLA, shared experts, their gate, dense first layers)."""
    roles = {"router": lambda n: n.endswith("mlp.gate.weight"), "routed_experts": lambda n: ".experts." in n,
             "shared_experts": lambda n: ".shared_expert" in n, "embeddings": lambda n: "embed_tokens" in n,
             "attention": lambda n: ".self_attn." in n, "head": lambda n: n.startswith("lm_head")}
    for cfg in _rand_moe_configs(4):
        spec = from_config(cfg)
        parts = moe.param_breakdown(spec)
        named = list(_hf_model(cfg).named_parameters())
        for role, test in roles.items():
            assert parts[role] == sum(p.numel() for n, p in named if test(n)), (spec.model_type, role)
        assert sum(parts.values()) == spec.params
    with pytest.raises(ValueError, match="dense"):
        moe.param_breakdown("gpt2")


# --- the KV cache: what transformers' cache holds after a forward --------------------------------

def _cache_bytes(model, input_ids) -> int:
    with torch.no_grad():
        out = model(input_ids, use_cache=True)
    layers = out.past_key_values.layers
    assert len(layers) == model.config.num_hidden_layers
    return sum(t.numel() * t.element_size() for layer in layers for t in (layer.keys, layer.values))


@pytest.mark.parametrize("seed", range(2))
def test_kv_cache_is_what_transformers_caches(seed):
    """A tiny CPU model, fp32, a prefill of batch x seq tokens with use_cache=True: the cache's bytes.
    DeepSeek's attention caches the latent (kv_a_layernorm's output) and the rotated shared key,
    as one-head tensors; the others, K and V of their kv heads."""
    r = random.Random(seed)
    for cfg in _rand_moe_configs(seed + 20):
        spec = from_config(cfg)
        b, s = r.randint(1, 3), r.randint(2, 7)
        measured = _cache_bytes(_hf_model(cfg, device="cpu").eval(), torch.randint(0, spec.vocab_size, (b, s)))
        assert measured == moe.kv_cache_bytes(spec, batch_size=b, seq_len=s, dtype="fp32"), spec.model_type
        if spec.is_mla:
            assert moe.kv_cache_bytes(spec, batch_size=b, seq_len=s, dtype="fp32", layout="latent") == measured
            assert measured == 4 * b * s * spec.num_layers * (spec.kv_lora_rank + spec.qk_rope_head_dim)
        else:
            with pytest.raises(ValueError, match="latent attention"):
                moe.kv_cache_bytes(spec, batch_size=b, seq_len=s, layout="latent")


def test_expanded_mla_cache_is_the_per_head_keys_and_values():
    """'expanded': the keys and values DeepSeek's attention rebuilds from the latent for every head
    (what transformers 4.x cached), measured from expand_kv's outputs during a forward."""
    for cfg in _rand_moe_configs(5)[4:]:
        spec = from_config(cfg)
        model = _hf_model(cfg, device="cpu").eval()
        sizes = []
        for layer in model.model.layers:
            attn = layer.self_attn

            def spy(kv_nope, k_rot, _orig=attn.expand_kv):
                k, v = _orig(kv_nope, k_rot)
                sizes.append(k.numel() + v.numel())
                return k, v
            attn.expand_kv = spy
        b, s = 2, 3
        with torch.no_grad():
            model(torch.randint(0, spec.vocab_size, (b, s)), use_cache=True)
        assert sum(sizes) == b * s * moe.kv_cache_elements_per_token(spec, "expanded")
        assert moe.kv_cache_elements_per_token(spec, "expanded") > moe.kv_cache_elements_per_token(spec, "latent")


def test_kv_cache_of_the_real_models():
    # DeepSeek-V3, bf16: 61 layers x (512 + 64) x 2 bytes a token as a latent; 128 heads x (192 + 128) expanded
    assert moe.kv_cache_bytes("deepseek-v3", batch_size=1, seq_len=1) == 61 * 576 * 2 == 70_272
    assert moe.kv_cache_bytes("deepseek-v3", batch_size=1, seq_len=1, layout="expanded") == 61 * 128 * 320 * 2
    # Mixtral: grouped-query attention, 8 kv heads of 128
    assert moe.kv_cache_bytes("mixtral-8x7b", batch_size=2, seq_len=10) == 2 * 32 * 8 * 128 * 2 * 20
    with pytest.raises(ValueError, match="reads at most"):
        moe.kv_cache_bytes("olmoe-1b-7b", batch_size=1, seq_len=5000)
    with pytest.raises(ValueError, match="unknown layout"):
        moe.kv_cache_bytes("deepseek-v3", batch_size=1, seq_len=1, layout="paged")
    assert "68.62 KiB" in moe.describe("deepseek-v3")


def test_expert_capacity_rounds_up_and_is_bounded():
    """GShard/Switch capacity: ceil(cf x tokens x top_k / experts), at least min_capacity, at most the
    tokens (an expert sees each token once); dropless (None) is the worst case, every token."""
    from vramlab.moe import expert_capacity
    assert expert_capacity(4096, 8, 2, 1.25) == 1280  # 1.25 x 4096 x 2 / 8
    assert expert_capacity(100, 8, 1, 1.0) == 13  # 12.5 rounds up
    assert expert_capacity(100, 8, 1, 0.16) == 2  # 0.16 x 100 / 8 = 2 exactly, not 3 from float error
    assert expert_capacity(10, 64, 6, 1.0) == 1 and expert_capacity(10, 64, 6, 1.0, min_capacity=4) == 4
    assert expert_capacity(10, 2, 2, 4.0) == 10 and expert_capacity(4096, 8, 2, None) == 4096
    for bad in [(0, 8, 2, 1.0), (10, 8, 9, 1.0), (10, 8, 2, 0), (10, 8, 2, "x"), (10, 8, 2, float("nan"))]:
        with pytest.raises(ValueError) as e:
            expert_capacity(*bad)
        assert "\n" not in str(e.value)
