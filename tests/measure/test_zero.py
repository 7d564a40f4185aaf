"""zerolab's command-line options, its models, and the stored validation runs
(benchmarks/results/zero/validation/, written by benchmarks/zero_validation.py). Its per-step tracker
is tests/measure/test_zero_tracking.py's."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from vramlab import zero as Z

from .conftest import refused, zerolab

ROOT = Path(__file__).resolve().parents[2]
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
    r = subprocess.run([sys.executable, "-m", "vramlab.measure.zero", *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr
    assert len([ln for ln in r.stderr.splitlines() if "error:" in ln]) == 1


def test_models_build_to_their_spec_sizes():
    """Each model zerolab can train has the parameters vramlab.specs counts from its config (the mT5-like
    model's head untied, as the published mT5's is), and the shape the sweep relies on."""
    pytest.importorskip("transformers")
    import torch

    from vramlab.measure import zero as Z

    built = {}
    for name in Z.MODELS:
        with torch.device("meta"):  # the modules transformers builds, without initialising their weights
            built[name] = st = Z.structure(Z._build(name=name))
        assert st["params"] == Z.model_spec(name).params, name
    opt, llama, mt5 = (built[n] for n in ("opt-wide-vocab", "llama-gqa-wide-mlp", "mt5-small-like"))
    assert opt["root_params"] > max(opt["block_params"]) and opt["head_tied_to_embedding"]
    assert llama["root_params"] < min(llama["block_params"]) and llama["at_or_below_threshold"]["largest"] <= 512
    assert not mt5["head_tied_to_embedding"] and len(mt5["block_params"]) == 4


def test_deepspeed_config_carries_the_knobs():
    from vramlab.measure.zero import deepspeed_config

    cfg = deepspeed_config("3", 2, "bf16", {"reduce_bucket": 5, "prefetch_bucket": 0, "max_live_params": None})
    assert cfg["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 5, "stage3_prefetch_bucket_size": 0}
    assert cfg["bf16"] == {"enabled": True} and cfg["gradient_clipping"] == 0.0


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
        assert r["command"].startswith("python -m vramlab.measure.zero ") and r["steps"] == 5
        for s in r["setups"].values():
            for rank in s["per_rank"]:
                assert rank["peak"]["phase"] in ("forward", "backward", "step")
                assert len(rank["peak"]["at_peak"]["top_transients"]) <= 10


# --------------------------------------------------------------- the command refuses bad arguments before any work

ZEROLAB = [
    (["--timeout", "-5"], "--timeout"), (["--timeout", "nan"], "--timeout"), (["--timeout", "0"], "--timeout"),
    (["--port", "70000"], "--port"), (["--port", "-2"], "--port"), (["--nproc", "0"], "--nproc"),
    (["--nproc", "300"], "--nproc must be at most 256"), (["--rank", "1"], "--rank needs --backend fake"),
    (["--rank", "-1"], "--rank"), (["--backend", "fake", "--setups", "fsdp2", "--nproc", "2", "--rank", "2"], "--rank"),
    (["--backend", "fake"], "FSDP2 only"), (["--setups", "1,1"], "once"), (["--setups", ""], "unknown setup"),
    (["--setups", "5"], "unknown setup 5"), (["--steps", "1"], "--steps must be at least 2"),
    (["--steps", "5000"], "--steps"), (["--micro-batch", "0"], "--micro-batch"), (["--seq", "0"], "--seq"),
    (["--seq", "999"], "--seq must be at most 128"), (["--model", "gpt5"], "--model"),
    (["--model", "llama-3.2-1b"], "GPU-scale"), (["--reduce-bucket", "0"], "--reduce-bucket"),
    (["--prefetch-bucket", "nan"], "--prefetch-bucket"), (["--kv-cache", "maybe"], "--kv-cache"),
    (["--precision", "fp16"], "--precision"), (["--bogus"], "unrecognized arguments"),
]


@pytest.mark.usefixtures("nothing_starts")
@pytest.mark.parametrize("argv, says", ZEROLAB, ids=[" ".join(a) or "(none)" for a, _ in ZEROLAB])
def test_zerolab_refuses_in_one_line_before_any_rank_starts(argv, says, capsys):
    line = refused(zerolab.main, argv, capsys)
    assert line.startswith("python -m vramlab.measure.zero: error: ") and says in line, line


@pytest.mark.usefixtures("nothing_starts")
@pytest.mark.parametrize("fake", [False, True])
def test_zerolab_out_is_checked_before_the_experiment(fake, afile, tmp_path, capsys):
    """`--out nodir/x.json` ran every setup, then died with a traceback and lost the results."""
    extra = ["--backend", "fake", "--setups", "fsdp2", "--nproc", "8"] if fake else []
    for out, says in ((tmp_path / "nodir" / "x.json", "does not exist"), (afile / "x.json", "not a folder"),
                      (tmp_path, "is a folder")):
        line = refused(zerolab.main, [*extra, "--out", str(out)], capsys)
        assert "--out" in line and says in line, line


@pytest.mark.parametrize("argv, says", [(["--setups", "5"], "unknown setup 5"), (["--steps", "1"], "--steps must be at least 2"),
                                        (["--seq", "999"], "--seq must be at most 128")])
def test_zerolab_cli_refuses_bad_input_in_one_line(argv, says):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "vramlab.measure.zero", *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("module", ["vramlab.measure.zero", "vramlab.measure.parallel", "vramlab.measure.collectives"])
def test_nccl_without_gpus_is_one_line(module):
    """The three multi-process tools share one launcher: --backend nccl on a machine without GPUs is
    refused before any rank starts (it was a ZeroDivisionError from inside a rank)."""
    import subprocess
    import sys

    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    argv = ["ddp"] if module.endswith("parallel") else []
    r = subprocess.run([sys.executable, "-m", module, *argv, "--backend", "nccl"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "needs CUDA GPUs and this machine has none" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_predict_asks_what_the_record_ran():
    """zerolab.predict: a results record's own configuration into estimate_rank (the book's tables and
    tests/test_validation.py ask through it); an unknown setup is one clear line."""
    from vramlab.measure.zero import model_spec, predict

    run = json.loads((ROOT / "benchmarks" / "results" / "zero" / "gpu" / "pythia410m_fp32_4r_rank0_nocache.json").read_text())
    assert run["use_cache"] is False
    direct = Z.estimate_rank(model_spec("pythia-410m"), 4, 3, micro_batch_size=run["micro_batch_size"], seq_len=run["seq_len"],
                             recipe="fp32-adam", implementation="fsdp2", optimizer_impl="for-loop", device="cuda",
                             use_cache=False)
    assert predict(run, "fsdp2", device="cuda").total == direct.total
    assert predict({**run, "use_cache": True}, "fsdp2", device="cuda").total < direct.total  # the fused qkv output freed
    for gpu in ("h100", "t4"):  # the GPU (its cuBLAS workspaces) reaches every phase too
        phases = predict(run, "fsdp2", device="cuda", gpu=gpu, phases=True)
        assert max(b.total for b in phases) == predict(run, "fsdp2", device="cuda", gpu=gpu).total
    assert predict(run, "fsdp2", device="cuda", gpu="t4").total != predict(run, "fsdp2", device="cuda", gpu="h100").total
    with pytest.raises(ValueError, match="unknown setup '4'"):
        predict(run, "4")
