"""vramlab.compression's prompt tuning, prefix tuning and P-tuning against peft 0.21: trainable
parameters equal `get_nb_trainable_parameters()` on models built from configs (meta device), and
one training step's memory, measured on real CPU tensors with peft's own wrappers, against
`peft_training`."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from vramlab import compression as C
from vramlab.specs import from_config, preset

ROOT = Path(__file__).resolve().parents[1]
MT5_BASE_PARAMS = 582_401_280  # ../shared/gpu-truth/seeds_mt5_h100.jsonl: mT5-base, untied head


def _peft_config(method: str, task: str, **kw):
    import peft

    cls = {"prompt": peft.PromptTuningConfig, "prefix": peft.PrefixTuningConfig, "p-tuning": peft.PromptEncoderConfig}[method]
    if method == "p-tuning" and "encoder_type" in kw:
        kw["encoder_reparameterization_type"] = kw.pop("encoder_type")
    return cls(task_type=task, **kw)


def _peft_counts(spec, method: str, device: str = "meta", **kw) -> tuple[int, int]:
    """(trainable, all) as peft counts them, on `spec` built from its config."""
    from peft import get_peft_model

    from vramlab.measure.models import build_model

    task = "SEQ_2_SEQ_LM" if spec.family == "t5" else "CAUSAL_LM"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(build_model(spec, device=device), _peft_config(method, task, **kw))
    return model.get_nb_trainable_parameters()


SETTINGS = [("prompt", {"num_virtual_tokens": 20}), ("prompt", {"num_virtual_tokens": 7}),
            ("prefix", {"num_virtual_tokens": 20}), ("prefix", {"num_virtual_tokens": 5, "prefix_projection": True}),
            ("prefix", {"num_virtual_tokens": 10, "prefix_projection": True, "encoder_hidden_size": 128}),
            ("p-tuning", {"num_virtual_tokens": 20}), ("p-tuning", {"num_virtual_tokens": 8, "encoder_hidden_size": 96}),
            ("p-tuning", {"num_virtual_tokens": 20, "encoder_type": "LSTM"}),
            ("p-tuning", {"num_virtual_tokens": 4, "encoder_type": "LSTM", "encoder_hidden_size": 64, "encoder_num_layers": 3})]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mt5-base", "gpt2", "llama-3.2-1b", "t5-small", "opt-125m", "pythia-160m"])
@pytest.mark.parametrize("method, kw", SETTINGS, ids=[f"{m}-{i}" for i, (m, _) in enumerate(SETTINGS)])
def test_prompt_learning_counts_equal_peft(name, method, kw):
    spec = preset(name)
    trainable, total = _peft_counts(spec, method, **kw)
    assert C.prompt_params(spec, method=method, **kw) == trainable
    assert total == spec.params + trainable  # the frozen base is the spec's own count


def test_mt5_base_is_the_seeds_model_and_gets_two_prompts():
    spec = preset("mt5-base")
    assert spec.params == MT5_BASE_PARAMS
    pl = C.prompt_learning(spec, method="prompt", num_virtual_tokens=20)
    assert (pl.submodules, pl.token_dim, pl.num_layers, pl.trainable) == (2, 768, 12, 2 * 20 * 768)
    assert C.prompt_params(spec, method="prefix", num_virtual_tokens=20) == 20 * 12 * 2 * 768  # 368,640


def test_gqa_prefix_uses_the_kv_width():
    """Llama with 4 KV heads of 8: peft's prefix holds a_kv x head_dim per layer, not hidden_size."""
    spec = from_config({"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100,
                        "tie_word_embeddings": False}, name="gqa")
    assert C.prompt_learning(spec, method="prefix").token_dim == 32
    assert C.prompt_params(spec, method="prefix", num_virtual_tokens=3) == _peft_counts(spec, "prefix", num_virtual_tokens=3)[0]
    assert C.prompt_params(spec, method="prompt", num_virtual_tokens=3) == 3 * 128


@pytest.mark.parametrize("kw, msg", [({"method": "lora"}, "prompt-learning method"),
                                     ({"num_virtual_tokens": 0}, "num_virtual_tokens"),
                                     ({"num_virtual_tokens": 2.5}, "num_virtual_tokens"),
                                     ({"encoder_type": "GRU"}, "encoder_type"),
                                     ({"prefix_projection": "yes"}, "prefix_projection"),
                                     ({"encoder_hidden_size": -1}, "encoder_hidden_size")])
def test_bad_input_is_one_clear_line(kw, msg):
    with pytest.raises(ValueError, match=msg):
        C.prompt_params("gpt2", **kw)


def test_prefix_on_a_t5_narrower_than_d_model_is_refused():
    with pytest.raises(ValueError, match="prefix tuning cannot"):
        C.prompt_params("mt5-small", method="prefix")


