"""vramlab.weights: each family's parameter counts and tensors must equal the real transformers model's
(`sum(p.numel())`, `named_parameters()` names, order and shapes), built offline on the meta device (no
memory, no download), for the presets and for configs of unseen sizes (tests/test_specs.py's)."""

import pytest

from vramlab.specs import from_config, preset, preset_names

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from tests.test_specs import _hf_model, _rand_configs, real_count  # noqa: E402


@pytest.mark.parametrize("name", preset_names())
def test_preset_params_exact(name):
    spec = preset(name)
    assert spec.params == real_count(spec)


def test_published_sizes():
    # sizes reported by the models' authors / the seeds: GPT-2 124M (HF), mT5-base ~582M (seeds)
    assert preset("gpt2").params == 124_439_808
    assert abs(preset("mt5-base").params - 582e6) / 582e6 < 0.001
    assert abs(preset("bert-base").params - 110e6) / 110e6 < 0.01
    assert abs(preset("llama-3.1-8b").params - 8.03e9) / 8.03e9 < 0.001


@pytest.mark.parametrize("seed", range(3))
def test_param_tensors_match_named_parameters(seed):
    # the order matters to for-loop optimizers; names are the module paths without the model prefix
    for cfg in _rand_configs(seed):
        spec = from_config(cfg)
        real = [(n, p.numel()) for n, p in _hf_model(cfg).named_parameters()]
        mine = spec.param_tensors()
        assert [n for _, n in mine] == [n for _, n in real], cfg.model_type
        assert all(r.endswith(m) for (m, _), (r, _) in zip(mine, real)), (mine, real)
        assert sum(n for _, n in mine) == spec.params
        assert _shapes_agree(spec, _hf_model(cfg)), cfg.model_type


def _shapes_agree(spec, model) -> bool:
    """`param_shapes` is each tensor's real shape; GPT-2's Conv1D weights are stored (in, out), listed (out, in)."""
    conv1d = {n for n, m in model.named_modules() if type(m).__name__ == "Conv1D"}
    real = []
    for n, p in model.named_parameters():
        shape = tuple(p.shape)
        if n.rsplit(".", 1)[0] in conv1d and n.endswith(".weight"):
            shape = shape[::-1]
        real.append(shape)
    return [shape for _, shape in spec.param_shapes()] == real
