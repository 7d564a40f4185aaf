"""`vramlab.measure.checkpointing`: the checkpointing chapter's measurement command."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from vramlab.measure import checkpointing as ckptlab  # noqa: E402
from .conftest import CUDA, refused  # noqa: E402


# --------------------------------------------------------------- the command refuses bad arguments before any work

CKPTLAB = [
    (["--seq-len", "5000"], "gpt2 reads at most 1,024 positions; --seq-len 5,000"),
    (["--models", "llama-small", "--seq-len", "4096"], "llama-small reads at most 2,048 positions"),
    (["--models", "bert-base", "--plans", "none", "--seq-len", "600"], "bert-base reads at most 512"),
    (["--seq-len", "0"], "--seq-len"), (["--batch-size", "0"], "--batch-size"), (["--batch-size", "1e3"], "--batch-size"),
    (["--time", "-1"], "--time"), (["--models", ""], "--models"), (["--models", "gpt2,gpt2"], "once"),
    (["--models", "gpt5"], "unknown model"), (["--plans", ""], "--plans"), (["--plans", "most"], "unknown recompute plan"),
    (["--plans", "selective"], "not measured"), (["--timed-plans", "none"], "--timed-plans applies with --time"),
    (["--time", "2", "--timed-plans", "full,none"], "must be none"), (["--time", "2", "--timed-plans", "none,most"],
                                                                       "unknown recompute plan"),
    (["--precision", "fp8"], "--precision"), (["--mode", "cpu"], "--mode"), (["--bogus"], "unrecognized arguments"),
]


@pytest.mark.usefixtures("nothing_starts")
@pytest.mark.parametrize("argv, says", CKPTLAB, ids=[" ".join(a) or "(none)" for a, _ in CKPTLAB])
def test_ckptlab_refuses_in_one_line_before_any_measurement(argv, says, capsys):
    line = refused(ckptlab.main, argv, capsys)
    assert line.startswith("python -m vramlab.measure.checkpointing: error: ") and says in line, line


@pytest.mark.usefixtures("nothing_starts")
@pytest.mark.skipif(CUDA, reason="this machine has a GPU")
def test_ckptlab_refuses_cuda_without_a_gpu(capsys):
    assert "needs a CUDA GPU" in refused(ckptlab.main, ["--mode", "cuda"], capsys)


@pytest.mark.usefixtures("nothing_starts")
def test_ckptlab_out_is_checked_before_the_experiment(afile, tmp_path, capsys):
    """`--out afile/x.json` measured every plan, then died with a traceback in write_results."""
    for out in (afile / "x.json", tmp_path):
        assert "--out" in refused(ckptlab.main, ["--out", str(out)], capsys)


@pytest.mark.usefixtures("nothing_starts")
def test_ckptlab_valid_arguments_still_run_and_write(monkeypatch, tmp_path):
    """Valid arguments reach run() as before; the folder of --out is made, as write_results made it."""
    seen = {}

    def fake_run(**kw):
        seen.update(kw)
        return {"experiment": "activation checkpointing", "cases": []}

    monkeypatch.setattr(ckptlab, "run", fake_run)
    out = tmp_path / "new" / "r.json"
    assert ckptlab.main(["--models", "gpt2", "--plans", "none,full", "--seq-len", "1024", "--time", "2",
                         "--out", str(out)]) == 0
    assert seen["models"] == ("gpt2",) and seen["plans"] == ("none", "full") and seen["seq_len"] == 1024
    assert seen["time_steps"] == 2 and seen["timed_plans"] == ckptlab.TIMED
    assert json.loads(out.read_text())["command"].startswith("python -m vramlab.measure.checkpointing ")


@pytest.mark.parametrize("argv, says", [(["--plans", "selective"], "computed by vramlab.memory but not measured"),
                                        (["--models", "t5-small", "--plans", "none,sqrt"], "decoder-only models"),
                                        (["--plans", "most"], "unknown recompute plan"),
                                        (["--time", "2", "--timed-plans", "full"], "must be none")])
def test_ckptlab_refuses_what_it_cannot_measure_before_any_process_starts(argv, says, capsys):
    pytest.importorskip("torch")
    from vramlab.measure import checkpointing as ckptlab

    assert ckptlab.main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and "measured" not in err.split(f"{ckptlab.PROG}:")[0]
