"""vramlab.activations: the ledger of tensors a block saves for backward, priced for a batch, and the
recompute plans that shrink it (measured counterparts: tests/test_gpu_truth.py, tests/measure/test_memory.py)."""

import dataclasses

from vramlab import preset
from vramlab.activations import activation_bytes, layer_saved


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


def test_t5_self_attention_on_cuda_keeps_one_mask_for_the_batch():
    """T5's self-attention mask is the relative-position bias (it needs a gradient). On CUDA under the
    pinned transformers the memory-efficient kernel takes it and keeps the (1, heads, s, s) mask, which
    the batch broadcasts (one per block, whatever the batch); the CPU's math path keeps the
    b x heads x s x s probabilities (tests/test_gpu_truth.py measures both versions on an H100)."""
    from vramlab.activations import saved_tensor_bytes

    spec = preset("t5-small")
    s, a = 256, spec.num_heads
    for precision, nb in (("fp32", 4), ("bf16", 2), ("bf16-mixed", 2)):
        cuda = layer_saved(spec, device="cuda", precision=precision)
        masks = [x for x in cuda if x.per_score]
        assert len(masks) == 1 and masks[0].shared_batch
        nbytes = {"half": nb}
        for b in (1, 8):
            assert saved_tensor_bytes(masks[0], tokens=b * s, scores=b * a * s * s, nbytes=nbytes, batch=b) == a * s * s * nb
        cpu = layer_saved(spec, device="cpu", precision=precision)
        assert any(x.per_score and not x.shared_batch for x in cpu)  # the probabilities
    # the bias's share of a step: activations grow with the batch except the masks, one a block
    one = activation_bytes(spec, batch_size=1, seq_len=s, device="cuda")["layers"]
    eight = activation_bytes(spec, batch_size=8, seq_len=s, device="cuda")["layers"]
    blocks = spec.num_layers + spec.num_decoder_layers
    assert 8 * one - eight == 7 * blocks * a * s * s * 4
