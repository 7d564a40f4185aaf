"""Mixture-of-experts TRAINING memory (issue 33, part 3): `estimate_training` for MoE models against
an independent trace-mode measurement of the real transformers model (FakeTensorMode: every tensor's
storage counted by the tracker), dropless as transformers runs its experts, and drop-and-pad with a
capacity factor (`vramlab.measure.moe.DropAndPadExperts` swapped into the same model). The shapes are
small and not the presets', chosen so that the step's peak is where the saved activations are all
alive (backward start), so that the activations category checks the ledger itself."""

import dataclasses

import pytest

from vramlab import estimate_training, moe
from vramlab.memory import training_phases
from vramlab.specs import preset

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
torch.set_num_threads(1)

from vramlab.measure.memory import measure_training  # noqa: E402


def _small(name, **kw):
    base = dict(num_layers=3, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32, vocab_size=2048)
    return dataclasses.replace(preset(name), **{**base, **kw})


# top-2 of 4 experts (fewer than top-k x 4); Qwen2-MoE with a shared expert and its gate, top-4 of 16;
# Qwen3-MoE's per-head q/k norms; OLMoE top-1 of 16 (more than top-k x 4), its q/k norms over the projection
MIXTRAL = _small("mixtral-8x7b", num_experts=4, num_experts_per_tok=2, intermediate_size=256, moe_intermediate_size=256)
QWEN2 = _small("qwen1.5-moe-a2.7b", num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64,
               shared_expert_intermediate_size=192, intermediate_size=256)
QWEN3 = _small("qwen3-30b-a3b", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96, intermediate_size=256)
OLMOE = _small("olmoe-1b-7b", num_kv_heads=4, num_experts=16, num_experts_per_tok=1, intermediate_size=64,
               moe_intermediate_size=64)
# DeepSeek-V3: one dense first layer, multi-head latent attention (with and without q's low rank), sigmoid
# routing limited to 1 of 2 expert groups, one shared expert; v_head_dim = qk head width, so that the CPU's
# SDPA takes its fused kernel as CUDA's memory-efficient one does
DEEPSEEK = _small("deepseek-v3", num_kv_heads=4, head_dim=48, qk_rope_head_dim=16, v_head_dim=48, kv_lora_rank=64,
                  q_lora_rank=0, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, intermediate_size=256,
                  first_dense_layers=1, num_shared_experts=1, num_expert_groups=2, topk_expert_groups=1)
DEEPSEEK_QLORA = dataclasses.replace(DEEPSEEK, q_lora_rank=48)

# (spec, batch, seq_len, precision, recompute, capacity_factor, check the activations category)
CASES = [
    (MIXTRAL, 4, 256, "fp32", "none", None, True),
    (QWEN2, 2, 256, "bf16-mixed", "none", None, True),
    (QWEN3, 2, 256, "fp32", "none", None, True),
    (MIXTRAL, 4, 256, "fp32", "none", 1.25, True),  # buffers larger than the tokens routed: padding
    (OLMOE, 8, 256, "fp32", "none", 1.0, True),  # top-1 of 16 at capacity 1.0: choices dropped
    (OLMOE, 8, 256, "bf16-mixed", "none", 1.25, True),
    (DEEPSEEK, 2, 256, "fp32", "none", None, True),
    (DEEPSEEK_QLORA, 2, 256, "bf16-mixed", "none", None, True),
    (DEEPSEEK_QLORA, 2, 256, "fp32", "none", 1.0, True),
    (MIXTRAL, 4, 256, "bf16", "none", None, True),  # pure bf16: the experts' grouped_mm in bf16
    # full recompute: the peak moves into a recomputed block's backward; its total is checked, not its
    # split between activations and gradients (see the module docstring of vramlab.moe's ledger)
    (MIXTRAL, 4, 256, "bf16-mixed", "full", None, False),
    (QWEN3, 2, 256, "bf16-mixed", "full", 1.0, False),
    (DEEPSEEK, 2, 256, "bf16-mixed", "full", None, False),
]
PEAK_TOLERANCE, ACT_TOLERANCE = 0.03, 0.05


