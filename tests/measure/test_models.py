"""vramlab.measure.models: a model built from a ModelSpec (random init, nothing downloaded) has the
spec's parameters and trains quietly."""

import pytest

torch = pytest.importorskip("torch")

from vramlab.measure.models import build_model  # noqa: E402

from .conftest import tiny  # noqa: E402


def test_build_model_modes():
    spec = tiny()
    m = build_model(spec, device="meta")
    assert sum(p.numel() for p in m.parameters()) == spec.params and m.training
    assert not build_model(spec, device="meta", train=False).training


@pytest.mark.slow
def test_building_and_running_a_model_prints_no_library_warning():
    """Newcomers saw transformers' 'loss_type=None' and out-of-vocabulary token warnings on every run."""
    code = ("import dataclasses, vramlab; from vramlab.measure.models import build_model, make_batch; "
            "s = dataclasses.replace(vramlab.preset('gpt2'), num_layers=1, hidden_size=64, num_heads=2, num_kv_heads=2, "
            "head_dim=32, intermediate_size=128, vocab_size=500); "
            "print(float(build_model(s)(**make_batch(s, batch_size=1, seq_len=8)).loss))")
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "loss_type" not in r.stderr and "eos_token_id" not in r.stderr, r.stderr
