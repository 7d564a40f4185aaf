"""The loss's memory (`loss` of vramlab.memory.estimate_training): the whole cross-entropy, torchtune's
chunked one and Liger-Kernel's fused linear cross-entropy, the estimate against traced peaks of the
real step (trace mode: FakeTensorMode + MemTracker on CPU kernels, the model's own loss or
`vramlab.measure.memory`'s chunked and fused losses), at sizes where the loss dominates the peak.
The expected values are measurements, never the estimator's output. Where a model is cut to a few
of its blocks (to keep a trace to seconds), its head, vocabulary and hidden size, all the loss
depends on, are the preset's."""

from __future__ import annotations

import dataclasses

import pytest

from vramlab import estimate_training, preset
from vramlab.memory import loss_chunk_size, training_phases

TOL = 0.05  # the bar, for the peak and for the saving; every traced case so far is within 1.7 %


# ----------------------------------------------------------------------------- the estimator alone

def test_the_default_is_the_whole_loss():
    for kw in (dict(model="gpt2", batch_size=4, seq_len=512, precision="bf16-mixed"),
               dict(model="llama-3.2-1b", batch_size=1, seq_len=4096, recompute="full", accumulation_steps=2),
               dict(model="bert-base", batch_size=8, seq_len=128)):
        model = kw.pop("model")
        assert training_phases(model, **kw) == training_phases(model, loss="whole", **kw)


def test_chunk_sizes_follow_torchtune_and_liger():
    # torchtune: 8 chunks; Liger: logits no larger than the head's input, to the next power of two
    # (its own example: BT = 16384, V = 32000, H = 4096 -> 2048)
    spec = dataclasses.replace(preset("mistral-7b"), vocab_size=32000, hidden_size=4096)
    assert loss_chunk_size(spec, tokens=16384, loss="fused") == 2048
    assert loss_chunk_size(spec, tokens=16384, loss="chunked") == 2048
    assert loss_chunk_size(spec, tokens=100, loss="chunked") == 13
    assert loss_chunk_size(spec, tokens=1000, loss="fused", loss_chunk_tokens=5000) == 1000
    assert loss_chunk_size(spec, tokens=1000, loss="whole") == 1000


def test_the_loss_dominates_and_the_options_lower_it():
    """Llama-3.2-1B at 16k tokens under AMP: the whole loss's fp32 logits and gradients (b s V 4 B each)
    set the peak; chunking removes the fp32 copy of the logits, fusing every N x V tensor."""
    kw = dict(batch_size=1, seq_len=16384, precision="bf16-mixed")
    whole, chunked, fused = (estimate_training("llama-3.2-1b", loss=lo, **kw) for lo in ("whole", "chunked", "fused"))
    assert whole.phase == "backward start (logits gradient)"
    assert whole.total > chunked.total > fused.total
    nv = 16384 * preset("llama-3.2-1b").vocab_size
    assert whole.total - fused.total > 2 * nv * 4  # at least the two fp32 N x V tensors of the backward start
    # a larger chunk costs more where the chunk is what the phase holds
    small = estimate_training("llama-3.2-1b", loss="fused", loss_chunk_tokens=1024, **kw)
    large = estimate_training("llama-3.2-1b", loss="fused", loss_chunk_tokens=8192, **kw)
    assert large.total > small.total


@pytest.mark.parametrize("kw, match", [
    (dict(loss="bogus"), "loss"),
    (dict(loss="chunked", loss_chunk_tokens=0), "loss_chunk_tokens"),
    (dict(loss="fused", loss_chunk_tokens=2.5), "loss_chunk_tokens"),
    (dict(loss_chunk_tokens=1024), "loss_chunk_tokens"),
    (dict(model="bert-base", loss="chunked"), "causal LMs"),
    (dict(model="t5-small", loss="fused"), "causal LMs"),
])
def test_bad_input_is_one_clear_error(kw, match):
    kw = {"model": "llama-3.2-1b", "batch_size": 1, "seq_len": 512, **kw}
    with pytest.raises(ValueError, match=match) as e:
        estimate_training(kw.pop("model"), **kw)
    assert "\n" not in str(e.value)


def test_parallel_layouts_keep_the_whole_loss():
    from vramlab.activations import DeviceShare

    with pytest.raises(ValueError, match="one device"):
        training_phases("llama-3.2-1b", batch_size=1, seq_len=512, loss="chunked",
                        share=DeviceShare(tp=2))


