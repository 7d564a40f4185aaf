"""Mixture-of-experts specs: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and DeepSeek-V2/V3
read from their configs, with parameter counts equal to sum(p.numel()) of the transformers model built on
the meta device, and active parameters equal to what one token's forward touches (the experts its router
picks, read from the module tree during a real CPU forward). The KV cache: tests/test_moe.py."""

import dataclasses
import json
import random

import pytest

from vramlab import moe, specs
from vramlab.specs import SpecError, from_config, moe_preset_names, preset, preset_names

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

PRESET_DIR = specs._preset_dir()


def _hf_model(cfg, device="meta"):
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(cfg)


def _published(name: str):
    """The transformers config object of a preset's stored config.json, read by transformers itself."""
    d = json.loads((PRESET_DIR / f"{name}.json").read_text())
    return transformers.AutoConfig.for_model(d.pop("model_type"), **d)


def _same_tensors(spec, model):
    real = [(n, p.numel()) for n, p in model.named_parameters()]
    mine = spec.param_tensors()
    assert [n for _, n in mine] == [n for _, n in real], spec.model_type
    assert all(r.endswith(m) for (m, _), (r, _) in zip(mine, real)), [(m, r) for (m, _), (r, _) in zip(mine, real)
                                                                       if not r.endswith(m)][:3]
    assert sum(n for _, n in mine) == spec.params == sum(n for _, n in real)
    assert [s for _, s in spec.param_shapes()] == [tuple(p.shape) for _, p in model.named_parameters()]


# --- the real models, at their published shapes ------------------------------------------------

def test_moe_presets_are_apart_from_the_dense_ones():
    """Every calculator iterates over preset_names() and does not model MoE yet: the six stay out."""
    assert set(moe_preset_names()) == {"mixtral-8x7b", "qwen1.5-moe-a2.7b", "qwen3-30b-a3b", "olmoe-1b-7b",
                                       "deepseek-v2-lite", "deepseek-v3"}
    assert not set(moe_preset_names()) & set(preset_names())
    assert all(preset(n).is_moe for n in moe_preset_names()) and not any(preset(n).is_moe for n in preset_names())
    for name in preset_names():  # a dense model is what it was: no MoE key reaches its config
        spec = preset(name)
        assert spec.active_params == spec.params and spec.moe_layer_ids == () and not spec.is_mla


@pytest.mark.parametrize("name", moe_preset_names())
def test_moe_preset_params_exact(name):
    """The preset's config.json, read by transformers and built on the meta device, holds exactly the
    tensors the spec names, in named_parameters() order."""
    spec = preset(name)
    _same_tensors(spec, _hf_model(_published(name)))
    assert from_config(spec.to_hf_config(), name=name) == spec


@pytest.mark.parametrize("name, total, active, rel", [
    ("mixtral-8x7b", 46.7e9, 12.9e9, 0.005),  # Mistral AI: 46.7B total, 12.9B active
    ("deepseek-v3", 671e9, 37e9, 0.02),  # DeepSeek-V3 report: 671B total, 37B activated
    ("qwen1.5-moe-a2.7b", 14.3e9, 2.7e9, 0.01),  # Qwen blog: 14.3B total, 2.7B activated
    ("qwen3-30b-a3b", 30.5e9, 3.3e9, 0.02),  # Qwen3 report: 30.5B total, 3.3B activated
    ("olmoe-1b-7b", 6.9e9, 1.3e9, 0.02),  # OLMoE paper: 6.9B total, 1.3B active
])
def test_published_sizes(name, total, active, rel):
    spec = preset(name)
    assert abs(spec.params - total) / total < rel
    assert abs(spec.active_params - active) / active < rel
    assert moe.active_params(name) == spec.active_params


def test_deepseek_v2_lite_size():
    # DeepSeek-V2 paper: 15.7B total, "2.4B activated" without saying what it counts. vramlab counts the
    # embedding and head whole (2.66B), as Mixtral's and Qwen's authors do; less the input embedding
    # (0.21B) it is 2.45B, which rounds down to their figure
    spec = preset("deepseek-v2-lite")
    assert abs(spec.params - 15.7e9) / 15.7e9 < 0.005
    assert 2.4e9 < spec.active_params - spec.vocab_size * spec.hidden_size < 2.5e9


