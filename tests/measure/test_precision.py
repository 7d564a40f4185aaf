"""vramlab.measure.precision: what an fp16 backward without a loss scale flushes to zero, measured."""

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from vramlab.measure.models import build_model  # noqa: E402

from .conftest import tiny  # noqa: E402


def test_flushed_fraction_agrees_with_doing_the_cast():
    """A gradient below half of fp16's smallest subnormal (2^-25) counts, one above does not."""
    from vramlab.measure.precision import flushed_fraction

    tiny16 = torch.finfo(torch.float16).smallest_normal * 2.0**-10  # 2^-24, the smallest subnormal
    reference = torch.tensor([tiny16 * 0.4, tiny16 * 0.6, 1e-6, 0.0, 1e-3, -tiny16 * 0.3])
    cast = reference.half().float()  # what an fp16 backward would hold
    assert cast.tolist()[:2] == [0.0, tiny16] and cast[2] != 0
    assert flushed_fraction([cast], [reference]) == 2 / 5  # 0.4 and -0.3 of the subnormal flush; 0.6 rounds up
    assert flushed_fraction([reference], [reference]) == 0.0
    assert flushed_fraction([None], [reference]) == 1.0


@pytest.mark.slow
def test_fp16_backward_flushes_logit_gradients_of_a_large_vocabulary():
    """A mean loss over b*s tokens makes each logit's gradient ~ 1/(V b s): with GPT-2's vocabulary
    and 1024 tokens that is below 2^-25, so an unscaled fp16 backward loses updates (the embedding
    rows that no target touches); a scale of 2^16 keeps them."""
    from vramlab.measure.precision import fp16_flushed_fraction
    from vramlab.measure.models import make_batch

    spec = tiny(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, head_dim=16, intermediate_size=64)
    model = build_model(spec)
    lost = fp16_flushed_fraction(model, make_batch(spec, batch_size=4, seq_len=256))
    assert lost > 0.05
    assert all(p.grad is None for p in model.parameters())
    small_vocab = dataclasses.replace(spec, vocab_size=256)
    assert fp16_flushed_fraction(build_model(small_vocab), make_batch(small_vocab, batch_size=1, seq_len=16)) < lost
