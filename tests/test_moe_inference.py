"""Mixture-of-experts inference memory: `estimate_inference` for the MoE presets at
their real published sizes against a trace-mode prefill of the transformers model (FakeTensorMode:
shapes, no storage, so a 47B model is measured on a laptop), and the KV cache category against what
the model's DynamicCache really holds. The long prefills are where the routed experts' token copies
(top-k x the hidden state per token, sorted and gathered by transformers' grouped_mm experts) are the
peak, not the logits; `all_logits=False` (one logits row, `logits_to_keep=1`) shows them in the models
whose vocabulary would otherwise hide them. Training is still refused, in one line."""

import pytest

from vramlab import estimate_inference, estimate_training, moe
from vramlab.specs import moe_preset_names, preset

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
torch.set_num_threads(1)

from vramlab.measure.memory import fake_mode, measure  # noqa: E402
from vramlab.measure.models import build_model, make_batch  # noqa: E402

# (preset, [(batch, seq_len, all_logits)]): a short prefill, and a long one where the MoE block is the peak
CASES = [
    ("mixtral-8x7b", [(1, 512, True), (8, 4096, True)]),
    ("qwen3-30b-a3b", [(1, 512, True), (8, 4096, False)]),
    ("olmoe-1b-7b", [(1, 512, True), (8, 4096, True)]),
    ("deepseek-v2-lite", [(1, 512, True), (64, 256, False)]),
]
TOLERANCE = 0.05


def _measure_prefills(spec, sizes):
    """Trace-mode peak and exact KV cache bytes of each prefill in `sizes`, with one model built once:
    `model(ids, use_cache=True)` keeping its outputs (as `measure.memory.measure_inference` does), or
    with `logits_to_keep=1` where `all_logits` is off."""
    results = []
    with fake_mode(True):
        model = build_model(spec, dtype=torch.bfloat16, device="cpu", train=False)
        for b, s, all_logits in sizes:
            batch = make_batch(spec, batch_size=b, seq_len=s, with_labels=False)
            out = []

            def step():
                out.clear()
                with torch.no_grad():
                    out.append(model(**batch, use_cache=True, **({} if all_logits else {"logits_to_keep": 1})))

            m = measure(step, model=model, inputs=batch, mode="trace", precision="bf16")
            cache = out[0].past_key_values
            kv = sum(t.untyped_storage().nbytes() for layer in cache.layers for t in (layer.keys, layer.values))
            results.append((m.breakdown, kv))
            out.clear()
    return results


@pytest.mark.slow
@pytest.mark.parametrize("name,sizes", CASES, ids=[c[0] for c in CASES])
def test_estimate_matches_the_trace_at_real_sizes(name, sizes):
    spec = preset(name)
    for (b, s, all_logits), (measured, kv) in zip(sizes, _measure_prefills(spec, sizes)):
        est = estimate_inference(name, batch_size=b, seq_len=s, dtype="bf16", all_logits=all_logits, device="cpu")
        where = f"{name} b={b} s={s} all_logits={all_logits}"
        assert est.parameters == measured.parameters == 2 * spec.params, where  # every expert is resident
        assert est.kv_cache == kv == moe.kv_cache_bytes(spec, batch_size=b, seq_len=s), where
        assert abs(est.total - measured.total) <= TOLERANCE * measured.total, (where, est.total, measured.total)
        # what is not weights, inputs or cache: the estimate's activations against the trace's
        transient = measured.total - measured.parameters - measured.inputs - measured.other - kv
        assert abs(est.activations - transient) <= TOLERANCE * transient, (where, est.activations, transient)


def test_the_long_prefills_peak_in_the_routed_experts():
    """In each long case the MoE block's largest phase is a routed-experts one and exceeds the logits,
    so the tests above check the experts' transients, not the head's."""
    for name, sizes in CASES:
        spec = preset(name)
        b, s, all_logits = sizes[-1]
        phases = moe.prefill_block_bytes(spec, tokens=b * s, dtype_bytes=2)
        top = max(phases, key=phases.get)
        kept = b * s if all_logits else b
        assert top.startswith("experts"), (name, phases)
        assert phases[top] > kept * (spec.hidden_size + spec.vocab_size) * 2, name


def test_families_differ_where_transformers_does():
    """Mixtral and DeepSeek weight the experts' outputs in fp32 (their routers keep fp32 weights),
    Qwen and OLMoE in the model's dtype; Qwen2-MoE's shared expert waits through the routed ones."""
    t = 1024
    mix, olmoe = moe.prefill_block_bytes("mixtral-8x7b", tokens=t), moe.prefill_block_bytes("olmoe-1b-7b", tokens=t)
    spec = preset("mixtral-8x7b")
    rows, h, i = t * spec.num_experts_per_tok, spec.hidden_size, spec.moe_intermediate_size
    # from gate-and-up to down-and-weights: less 4i bf16 values a row, plus the down output (bf16), the
    # weighted and reordered outputs (fp32: 2 x 4 bytes) and two int64 permutations
    assert mix["experts: down and weights"] - mix["experts: gate and up"] == rows * (h * (2 + 8) + 16 - 4 * i * 2)
    assert olmoe["experts: down and weights"] > olmoe["experts: gate and up"]  # narrow experts: the copies dominate
    assert "shared expert" in moe.prefill_block_bytes("qwen1.5-moe-a2.7b", tokens=t)
    assert "shared experts" in moe.prefill_block_bytes("deepseek-v2-lite", tokens=t)


def test_generation_and_options():
    """new_tokens: the last step holds the grown cache; int8 weights; fp8 is not an inference dtype here."""
    spec = preset("deepseek-v2-lite")
    gen = estimate_inference(spec, batch_size=2, seq_len=1000, new_tokens=24)
    assert gen.kv_cache in (moe.kv_cache_bytes(spec, batch_size=2, seq_len=1024),
                            moe.kv_cache_bytes(spec, batch_size=2, seq_len=1000))
    assert estimate_inference(spec, batch_size=1, seq_len=8, dtype="int8").parameters == spec.params
    for name in moe_preset_names():
        assert estimate_inference(name, batch_size=1, seq_len=16).parameters == 2 * preset(name).params


def test_every_moe_family_trains_and_a_dense_model_has_no_experts():
    for name in ("mixtral-8x7b", "deepseek-v2-lite"):
        assert estimate_training(name, batch_size=1, seq_len=16).parameters == 4 * preset(name).params
    with pytest.raises(ValueError, match="dense"):
        moe.prefill_block_bytes("llama-3.1-8b", tokens=8)