# ---------------------------------------------------------------------------- memory against peft's own steps
STORED = ROOT / "benchmarks" / "results" / "prompt_tuning_cpu.json"
# measured on real CPU tensors (benchmarks/prompt_tuning_validation.py): prompt tuning and P-tuning
# within 6 %; prefix tuning over-predicts small models with attention dropout by up to ~10 % (on the CPU
# the math path's saved scores: GPT-2-tiny b8 s64 p16 with only attention dropout +7.6 %, with only
# residual/embedding dropout +1.0 %, with none +0.1 %; measured by hand, not yet explained)
TOLERANCE = {"full": 0.01, "prompt": 0.06, "p-tuning": 0.06, "prefix": 0.11}


def _stored_cases():
    return json.loads(STORED.read_text())["cases"] if STORED.exists() else []


def test_the_stored_run_covers_every_method_on_three_families():
    saved = json.loads(STORED.read_text())
    assert {"date", "torch"} <= set(saved["provenance"]) and saved["mode"].startswith("cpu")
    cases = saved["cases"]
    assert {c["method"] for c in cases} == {"full", "prompt", "prefix", "p-tuning"}
    assert {from_config(c["config"], name=c["model"]).family for c in cases} == {"t5", "gpt2", "llama"}


@pytest.mark.parametrize("case", _stored_cases(), ids=lambda c: f"{c['model']}-{c['method']}-p{c['num_virtual_tokens']}"
                         + ("-proj" if c["options"].get("prefix_projection") else ""))
def test_estimate_against_the_stored_measurement(case):
    spec = from_config(case["config"], name=case["model"])
    kw = {} if case["method"] == "full" else dict(num_virtual_tokens=case["num_virtual_tokens"], **case["options"])
    est = C.peft_training(spec, method=case["method"], batch_size=case["batch_size"], seq_len=case["seq_len"],
                          device="cpu", **kw)
    m = case["measured_bytes"]
    assert abs(est.total - m) <= TOLERANCE[case["method"]] * m, (est.total, m)
    if case["method"] != "full":  # the frozen base and peft's fp32 prompt parameters, exactly
        assert case["measured"]["parameters"] == spec.params * 4 + 4 * C.prompt_params(spec, method=case["method"], **kw)


def test_prompt_lengthens_the_sequence_and_prefix_only_attention():
    """mT5-base at the article's batch 32 x 10 tokens: a 20-token prompt triples the encoder's
    sequence, so prompt tuning keeps more activations than LoRA; the prefix reaches only the decoder's
    self-attention, so the encoder saves nothing and prefix tuning keeps less."""
    kw = dict(batch_size=32, seq_len=10)
    lora = C.peft_training("mt5-base", method="lora", rank=8, targets=("q", "v"), **kw)
    prompt = C.peft_training("mt5-base", method="prompt", num_virtual_tokens=20, **kw)
    prefix = C.peft_training("mt5-base", method="prefix", num_virtual_tokens=20, **kw)
    full = C.peft_training("mt5-base", method="full", **kw)
    assert prefix.activations < lora.activations < prompt.activations
    assert max(prompt.total, prefix.total) < full.total / 2
    assert C.peft_training("mt5-base", method="prompt", num_virtual_tokens=1, **kw).activations < prompt.activations


def test_prefix_with_checkpointing_is_refused_as_peft_does():
    with pytest.raises(ValueError, match="gradient checkpointing"):
        C.peft_training("gpt2", method="prefix", batch_size=1, seq_len=8, recompute="full")


def test_lab8_probes_prompt_and_prefix_tuning():
    from vramlab.measure.compression import PROBES, PROMPT_TOKENS, _probe_config, probe_label

    assert [probe_label(p) for p in PROBES if p["method"] in C.PROMPT_METHODS] == ["prompt", "prefix"]
    cfg = _probe_config('{"method": "prefix", "targets": "-", "batch_size": 8, "seq_len": 128, "mode": "cpu"}')
    assert cfg["method"] == "prefix" and PROMPT_TOKENS == 16


@pytest.mark.parametrize("method", ["prompt", "prefix", "p-tuning"])
def test_virtual_tokens_take_positions(method):
    """A real peft run of GPT-2 with 1,020 tokens and 20 virtual ones fails (position ids past 1,024, for
    prefix tuning as a KV cache's past length): the estimate refuses the same input in one line."""
    with pytest.raises(ValueError, match="1,040 is longer"):
        C.peft_training("gpt2", method=method, batch_size=1, seq_len=1020, num_virtual_tokens=20)
    assert C.peft_training("gpt2", method=method, batch_size=1, seq_len=1004, num_virtual_tokens=20).total > 0
    # T5's relative positions have no such limit
    assert C.peft_training("t5-small", method=method, batch_size=1, seq_len=1020, num_virtual_tokens=20).total > 0
