"""Inputs that can never produce a wrong number or a hang: every config field is
type- and range-checked where it is parsed; the public calculators reject what they cannot answer
with one ValueError naming the argument, and accept what is valid (numpy integers); property tests
(hypothesis) over random valid and invalid inputs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vramlab
from vramlab import activations, collectives, memory, precision, specs  # noqa: F401 (the calls below are eval'd)
from vramlab import optimizers
from vramlab.specs import SpecError, from_config


def cli(*args, timeout=120):  # a hang guard: the commands answer in about a second
    return subprocess.run([sys.executable, "-m", "vramlab", *args], capture_output=True, text=True, timeout=timeout)


# ----------------------------------------------------------------------------- configs

@pytest.mark.slow
@pytest.mark.parametrize("field, value, model_type", [
    ("n_positions", -1024, "gpt2"), ("type_vocab_size", -2, "bert"), ("relative_attention_num_buckets", -32, "t5"),
    ("n_layer", 12.5, "gpt2"), ("n_embd", 768.0, "gpt2"), ("vocab_size", 1e30, "gpt2"),
    ("tie_word_embeddings", "false", "gpt2"), ("resid_pdrop", 1.5, "gpt2"), ("hidden_act", ["gelu"], "llama"),
    ("num_hidden_layers", 10**9, "llama"), ("n_head", "12", "gpt2"), ("head_dim", -64, "llama"),
    ("rope_parameters", [1, 2], "gpt_neox"), ("attention_bias", 1, "llama"),
])
def test_bad_config_field_is_one_line_naming_file_field_and_value(tmp_path, field, value, model_type):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": model_type, field: value}))
    with pytest.raises(SpecError) as e:
        from_config(path)
    msg = str(e.value)
    assert str(path) in msg and field in msg and repr(value)[:12] in msg and "\n" not in msg
    r = cli("estimate", "train", "--hf-config", str(path), "--batch-size", "1", "--seq-len", "8")
    assert r.returncode == 2 and field in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("text", ['{"model_type": "gpt2", "n_layer": Infinity}', '{"model_type": "gpt2", "n_embd": NaN}',
                                  "[" * 100000 + "]" * 100000, '{"model_type": ["gpt2"]}', '"gpt2"'])
def test_non_standard_or_hostile_json_is_refused(tmp_path, text):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(SpecError, match=str(path).replace("/", ".")):
        from_config(path)


def test_special_files_are_refused_without_reading_them(tmp_path):
    """A FIFO would block forever and /dev/zero never ends: only regular files are read, and only a MiB."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/zero"):
        r = cli("estimate", "train", "--hf-config", str(path), "--batch-size", "1", "--seq-len", "8")
        assert r.returncode == 2 and "not a regular file" in r.stderr
    big = tmp_path / "big.json"
    big.write_text('{"model_type": "gpt2", "x": "' + "a" * (2 << 20) + '"}')
    with pytest.raises(SpecError, match="too large"):
        from_config(big)


def test_what_if_replace_is_checked_too():
    import dataclasses

    with pytest.raises(SpecError, match="num_layers must be a positive integer up to 10,000"):
        dataclasses.replace(vramlab.preset("gpt2"), num_layers=10**9)
    with pytest.raises(SpecError, match="hidden_dropout"):
        dataclasses.replace(vramlab.preset("gpt2"), hidden_dropout=float("nan"))


# ----------------------------------------------------------------------------- the Python API

@pytest.mark.parametrize("call, needle", [
    ("vramlab.checkpoint_bytes(-5)", "parameter_count"),
    ("memory.kv_cache_bytes(vramlab.preset('gpt2'), batch_size=-1, seq_len=4)", "batch_size"),
    ("activations.activation_bytes(vramlab.preset('gpt2'), batch_size=1, seq_len=-4)", "seq_len"),
    ("activations.activation_bytes(vramlab.preset('gpt2'), batch_size=1, seq_len=4, attention='flash')", "attention"),
    ("vramlab.fit('gpt2', 't4', reserve=-10**15)", "does not take reserve"),
    ("vramlab.fit('gpt2', 16e9)", "custom_gpu"),
    ("vramlab.gpu(None)", "catalogue name"),
    ("specs.custom_gpu(1.9)", "positive number of bytes"),
    ("memory.kv_cache_bytes(vramlab.preset('gpt2'), batch_size=1, seq_len=4, dtype='fp8')", "dtype"),
    ("vramlab.estimate_training('gpt2', batch_size=10**35, seq_len=8)", "at most"),
    ("vramlab.estimate_training('gpt2', batch_size=1, seq_len=4096)", "1,024 positions"),
    ("collectives.collective_time('all_reduce', 8, 1 << 20, 'nvlink4', algorithm='mesh')", "algorithm"),
    ("collectives.collective_time('broadcast', 8, 1 << 20, 'nvlink4', chunks=-3)", "chunks"),
    ("collectives.fit_alpha_beta('all_reduce', 2, [1, 2, 3], [3e-3, 2e-3, 1e-3])", "do not grow"),
    ("collectives.fit_alpha_beta('all_reduce', 2, [1, 2], [1e-3, float('nan')])", "NaN"),
    ("precision.min_loss_scale(float('nan'))", "finite"),
    ("vramlab.estimate_training(3.5, batch_size=1, seq_len=8)", "ModelSpec or a preset name"),
])
def test_api_rejects_what_it_cannot_answer(call, needle):
    with pytest.raises(ValueError, match=needle):
        eval(call)