# --- configs of sizes never tried: random, but each built by transformers itself --------------

def _rand_moe_configs(seed: int):
    r = random.Random(seed)
    heads = r.choice([2, 4])
    kv = r.choice([k for k in (1, 2, heads) if heads % k == 0])
    h = heads * r.choice([8, 16])
    L, V, I, Ie = r.randint(2, 4), r.randint(64, 300), r.choice([24, 40]), r.choice([8, 12, 16])
    E = r.choice([4, 8])
    k = r.randint(1, 3)
    b, tie = r.random() < 0.5, r.random() < 0.3
    qwen = dict(moe_intermediate_size=Ie, num_experts=E, num_experts_per_tok=k, decoder_sparse_step=r.choice([1, 2]),
                mlp_only_layers=r.sample(range(L), r.randint(0, 1)))
    common = dict(hidden_size=h, num_attention_heads=heads, num_hidden_layers=L, vocab_size=V, intermediate_size=I,
                  tie_word_embeddings=tie)
    groups = r.choice([1, 2])
    mla = dict(moe_intermediate_size=Ie, n_routed_experts=E, num_experts_per_tok=k, n_shared_experts=r.randint(1, 2),
               first_k_dense_replace=r.randint(0, 2), kv_lora_rank=r.choice([8, 16]), q_lora_rank=r.choice([None, 12]),
               qk_nope_head_dim=r.choice([4, 8]), qk_rope_head_dim=r.choice([2, 4]), v_head_dim=r.choice([4, 6]),
               attention_bias=b)
    return [
        transformers.MixtralConfig(**common, num_key_value_heads=kv, num_local_experts=E, num_experts_per_tok=k,
                                   head_dim=r.choice([None, 12])),
        transformers.Qwen2MoeConfig(**common, num_key_value_heads=kv, shared_expert_intermediate_size=r.choice([16, 20]),
                                    qkv_bias=b, **qwen),
        transformers.Qwen3MoeConfig(**common, num_key_value_heads=kv, head_dim=r.choice([8, 24]), attention_bias=b, **qwen),
        transformers.OlmoeConfig(**common, num_key_value_heads=kv, num_experts=E, num_experts_per_tok=k, attention_bias=b),
        transformers.DeepseekV2Config(**common, **mla, mlp_bias=not b,
                                      topk_method="group_limited_greedy" if groups > 1 else "greedy",
                                      n_group=groups, topk_group=1),
        transformers.DeepseekV3Config(**common, **mla, num_key_value_heads=heads, n_group=groups,
                                      topk_group=r.randint(1, groups)),
    ]


@pytest.mark.parametrize("seed", range(3))
def test_unseen_moe_configs_exact(seed):
    for cfg in _rand_moe_configs(seed):
        spec = from_config(cfg)
        _same_tensors(spec, _hf_model(cfg))
        # read back from a config.json, as the CLI does
        assert from_config(json.loads(cfg.to_json_string())) == dataclasses.replace(spec, name=spec.model_type)
        # and written back: to_hf_config builds the same model
        back = spec.to_hf_config()
        assert from_config(back, name=spec.name) == spec
        _same_tensors(spec, _hf_model(transformers.AutoConfig.for_model(back.pop("model_type"), **back)))


def test_what_if_replace_rebuilds():
    """dataclasses.replace on an MoE preset is a model transformers builds, counted exactly."""
    small = {"num_layers": 4, "hidden_size": 64, "vocab_size": 500, "intermediate_size": 96}
    v3 = dataclasses.replace(preset("deepseek-v3"), num_heads=4, num_kv_heads=4, num_experts=16,
                             moe_intermediate_size=32, kv_lora_rank=32, q_lora_rank=24, **small)
    qwen = dataclasses.replace(preset("qwen1.5-moe-a2.7b"), num_heads=4, num_kv_heads=2, head_dim=16, num_experts=6,
                               moe_intermediate_size=16, shared_expert_intermediate_size=48, moe_layer_step=2,
                               dense_layer_ids=(3,), **small)
    for spec in (v3, qwen):
        back = spec.to_hf_config()
        _same_tensors(spec, _hf_model(transformers.AutoConfig.for_model(back.pop("model_type"), **back)))
    assert qwen.moe_layer_ids == (1,)
    with pytest.raises(SpecError, match="replace them together"):
        dataclasses.replace(preset("mixtral-8x7b"), moe_intermediate_size=1000)
    # MLA makes keys and values for every head: a config's num_key_value_heads (V3's default 128) shapes nothing
    assert from_config({"model_type": "deepseek_v3", "hidden_size": 64, "num_attention_heads": 4}).num_kv_heads == 4


