"""Mixture-of-experts TRAINING memory: `estimate_training` for MoE models against
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
# DeepSeek-V2 (transformers' DeepseekV2: softmax router, complex-number rotary): greedy top-2 of 8 ("greedy",
# n_group 1) without q's low rank; group-limited greedy top-3 of 16 in 2 of 4 groups with q's low rank; and
# V2-Lite's regime, top-6 with two shared experts, two dense first layers and experts narrower than the model
# (moe_intermediate_size < hidden_size): the backward of the routing weights' product (3 x tokens x top-k x h,
# fp32) outgrows the experts' own, where a block's backward peaks (full recompute)
DEEPSEEK_V2 = _small("deepseek-v2-lite", num_kv_heads=4, head_dim=48, qk_rope_head_dim=16, v_head_dim=48,
                     kv_lora_rank=64, q_lora_rank=0, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                     intermediate_size=256, first_dense_layers=1, num_shared_experts=1)
DEEPSEEK_V2_GROUPED = dataclasses.replace(DEEPSEEK_V2, num_experts=16, num_experts_per_tok=3, num_expert_groups=4,
                                          topk_expert_groups=2, q_lora_rank=48)
DEEPSEEK_V2_TOP6 = _small("deepseek-v2-lite", num_layers=4, hidden_size=96, num_heads=2, num_kv_heads=2, head_dim=96,
                          qk_rope_head_dim=32, v_head_dim=96, kv_lora_rank=48, q_lora_rank=0, num_experts=16,
                          num_experts_per_tok=6, moe_intermediate_size=32, intermediate_size=192, first_dense_layers=2,
                          num_shared_experts=2, vocab_size=1024)

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
    (DEEPSEEK_V2_GROUPED, 2, 256, "bf16-mixed", "none", None, True),
    (DEEPSEEK_V2_TOP6, 4, 256, "fp32", "none", None, True),
    (DEEPSEEK_V2_TOP6, 4, 256, "bf16-mixed", "none", 1.25, True),
    (DEEPSEEK_V2_GROUPED, 2, 256, "fp32", "none", 1.0, True),
    (DEEPSEEK_V2, 2, 256, "bf16-mixed", "full", None, False),
    (DEEPSEEK_V2_GROUPED, 2, 256, "bf16-mixed", "full", 1.0, False),
    (DEEPSEEK_V2_TOP6, 4, 256, "bf16", "full", None, False),  # peaks in the routing weights' backward
]
PEAK_TOLERANCE, ACT_TOLERANCE = 0.03, 0.05
# Under full recompute the one-device walk (memory.training_phases, "backward of a recomputed block") over-counts,
# on the safe side, the final norm's saved tensors (freed before any block's backward), a second incoming b x s x h
# gradient and the block's weight gradients not made yet (diagnosed byte for byte on a Llama-like block: the chapter's
# note). V2-Lite's top-6 shape in pure bf16, whose norms' fp32 copies are now counted, shows it: +3.3 %.
RECOMPUTE_PEAK_TOLERANCE = 0.04


def _id(case):
    spec, b, s, p, r, cf, _ = case
    return f"{spec.model_type}-b{b}-s{s}-{p}-{r}-cf{cf}"


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_estimate_matches_the_trace(case):
    spec, b, s, precision, recompute, cf, check_act = case
    measured = measure_training(spec, batch_size=b, seq_len=s, precision=precision, recompute=recompute, mode="trace",
                                capacity_factor=cf).breakdown
    est = estimate_training(spec, batch_size=b, seq_len=s, precision=precision, recompute=recompute, device="cpu",
                            capacity_factor=cf)
    where = _id(case)
    assert est.parameters == measured.parameters, where  # every expert's weights
    err = est.total / measured.total - 1
    assert -PEAK_TOLERANCE < err < (RECOMPUTE_PEAK_TOLERANCE if recompute == "full" else PEAK_TOLERANCE), \
        (where, err, est.to_dict(), measured.to_dict())
    if check_act:
        assert abs(est.activations / measured.activations - 1) < ACT_TOLERANCE, (where, est.activations,
                                                                                 measured.activations)


@pytest.mark.slow
@pytest.mark.parametrize("spec", [DEEPSEEK_V2, DEEPSEEK_V2_GROUPED], ids=["greedy", "group-limited"])
def test_deepseek_v2_in_pure_bf16_counts_the_norms_fp32_copies(spec):
    """Pure bf16: transformers' RMSNorm saves an fp32 copy of its 16-bit input; the Llama twin whose two norms
    per block (and the final one) `activations` borrows counts the 2-byte input, so the MLA branch adds
    (2L + 1) x tokens x h x 2 bytes: the ledger meets the trace within 1 %."""
    b, s = 2, 256
    measured = measure_training(spec, batch_size=b, seq_len=s, precision="bf16", mode="trace").breakdown
    est = estimate_training(spec, batch_size=b, seq_len=s, precision="bf16", device="cpu")
    assert abs(est.activations / measured.activations - 1) < 0.01, (est.activations, measured.activations)
    assert abs(est.total / measured.total - 1) < PEAK_TOLERANCE


def test_deepseek_v2_router_entries_follow_topk_method():
    """greedy (n_group 1): softmax and top-k indices; group-limited greedy: + each group's argmax, the chosen
    groups and the bool mask, T x (8G + 8 topk_group + E) bytes; pure 16 bits: + fp32 copies of the router's
    input and weight. No renormalisation (transformers' DeepseekV2TopkRouter has none)."""
    T = 1000
    greedy = moe.training_layer_saved(DEEPSEEK_V2, layer=1, tokens=T)
    grouped = moe.training_layer_saved(DEEPSEEK_V2_GROUPED, layer=1, tokens=T)
    assert greedy["router softmax (fp32)"] == T * 8 * 4 and greedy["top-k indices"] == T * 2 * 8
    assert "group max and top-group indices, expert mask" not in greedy
    assert grouped["group max and top-group indices, expert mask"] == T * (4 * 8 + 2 * 8 + 16)
    assert not any("renormalised" in name for name in grouped)
    pure = moe.training_layer_saved(DEEPSEEK_V2, layer=1, tokens=T, precision="bf16")
    assert pure["router's fp32 copies of its input and weight (pure 16-bit)"] == (T + 8) * 128 * 4
    # a dense first layer is a gated MLP, not a router
    assert "dense MLP: gate (act input), act(gate), up, down input" in moe.training_layer_saved(DEEPSEEK_V2, layer=0, tokens=T)


def test_the_weighting_backward_is_the_block_transient_where_experts_are_narrow():
    """V2-Lite's shape in pure bf16 (top-6, moe_intermediate_size 1408 < hidden 2048, fp32 routing weights): the
    routing weights' product's backward (3 x tokens x 6 x h, fp32) beats the experts' own (3 x rows x i + rows x h,
    bf16); both less the shared experts' saved tensors (freed first: DeepSeek adds their output last)."""
    spec, T = preset("deepseek-v2-lite"), 4096
    k, h, i, shared = 6, 2048, 1408, 2 * 1408
    freed = T * 4 * shared * 2
    got = moe.training_block_bytes(spec, layer=1, tokens=T, precision="bf16")
    assert got == 3 * T * k * h * 4 - freed > 3 * T * k * i * 2 + T * k * h * 2 - freed
    # Mixtral's wide experts (14336 > 4096): the experts' own backward stays the larger
    assert moe.training_block_bytes("mixtral-8x7b", layer=0, tokens=T, precision="bf16") == 3 * T * 2 * 14336 * 2 + T * 2 * 4096 * 2


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
    for call in (lambda: estimate_training("deepseek-v2-lite", batch_size=1, seq_len=16, recompute="sac-matmuls"),
                 lambda: estimate_training(MIXTRAL, batch_size=1, seq_len=16, recompute="sac-matmuls")):
        with pytest.raises(ValueError) as err:
            call()
        assert "\n" not in str(err.value)


def test_the_real_presets_are_estimated():
    """Every MoE preset at its published size."""
    for name in ("mixtral-8x7b", "qwen1.5-moe-a2.7b", "qwen3-30b-a3b", "olmoe-1b-7b", "deepseek-v2-lite", "deepseek-v3"):
        for recompute in ("none", "full"):
            forward_end = training_phases(name, batch_size=1, seq_len=4096, precision="bf16-mixed", recompute=recompute)[0]
            assert forward_end.parameters == 4 * preset(name).params and forward_end.activations > 0
        full = training_phases(name, batch_size=1, seq_len=4096, recompute="full")[0].activations
        assert full < training_phases(name, batch_size=1, seq_len=4096)[0].activations


def test_a_family_left_out_of_the_ledger_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(moe, "TRAINING_FAMILIES", tuple(f for f in moe.TRAINING_FAMILIES if f != "deepseek_v2"))
    with pytest.raises(ValueError, match="deepseek_v2 training memory is not modelled yet") as err:
        moe.check_trainable(DEEPSEEK_V2)
    assert "\n" not in str(err.value)


def test_model_states_count_every_expert():
    est = estimate_training("mixtral-8x7b", batch_size=1, seq_len=16, precision="bf16-mixed")
    assert est.parameters == 4 * preset("mixtral-8x7b").params  # 46.7B, not the 12.9B active
    assert est.optimizer_states == 8 * preset("mixtral-8x7b").params
