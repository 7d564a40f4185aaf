"""Every public function of memory, checkpointing, precision, specs and the `vramlab`
command line answers bad input with one ValueError naming the argument (never a TypeError or an
OverflowError, never a silently wrong number), accepts numpy's scalars where a number is meant,
and refuses bools, strings, NaN and infinities there."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest

import vramlab.activations
import vramlab.fitting
from vramlab import checkpointing as C
from vramlab.present import cli
from vramlab import memory as M
from vramlab import precision as P
from vramlab import specs as S

np = pytest.importorskip("numpy")

KW = dict(batch_size=1, seq_len=8)


def one_error(call, *needles):
    """`call()` raises one ValueError, on one line, whose message holds every needle."""
    with pytest.raises(ValueError) as e:
        call()
    msg = str(e.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


def cli_run(*args):
    return subprocess.run([sys.executable, "-m", "vramlab", *args], capture_output=True, text=True, timeout=60)


# ----------------------------------------------------------------------------- the cases

@pytest.mark.parametrize("mfu", ["0.5", None, True, float("nan"), float("inf"), 0, 1.5, -0.1])
def test_evaluate_mfu_is_a_fraction_by_name(mfu):
    one_error(lambda: C.evaluate("gpt2", "full", gpu="t4", mfu=mfu, **KW), "mfu")


def test_evaluate_takes_numpy_mfu():
    want = C.evaluate("gpt2", "full", gpu="t4", mfu=0.5, **KW).step_seconds
    for v in (np.float64(0.5), np.float32(0.5)):
        assert C.evaluate("gpt2", "full", gpu="t4", mfu=v, **KW).step_seconds == pytest.approx(want)


@pytest.mark.parametrize("new_tokens", ["4", 4.0, True, -1, float("nan"), [4]])
def test_new_tokens_is_checked_by_its_own_name_first(new_tokens):
    one_error(lambda: M.estimate_inference("gpt2", new_tokens=new_tokens, **KW), "new_tokens")


def test_new_tokens_takes_numpy_integers():
    want = M.estimate_inference("gpt2", new_tokens=4, **KW)
    assert M.estimate_inference("gpt2", new_tokens=np.int64(4), **KW) == want
    assert M.estimate_inference("gpt2", new_tokens=np.int32(4), **KW) == want


def test_huge_new_tokens_blames_new_tokens_not_seq_len():
    msg = one_error(lambda: M.estimate_inference("t5-small", new_tokens=10**30, **KW), "new_tokens")
    assert not msg.startswith("seq_len")
    # beyond the model's positions: the sum is named, with both terms
    one_error(lambda: M.estimate_inference("gpt2", batch_size=1, seq_len=1000, new_tokens=100),
              "1,024 positions", "new_tokens", "1,100")


def test_an_encoder_only_model_does_not_generate():
    one_error(lambda: M.estimate_inference("bert-base", batch_size=1, seq_len=8, new_tokens=5),
              "bert-base", "encoder-only", "new_tokens")
    assert M.estimate_inference("bert-base", batch_size=1, seq_len=8).phase == "prefill"  # a prefill still answers


def test_cli_refuses_generation_for_an_encoder_only_model():
    r = cli_run("estimate", "infer", "--model", "bert-base", "--batch-size", "1", "--seq-len", "8", "--new-tokens", "5")
    assert r.returncode == 2 and "encoder-only" in r.stderr and "--new-tokens" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr and not r.stdout


@pytest.mark.parametrize("mode", ["infer", "train"])
def test_fit_without_seq_len_names_seq_len(mode):
    one_error(lambda: vramlab.fitting.fit("gpt2", "t4", mode=mode), "seq_len")


@pytest.mark.parametrize("call", [
    lambda: C.cheapest_plan("gpt2", 10**10, bogus=1, **KW),
    lambda: C.brute_force_blocks("gpt2", 10**10, bogus=1, **KW),
    lambda: vramlab.fitting.fragmentation_bytes("gpt2", bogus=1, **KW),
    lambda: vramlab.fitting.largest_tensor_bytes("gpt2", bogus=1, **KW),
    lambda: vramlab.fitting.fit("gpt2", "t4", seq_len=8, bogus=1),
])
def test_unknown_keywords_passed_on_are_named(call):
    one_error(call, "bogus")


def test_cheapest_plan_takes_a_numpy_budget():
    want = C.cheapest_plan("gpt2", 3 * 10**9, **KW)
    for budget in (np.int64(3 * 10**9), np.float64(3e9)):
        got = C.cheapest_plan("gpt2", budget, **KW)
        assert got.plan == want.plan and got.peak == want.peak


@pytest.mark.parametrize("budget", [True, "1e9", float("nan"), float("inf"), 0, -5, 10**400])
def test_cheapest_plan_refuses_a_bad_budget(budget):
    one_error(lambda: C.cheapest_plan("gpt2", budget, **KW), "budget_bytes")


@pytest.mark.parametrize("segments", [(("a", "b"),), ((0.5, 2),), ((0, 2.0),), ((True, 2),), (0, 2), "ab", 5,
                                      ((0, 1, 2),), ((0, 10**30),), ((np.bool_(False), 2),), (None,)])
def test_plan_segments_are_pairs_of_block_indices(segments):
    one_error(lambda: vramlab.activations.Plan(name="mine", segments=segments), "segment")


def test_plan_segments_take_numpy_integers():
    p = vramlab.activations.Plan(name="mine", segments=((np.int64(0), np.int32(2)), [np.int64(4), 6]))
    assert p.segments == ((0, 2), (4, 6)) and all(type(x) is int for seg in p.segments for x in seg)
    assert vramlab.activations.Plan(name="mine", segments=((0, 2),), offload=np.bool_(True)).offload is True


@pytest.mark.parametrize("plan", ["every-²", "every-0", "every--1", "first-x", "segments-", "every-1e3", "segments-0",
                                  "every-٣", "first-1.5", "every-", "sqrt-2", "FULL", "every-99999999999999999999"])
def test_odd_plan_names_say_what_plans_are_valid(plan):
    msg = one_error(lambda: vramlab.activations.recompute_plan(plan, "gpt2"), "recompute plan")
    assert "invalid literal" not in msg
    if "9999" not in plan:
        assert "every-K" in msg and "full" in msg
    one_error(lambda: M.estimate_training("gpt2", recompute=plan, **KW), "recompute plan")


@pytest.mark.parametrize("plan", ["every-²", "first-x", "every-1e3"])
def test_cli_odd_plan_names_are_one_line(plan):
    r = cli_run("estimate", "train", "--model", "gpt2", "--batch-size", "1", "--seq-len", "8", "--recompute", plan)
    assert r.returncode == 2 and "every-K" in r.stderr and "invalid literal" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_valid_plan_names_still_work():
    gpt2 = S.preset("gpt2")
    assert vramlab.activations.recompute_plan("every-4", gpt2).checkpointed() == {0, 4, 8}
    assert vramlab.activations.recompute_plan("first-0", gpt2).segments == ()
    assert vramlab.activations.recompute_plan("every-007", gpt2).checkpointed() == {0, 7}
    assert vramlab.activations.recompute_plan(np.array([2, 7]), gpt2).segments == ((2, 3), (7, 8))


# ----------------------------------------------------------------------------- memory, further

def test_numpy_scalars_give_the_same_plain_ints():
    spec = S.preset("gpt2")
    kw = dict(batch_size=np.int64(2), seq_len=np.int32(16))
    assert M.kv_cache_bytes(spec, **kw) == M.kv_cache_bytes(spec, batch_size=2, seq_len=16)
    assert type(M.kv_cache_bytes(spec, **kw)) is int
    a = vramlab.activations.activation_bytes(spec, **kw)
    assert all(type(v) is int for v in a["kept"]) and a == vramlab.activations.activation_bytes(spec, batch_size=2, seq_len=16)
    assert all(type(b) is int for _, b in C.timeline("gpt2", **kw))
    assert vramlab.fitting.device_fit(np.int64(10**9), "t4", largest_tensor=np.int64(10)).estimate == 10**9
    assert M.checkpoint_bytes(np.int64(10)) == 40
    assert M.checkpoint_bytes(70_000_000_000, dtype="bf16") == 140_000_000_000  # beyond 2^31 parameters
    assert M.model_states("gpt2", trainable_params=np.int64(5)) == M.model_states("gpt2", trainable_params=5)
    assert vramlab.fitting.fit("gpt2", "t4", seq_len=np.int64(64), batch_size=np.int64(2)) == vramlab.fitting.fit("gpt2", "t4", seq_len=64, batch_size=2)
    assert vramlab.fitting.largest_true(lambda n: n <= 37, limit=np.int64(100)) == 37
    assert M.optimizer_state_bytes("adamw", np.int64(10), "fp32") == 80


@pytest.mark.parametrize("call, name", [
    (lambda: M.estimate_inference("gpt2", all_logits="no", **KW), "all_logits"),
    (lambda: M.estimate_inference("gpt2", kv_dtype="fp8", **KW), "kv_dtype"),
    (lambda: M.estimate_inference("gpt2", gpu="voodoo", device="cpu", **KW), "GPU"),
    (lambda: M.estimate_training("gpt2", use_cache="no", **KW), "use_cache"),
    (lambda: M.estimate_training("gpt2", gpu=5, device="cpu", **KW), "GPU"),
    (lambda: M.estimate_training("gpt2", trainable_params=2.5, **KW), "trainable_params"),
    (lambda: vramlab.activations.activation_bytes(S.preset("gpt2"), frozen_base="yes", **KW), "frozen_base"),
    (lambda: vramlab.activations.activation_bytes(S.preset("gpt2"), share="all", **KW), "share"),
    (lambda: vramlab.activations.layer_saved(S.preset("gpt2"), decoder=1), "decoder"),
    (lambda: vramlab.activations.layer_saved(S.preset("gpt2"), batch_size=0), "batch_size"),
    (lambda: vramlab.activations.layer_saved("nope"), "preset"),
    (lambda: vramlab.activations.model_saved(5), "model"),
    (lambda: vramlab.activations.tp_split("q", S.preset("gpt2")), "Saved"),
    (lambda: M.param_bytes("fp64"), "precision"),
    (lambda: M.state_bytes(True), "precision"),
    (lambda: M.optimizer_state_bytes("lion", 10, "fp32"), "optimizer"),
    (lambda: M.optimizer_state_bytes("adamw", "10", "fp32"), "n_params"),
    (lambda: M.optimizer_state_bytes("adamw", 10**20, "fp32"), "n_params"),
    (lambda: M.optimizer_step_temporaries("adamw", "loop", S.preset("gpt2"), 10, "fp32"), "optimizer implementation"),
    (lambda: M.optimizer_step_temporaries("adamw", "for-loop", [1.5, 2], 10, "fp32"), "spec"),
    (lambda: M.checkpoint_bytes(True), "parameter_count"),
    (lambda: M.checkpoint_bytes(10**30), "parameter_count"),
    (lambda: vramlab.fitting.device_fit(float("inf"), "t4", largest_tensor=0), "estimate"),
    (lambda: vramlab.fitting.device_fit(10**9, "t4", largest_tensor=-1), "largest_tensor"),
    (lambda: vramlab.fitting.device_fit(10**9, "t4", largest_tensor=0, expandable_segments="yes"), "expandable_segments"),
    (lambda: vramlab.fitting.device_fit(10**9, "t4", largest_tensor=0, max_batch_size=1.5), "max_batch_size"),
    (lambda: vramlab.fitting.largest_tensor_bytes("gpt2", mode="decode", **KW), "mode"),
    (lambda: vramlab.fitting.largest_tensor_bytes("gpt2", dtype="fp7", mode="infer", **KW), "dtype"),
    (lambda: vramlab.fitting.largest_tensor_bytes("gpt2", batch_size=True, seq_len=8), "batch_size"),
    (lambda: vramlab.fitting.largest_true(5), "fits"),
    (lambda: vramlab.fitting.largest_true(lambda n: True, limit="5"), "limit"),
    (lambda: vramlab.fitting.largest_true(lambda n: True, start=0.5), "start"),
    (lambda: vramlab.fitting.fit("gpt2", "t4", seq_len=8, mode=True), "mode"),
    (lambda: vramlab.fitting.fit("gpt2", "t4", seq_len=8, max_search=np.float64(5)), "max_search"),
    (lambda: vramlab.fitting.fit("gpt2", "t4", seq_len=8, expandable_segments=1), "expandable_segments"),
    (lambda: vramlab.fitting.fit("gpt2", "t4", mode="infer", seq_len=8, new_tokens="5"), "new_tokens"),
    (lambda: vramlab.activations.recompute_plan("full", 3.5), "model"),
    (lambda: vramlab.activations.recompute_plan(None, "gpt2"), "recompute"),
])
def test_memory_arguments_are_named(call, name):
    one_error(call, name)


@pytest.mark.parametrize("kw, name", [
    (dict(parameters=1.5), "parameters"), (dict(activations="3"), "activations"), (dict(other=True), "other"),
    (dict(kv_cache=float("nan")), "kv_cache"), (dict(gradients=10**30), "gradients"), (dict(label=5), "label"),
])
def test_memory_breakdown_holds_integer_bytes(kw, name):
    one_error(lambda: M.MemoryBreakdown(**kw), name)


def test_memory_breakdown_takes_numpy_integers_and_differences():
    b = M.MemoryBreakdown(parameters=np.int64(10), activations=np.int32(5))
    assert b.total == 15 and type(b.parameters) is int
    assert (M.MemoryBreakdown(parameters=1) - M.MemoryBreakdown(parameters=3)).parameters == -2


@pytest.mark.parametrize("kw, name", [
    (dict(blocks=(3, 1)), "blocks"), (dict(blocks=(0, 1.5)), "blocks"), (dict(blocks="ab"), "blocks"),
    (dict(tp=0), "tp"), (dict(tp=True), "tp"), (dict(sp=1), "sp"), (dict(in_flight=0), "in_flight"),
    (dict(buffers=-1), "buffers"), (dict(param_tensors=[1, "2"]), "param_tensors"),
    (dict(embedding_grad="full"), "embedding_grad"), (dict(optimizer_shards=2.0), "optimizer_shards"),
])
def test_device_share_fields_are_checked(kw, name):
    one_error(lambda: vramlab.activations.DeviceShare(**kw), name)


def test_device_share_takes_numpy_scalars():
    share = vramlab.activations.DeviceShare(blocks=(np.int64(0), np.int64(1)), tp=np.int64(2), first=np.bool_(False), last=False,
                          param_tensors=np.array([3, 4]))
    assert share == vramlab.activations.DeviceShare(blocks=(0, 1), tp=2, first=False, last=False, param_tensors=(3, 4))
    assert vramlab.activations.DeviceShare() == vramlab.activations.WHOLE_MODEL and vramlab.activations.DeviceShare().whole


@pytest.mark.parametrize("kw, name", [
    (dict(name="", width=1, kind="x"), "name"), (dict(name="a", width=-1, kind="x"), "width"),
    (dict(name="a", width=1, kind="fp8"), "kind"), (dict(name="a", width=1, kind="x", part="head"), "part"),
    (dict(name="a", width=1, kind="x", per_score=1), "per_score"),
])
def test_saved_fields_are_checked(kw, name):
    one_error(lambda: vramlab.activations.Saved(**kw), name)


def test_fit_result_is_checked():
    good = vramlab.fitting.device_fit(10**9, "t4", largest_tensor=0)
    one_error(lambda: dataclasses.replace(good, fits="yes"), "fits")
    one_error(lambda: dataclasses.replace(good, needed=-1), "needed")
    one_error(lambda: dataclasses.replace(good, gpu="t4"), "gpu")


# ----------------------------------------------------------------------------- checkpointing, further

@pytest.mark.parametrize("call, name", [
    (lambda: C.flops("gpt2", batch_size="1", seq_len=8), "batch_size"),
    (lambda: C.flops("gpt2", batch_size=1, seq_len=10**12), "seq_len"),
    (lambda: C.recompute_flops("gpt2", "every-x", **KW), "recompute plan"),
    (lambda: C.evaluate("gpt2", "full", device="tpu", **KW), "device"),
    (lambda: C.evaluate("gpt2", "full", gpu=80, **KW), "GPU"),
    (lambda: C.evaluate("gpt2", "full", batch_size=2.0, seq_len=8), "batch_size"),
    (lambda: C.candidate_plans(None), "model"),
    (lambda: C.cheapest_plan("gpt2", 10**10, plans="full", **KW), "plans"),
    (lambda: C.cheapest_plan("gpt2", 10**10, plans=[], **KW), "plans"),
    (lambda: C.cheapest_plan("gpt2", 10**10, plans=["full", "every-²"], **KW), "every-²"),
    (lambda: C.cheapest_plan("gpt2", None, **KW), "gpu"),
    (lambda: C.brute_force_blocks("gpt2", 10**10, precision="fp7", **KW), "precision"),
    (lambda: C.timeline("gpt2", "full", batch_size=1, seq_len=8, precision="int4"), "precision"),
])
def test_checkpointing_arguments_are_named(call, name):
    one_error(call, name)


def test_checkpointing_takes_numpy_sizes():
    kw = dict(batch_size=np.int64(2), seq_len=np.int64(64))
    assert C.flops("gpt2", **kw) == C.flops("gpt2", batch_size=2, seq_len=64)
    r = C.evaluate("gpt2", "offload", gpu="t4", **kw)
    assert r == C.evaluate("gpt2", "offload", gpu="t4", batch_size=2, seq_len=64) and type(r.offload_bytes) is int


# ----------------------------------------------------------------------------- precision

@pytest.mark.parametrize("call, name", [
    (lambda: P.fmt(["fp16"]), "format"), (lambda: P.fmt(True), "format"), (lambda: P.fmt(None), "format"),
    (lambda: P.round_to("1", "fp16"), "x"), (lambda: P.round_to(True, "fp16"), "x"),
    (lambda: P.round_to(10**400, "fp16"), "x"), (lambda: P.round_to(1.0, "fp4"), "format"),
    (lambda: P.round_to(float("nan"), "int8"), "x"),
    (lambda: P.update_survives("1", 1e-3, 1e-3, "bf16"), "weight"),
    (lambda: P.update_survives(1.0, float("nan"), 1e-3, "bf16"), "lr"),
    (lambda: P.update_survives(1.0, 1e-3, None, "bf16"), "grad"),
    (lambda: P.min_loss_scale("1e-9"), "grad"), (lambda: P.min_loss_scale(1e-9, "fp9"), "format"),
    (lambda: P.DynamicLossScaler(scale="x"), "scale"), (lambda: P.DynamicLossScaler(scale=float("inf")), "scale"),
    (lambda: P.DynamicLossScaler(growth_factor=0.5), "growth_factor"),
    (lambda: P.DynamicLossScaler(backoff_factor=1.5), "backoff_factor"),
    (lambda: P.DynamicLossScaler(growth_interval=0), "growth_interval"),
    (lambda: P.DynamicLossScaler().update("no"), "found_inf"),
    (lambda: P.DynamicLossScaler().update(1), "found_inf"),
    (lambda: P.Format(name="x", bits=8, exponent_bits=9, mantissa_bits=0), "exponent_bits"),
    (lambda: P.Format(name="x", bits="8", exponent_bits=4, mantissa_bits=3), "bits"),
    (lambda: P.Format(name="x", bits=8, exponent_bits=4, mantissa_bits=3, finite_only="no"), "finite_only"),
    (lambda: P.RecipeLedger(name="x", weights=-1, gradients=2, master_weights=0, optimizer_states=4, note=""),
     "weights"),
])
def test_precision_arguments_are_named(call, name):
    one_error(call, name)


def test_precision_takes_numpy_scalars():
    assert P.min_loss_scale(np.float32(1e-9)) == P.min_loss_scale(1e-9)
    assert P.round_to(np.float32(1.1), "fp16") == P.round_to(1.1, "fp16")
    assert P.round_to(np.int64(300), "int8") == 127.0
    assert P.update_survives(np.float64(1.0), np.float32(1e-2), np.float64(1.0), "bf16")
    assert not P.update_survives(np.float64(1.0), np.float32(1e-3), np.float64(1.0), "bf16")
    s = P.DynamicLossScaler(scale=np.float64(1024.0), growth_interval=np.int64(2))
    assert s.update(np.bool_(True)) is False and s.scale == 512.0
    assert math.isinf(P.round_to(float("inf"), "fp16"))  # a cast of infinity is an answer, as torch's


# ----------------------------------------------------------------------------- specs

@pytest.mark.parametrize("call, name", [
    (lambda: S.preset(5), "preset"), (lambda: S.preset(None), "preset"),
    (lambda: S.from_config({"model_type": "gpt2"}, name=5), "name"),
    (lambda: S.gpu_for_device("NVIDIA A100-PCIE", "x"), "memory_bytes"),
    (lambda: S.gpu_for_device(None), "device_name"),
    (lambda: S.custom_gpu(True), "memory"), (lambda: S.custom_gpu(10**400), "memory"),
    (lambda: S.custom_gpu(float("nan")), "memory"), (lambda: S.custom_gpu(10**10, name=5), "name"),
    (lambda: S.custom_gpu(10**10, context_bytes=True), "context_bytes"),
    (lambda: S.custom_gpu(10**10, context_bytes=2.5), "context_bytes"),
    (lambda: dataclasses.replace(S.gpu("t4"), memory_bytes="16GB"), "memory_bytes"),
    (lambda: dataclasses.replace(S.gpu("t4"), bandwidth_GBps=float("nan")), "bandwidth_GBps"),
    (lambda: dataclasses.replace(S.gpu("t4"), name=""), "name"),
    (lambda: dataclasses.replace(S.preset("gpt2"), model_type=["gpt2"]), "model_type"),
    (lambda: dataclasses.replace(S.preset("gpt2"), norm="batchnorm"), "norm"),
    (lambda: dataclasses.replace(S.preset("gpt2"), num_layers=3.0), "num_layers"),
    (lambda: dataclasses.replace(S.preset("gpt2"), qkv_bias=1), "qkv_bias"),
])
def test_specs_arguments_are_named(call, name):
    with pytest.raises(S.SpecError) as e:  # a ValueError
        call()
    assert name in str(e.value) and "\n" not in str(e.value)


def test_specs_take_numpy_scalars():
    gpt2 = S.preset("gpt2")
    deeper = dataclasses.replace(gpt2, num_layers=np.int64(3), hidden_dropout=np.float64(0.1), qkv_bias=np.bool_(True))
    assert deeper == dataclasses.replace(gpt2, num_layers=3, hidden_dropout=0.1, qkv_bias=True)
    assert type(deeper.num_layers) is int
    assert S.custom_gpu(np.int64(16 * 2**30)) == S.custom_gpu(16 * 2**30)
    assert S.gpu_for_device("NVIDIA A100-PCIE", np.int64(42_000_000_000)).name == "a100-40gb"
    assert S.from_config({"model_type": "gpt2", "n_layer": np.int64(2)}).num_layers == 2


# ----------------------------------------------------------------------------- the command line

def test_cli_main_checks_argv():
    one_error(lambda: cli.main("estimate"), "argv")
    one_error(lambda: cli.main(["estimate", 5]), "argv")


@pytest.mark.parametrize("args, needle", [
    (["--batch-size", "1e3"], "--batch-size"), (["--batch-size", "99999999999999"], "at most"),
    (["--seq-len", "nan"], "--seq-len"), (["--new-tokens", "-1"], "non-negative"),
])
def test_cli_numbers_are_one_line(args, needle):
    mode = "infer" if "--new-tokens" in args else "train"
    base = {"--batch-size": "1", "--seq-len": "8"}
    base.update(dict(zip(args[::2], args[1::2])))
    r = cli_run("estimate", mode, "--model", "gpt2", *[x for kv in base.items() for x in kv])
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1
