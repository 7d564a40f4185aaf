"""Measurement: trace mode equals real tensor tracking; frozen (PEFT) parameters work; the
breakdown's fixed categories hold what they should."""

import dataclasses
import sys

import pytest

torch = pytest.importorskip("torch")

from vramlab import estimate_training, preset  # noqa: E402
from vramlab.specs import from_config  # noqa: E402
from vramlab.measure.memory import measure_inference, measure_isolated, measure_training  # noqa: E402

from .conftest import tiny  # noqa: E402


def test_trace_equals_real_cpu_tracking():
    spec = tiny()
    kw = dict(batch_size=2, seq_len=64)
    real = measure_training(spec, mode="cpu", **kw)
    fake = measure_training(spec, mode="trace", **kw)
    assert abs(real.total - fake.total) <= 1 << 20  # within 1 MiB
    assert real.breakdown.parameters == fake.breakdown.parameters == 4 * spec.params


def test_categories():
    spec = tiny()
    m = measure_training(spec, batch_size=1, seq_len=16, mode="trace")  # tiny batch: the step is the peak
    bd = m.breakdown
    assert bd.parameters == 4 * spec.params
    assert bd.optimizer_states >= 8 * spec.params  # Adam m and v (+ step counters)
    assert bd.inputs == 16 * 8  # the int64 token ids (labels share them)
    big = measure_training(spec, batch_size=8, seq_len=256, mode="trace", attention="eager")
    assert big.breakdown.activations > big.breakdown.parameters


def test_trace_mode_measures_gpu_sized_models_without_their_memory():
    spec = dataclasses.replace(preset("llama-3.1-8b"), num_layers=1)  # 1.3 B params incl. embeddings
    m = measure_training(spec, batch_size=1, seq_len=256, mode="trace", precision="bf16-mixed")
    assert m.breakdown.parameters == 4 * spec.params  # 5 GiB of fp32 weights that were never allocated


@pytest.mark.slow
def test_frozen_parameters_peft():
    peft = pytest.importorskip("peft")
    spec = tiny()

    def lora(model):
        cfg = peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True)
        return peft.get_peft_model(model, cfg)

    m = measure_training(spec, batch_size=2, seq_len=32, mode="cpu", model_hook=lora)
    n_lora = 2 * 4 * (128 + 3 * 128)  # two layers, r (d_in + d_out) each (Hu+21)
    assert m.breakdown.optimizer_states < 8 * n_lora + 4096  # Adam states for the adapters only
    assert m.breakdown.gradients <= 4 * n_lora
    assert m.breakdown.parameters == 4 * (spec.params + n_lora)
    est = estimate_training(spec, batch_size=2, seq_len=32, trainable_params=n_lora, device="cpu")
    assert est.optimizer_states == 8 * n_lora


def test_inference_prefill_keeps_kv_cache():
    spec = tiny("llama-3.2-1b", num_kv_heads=2, vocab_size=1000)
    m = measure_inference(spec, batch_size=2, seq_len=64, mode="trace", precision="bf16")
    kv = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 64 * 2 * 2
    assert m.breakdown.parameters == 2 * spec.params
    assert m.breakdown.activations >= kv  # the cache (held by the output) is tracked as activations


def test_cuda_mode_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        measure_training(tiny(), batch_size=1, seq_len=8, mode="cuda")


# ----------------------------------------------------------------------------- nothing leaks

@pytest.mark.slow
def test_a_measurement_leaves_nothing_alive_and_repeats_exactly():
    """After measure_training returns, its model, optimizer, batch and tracker are gone (a weak
    reference to the model dies), and repeated measurements read the same peak: nothing of one
    measurement can count in the next."""
    import gc
    import weakref

    spec = tiny()
    refs = []

    def remember(model):
        refs.append(weakref.ref(model))
        return model

    peaks = [measure_training(spec, batch_size=2, seq_len=32, mode="cpu", model_hook=remember).total for _ in range(3)]
    gc.collect()
    assert len(refs) == 3 and all(r() is None for r in refs), "a measured model is still referenced"
    assert peaks[0] == peaks[1] == peaks[2]
    inf = [measure_inference(spec, batch_size=2, seq_len=32, mode="cpu").total for _ in range(2)]
    assert inf[0] == inf[1]


