"""vramlab.optimizers: each optimizer's state bytes by tensor, where they live, and the training step
with the optimizer in the backward. The exact checks against the libraries' real storage are at the end: the
stored CPU measurements (benchmarks/results/optimizers/cpu.json, written by vramlab.measure.optimizers, which
never reads this module) and a few live steps."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

import vramlab
from vramlab import memory as M
from vramlab import optimizers as O
from vramlab import precision as P

ROOT = Path(__file__).resolve().parents[1]
STORED = ROOT / "benchmarks" / "results" / "optimizers" / "cpu.json"


def test_every_optimizer_is_described_and_one_device_takes_them_all():
    assert set(O.INFO) == set(O.NAMES) and set(O.SHARDED) < set(O.NAMES)
    assert not hasattr(M, "OPTIMIZERS") and not hasattr(M, "ALL_OPTIMIZERS")  # one vocabulary: the registry's
    for name in O.NAMES:
        assert O.INFO[name].label and O.INFO[name].source and O.INFO[name].keeps


@pytest.mark.parametrize("shape", [(4096, 1024), (3, 50, 70), (513,), (7, 9)])
def test_adam_and_adafactor_by_hand(shape):
    n = math.prod(shape)
    assert O.tensor_states("adamw", shape, param_bytes=2) == {"exp_avg": 2 * n, "exp_avg_sq": 2 * n, "step": 4}
    ada = O.tensor_states("adafactor", shape, param_bytes=4)
    if len(shape) == 1:
        assert ada == {"variance": 4 * n, "step": 4}
    else:  # the row statistic drops the last dimension, the column one the one before it
        lead = math.prod(shape[:-2])
        assert ada == {"row_var": 4 * lead * shape[-2], "col_var": 4 * lead * shape[-1], "step": 4}
    hf = O.tensor_states("adafactor-momentum", shape, param_bytes=2)  # transformers: fp32 whatever the model
    assert hf["exp_avg"] == 4 * n and hf["RMS"] == 4 and "step" not in hf
    assert sum(O.tensor_states("adafactor", (4096, 4096), param_bytes=4).values()) < 1e-3 * 8 * 4096 * 4096


def test_quantized_states_fall_back_where_the_libraries_do():
    # bitsandbytes: under 4096 values both moments are fp32; from 4096 on 1 byte + an fp32 absmax per 256
    assert O.tensor_states("adamw-8bit", (4095,), param_bytes=2) == {"state1": 4 * 4095, "state2": 4 * 4095}
    assert sum(O.tensor_states("adamw-8bit", (4096,), param_bytes=2).values()) == 2 * 4096 + 2 * 4 * 16
    # torchao: a tensor the block does not divide keeps zeros_like(p), in the parameter's dtype
    assert O.tensor_states("adamw-8bit-ao", (200, 200), param_bytes=2)["exp_avg"] == 2 * 40000
    assert O.tensor_states("adamw-8bit-ao", (256, 64), param_bytes=2)["exp_avg"] == 16384 + 4 * 64 + 4 * 256
    assert O.tensor_states("adamw-4bit-ao", (256, 64), param_bytes=2)["exp_avg"] == 8192 + 4 * 128 + 4 * 16
    assert O.tensor_states("adamw-fp8-ao", (256, 64), param_bytes=2)["exp_avg"] == 16384 + 4 * 64
    assert O.shared_bytes("adamw-8bit", [(4095,)]) == 0 < O.shared_bytes("adamw-8bit", [(4095,), (4096,)]) == 2048


def test_galore_projects_the_blocks_matrices_with_its_rank_capped():
    assert O.galore_target("layers.0.self_attn.q_proj.weight", (64, 64))
    assert O.galore_target("h.3.mlp.c_fc.weight", (3072, 768))
    assert not O.galore_target("embed_tokens.weight", (1000, 64))
    assert not O.galore_target("layers.0.mlp.experts.gate_up_proj", (8, 128, 64))  # 3-D: not a linear layer
    assert not O.galore_target("layers.0.self_attn.q_proj.bias", (64,))
    st = O.tensor_states("galore-adamw", (4096, 1024), param_bytes=2, rank=128)
    assert st == {"exp_avg": 2 * 4096 * 128, "exp_avg_sq": 2 * 4096 * 128, "ortho_matrix": 2 * 1024 * 128}
    small = O.tensor_states("galore-adamw", (100, 40), param_bytes=2, rank=128)  # rank above the small side
    assert small["ortho_matrix"] == 2 * 40 * 40 and small["exp_avg"] == 2 * 100 * 40
    # an fp32 weight's projection is a slice of the SVD's whole s x s factor, which its storage keeps
    assert O.tensor_states("galore-adamw", (4096, 1024), param_bytes=4, rank=128)["ortho_matrix"] == 4 * 1024 * 1024
    assert not O.galore_target("layers.0.mlp.gate.weight", (8, 64))  # a router
    assert not O.galore_target("layers.0.mlp.shared_expert_gate.weight", (1, 64))
    assert O.galore_target("layers.0.mlp.gate_proj.weight", (256, 64))
    assert O.galore_target("encoder.block.0.layer.1.DenseReluDense.wi.weight", (512, 128))


def test_the_ledger_says_where_the_bytes_live():
    spec = vramlab.preset("llama-3.2-1b")
    adam = O.ledger("adamw", spec, param_bytes=4)
    assert adam.device == 8 * spec.params and adam.paged == adam.host == 0 and adam.steps == 4 * len(spec.param_tensors())
    paged = O.ledger("paged-adamw", spec, param_bytes=2)  # fp32 states, big ones in unified memory
    big = sum(n for _, n in spec.param_tensors() if n >= O.BNB_PAGE_MIN)
    assert paged.paged == 8 * big and paged.device == 8 * (spec.params - big)
    off = O.ledger("adamw-cpu-offload", spec, param_bytes=2)
    small = sum(n for _, n in spec.param_tensors() if n < O.OFFLOAD_MIN)
    assert off.device == 4 * small and off.host > 3 * 2 * (spec.params - small)
    # model_states counts what the allocator holds
    assert M.model_states(spec, precision="bf16", optimizer="paged-adamw").optimizer_states == paged.device
    # pinned copies of each weight and gradient, rounded to a power of two by the pinned allocator; unpinned states
    big = [n for _, n in spec.param_tensors() if n >= O.OFFLOAD_MIN]
    assert off.host == sum(2 * O.pinned_bytes(2 * n) + 4 * n + 4 for n in big)
    assert O.pinned_bytes(3) == 4 and O.pinned_bytes(4096) == 4096 and O.pinned_bytes(0) == 0
    # torchao's default keeps the device's gradients until zero_grad (offload_gradients=False) and steps on the
    # host after the backward; offload_gradients=True is the optimizer in the backward: one tensor's at a time
    kw = dict(batch_size=1, seq_len=256, precision="bf16", optimizer="adamw-cpu-offload")
    assert M.model_states(spec, precision="bf16", optimizer="adamw-cpu-offload").gradients == 2 * spec.params
    step = next(p for p in M.training_phases(spec, **kw) if p.phase == "optimizer.step()")
    assert step.gradients == 2 * spec.params and step.temporaries == 0 and step.optimizer_states == off.device
    inb = M.training_phases(spec, optimizer_in_backward=True, **kw)
    assert max(p.gradients for p in inb) <= 2 * 2 * max(big)


def test_bad_input_is_one_line():
    with pytest.raises(ValueError, match="unknown optimizer .lion."):
        O.tensor_states("lion", (3,), param_bytes=4)
    with pytest.raises(ValueError, match="modelled on one device"):
        M.training_phases("gpt2", batch_size=1, seq_len=64, optimizer="adafactor",
                          share=dataclasses.replace(M.WHOLE_MODEL, tp=2, blocks=(0, 12)))
    with pytest.raises(ValueError, match="accumulate"):
        M.estimate_training("gpt2", batch_size=1, seq_len=64, optimizer_in_backward=True, accumulation_steps=2)
    with pytest.raises(ValueError, match="keeps fp32 states"):
        M.model_states("gpt2", precision="bf16-fp32-states", optimizer="adafactor")
    with pytest.raises(ValueError, match="adapters' shapes"):
        M.model_states("gpt2", optimizer="galore-adamw", trainable_params=1000)
    with pytest.raises(ValueError, match="no fused implementation"):
        M.estimate_training("gpt2", batch_size=1, seq_len=64, optimizer="adafactor", optimizer_impl="fused")


@pytest.mark.parametrize("model, b, s", [("llama-3.2-1b", 1, 512), ("gpt2", 1, 128), ("qwen2.5-7b", 1, 256)])
def test_optimizer_in_backward_drops_the_gradients_and_the_step(model, b, s):
    """With the step inside the backward no phase holds more than one tensor's gradient (plus a tied embedding's,
    waiting for its second use) and there is no optimizer.step() phase: where the step was the peak, the peak
    falls by at least the gradients."""
    spec = vramlab.preset(model)
    kw = dict(batch_size=b, seq_len=s, precision="bf16")
    normal = M.training_phases(spec, **kw)
    fused = M.training_phases(spec, optimizer_in_backward=True, **kw)
    assert not any(p.phase == "optimizer.step()" for p in fused)
    largest = max(n for _, n in spec.param_tensors()) * 2
    assert max(p.gradients for p in fused) <= largest * (2 if spec.tie_word_embeddings else 1)
    top, top_f = max(normal, key=lambda p: p.total), max(fused, key=lambda p: p.total)
    if top.phase == "optimizer.step()":
        assert top.total - top_f.total >= 2 * spec.params - largest
    assert top_f.total <= top.total


def test_cli_takes_the_new_optimizers(capsys):
    from vramlab.present import cli

    assert cli.main(["estimate", "train", "--model", "gpt2", "--batch-size", "1", "--seq-len", "128",
                     "--optimizer", "galore-adamw", "--galore-rank", "32", "--precision", "bf16"]) == 0
    assert "total" in capsys.readouterr().out
    assert cli.main(["estimate", "train", "--model", "gpt2", "--batch-size", "1", "--seq-len", "128",
                     "--optimizer-in-backward"]) == 0
    capsys.readouterr()
    assert cli.main(["estimate", "train", "--model", "gpt2", "--batch-size", "1", "--seq-len", "128",
                     "--galore-rank", "8"]) == 2
    err = capsys.readouterr().err
    assert "--optimizer galore-adamw" in err and len(err.strip().splitlines()) == 1


def test_fp8_recipes_reproduce_the_playbooks_table():
    """The Ultra-Scale Playbook's FP8 table: each recipe's parts add up to its published total."""
    want = {"bf16-baseline": 20, "bf16-no-fp32-accum": 16, "transformer-engine": 16, "fp8-lm-o3": 9,
            "deepseek-v3": 15, "nanotron-fp8": 10}
    assert {n: r.total for n, r in P.FP8_RECIPES.items()} == want == {n: r.published_total for n, r in P.FP8_RECIPES.items()}
    ms = P.fp8_model_states("deepseek-v3", 10**9)
    assert ms["total"] == 15 * 10**9 and ms["weights"] == 10**9
    # DeepSeek-V3's scales: one per 128 x 128 weight block, one per 1 x 128 input tile
    assert P.fp8_scale_bytes("deepseek-v3", [(7168, 2048)]) == 4 * 56 * 16
    assert P.fp8_saved_input_bytes("deepseek-v3", 4096, 7168) == 4096 * 7168 + 4 * 4096 * 56
    assert P.fp8_scale_bytes("transformer-engine", [(10, 10)] * 3) == 3 * 5 * 1026 * 4
    assert P.fp8_scale_bytes("bf16-baseline", [(10, 10)]) == 0
    with pytest.raises(ValueError, match="2 dimensions"):
        P.fp8_scale_bytes("deepseek-v3", [(3, 4, 5)])


# ----------------------------------------------------------------------------- against the real libraries

def _stored():
    if not STORED.exists():
        pytest.skip("no stored optimizer measurements (python -m vramlab.measure.optimizers)")
    return json.loads(STORED.read_text())


def _spec(data, name):
    from vramlab.specs import ModelSpec

    s = data["models"][name]["spec"]
    return ModelSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in s.items()})


_LIB = {"adamw-bnb-32bit": "paged-adamw"}  # bitsandbytes' 32-bit AdamW: the bytes its paged version keeps


def _ledger_for(row, spec):
    opt = _LIB.get(row["optimizer"], row["optimizer"])
    names = [n for n, _ in spec.param_shapes()]
    projected = None
    if "projected" in row:  # the tensors the measured run projected (the real names carry the model's prefix)
        projected = [n for n in names if any(p == n or p.endswith("." + n) for p in row["projected"])]
    pb = 4 if row["dtype"] == "fp32" else 2
    return opt, pb, projected, O.ledger(opt, spec, param_bytes=pb, rank=row.get("rank", O.GALORE_RANK),
                                        projected=projected)


def test_state_bytes_equal_the_libraries_storage_exactly():
    """Every stored run (4 model families not the labs', fp32 and bf16, 13 optimizers from 5 libraries, GaLore at
    two ranks): the optimizer's state storage after a real step on the CPU equals the estimate to the byte, in
    total and tensor by tensor."""
    data = _stored()
    checked = 0
    for row in data["states"]:
        spec = _spec(data, row["model"])
        if "skipped" in row:  # the paged optimizers fall back to ordinary buffers on the CPU: the same bytes
            if "cpu_fallback_bytes" in row:
                lg = O.ledger(row["optimizer"], spec, param_bytes=4 if row["dtype"] == "fp32" else 2)
                assert lg.device + lg.paged + lg.steps == row["cpu_fallback_bytes"], row["optimizer"]
            continue
        opt, pb, projected, lg = _ledger_for(row, spec)
        assert lg.storage == row["in_state"], (row["model"], row["dtype"], row["optimizer"], lg.storage, row["in_state"])
        for (name, shape), t in zip(spec.param_shapes(), row["tensors"]):
            assert t["name"].endswith(name) and tuple(t["shape"]) in (shape, shape[::-1]), (name, t["name"])
            mine = O.tensor_states(opt, shape, param_bytes=pb, rank=row.get("rank", O.GALORE_RANK),
                                   projected=projected is not None and name in projected)
            real = {k: v for k, v in t["state"].items() if not k.startswith("qmap") or "." in k}  # bnb's maps: shared
            assert sum(mine.values()) == sum(real.values()), (row["optimizer"], name, mine, real)
        checked += 1
    assert checked >= 80
    optimizers = {r["optimizer"] for r in data["states"] if "skipped" not in r}
    assert {"adamw", "adafactor", "adafactor-hf", "adafactor-momentum", "adamw-8bit", "adamw-8bit-ao", "adamw-4bit-ao",
            "adamw-fp8-ao", "galore-adamw"} <= optimizers
    # where the effects live: torchao quantizes nothing in a model whose sizes its blocks do not divide, GaLore at a
    # rank above the matrices' smaller side keeps more than AdamW
    by = {(r["model"], r["dtype"], r["optimizer"], r.get("rank")): r for r in data["states"] if "skipped" not in r}
    assert by[("llama-gqa-200", "bf16", "adamw-4bit-ao", None)]["in_state"] >= by[("llama-gqa-200", "bf16", "adamw", None)]["in_state"]
    assert by[("gpt2-small-256", "fp32", "galore-adamw", 512)]["in_state"] > by[("gpt2-small-256", "fp32", "adamw", None)]["in_state"]


def test_step_peaks_with_the_optimizer_in_and_after_the_backward():
    """The stored whole-step peaks (trace mode and real CPU tensors, MemTracker): the normal loop and the optimizer
    stepped in the backward, on GPT-2, Llama-3.2-1B (where the step is the normal loop's peak and the in-backward
    loop saves 20-25 %) and two small models, within 2 %; Adafactor's and torchao's step phase within 1 %."""
    data = _stored()
    saved = 0
    for r in data["in_backward"]:
        spec = _spec(data, r["model"])
        for loop, in_bwd in (("normal", False), ("in-backward", True)):
            est = M.estimate_training(spec, batch_size=r["batch_size"], seq_len=r["seq_len"], precision=r["precision"],
                                      device="cpu", optimizer_in_backward=in_bwd)
            got = r[loop]["peak"]
            assert abs(est.total - got) <= 0.02 * got, (r["model"], r["precision"], loop, est.total, got)
        saved = max(saved, r["normal"]["peak"] - r["in-backward"]["peak"])
    assert saved > 4e9  # Llama-3.2-1B fp32: its gradients and the step's copy
    for r in data["peaks"]:
        spec = _spec(data, r["model"])
        # torch's Adafactor steps tensor by tensor on the CPU (foreach only by default on CUDA)
        impl = "for-loop" if r["optimizer"] == "adafactor" else "foreach"
        phases = M.training_phases(spec, batch_size=r["batch_size"], seq_len=r["seq_len"], precision=r["precision"],
                                   device="cpu", optimizer=r["optimizer"], optimizer_impl=impl)
        step = next(p for p in phases if p.phase == "optimizer.step()")
        got = r["phase_peaks"]["optimizer.step"]["peak"]
        assert abs(step.total - got) <= 0.01 * got, (r["optimizer"], r["mode"], step.total, got)
        assert abs(max(p.total for p in phases) - r["peak"]) <= 0.01 * r["peak"]


@pytest.mark.slow
def test_live_states_on_a_family_the_stored_runs_lack():
    """A fresh model of another family (OPT), the libraries that step without compiling: the real storage after one
    step (vramlab.measure.optimizers counts it) equals the estimate to the byte."""
    pytest.importorskip("torch")
    from vramlab.measure import optimizers as MO

    spec = dataclasses.replace(vramlab.preset("opt-125m"), name="opt-tiny", hidden_size=96, num_heads=4, num_kv_heads=4,
                               head_dim=24, intermediate_size=200, num_layers=2, vocab_size=1000,
                               max_position_embeddings=64, word_embed_proj_dim=96)
    for opt, dtype, rank in (("adamw", "bf16", None), ("adafactor", "fp32", None), ("adafactor-momentum", "bf16", None),
                             ("adamw-8bit", "fp32", None), ("galore-adamw", "bf16", 32), ("galore-adamw", "fp32", 32)):
        row = MO.measure_states(spec, dtype, opt, rank=rank)
        assert "skipped" not in row, row
        _, _, _, lg = _ledger_for(row, spec)
        assert lg.storage == row["in_state"], (opt, dtype, lg.storage, row["in_state"])


def test_the_registry_declares_each_optimizer_once():
    """One registry: every name has its library (and the version its rules were read from), where its states live,
    and whether the sharded estimators, flat counts and the recipe's state dtype apply; the vocabularies the other
    modules read are derived from it."""
    from vramlab import step as STEP

    for name, info in O.INFO.items():
        assert info.library in O.VERSIONS and info.version == O.VERSIONS[info.library]
        assert info.placement in O.PLACEMENTS
        assert not (info.sharded and info.shaped)  # a flat shard cannot price a shaped optimizer
        lg = O.ledger(name, [("w", (4096, 64))], param_bytes=4)
        assert (lg.paged > 0) == (info.placement == "paged") and (lg.host > 0) == (info.placement == "host")
    assert O.SHARDED == tuple(n for n in O.NAMES if O.INFO[n].sharded)
    assert O.SHAPED == tuple(n for n in O.NAMES if O.INFO[n].shaped)
    assert set(O.TORCH) == {n for n in O.NAMES if O.INFO[n].library == "torch.optim"} - {"adafactor"}
    assert STEP.Step("gpt2", batch_size=1, seq_len=8, optimizer=O.NAMES[-1]).optimizer == O.NAMES[-1]
