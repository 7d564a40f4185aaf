"""vramlab.configs: the estimate of a training configuration the user already has.

Every format is read from a real, documented example typed in by hand (its source beside it); each
estimate is checked against the equivalent call of the library written out here by hand (same bytes,
category by category), each setting's source against the field it came from, unknown fields and
unmodelled values against a one-line refusal naming the field. Models are small config.json files in
tmp_path (a fake Hugging Face cache for the model-id path); nothing touches the network.

This file holds the fixtures and helpers and the model's resolution; each format's examples and tests are
in the test file of its reader: tests/test_configs_deepspeed.py, test_configs_hf.py, test_configs_pytorch.py,
and the parser's in test_configs_fields.py.
"""

import json

import pytest

import vramlab
from vramlab import configs, memory, specs
from vramlab.present import from_config

H = 256  # the test model's hidden size


read = from_config.read_setup  # configs.read_setup with PyYAML's safe_load for the YAML formats


def _llama(dtype="bfloat16", **over) -> dict:
    cfg = {"model_type": "llama", "hidden_size": H, "intermediate_size": 688, "num_hidden_layers": 4,
           "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1024, "max_position_embeddings": 16384,
           "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
    if dtype:
        cfg["torch_dtype"] = dtype
    cfg.update(over)
    return cfg


@pytest.fixture
def model(tmp_path):
    """A small llama config.json saved in bf16 (as Llama 3's checkpoints are)."""
    folder = tmp_path / "small-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_llama()))
    return str(folder / "config.json")


@pytest.fixture
def model32(tmp_path):
    folder = tmp_path / "small-llama-fp32"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_llama("float32")))
    return str(folder / "config.json")


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """A Hugging Face cache holding NousResearch/Llama-3.2-1B's config (a small one): the layout
    huggingface_hub writes (models--ORG--NAME/refs/main, snapshots/<commit>/config.json)."""
    cache = tmp_path / "hub"
    repo = cache / "models--NousResearch--Llama-3.2-1B"
    snap = repo / "snapshots" / "4e20de362430cd3b72f300e6b0f18e50e7166e08"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(_llama()))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("4e20de362430cd3b72f300e6b0f18e50e7166e08")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return str(snap / "config.json")


def same(a: memory.MemoryBreakdown, b: memory.MemoryBreakdown) -> None:
    assert a.to_dict() == b.to_dict() and a.phase == b.phase and a.total == b.total


def check_api_call(setup: configs.Setup) -> None:
    """The call `api_call()` writes, run as written, gives the same bytes."""
    got = eval(setup.api_call(), {"vramlab": vramlab})
    same(setup.estimate(), got)


def test_hf_cache_location(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert configs.hf_cache_dir() == str(tmp_path / "hf" / "hub")
    snap = tmp_path / "hf" / "hub" / "models--org--name" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(_llama()))  # no refs/main: the newest snapshot
    assert configs.cached_config("org/name") == str(snap / "config.json")


def test_model_references(model, tmp_path):
    assert configs.resolve_model(model).dtype == "bfloat16"
    assert configs.resolve_model(str(tmp_path / "small-llama")).spec == specs.from_config(model)
    assert configs.resolve_model("gpt2").expr == "vramlab.specs.preset('gpt2')"
    with pytest.raises(ValueError, match="neither"):
        configs.resolve_model("not a model")
