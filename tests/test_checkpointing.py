"""Activation checkpointing (chapter 7): recompute plans, their FLOPs, the budget planner, and the
stored measurements of lab 7."""

import dataclasses
import json
from pathlib import Path

import pytest

import vramlab.activations
import vramlab.precision
import vramlab.specs
from vramlab import checkpointing as C
from vramlab import memory as M
from vramlab.measure.checkpointing import lab_spec  # the lab's models (a choice of shapes, not an expectation)
from vramlab.specs import from_config, preset

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30


def test_plan_names_give_the_segments_they_promise():
    gpt2 = preset("gpt2")  # 12 blocks
    assert vramlab.activations.recompute_plan("none", gpt2).segments == ()
    assert vramlab.activations.recompute_plan("full", gpt2).segments == tuple((i, i + 1) for i in range(12))
    assert vramlab.activations.recompute_plan("sqrt", gpt2).segments == ((0, 3), (3, 6), (6, 9), (9, 12))  # round(sqrt 12) = 3
    assert vramlab.activations.recompute_plan("segments-5", gpt2).segments == ((0, 5), (5, 10), (10, 12))
    assert vramlab.activations.recompute_plan("every-4", gpt2).checkpointed() == {0, 4, 8}
    assert vramlab.activations.recompute_plan("first-3", gpt2).checkpointed() == {0, 1, 2}
    assert vramlab.activations.recompute_plan({7, 2}, gpt2).segments == ((2, 3), (7, 8))
    t5 = preset("t5-small")  # 6 + 6 blocks: a segment never spans encoder and decoder
    assert vramlab.activations.recompute_plan("segments-4", t5).segments == ((0, 4), (4, 6), (6, 10), (10, 12))


@pytest.mark.parametrize("plan, match", [("every-0", "unknown recompute plan"), ("first-13", "only 12 blocks"),
                                         ("most", "unknown recompute plan"), ({12}, r"0\.\.11"),
                                         ([True], "set of block indices"), (3.5, "set of block indices")])
def test_bad_plans_are_one_clear_error(plan, match):
    with pytest.raises(ValueError, match=match):
        M.estimate_training("gpt2", batch_size=1, seq_len=64, recompute=plan)


def test_full_recompute_flops_are_megatrons_formula():
    """Narayanan+21 (arXiv:2104.04473) eq. 3: a GPT step with full recompute is
    96 B s l h^2 (1 + s/(6h) + V/(16 l h)) FLOPs; without, 72 B s l h^2 (1 + s/(6h) + V/(12 l h))
    (Korthikanti+22 eq. 8). Checked on GPT-3 175B's shape."""
    gpt3 = dataclasses.replace(preset("gpt2"), name="gpt3-175b", hidden_size=12288, num_heads=96, num_kv_heads=96, head_dim=128,
                               num_layers=96, intermediate_size=4 * 12288)
    B, s, l, h, V = 4, 2048, 96, 12288, gpt3.vocab_size
    f = C.flops(gpt3, batch_size=B, seq_len=s)
    assert f["step"] == pytest.approx(72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h)), rel=1e-12)
    with_recompute = f["step"] + C.recompute_flops(gpt3, "full", batch_size=B, seq_len=s)
    assert with_recompute == pytest.approx(96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h)), rel=1e-12)


def test_recompute_fractions():
    kw = dict(batch_size=2, seq_len=1024)
    f = C.flops("gpt2", **kw)
    full = C.recompute_flops("gpt2", "full", **kw)
    assert full == sum(f["blocks"])
    assert C.recompute_flops("gpt2", "sqrt", **kw) == full  # every block once, whatever the segments
    assert C.recompute_flops("gpt2", "first-3", **kw) == 3 * f["blocks"][0]
    assert C.recompute_flops("gpt2", "sac-matmuls", **kw) == 0
    assert C.recompute_flops("gpt2", "selective", **kw) == 12 * 4 * 2 * 1024 ** 2 * 768  # QK^T and PV only
    assert 0.2 < full / f["step"] < 1 / 3  # one extra forward of the blocks: < 1/3 of a step (the head is not recomputed)