def test_numpy_integers_are_accepted():
    np = pytest.importorskip("numpy")
    a = vramlab.estimate_training("gpt2", batch_size=np.int64(4), seq_len=np.int32(128))
    assert a.total == vramlab.estimate_training("gpt2", batch_size=4, seq_len=128).total


def test_round_to_saturates_e4m3fn_like_torch():
    assert precision.round_to(500, "fp8-e4m3") == 448.0 and precision.round_to(-1e5, "fp8-e4m3") == -448.0
    assert precision.round_to(1e5, "fp8-e5m2") == math.inf


# ----------------------------------------------------------------------------- the command line

@pytest.mark.parametrize("args, needle", [
    (["infer", "--optimizer", "sgd"], "--optimizer does not apply to 'estimate infer'"),
    (["infer", "--recompute", "full"], "--recompute does not apply"),
    (["train", "--new-tokens", "3"], "--new-tokens does not apply to 'estimate train'"),
    (["train", "--gpu", ""], "catalogue name"),
    (["train", "--seq-len", "4096"], "1,024 positions"),
])
def test_flags_that_do_not_apply_are_errors(args, needle):
    base = ["--model", "gpt2", "--batch-size", "1"] + ([] if "--seq-len" in args else ["--seq-len", "8"])
    r = cli("estimate", args[0], *base, *args[1:])
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr


def test_a_closed_pipe_is_not_a_traceback():
    r = subprocess.run(f"{sys.executable} -m vramlab presets | head -1", shell=True, capture_output=True, text=True)
    assert r.stdout.count("\n") == 1 and "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr


# ----------------------------------------------------------------------------- property tests

presets = st.sampled_from(specs.preset_names())
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _finite_breakdown(b):
    d = b.to_dict()
    return all(isinstance(v, int) and v >= 0 for v in d.values()) and b.total == sum(d.values())


@FAST
@given(model=presets, b=st.integers(1, 64), s=st.integers(1, 255), precision=st.sampled_from(precision.PRECISIONS),
       optimizer=st.sampled_from(optimizers.SHARDED), impl=st.sampled_from(memory.OPTIMIZER_IMPLS),
       attention=st.sampled_from(activations.ATTENTIONS), recompute=st.sampled_from(activations.RECOMPUTES),
       device=st.sampled_from(("cuda", "cpu")))
def test_training_estimates_are_finite_non_negative_and_monotonic(model, b, s, precision, optimizer, impl, attention,
                                                                  recompute, device):
    kw = dict(precision=precision, optimizer=optimizer, optimizer_impl=impl, attention=attention, recompute=recompute,
              device=device)
    base = vramlab.estimate_training(model, batch_size=b, seq_len=s, **kw)
    assert _finite_breakdown(base)
    assert vramlab.estimate_training(model, batch_size=b + 1, seq_len=s, **kw).total >= base.total
    assert vramlab.estimate_training(model, batch_size=b, seq_len=s + 1, **kw).total >= base.total


@FAST
@given(model=presets, b=st.integers(1, 64), s=st.integers(1, 255), dtype=st.sampled_from(("fp32", "bf16", "fp16", "int8")),
       new=st.one_of(st.none(), st.integers(0, 200)))  # every preset reads at least 512 positions
def test_inference_estimates_are_finite_non_negative_and_monotonic(model, b, s, dtype, new):
    if specs.preset(model).family == "bert":
        new = None  # an encoder-only model has no generation to estimate (refused)
    base = vramlab.estimate_inference(model, batch_size=b, seq_len=s, dtype=dtype, new_tokens=new)
    assert _finite_breakdown(base)
    assert vramlab.estimate_inference(model, batch_size=b + 1, seq_len=s, dtype=dtype, new_tokens=new).total >= base.total
    assert vramlab.estimate_inference(model, batch_size=b, seq_len=s + 1, dtype=dtype, new_tokens=new).total >= base.total


junk = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**40, 0),
                 st.integers(10**32, 10**40), st.text(max_size=5), st.lists(st.integers(), max_size=2),
                 st.dictionaries(st.text(max_size=2), st.integers(), max_size=2))


@pytest.mark.slow
@FAST
@given(field=st.sampled_from(("batch_size", "seq_len", "precision", "optimizer", "optimizer_impl", "attention",
                              "recompute", "device", "trainable_params", "gpu")), value=junk)
def test_invalid_training_inputs_raise_value_error_and_nothing_else(field, value):
    kw = dict(batch_size=2, seq_len=64)
    kw[field] = value
    if field in ("gpu", "trainable_params") and value is None:
        return  # None is their documented default
    if field == "trainable_params" and type(value) is int and value == 0:
        return  # 0 trainable parameters (everything frozen) is valid; the junk strategy can draw it
    if field == "recompute" and type(value) is list and all(type(i) is int and 0 <= i < 12 for i in value):
        return  # a set of GPT-2's 12 blocks to checkpoint (the empty set is no recompute) is a valid plan
    with pytest.raises(ValueError):
        vramlab.estimate_training("gpt2", **kw)


@FAST
@given(fields=st.dictionaries(st.sampled_from(("n_embd", "n_head", "n_layer", "n_positions", "vocab_size", "n_inner",
                                               "resid_pdrop", "tie_word_embeddings", "activation_function")),
                              junk, min_size=1, max_size=3))
def test_invalid_config_values_raise_spec_error_and_nothing_else(fields):
    cfg = {"model_type": "gpt2", **fields}
    try:
        spec = from_config(cfg)
    except SpecError:
        return
    # whatever was accepted is a sane model (e.g. a null field falls back to its default)
    assert spec.params > 0 and math.isfinite(spec.params)