# --- active parameters: what one token's forward touches, read from the module tree ------------

def _touched(model, input_ids) -> tuple[int, int]:
    """Parameters one token's forward touches, counted from the modules: every tensor outside the
    routed experts, plus, in each experts module the forward calls, the slices [e] of the experts e
    its router picked. Returns (count, how many experts modules ran)."""
    picked = []

    def hook(module, args, kwargs):
        picked.append((module, set(args[1].flatten().tolist())))

    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in experts]
    try:
        with torch.no_grad():
            model(input_ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    expert_tensors = {id(p) for m in experts for p in m.parameters()}
    count = sum(p.numel() for p in model.parameters() if id(p) not in expert_tensors)
    for module, chosen in picked:
        per_expert = sum(p[0].numel() for p in module.parameters())  # each tensor is [num_experts, ...]
        count += len(chosen) * per_expert
    return count, len(picked)


@pytest.mark.parametrize("seed", range(2))
def test_active_params_are_what_a_token_touches(seed):
    torch.manual_seed(seed)
    for cfg in _rand_moe_configs(seed + 10):
        spec = from_config(cfg)
        model = _hf_model(cfg, device="cpu").eval()
        touched, ran = _touched(model, torch.randint(0, spec.vocab_size, (1, 1)))
        assert ran == len(spec.moe_layer_ids), spec.model_type
        assert touched == spec.active_params, (spec.model_type, touched, spec.active_params)


# --- what the calculators do with an MoE model: refuse it, in one line ---------------------------

def test_calculators_refuse_an_moe_model_in_one_line():
    from vramlab import memory

    for model in ("mixtral-8x7b", preset("deepseek-v3")):
        # model states count every expert (one-device training is modelled: tests/test_moe_training.py)
        spec = model if isinstance(model, specs.ModelSpec) else preset(model)
        assert memory.model_states(model).parameters == 4 * spec.params
        with pytest.raises(ValueError, match="not modelled yet"):
            specs.resolve(model)
    assert specs.resolve("gpt2") == preset("gpt2")


@pytest.mark.parametrize("bad, match", [
    ({"model_type": "deepseek_v2", "hidden_size": 64, "num_attention_heads": 4}, "num_experts_per_tok: a deepseek_v2"),
    ({"model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 3}, "cannot exceed num_experts"),
    ({"model_type": "qwen3_moe", "mlp_only_layers": "0,1"}, "mlp_only_layers: expected a list"),
    ({"model_type": "qwen2_moe", "mlp_only_layers": [-1]}, r"dense_layer_ids\[0\]"),
    ({"model_type": "olmoe", "hidden_size": 64, "num_attention_heads": 4, "head_dim": 8}, "q_norm is hidden_size wide"),
    ({"model_type": "deepseek_v3", "n_routed_experts": 12, "n_group": 8}, "must divide num_experts"),
    ({"model_type": "deepseek_v3", "kv_lora_rank": 0}, "kv_lora_rank: expected a whole number from 1"),
    ({"model_type": "mixtral", "num_local_experts": "eight"}, "num_local_experts: expected a whole number"),
])
def test_bad_moe_configs(bad, match):
    with pytest.raises(SpecError, match=match):
        from_config(bad)


def test_fields_a_model_type_cannot_build_are_refused():
    with pytest.raises(SpecError, match="describes a mixture of experts"):
        dataclasses.replace(preset("llama-3.2-1b"), num_experts=8)
    with pytest.raises(SpecError, match="qwen3_moe model always has num_shared_experts=0"):
        dataclasses.replace(preset("qwen3-30b-a3b"), num_shared_experts=1)
    with pytest.raises(SpecError, match="moe_layer_step must be a whole number from 1"):
        dataclasses.replace(preset("qwen3-30b-a3b"), moe_layer_step=0)
