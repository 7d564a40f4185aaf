"""A training step's settings as one value: made once, checked once, and the same step whichever way the
estimators are called. The numbers themselves are held by test_memory.py, test_accuracy.py and the rest."""

import dataclasses
import inspect

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vramlab import memory, optimizers
from vramlab.fitting import fit
from vramlab.specs import preset
from vramlab.step import OPTIONS, Step, as_step

CASES = [
    ("gpt2", dict(batch_size=2, seq_len=128)),
    ("gpt2", dict(batch_size=2, seq_len=128, precision="bf16-mixed", recompute="full", optimizer_impl="for-loop")),
    ("llama-3.2-1b", dict(batch_size=1, seq_len=256, precision="bf16", loss="chunked", loss_chunk_tokens=64)),
    ("gpt2", dict(batch_size=1, seq_len=64, optimizer="galore-adamw", galore_rank=32)),
    ("gpt2", dict(batch_size=1, seq_len=64, optimizer="adamw", optimizer_in_backward=True, device="cpu")),
    ("bert-base", dict(batch_size=4, seq_len=128, accumulation_steps=4, attention="eager")),
    ("olmoe-1b-7b", dict(batch_size=1, seq_len=64, precision="bf16", capacity_factor=1.25)),
]


@pytest.mark.parametrize("model,kw", CASES)
def test_a_step_and_its_options_give_the_same_phases(model, kw):
    """estimate_training(model, **options), estimate_training(Step) and the largest of training_phases(Step)
    are one estimate; the Step holds the model resolved and the recompute plan it names."""
    step = Step(model, **kw)
    assert step.model == preset(model) and step.plan.name == memory.recompute_plan(kw.get("recompute", "none"),
                                                                                    preset(model)).name
    phases = memory.training_phases(step)
    assert phases == memory.training_phases(model, **kw)
    assert memory.estimate_training(model, **kw) == memory.estimate_training(step) == max(phases, key=lambda m: m.total)


