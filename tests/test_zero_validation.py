"""zerolab's per-step tracker, its new command-line options, and the stored validation runs
(benchmarks/results/zero/validation/, written by benchmarks/zero_validation.py)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VALIDATION = ROOT / "benchmarks" / "results" / "zero" / "validation"


def _driver():
    spec = importlib.util.spec_from_file_location("zero_validation", ROOT / "benchmarks" / "zero_validation.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("argv, says", [
    (["--reduce-bucket", "0"], "argument --reduce-bucket: must be between 1"),
    (["--allgather-bucket", "1.5"], "argument --allgather-bucket: expected a whole number"),
    (["--max-live-params", "-1"], "argument --max-live-params: must be between 0"),
    (["--prefetch-bucket", "nan"], "argument --prefetch-bucket: expected a whole number"),
    (["--model", "gpt5"], "argument --model: invalid choice"),
    (["--model", "opt-wide-vocab", "--seq", "999"], "--seq must be at most 512 (opt-wide-vocab's positions)"),
])
def test_new_options_refuse_bad_values_in_one_line(argv, says):
    r = subprocess.run([sys.executable, "-m", "vramlab.zerolab", *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr
    assert len([ln for ln in r.stderr.splitlines() if "error:" in ln]) == 1


def test_models_build_to_their_spec_sizes():
    """Each model zerolab can train has the parameters vramlab.specs counts from its config (the mT5-like
    model's head untied, as the published mT5's is), and the shape the sweep relies on."""
    pytest.importorskip("transformers")
    from vramlab import zerolab as Z

    for name in Z.MODELS:
        st = Z.structure(Z._build(name=name))
        assert st["params"] == Z.model_spec(name).params, name
    opt, llama, mt5 = (Z.structure(Z._build(name=n)) for n in ("opt-wide-vocab", "llama-gqa-wide-mlp", "mt5-small-like"))
    assert opt["root_params"] > max(opt["block_params"]) and opt["head_tied_to_embedding"]
    assert llama["root_params"] < min(llama["block_params"]) and llama["at_or_below_threshold"]["largest"] <= 512
    assert not mt5["head_tied_to_embedding"] and len(mt5["block_params"]) == 4


def test_deepspeed_config_carries_the_knobs():
    from vramlab.zerolab import deepspeed_config

    cfg = deepspeed_config("3", 2, "bf16", {"reduce_bucket": 5, "prefetch_bucket": 0, "max_live_params": None})
    assert cfg["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 5, "stage3_prefetch_bucket_size": 0}
    assert cfg["bf16"] == {"enabled": True} and cfg["gradient_clipping"] == 0.0


def test_tracker_follows_frees_resizes_and_phases():
    """The tracker counts what a step starts with, every new storage until it dies, a storage resized to
    0 (FSDP2's way of freeing a gathered parameter) as freed and resized back as allocated, and keeps
    each phase's high with what was live then."""
    torch = pytest.importorskip("torch")
    from vramlab.zerolab import _PeakTracker, _TrackMode

    lin = torch.nn.Linear(256, 256, bias=False)
    gathered = torch.empty(1024)  # 4 KiB, resized away below, like an FSDP2 unsharded parameter
    tracker = _PeakTracker(lin, torch.optim.SGD(lin.parameters()), {"parameters": {lin.weight.untyped_storage().data_ptr()}})
    start = tracker.now
    with _TrackMode(tracker):
        tracker.set_phase("forward")
        gathered.untyped_storage().resize_(0)
        a = torch.ones(1000)          # 4,000 B
        b = a * 2                     # 4,000 B
        del a
        tracker.set_phase("backward")
        gathered.untyped_storage().resize_(4096)  # reallocated: 4,096 B
        c = torch.zeros(2000)         # 8,000 B
        del b, c
        tracker.set_phase("step")
        gathered.untyped_storage().resize_(0)
    out = tracker.close()
    assert out["start"] == start and out["end"] == start - 4096
    ph = out["phases"]
    assert ph["forward"]["peak"] - start == 8000 - 4096
    assert ph["backward"]["peak"] - start == 4000 + 8000  # b, the regathered 4,096 B and c, less the 4,096 freed before
    assert ph["forward"]["by_category"]["parameters"] == 256 * 256 * 4
    top = ph["backward"]["top_transients"]
    assert top[0]["bytes"] == 8000 and top[0]["op"].startswith("aten::zeros") and top[0]["phase"] == "backward"
    assert out["resize_allocated_bytes"] == 4096


def test_stored_validation_runs_check_out():
    """Every stored run: resident categories equal the counts made from the model, every setup trains
    what one process trains (within the rounding floor of adding the ranks' gradients), each step ends
    where it began, nothing was first seen as an input, and the tracker's peak equals the CPU
    allocator's with collectives' own buffers left out."""
    files = sorted(VALIDATION.glob("*.json"))
    if not files:
        pytest.skip("no stored validation runs")
    driver = _driver()
    assert {f.stem for f in files} <= set(driver.CASES)
    assert driver.check([f.stem for f in files]) == 0
    for f in files:
        r = json.loads(f.read_text())
        assert {"date", "torch", "deepspeed", "transformers", "python", "platform"} <= set(r["provenance"])
        assert r["command"].startswith("python -m vramlab.zerolab ") and r["steps"] == 5
        for s in r["setups"].values():
            for rank in s["per_rank"]:
                assert rank["peak"]["phase"] in ("forward", "backward", "step")
                assert len(rank["peak"]["at_peak"]["top_transients"]) <= 10