@pytest.mark.slow
def test_warmup_steps_do_not_count_in_the_measured_peak():
    """Warm-up steps run before the tracked step: the peak is one step's, however many came first."""
    spec = tiny()
    one = measure_training(spec, batch_size=2, seq_len=32, mode="cpu", warmup_steps=0)
    three = measure_training(spec, batch_size=2, seq_len=32, mode="cpu", warmup_steps=3, timing_steps=2)
    assert one.total == three.total
    assert len(three.step_seconds) == 2 and three.seconds == sum(three.step_seconds) / 2  # the median of two


@pytest.mark.slow
@pytest.mark.parametrize("fork", [True, False], ids=["forked-from-the-fork-server", "new-interpreter"])
def test_measure_isolated_runs_in_a_fresh_process_and_round_trips(fork, monkeypatch):
    """On the CPU the measurement runs in a process forked from a fork server that imported torch once; on a GPU
    (and here with FORK_ON_CPU off) in a new interpreter. Either way a process of its own, with the same answer."""
    import os

    import vramlab.measure.memory as M

    monkeypatch.setattr(M, "FORK_ON_CPU", fork)
    spec = tiny()
    here = measure_training(spec, batch_size=2, seq_len=32, mode="cpu")
    pids = []
    real = M.measure_training
    monkeypatch.setattr(M, "measure_training", lambda *a, **k: pids.append(os.getpid()) or real(*a, **k))
    there = measure_isolated("training", spec, batch_size=2, seq_len=32, mode="cpu")
    assert there is not None and there.total == here.total
    assert there.breakdown == here.breakdown  # categories, label, precision and device survive the trip
    assert there.provenance["torch"] == torch.__version__
    assert not pids  # (not measured in this process: the function patched here was never called)


@pytest.mark.slow
def test_in_fork_answers_reports_a_death_and_stops_at_its_timeout():
    """What a forked process returns comes back; one that dies without an answer leaves {} and its exit code;
    one past the timeout is killed and raised as a timeout (several processes: slow tier)."""
    import os
    import subprocess
    import time

    import vramlab.measure.memory as M

    assert M.in_fork(dict, {"a": 1}) == ({"a": 1}, "")
    answer, log = M.in_fork(os._exit, 3, what="probe x")
    assert answer == {} and log.strip().endswith("the probe x's process ended with exit code 3")
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired, match="probe y"):
        M.in_fork(time.sleep, 60, timeout=1, what="probe y")
    assert time.monotonic() - t0 < 30


@pytest.mark.slow
def test_measure_isolated_reports_errors_in_one_line():
    with pytest.raises(RuntimeError, match="failed: .*batch_size"):
        measure_isolated("training", tiny(), batch_size="two", seq_len=32, mode="cpu")
    with pytest.raises(ValueError, match="kind must be"):
        measure_isolated("training-step", tiny(), batch_size=2, seq_len=32)


@pytest.mark.slow
def test_recompute_full_works_with_either_transformers_api():
    """transformers 5.17 (the GPU image) has only gradient_checkpointing_enable."""
    from vramlab.measure.memory import _enable_checkpointing

    calls = []

    class Old:
        def gradient_checkpointing_enable(self, **kw):
            calls.append(("old", kw))

    class New(Old):
        def activation_checkpointing_enable(self, **kw):
            calls.append(("new", kw))

    _enable_checkpointing(Old())
    _enable_checkpointing(New())
    assert [c[0] for c in calls] == ["old", "new"]
    full = measure_training(tiny(), batch_size=4, seq_len=64, mode="cpu", recompute="full")
    none = measure_training(tiny(), batch_size=4, seq_len=64, mode="cpu")
    assert full.breakdown.activations < none.breakdown.activations


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_measurement_releases_everything():
    """On a GPU: after a measurement the allocator holds what it held before (plus cuBLAS
    workspaces, which live for the process), and a second measurement reads the same peak."""
    spec = tiny()
    torch.ones(1, device="cuda") @ torch.ones(1, 1, device="cuda")
    first = measure_training(spec, batch_size=2, seq_len=64, mode="cuda")
    import gc

    gc.collect()
    after = torch.cuda.memory_allocated()
    second = measure_training(spec, batch_size=2, seq_len=64, mode="cuda")
    gc.collect()
    assert torch.cuda.memory_allocated() == after
    assert second.peak_allocated == first.peak_allocated
    iso = measure_isolated("training", spec, batch_size=2, seq_len=64, mode="cuda")
    assert abs(iso.peak_allocated - first.peak_allocated) <= 64 << 20  # the workspaces differ at most