def test_a_step_is_frozen_and_says_what_it_is():
    step = Step("gpt2", batch_size=1, seq_len=32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.batch_size = 2
    assert "batch_size=1" in repr(step) and step.rank == optimizers.GALORE_RANK
    assert Step("gpt2", batch_size=1, seq_len=32) == step


@pytest.mark.parametrize("kw,message", [
    (dict(optimizer="adamw", galore_rank=64), "galore_rank is GaLore's projection rank: it applies to optimizer="),
    (dict(loss_chunk_tokens=64), "loss_chunk_tokens applies to loss='chunked' or 'fused'"),
    (dict(capacity_factor=1.25), "capacity_factor applies to a mixture of experts"),
    (dict(optimizer_in_backward=True, accumulation_steps=2), "gradients cannot accumulate"),
    (dict(use_cache=True, recompute="full"), "use_cache=True with recompute"),
    (dict(batch_size=0), "batch_size"),
    (dict(optimizer="lion"), "optimizer"),
])
def test_an_option_that_does_not_apply_is_refused_in_one_line(kw, message):
    kw = {"batch_size": 1, "seq_len": 32, **kw}
    for call in (lambda: Step("gpt2", **kw), lambda: memory.estimate_training("gpt2", **kw)):
        with pytest.raises(ValueError) as e:
            call()
        assert message in str(e.value) and "\n" not in str(e.value)


def test_unknown_options_and_a_step_with_options_are_refused():
    with pytest.raises(ValueError, match="estimate_training: unknown argument galore"):
        memory.estimate_training("gpt2", batch_size=1, seq_len=32, galore=8)
    step = Step("gpt2", batch_size=1, seq_len=32)
    with pytest.raises(ValueError, match="takes a Step or a model with options, not both: drop precision"):
        as_step(step, {"precision": "bf16"})
    with pytest.raises(ValueError, match="share must be"):
        memory.training_phases(step, share="whole")


def test_the_option_lists_are_the_functions_own():
    """What `fit` and the searches pass on is read from the Step's fields and estimate_inference's declared list,
    not from signatures; the declared list is estimate_inference's signature."""
    assert set(OPTIONS) == {f.name for f in dataclasses.fields(Step) if f.init} - {"model"}
    assert set(memory.INFERENCE_OPTIONS) == set(inspect.signature(memory.estimate_inference).parameters) - {"model"}
    assert memory.estimate_options() == set(OPTIONS) | set(memory.INFERENCE_OPTIONS)
    with pytest.raises(ValueError, match="does not take"):
        fit("gpt2", gpu="h100-80gb", seq_len=128, mode="train", kv_dtype="fp8")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(optimizer=st.sampled_from(optimizers.NAMES), rank=st.one_of(st.none(), st.integers(1, 4096)))
def test_a_galore_rank_reaches_galore_or_is_refused(optimizer, rank):
    """The fuzz input that reached an ignored argument: a rank with another optimizer is refused, never ignored;
    with GaLore it changes the states (a smaller rank, fewer bytes)."""
    kw = dict(batch_size=1, seq_len=32, optimizer=optimizer, galore_rank=rank)
    if rank is not None and optimizer != "galore-adamw":
        with pytest.raises(ValueError, match="galore_rank"):
            memory.estimate_training("gpt2", **kw)
        return
    est = memory.estimate_training("gpt2", **kw)
    if optimizer == "galore-adamw" and rank is not None and rank < 128:
        assert est.optimizer_states < memory.estimate_training("gpt2", **{**kw, "galore_rank": 128}).optimizer_states


@pytest.mark.parametrize("n,stage,kw", [
    (4, 2, dict(micro_batch_size=2, seq_len=128, recipe="fp32-adam", reduce_bucket=1_000_000)),
    (2, 3, dict(micro_batch_size=1, seq_len=64, implementation="fsdp2", recompute="full", loss="chunked")),
    (8, 3, dict(micro_batch_size=1, seq_len=256, accumulation_steps=4, persistence_threshold=10)),
])
def test_a_sharded_step_is_a_step_and_its_ranks(n, stage, kw):
    """zero.rank_phases(model, n, stage, **options) is the phases of its (Step, Ranks): the step's precision is
    the recipe's and its optimizer_impl DeepSpeed's and FSDP2's fused one unless given."""
    from vramlab import zero as Z

    step, ranks = Z.sharded_step("gpt2", n, stage, micro_batch_size=kw.pop("micro_batch_size"),
                                 seq_len=kw.pop("seq_len"), options=dict(kw))
    assert step.precision == Z.ACT_PRECISION[ranks.recipe] and step.optimizer_impl == "fused"
    assert (ranks.n_ranks, ranks.stage) == (n, stage)
    phases = Z.rank_phases(step, ranks)
    assert phases == Z.rank_phases("gpt2", n, stage, micro_batch_size=step.batch_size, seq_len=step.seq_len, **kw)
    assert Z.estimate_rank(step, ranks) == max(phases, key=lambda b: b.total)


def test_a_sharded_step_refuses_a_mix_and_what_it_does_not_model():
    from vramlab import zero as Z

    ranks = Z.Ranks(2, 2)
    with pytest.raises(ValueError, match="takes a Step and a Ranks, or a model"):
        Z.rank_phases(Step("gpt2", batch_size=1, seq_len=32), 2, 2)
    with pytest.raises(ValueError, match="not a mix"):
        Z.estimate_rank(Step("gpt2", batch_size=1, seq_len=32, precision="bf16-fp32-states"), ranks, seq_len=32)
    with pytest.raises(ValueError, match="has precision 'bf16-fp32-states', got 'fp32'"):
        Z.rank_phases(Step("gpt2", batch_size=1, seq_len=32), ranks)
    with pytest.raises(ValueError, match="models Adam on every parameter"):
        Z.rank_phases(Step("gpt2", batch_size=1, seq_len=32, precision="bf16-fp32-states", optimizer="sgd"), ranks)
    with pytest.raises(ValueError, match="rank_phases: unknown argument precision"):
        Z.rank_phases("gpt2", 2, 2, micro_batch_size=1, seq_len=32, precision="bf16")
    with pytest.raises(ValueError, match="stage must be 3 with implementation='fsdp2'"):
        Z.Ranks(2, 2, implementation="fsdp2")


def test_a_layouts_device_takes_a_step():
    """parallel.estimate_layout(model, layout, micro_batch_size=..., seq_len=..., **options) is the estimate of its
    Step (precision bf16-mixed unless given); what a layout does not model is refused in one line."""
    from vramlab import parallel as P

    layout = P.Layout(tp=2, pp=2, micro_batches=4)
    kw = dict(precision="fp32", recompute="selective", optimizer_impl="fused")
    step = P.layout_step("gpt2", micro_batch_size=2, seq_len=128, options=kw)
    assert step.batch_size == 2 and step.precision == "fp32"
    assert P.estimate_layout(step, layout) == P.estimate_layout("gpt2", layout, micro_batch_size=2, seq_len=128, **kw)
    assert P.layout_step("gpt2", micro_batch_size=1, seq_len=8).precision == "bf16-mixed"
    with pytest.raises(ValueError, match="not both"):
        P.estimate_layout(step, layout, seq_len=128)
    with pytest.raises(ValueError, match="estimate_layout: unknown argument loss"):
        P.estimate_layout("gpt2", layout, micro_batch_size=1, seq_len=8, loss="chunked")
    with pytest.raises(ValueError, match="leave accumulation_steps"):
        P.estimate_layout(Step("gpt2", batch_size=1, seq_len=8, accumulation_steps=2), layout)
    with pytest.raises(ValueError, match="unknown optimizer 'adafactor'"):
        P.estimate_layout(Step("gpt2", batch_size=1, seq_len=8, optimizer="adafactor"), layout)
