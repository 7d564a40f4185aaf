"""Gradient accumulation (`accumulation_steps` of vramlab.memory.estimate_training): the estimate
against traced peaks of the real loop (k micro-batches, backward each, one optimizer step; trace
mode: FakeTensorMode + MemTracker on CPU kernels, not a GPU), on models that are not lab 1's, in
the regime where activations dominate (a smaller micro-batch lowers the peak) and where model states
dominate (accumulation raises it: the gradients stay under the next micro-batches). The expected
values are measurements, never the estimator's output."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

from vramlab import estimate_training, preset
from vramlab.memory import model_states, training_phases

ROOT = Path(__file__).resolve().parents[1]
STORED = ROOT / "benchmarks" / "results" / "accumulation" / "validation_trace.json"
TOL = 0.02  # every traced case so far is within 0.4 %
TINY = dict(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=4, head_dim=32, intermediate_size=512)


def tiny(name, **extra):
    return dataclasses.replace(preset(name), **{**TINY, **extra})


# ----------------------------------------------------------------------------- the estimator alone

def test_one_micro_batch_is_the_plain_step():
    kw = dict(batch_size=4, seq_len=512, precision="bf16-mixed")
    assert training_phases("gpt2", **kw) == training_phases("gpt2", accumulation_steps=1, **kw)


def test_later_micro_batches_run_over_every_gradient():
    kw = dict(batch_size=4, seq_len=512, precision="bf16-mixed")
    G = model_states("gpt2", precision="bf16-mixed").gradients
    plain = training_phases("gpt2", **kw)
    acc = training_phases("gpt2", accumulation_steps=4, **kw)
    later = [p for p in acc if p.phase.startswith("micro-batch 2-4: ")]
    assert acc[:len(plain) - 1] == plain[:-1] and acc[-1] == plain[-1]  # micro-batch 1 ... the one optimizer step
    assert len(later) == len(plain) - 1 and all(p.gradients == G for p in later)
    fwd = next(p for p in later if "forward end" in p.phase)
    assert fwd.total - plain[0].total == G  # what stays: every gradient; what scales: the activations
    # the same for any k > 1: the gradients are held, whatever the number of micro-batches
    assert estimate_training("gpt2", accumulation_steps=2, **kw).total == estimate_training("gpt2", accumulation_steps=64, **kw).total
    assert training_phases("gpt2", accumulation_steps=2, **kw)[len(plain) - 1].phase.startswith("micro-batch 2: ")


def test_tied_head_gradient_waits_for_the_embedding():
    """Tied: the head's new gradient waits in autograd's input buffer under the blocks' backward;
    untied it is added into .grad at once."""
    tied = tiny("gpt2", vocab_size=50257)
    untied = dataclasses.replace(tied, tie_word_embeddings=False)
    head = 50257 * 128 * 4
    for spec, extra in ((tied, head), (untied, 0)):
        ph = training_phases(spec, batch_size=1, seq_len=64, accumulation_steps=2)
        first = next(p for p in ph if "block" in p.phase and not p.phase.startswith("micro"))
        later = next(p for p in ph if "block" in p.phase and p.phase.startswith("micro"))
        assert later.temporaries - first.temporaries == extra


@pytest.mark.parametrize("bad", [0, -1, 2.5, "4", True, 1 << 17])
def test_bad_accumulation_steps(bad):
    with pytest.raises(ValueError, match="accumulation_steps"):
        estimate_training("gpt2", batch_size=1, seq_len=128, accumulation_steps=bad)


# ----------------------------------------------------------------------------- against traces

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def _bench():
    s = importlib.util.spec_from_file_location("accumulation_validation", ROOT / "benchmarks" / "accumulation_validation.py")
    mod = importlib.util.module_from_spec(s)
    s.loader.exec_module(mod)
    return mod


def _stored_rows():
    run = json.loads(STORED.read_text())
    return [(name, row) for name, case in run["cases"].items() for row in case["rows"]]


@pytest.mark.parametrize("name,row", _stored_rows(), ids=lambda x: x if isinstance(x, str) else f"m{x['micro_batch']}")
def test_stored_traces_within_tolerance(name, row):
    bench = _bench()
    est = estimate_training(bench.spec(name), batch_size=row["micro_batch"], accumulation_steps=row["accumulation_steps"],
                            device="cpu", **bench.MODELS[name][1])
    assert abs(est.total / row["measured"] - 1) <= TOL, (name, row["micro_batch"], est.total, row["measured"], est.phase)
    if row["accumulation_steps"] > 1:  # the traced peak has every gradient resident
        assert row["breakdown"]["gradients"] == model_states(bench.spec(name), precision="fp32").gradients


def test_stored_traces_show_both_regimes():
    run = json.loads(STORED.read_text())
    assert run["mode"] == "trace" and "torch" in run["provenance"]
    peaks = {name: {r["micro_batch"]: r["measured"] for r in case["rows"]} for name, case in run["cases"].items()}
    act = peaks["neox-activations"]
    assert act[1] < act[2] < act[4] < act[8] and act[1] < 0.5 * act[8]  # activations scale with the micro-batch
    states = peaks["opt-model-states"]
    assert states[1] > states[8]  # accumulating costs memory: the gradients stay


@pytest.mark.slow
def test_stored_file_reproduces():
    """One stored number, traced again here: the file is what the benchmark measures."""
    bench = _bench()
    run = json.loads(STORED.read_text())
    row = run["cases"]["llama-gqa-bf16"]["rows"][2]
    from vramlab.measure.memory import measure_training

    torch.set_num_threads(1)
    m = measure_training(bench.spec("llama-gqa-bf16"), batch_size=row["micro_batch"],
                         accumulation_steps=row["accumulation_steps"], mode="trace", **bench.MODELS["llama-gqa-bf16"][1])
    assert m.total == row["measured"]


@pytest.mark.slow
@pytest.mark.parametrize("name,extra,kw", [
    ("gpt2", dict(vocab_size=2000), dict(seq_len=64)),  # tied head and embedding, fp32
    ("bert-base", dict(vocab_size=1500), dict(seq_len=64, optimizer="sgd-momentum")),
])
def test_live_trace(name, extra, kw):
    """Two micro-batches of 2 against the trace of the real loop, on families the stored file lacks."""
    from vramlab.measure.memory import measure_training

    torch.set_num_threads(1)
    spec = tiny(name, **extra)
    m = measure_training(spec, batch_size=2, accumulation_steps=2, mode="trace", **kw)
    est = estimate_training(spec, batch_size=2, accumulation_steps=2, device="cpu", **kw)
    assert abs(est.total / m.total - 1) <= TOL, (est.total, m.total, est.phase)
    assert m.breakdown.gradients == 4 * spec.params


def test_chapter_1_calculator_takes_accumulation_steps():
    from vramlab import fit
    from vramlab.present import calculators as C

    kw = dict(seq_len=1024, precision="bf16-mixed")
    r = C.get("training").run(model="gpt2-medium", batch_size=4, gpu="t4", accumulation_steps=8, **kw)
    assert not r.error
    est = estimate_training("gpt2-medium", batch_size=4, gpu="t4", accumulation_steps=8, **kw)
    assert r.numbers["train_total"][0] == est.total and r.numbers["global_batch"][0] == 32
    assert r.numbers["max_batch"][0] == fit("gpt2-medium", "t4", accumulation_steps=8, **kw).max_batch_size
    assert "8 micro-batches of 4 (global batch 32)" in r.text
    plain = C.get("training").run(model="gpt2-medium", batch_size=4, gpu="t4", **kw)
    assert r.numbers["train_total"][0] - plain.numbers["train_total"][0] == model_states("gpt2-medium", precision="bf16-mixed").gradients
    bad = C.get("training").run(accumulation_steps=0)
    assert bad.invalid == ("accumulation_steps",) and "out of range" in bad.error


@pytest.mark.slow
def test_trace_equals_real_cpu_tracking_of_the_loop():
    """The accumulation loop's trace is what real CPU tensors hold (the tracker sees the same
    storages): trace mode may stand for the loop."""
    from vramlab.measure.memory import measure_training

    torch.set_num_threads(1)
    spec = tiny("gpt2", vocab_size=1000)
    kw = dict(batch_size=2, seq_len=32, accumulation_steps=3)
    real = measure_training(spec, mode="cpu", **kw)
    fake = measure_training(spec, mode="trace", **kw)
    assert abs(real.total - fake.total) <= 1 << 16
    assert real.breakdown.gradients == fake.breakdown.gradients == 4 * spec.params