# ----------------------------------------------------------------------------- fp16 flushing (lab 5)


def test_generate_measurement_runs_for_decoders_and_t5():
    """new_tokens: generate() with the cache growing to prompt + new tokens (no early stop)."""
    spec = tiny("llama-3.2-1b", num_kv_heads=2, vocab_size=1000)
    gen = measure_inference(spec, batch_size=2, seq_len=32, precision="fp32", mode="cpu", new_tokens=8)
    assert gen.breakdown.parameters == 4 * spec.params and gen.total > gen.breakdown.parameters
    t5 = dataclasses.replace(preset("t5-small"), num_layers=1, num_decoder_layers=1, hidden_size=64, num_heads=2,
                             num_kv_heads=2, head_dim=32, intermediate_size=128, vocab_size=500)
    assert measure_inference(t5, batch_size=1, seq_len=16, precision="fp32", mode="cpu", new_tokens=4).total > 0


@pytest.mark.slow
def test_kernelless_lab_runner_matches_jupytext_and_runs_lab1(tmp_path):
    """The GPU campaign runs labs without Jupyter (the GPU image has no Jupyter stack): its cells
    are jupytext's, and lab 1 runs end to end from them and saves its results."""
    import importlib.util
    import json
    from pathlib import Path

    labs = Path(__file__).resolve().parents[2] / "labs"
    mods = {}
    for name in ("kernelless", "tools"):
        s = importlib.util.spec_from_file_location(name, labs / f"{name}.py")
        mods[name] = importlib.util.module_from_spec(s)
        s.loader.exec_module(mods[name])
    kl, tools = mods["kernelless"], mods["tools"]
    for lab in tools.labs():
        assert kl.code_cells(lab) == [c.source for c in tools.source_notebook(lab).cells if c.cell_type == "code"]
    out = tmp_path / "lab01.json"
    kl.run("lab01_where_memory_goes", results=out)
    saved = json.loads(out.read_text())
    assert saved["mode"] == "trace" and saved["command"] == "python labs/kernelless.py lab01_where_memory_goes"
    assert {r["kind"] for r in saved["rows"]} == {"train", "prefill", "max_batch"}
    # lab 2's grader reads the ring function's source (inspect.getsource): the runner keeps cell sources
    out2 = tmp_path / "lab02.json"
    kl.run("lab02_collectives", results=out2)
    assert "gloo" in json.loads(out2.read_text())["runs"]


def test_measuring_8bit_adamw_says_what_it_needs(monkeypatch):
    """measure_training with bitsandbytes' 8-bit AdamW: refused on fake tensors (its step reads
    values), and a one-line reason when bitsandbytes is missing."""
    from vramlab.measure import memory as measure

    from vramlab.measure.compression import TEACHER  # lab 8's model

    spec = from_config(TEACHER, name="lab")
    with pytest.raises(NotImplementedError, match="mode='cpu'"):
        measure.measure_training(spec, batch_size=1, seq_len=8, mode="trace", optimizer="adamw-8bit")
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails as if not installed
    with pytest.raises(NotImplementedError, match="needs bitsandbytes"):
        measure.make_optimizer([torch.nn.Parameter(torch.zeros(3))], optimizer="adamw-8bit", optimizer_impl="foreach")