# ----------------------------------------------------------------------------- against traces

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def _cut(name: str, blocks: int | None):
    spec = preset(name)
    return spec if blocks is None else dataclasses.replace(spec, name=f"{spec.name} ({blocks} blocks)", num_layers=blocks)


# (preset, blocks kept (None: all), batch, sequence, precision, chunk sizes for chunked and fused)
CASES = [
    ("llama-3.2-1b", None, 1, 8192, "fp32", 2048, None),  # tied head; Liger's chunk: 256
    ("qwen2.5-7b", 4, 1, 8192, "fp32", 1024, 2048),  # untied head, V = 152,064
    ("llama-3.2-1b", 4, 1, 16384, "bf16", None, 4096),  # pure bf16; torchtune's chunk: 2048
    ("pythia-1b", 4, 2, 2048, "fp32", 512, None),  # GPT-NeoX, untied, two sequences
]


@pytest.mark.slow
@pytest.mark.parametrize("name,blocks,b,s,precision,chunked,fused", CASES, ids=lambda x: str(x))
def test_traced_peaks_and_savings(name, blocks, b, s, precision, chunked, fused):
    from vramlab.measure.memory import measure_training

    torch.set_num_threads(1)
    spec = _cut(name, blocks)
    kw = dict(batch_size=b, seq_len=s, precision=precision)
    chunks = {"whole": None, "chunked": chunked, "fused": fused}
    measured, estimated = {}, {}
    for loss, chunk in chunks.items():
        measured[loss] = measure_training(spec, mode="trace", loss=loss, loss_chunk_tokens=chunk, **kw).total
        est = estimate_training(spec, device="cpu", loss=loss, loss_chunk_tokens=chunk, **kw)
        estimated[loss] = est.total
        assert abs(est.total / measured[loss] - 1) <= TOL, (loss, est.total, measured[loss], est.phase)
    assert measured["whole"] > measured["chunked"] > measured["fused"]
    for loss in ("chunked", "fused"):
        saved, predicted = measured["whole"] - measured[loss], estimated["whole"] - estimated[loss]
        assert abs(predicted / saved - 1) <= TOL, (loss, predicted, saved)


def test_chunked_and_fused_losses_are_the_loss():
    """The measured step's chunked and fused losses (and their gradients) equal transformers' own, on
    real tensors: what the traces measure is cross-entropy."""
    from vramlab.measure.memory import IGNORE_INDEX, chunked_cross_entropy, fused_cross_entropy
    from vramlab.measure.models import build_model, make_batch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    spec = dataclasses.replace(preset("llama-3.2-1b"), num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1,
                               head_dim=16, intermediate_size=64, vocab_size=300)
    model = build_model(spec, dtype=torch.float64)
    batch = make_batch(spec, batch_size=2, seq_len=24)
    batch["labels"] = batch["labels"].clone()
    batch["labels"][0, 5] = IGNORE_INDEX  # an ignored target
    head = model.get_output_embeddings()

    def run(fn):
        model.zero_grad(set_to_none=True)
        if fn is None:
            value = model(**batch).loss
        else:
            value = fn(model.base_model(input_ids=batch["input_ids"])[0], head, batch["labels"], 7)
        (2 * value).backward()  # a gradient other than 1 reaches the loss
        return value.detach(), [p.grad.clone() for p in model.parameters()]

    ref, ref_grads = run(None)  # transformers' loss upcasts with .float(): fp32 even for an fp64 model
    for fn in (chunked_cross_entropy, fused_cross_entropy):
        value, grads = run(fn)
        assert torch.allclose(value.double(), ref.double(), rtol=1e-6), fn.__name__
        assert all(torch.allclose(g.double(), r.double(), rtol=1e-5, atol=1e-7) for g, r in zip(grads, ref_grads)), fn.__name__


def test_measurement_refuses_what_it_cannot_run():
    from vramlab.measure.memory import measure_training

    with pytest.raises(NotImplementedError, match="causal LMs"):
        measure_training(preset("bert-base"), batch_size=1, seq_len=64, mode="trace", loss="chunked")
    with pytest.raises(ValueError, match="loss_chunk_tokens"):
        measure_training(preset("gpt2"), batch_size=1, seq_len=64, mode="trace", loss="fused", loss_chunk_tokens=0)