def _id(case):
    spec, b, s, p, r, cf, _ = case
    return f"{spec.model_type}-b{b}-s{s}-{p}-{r}-cf{cf}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_estimate_matches_the_trace(case):
    spec, b, s, precision, recompute, cf, check_act = case
    measured = measure_training(spec, batch_size=b, seq_len=s, precision=precision, recompute=recompute, mode="trace",
                                capacity_factor=cf).breakdown
    est = estimate_training(spec, batch_size=b, seq_len=s, precision=precision, recompute=recompute, device="cpu",
                            capacity_factor=cf)
    where = _id(case)
    assert est.parameters == measured.parameters, where  # every expert's weights
    assert abs(est.total / measured.total - 1) < PEAK_TOLERANCE, (where, est.to_dict(), measured.to_dict())
    if check_act:
        assert abs(est.activations / measured.activations - 1) < ACT_TOLERANCE, (where, est.activations,
                                                                                 measured.activations)


def test_the_capacity_cases_are_the_regimes_they_claim():
    """cf=1.0 top-1 of 16 over 2048 tokens: 128 rows an expert, fewer than some expert gets from a random
    router (so choices drop); cf=1.25 for Mixtral's top-2 of 4: 640 rows, more than 512 on average."""
    assert moe.expert_capacity(2048, 16, 1, 1.0) == 128
    assert moe.expert_capacity(1024, 4, 2, 1.25) == 640 > 1024 * 2 // 4


def test_capacity_changes_the_estimate_the_way_the_buffers_do():
    dropless = estimate_training(MIXTRAL, batch_size=4, seq_len=256, device="cpu")
    padded = estimate_training(MIXTRAL, batch_size=4, seq_len=256, device="cpu", capacity_factor=1.25)
    tight = estimate_training(MIXTRAL, batch_size=4, seq_len=256, device="cpu", capacity_factor=0.5)
    assert tight.activations < dropless.activations < padded.activations
    # the ledger's routed rows: E x C with a capacity, tokens x top-k without
    per_layer = {cf: moe.training_layer_saved(MIXTRAL, layer=0, tokens=1024, capacity_factor=cf) for cf in (None, 1.25)}
    assert per_layer[None]["each row's token copy (grouped gate_up input)"] == 2048 * 128 * 4
    assert per_layer[1.25]["expert buffers (E x C x h, bmm input)"] == 4 * 640 * 128 * 4


@pytest.mark.parametrize("bad", [0, -1.0, "1.0", float("nan"), float("inf"), True])
def test_bad_capacity_factor_is_one_line(bad):
    with pytest.raises(ValueError, match="capacity_factor") as err:
        estimate_training(MIXTRAL, batch_size=1, seq_len=16, capacity_factor=bad)
    assert "\n" not in str(err.value)


def test_a_dense_model_with_a_capacity_factor_is_refused():
    with pytest.raises(ValueError, match="capacity_factor applies to a mixture of experts") as err:
        estimate_training("llama-3.2-1b", batch_size=1, seq_len=16, capacity_factor=1.0)
    assert "\n" not in str(err.value)
    assert estimate_training("llama-3.2-1b", batch_size=1, seq_len=16, capacity_factor=None).total > 0


def test_refusals_are_one_line():
    for call in (lambda: estimate_training("deepseek-v2-lite", batch_size=1, seq_len=16),
                 lambda: estimate_training(MIXTRAL, batch_size=1, seq_len=16, recompute="sac-matmuls")):
        with pytest.raises(ValueError) as err:
            call()
        assert "\n" not in str(err.value)


def test_the_real_presets_are_estimated():
    """Every modelled MoE preset at its published size (DeepSeek-V2's router and rotary attention aside)."""
    for name in ("mixtral-8x7b", "qwen1.5-moe-a2.7b", "qwen3-30b-a3b", "olmoe-1b-7b", "deepseek-v3"):
        for recompute in ("none", "full"):
            forward_end = training_phases(name, batch_size=1, seq_len=4096, precision="bf16-mixed", recompute=recompute)[0]
            assert forward_end.parameters == 4 * preset(name).params and forward_end.activations > 0
        full = training_phases(name, batch_size=1, seq_len=4096, recompute="full")[0].activations
        assert full < training_phases(name, batch_size=1, seq_len=4096)[0].activations


def test_model_states_count_every_expert():
    est = estimate_training("mixtral-8x7b", batch_size=1, seq_len=16, precision="bf16-mixed")
    assert est.parameters == 4 * preset("mixtral-8x7b").params  # 46.7B, not the 12.9B active
    assert est.optimizer_states == 8 * preset("mixtral-8x7b").params