def test_h100_reference_full_recompute():
    """../shared/gpu-truth: llama-3.2-1b b=4 s=2048 bf16-mixed on an H100: 47,074,650,624 B peak
    allocated without recompute and 29,272,975,872 B with full recompute (the first run's 43.8 and 27.3
    GiB). The plan's peak within 3 % of both."""
    kw = dict(batch_size=4, seq_len=2048, precision="bf16-mixed", gpu="h100-80gb")
    none = C.evaluate("llama-3.2-1b", "none", **kw).peak.total
    full = C.evaluate("llama-3.2-1b", "full", **kw).peak.total
    assert abs(none - 47_074_650_624) / 47_074_650_624 < 0.03
    assert abs(full - 29_272_975_872) / 29_272_975_872 < 0.03


def test_more_checkpoints_never_cost_memory_at_the_forward_end():
    kw = dict(batch_size=4, seq_len=512, device="cpu")
    acts = [vramlab.activations.activation_bytes(preset("gpt2"), recompute=f"first-{k}", **kw)["layers"] for k in range(13)]
    assert all(a > b for a, b in zip(acts, acts[1:]))
    assert acts[12] == vramlab.activations.activation_bytes(preset("gpt2"), recompute="full", **kw)["layers"]


def test_sqrt_beats_full_where_activations_dominate():
    """Chen+16: sqrt(L) segments keep sqrt(L) checkpoints and one segment, against L checkpoints
    and one block: on a 64-block model with short vocabulary the forward-end activations are far
    smaller, for the same recompute."""
    deep = dataclasses.replace(preset("gpt2"), num_layers=64, vocab_size=256)
    kw = dict(batch_size=8, seq_len=1024, device="cpu", precision="fp32")
    full, sqrt = C.evaluate(deep, "full", **kw), C.evaluate(deep, "sqrt", **kw)
    assert sqrt.recompute_flops == full.recompute_flops
    layers = lambda p: vramlab.activations.activation_bytes(deep, recompute=p, batch_size=8, seq_len=1024, device="cpu")["layers"]
    assert layers("sqrt") * 8 == layers("full")  # 8 checkpoints instead of 64


SMALL = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 6,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512,
         "max_position_embeddings": 1024, "tie_word_embeddings": True}


@pytest.mark.parametrize("model", [dataclasses.replace(preset("gpt2"), num_layers=5), from_config(SMALL, name="small"),
                                   dataclasses.replace(preset("t5-small"), num_layers=3, num_decoder_layers=3)])
def test_cheapest_plan_against_brute_force(model):
    """For budgets between no recompute and full recompute: the planner's choice fits and recomputes
    no more than the best of all 2^L sets of individually checkpointed blocks (brute force); where
    brute force finds a fit, so does the planner."""
    kw = dict(batch_size=4, seq_len=512, precision="fp32", device="cpu")
    lo = C.evaluate(model, "full", **kw).peak.total
    hi = C.evaluate(model, "none", **kw).peak.total
    assert lo < hi
    for frac in (0.05, 0.3, 0.6, 0.9, 1.0):
        budget = int(lo + frac * (hi - lo))
        best = C.brute_force_blocks(model, budget, **kw)
        got = C.cheapest_plan(model, budget, **kw)
        assert best is not None and got is not None
        assert got.peak.total <= budget
        assert got.recompute_flops <= best.recompute_flops, (frac, got.plan.name, best.plan.name)
    assert C.cheapest_plan(model, hi, **kw).plan.name == "none"
    assert C.cheapest_plan(model, lo // 2, **kw) is None or C.cheapest_plan(model, lo // 2, **kw).plan.offload


def test_planner_bad_input():
    with pytest.raises(ValueError, match="positive number of bytes"):
        C.cheapest_plan("gpt2", -1, batch_size=1, seq_len=64)
    with pytest.raises(ValueError, match="mfu"):
        C.evaluate("gpt2", "full", batch_size=1, seq_len=64, gpu="t4", mfu=1.5)
    with pytest.raises(ValueError, match="brute force"):
        C.brute_force_blocks("gpt2-xl", 1 << 40, batch_size=1, seq_len=64)


def test_timeline_rises_in_the_forward_and_peaks_in_the_backward():
    ev = C.timeline("gpt2", "none", batch_size=2, seq_len=512, device="cpu")
    fwd = [b for n, b in ev if n.startswith("forward")]
    assert fwd == sorted(fwd) and len(ev) == 12 + 1 + 12
    full = C.timeline("gpt2", "full", batch_size=2, seq_len=512, device="cpu")
    assert max(b for _, b in full) < max(b for _, b in ev) / 3
    # the full plan's backward holds the checkpoints before the block and the block recomputed
    act = vramlab.activations.activation_bytes(preset("gpt2"), batch_size=2, seq_len=512, device="cpu", recompute="full")
    assert dict(full)["backward 11"] == 11 * act["block_in"] + act["full"][11] + act["outside"]


# ----------------------------------------------------------------------------- measured (lab 7)
def _stored():
    """`python -m vramlab.measure.checkpointing --time 3` on this project's CPU machine (chapter 7's table)."""
    return json.loads((ROOT / "benchmarks" / "results" / "checkpointing" / "ckptlab_cpu.json").read_text())


def test_stored_memory_of_every_plan_within_5_percent():
    """Every plan's traced peak within 5 % of the prediction, recomputed here from the
    case's settings (not read from the file)."""
    run = _stored()
    assert run["mode"] == "trace" and "gpu" not in run["provenance"]
    cases = run["cases"]
    assert {c["plan"] for c in cases} == {"none", "full", "sac-matmuls", "sqrt", "every-2", "first-4", "segments-4"}
    assert {c["model"] for c in cases} == {"gpt2", "llama-small"}
    for c in cases:
        pred = C.evaluate(lab_spec(c["model"]), c["plan"], batch_size=c["batch_size"], seq_len=c["seq_len"],
                          precision=c["precision"], device="cpu").peak.total
        assert abs(pred - c["measured_bytes"]) <= 0.05 * c["measured_bytes"], (c["model"], c["plan"])
    # and the plans really differ: full recompute saves more than a third of GPT-2's peak here
    g = {c["plan"]: c["measured_bytes"] for c in cases if c["model"] == "gpt2"}
    assert g["full"] < 0.67 * g["none"] and g["full"] < g["sac-matmuls"] < g["none"]


def test_stored_step_time_overhead_against_the_recompute_fraction():
    """The measured overhead t_plan / t_none - 1 within 20 % of the predicted recompute
    fraction (FLOPs), for the plans that recompute blocks; sac-matmuls recomputes no matmul (its FLOP
    prediction is 0), so its measured cost is only required to be below full recompute's."""
    rows = _stored()["timing"]
    checked = 0
    for r in rows:
        spec = lab_spec(r["model"])
        if r["plan"] in ("full", "sqrt"):
            frac = C.recompute_flops(spec, r["plan"], batch_size=r["batch_size"], seq_len=r["seq_len"]) / \
                C.flops(spec, batch_size=r["batch_size"], seq_len=r["seq_len"])["step"]
            assert abs(r["overhead"] - frac) <= 0.2 * frac, (r["model"], r["plan"], r["overhead"], frac)
            checked += 1
    assert checked == 4
    for model in ("gpt2", "llama-small"):
        t = {r["plan"]: r["overhead"] for r in rows if r["model"] == model}
        assert t["none"] == 0 and 0 < t["sac-matmuls"] < t["full"]


def test_h100_lab_run_memory_of_every_plan_within_4_percent():
    """Lab 7's instructor version on an H100 (CUDA allocator peaks, one process per plan,
    labs/results/h100/): every plan's peak within 4 % of the prediction for a CUDA device, recomputed
    here from the case's settings. On the GPU the time overheads are not FLOP-bound at the lab's sizes
    (chapter 7 says so); only their order is asserted: full recompute costs more than none."""
    lab = json.loads((ROOT / "labs" / "results" / "h100" / "lab07_checkpointing_h100.json").read_text())
    run = lab["run"]
    assert run["mode"] == "cuda" and lab["provenance"]["gpu"].startswith("NVIDIA H100")
    assert len(run["cases"]) == 14
    for c in run["cases"]:
        pred = C.evaluate(lab_spec(c["model"]), c["plan"], batch_size=c["batch_size"], seq_len=c["seq_len"],
                          precision=c["precision"], device="cuda").peak.total
        assert abs(pred - c["measured_bytes"]) <= 0.04 * c["measured_bytes"], (c["model"], c["plan"])
    for model in ("gpt2", "llama-small"):
        t = {r["plan"]: r["overhead"] for r in run["timing"] if r["model"] == model}
        assert t["none"] == 0 and t["full"] > 0


def test_plans_beyond_the_labs_models_where_a_recomputed_block_decides_the_peak():
    """Every measurable plan on OPT and GPT-NeoX models built from configs (not the lab's
    families; a small vocabulary so that the blocks decide the peak), 8 x 1024 tokens, traced on the
    CPU one process per configuration (benchmarks/checkpointing_validation.py). The prediction is
    recomputed here. In this regime the peak of full, sqrt and segments-4 (and NeoX's sac-matmuls) is
    a recomputed block's backward. There the model erred high by 0 to 4 % until a later change traced the
    over-count apart: that phase added the final norm's saved tensors (freed before any block's backward), a
    second incoming b x s x h gradient and weight gradients not made yet; it is now within 1 % either side
    (OPT 0.0 %, NeoX +0.8 to +1.3 %: its parallel residual). This run found the model holding one (b, s, intermediate) tensor too many
    in a GELU MLP's backward (NeoX was 5.5 to 9 % high): the down projection's input is freed before
    the activation's gradient is made."""
    run = json.loads((ROOT / "benchmarks" / "results" / "checkpointing" / "validation_trace.json").read_text())
    assert run["mode"] == "trace" and "gpu" not in run["provenance"]
    specs_ = {name: from_config(cfg, name=name) for name, cfg in run["models"].items()}
    inside = 0
    for c in run["cases"]:
        r = C.evaluate(specs_[c["model"]], c["plan"], batch_size=c["batch_size"], seq_len=c["seq_len"],
                       precision=c["precision"], device="cpu")
        err = (r.peak.total - c["measured_bytes"]) / c["measured_bytes"]
        assert -0.05 <= err <= 0.045, (c["model"], c["plan"], c["precision"], err)
        if r.peak.phase.startswith("backward of a recomputed block"):
            inside += 1
            assert -0.01 <= err <= 0.02, (c["model"], c["plan"], err)  # the re-run block's moment, traced apart
    assert inside >= 6  # (OPT's full plan in fp32 peaks at the logits' gradient, exactly, since the fix)
    # the effect is there: checkpointing cuts each model's traced fp32 peak by more than 40 %
    for m in specs_:
        got = {c["plan"]: c["measured_bytes"] for c in run["cases"] if c["model"] == m and c["precision"] == "fp32"}
        assert got["full"] < 0.6 * got["none"] and got["full"] < got["sqrt"] < got["none"]


def test_validation_benchmark_refuses_an_unwritable_out_before_tracing(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "checkpointing_validation.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "cannot write --out" in r.stderr


@pytest.mark.parametrize("plan", ["full", "sqrt", "first-2", "sac-matmuls"])
def test_t5_checkpoints_keep_one_shared_bias_of_all_heads(plan):
    """Checkpointed T5 blocks keep their shared (1, a, s, s) position bias as an input: a = the number
    of heads, whatever the plan's segments (a loop over segments once reused the name `a` and counted
    the last segment's start instead)."""
    t5 = preset("t5-small")
    kw = dict(batch_size=3, seq_len=256, precision="fp32")
    extra = vramlab.activations.activation_bytes(t5, recompute=plan, **kw)["outside"] - vramlab.activations.activation_bytes(t5, **kw)["outside"]
    assert extra == t5.num_heads * 256 * 256 * 4


@pytest.mark.parametrize("kw, needle", [(dict(segments=((3, 1),)), "empty or reversed"),
                                        (dict(segments=((2, 2),)), "empty or reversed"),
                                        (dict(segments=((0, 3), (2, 4))), "overlap"),
                                        (dict(segments=((0, True),)), "pairs of block indices"),
                                        (dict(keep="everything"), "keep must be"),
                                        (dict(offload="yes"), "offload must be True or False")])
def test_hand_built_plans_are_checked(kw, needle):
    """A reversed or empty segment was accepted and answered a smaller peak with no recompute
    FLOPs; a bogus `keep` was accepted. Now one line says what is wrong."""
    from vramlab.activations import Plan

    with pytest.raises(ValueError, match=needle):
        Plan(name="mine", **kw)


def test_a_plan_cannot_cross_from_encoder_to_decoder():
    from vramlab.activations import Plan

    with pytest.raises(ValueError, match="crosses from t5-small's encoder into its decoder"):
        C.evaluate("t5-small", Plan(name="mine", segments=((5, 7),)), batch_size=1, seq_len=8)
    ok = C.evaluate("t5-small", Plan(name="mine", segments=[[6, 8], [0, 2]]), batch_size=1, seq_len=8)
    assert ok.plan.segments == ((0, 2), (6, 8)) and ok.recompute_flops > 0


def test_offload_plan_pays_its_copies_as_chapter_6_measured_them():
    """The offload plan assumed its copies hide behind compute at the link's nominal rate;
    chapter 6 measured save_on_cpu's on the compute stream at 0.62 of nominal. The step is the full
    plan's compute plus both copies of every checkpoint (b x s x h, fp32 under autocast) at that rate."""
    from vramlab import offload as OFF

    kw = dict(batch_size=4, seq_len=2048, precision="bf16-mixed", gpu="h100-80gb")
    spec = preset("llama-3.2-1b")
    off, full = C.evaluate(spec, "offload", **kw), C.evaluate(spec, "full", **kw)
    moved = spec.num_layers * 4 * 2048 * spec.hidden_size * 4
    assert off.offload_bytes == moved
    link = 16 * 3.938e9 * OFF.SAVE_ON_CPU_EFFICIENCY  # PCIe 5.0 x16 after line coding, as the H100 host has
    assert off.step_seconds == pytest.approx(full.step_seconds + 2 * moved / link)


def _cheapest_by_weighing_every_plan(model, budget, **kw):
    """cheapest_plan as it was: every candidate evaluated, the least (offload, recompute, peak) that fits."""
    spec = vramlab.specs.resolve(model)
    results = [C.evaluate(spec, p, **kw) for p in C.candidate_plans(spec)]
    fitting = [r for r in results if C._fits(r, budget)]
    if not fitting:
        return None
    return min(fitting, key=lambda r: (r.plan.offload, r.recompute_flops, C._recomputes(r.plan), r.peak.total))


@pytest.mark.parametrize("model", ["gpt2", "opt-125m", "llama-3.2-1b", "t5-small", "bert-base", "llama-3.1-8b"])
def test_cheapest_plan_weighs_groups_but_answers_as_weighing_every_plan(model):
    """cheapest_plan stops at the first group of equally cheap plans with one that fits (and when the
    model states alone do not fit); the answer is the exhaustive one, whether something fits or not."""
    import random

    rng = random.Random(model)
    answers = set()
    for _ in range(5):
        kw = dict(batch_size=rng.choice((1, 4, 16, 64)), seq_len=rng.choice((128, 512)),
                  precision=rng.choice(vramlab.precision.PRECISIONS))
        for budget, gpu in ((None, rng.choice(("t4", "h100-80gb", "gtx-1060-6gb"))),
                            (rng.choice((10**8, 10**9, 4 * 10**9, 2 * 10**10)), None)):
            extra = dict(kw, gpu=gpu) if gpu else kw
            want = _cheapest_by_weighing_every_plan(model, budget, **extra)
            got = C.cheapest_plan(model, budget, **extra)
            assert (want is None) == (got is None), (extra, budget)
            if want is not None:
                assert (got.plan, got.peak, got.recompute_flops) == (want.plan, want.peak, want.recompute_flops)
            answers.add(None if got is None else got.plan.name)
    # the cases reach more than one answer (fits at once, fits later, nothing fits); the 8B's model
    # states never fit these budgets: it is the shortcut's case, every time
    assert len(answers) >= 2 if model != "llama-3.1-8b" else answers == {None}
