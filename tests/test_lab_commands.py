"""Issue 29, item 2: every lab command (parlab ddp|tp|pp, zerolab, ckptlab, complab, commbench,
offloadlab) checks all of its arguments and its output path before any process or measurement
starts: one line on stderr, exit status 2.

In process: `main([...])` with everything that would start work (torch's spawn, the launcher, the
measurement entry points, subprocess) replaced by a function that fails the test if reached. A few
real `python -m vramlab.<lab>` runs show the one line end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from vramlab import ckptlab, commbench, complab, offloadlab, parlab, zerolab  # noqa: E402


class Reached(BaseException):
    """Work started: a BaseException, so that no `except Exception` on the way can swallow it."""


def _boom(*args, **kwargs):
    raise Reached(f"a process or measurement started: {args[:1]}")


@pytest.fixture(autouse=True)
def nothing_starts(monkeypatch):
    import torch.multiprocessing as mp

    monkeypatch.setattr(mp, "spawn", _boom)
    monkeypatch.setattr(commbench, "launch", _boom)  # parlab and zerolab import it from commbench when run
    monkeypatch.setattr(zerolab, "_fake_rank", _boom)
    monkeypatch.setattr(ckptlab, "run", _boom)
    monkeypatch.setattr(complab, "run", _boom)
    monkeypatch.setattr(complab, "_probe", _boom)
    monkeypatch.setattr(offloadlab, "run_probe", _boom)
    monkeypatch.setattr(subprocess, "run", _boom)
    monkeypatch.setattr(subprocess, "Popen", _boom)


def refused(main, argv, capsys) -> str:
    """`main(argv)` refuses: exit status 2 (raised, or returned as the commands that return their
    status do), exactly one line on stderr, which it returns."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    assert len(err.splitlines()) == 1 and err.endswith("\n"), err
    assert "error:" in err and "Traceback" not in err and "usage:" not in err, err
    return err.strip()


@pytest.fixture
def afile(tmp_path):
    f = tmp_path / "afile"
    f.write_text("not a folder\n")
    return f


CUDA = __import__("torch").cuda.is_available()

# ----------------------------------------------------------------------------- parlab

PARLAB = [
    (["ddp", "--timeout", "nan"], "--timeout"), (["ddp", "--timeout", "-1"], "--timeout"),
    (["ddp", "--timeout", "0"], "--timeout"), (["ddp", "--timeout", "inf"], "--timeout"),
    (["ddp", "--timeout", "1e9"], "--timeout"), (["ddp", "--port", "70000"], "--port"),
    (["ddp", "--port", "-1"], "--port"), (["ddp", "--port", "80.5"], "--port"),
    (["ddp", "--bucket-cap-mb", "nan"], "--bucket-cap-mb"), (["ddp", "--bucket-cap-mb", "-5"], "--bucket-cap-mb"),
    (["ddp", "--bucket-cap-mb", "0"], "--bucket-cap-mb"), (["ddp", "--bucket-cap-mb", "inf"], "--bucket-cap-mb"),
    (["ddp", "--nproc", "0"], "--nproc"), (["ddp", "--nproc", "65"], "--nproc"), (["ddp", "--nproc", "two"], "--nproc"),
    (["ddp", "--micro-batch", "0"], "--micro-batch"), (["ddp", "--micro-batch", "5000"], "--micro-batch"),
    (["ddp", "--seq", "1"], "--seq"), (["ddp", "--seq", "5000"], "reads at most 512 positions; --seq 5,000"),
    (["tp", "--model", "opt-val", "--seq", "513"], "reads at most 512"),
    (["tp", "--nproc", "3"], "cannot be split 3 ways"), (["tp", "--nproc", "2", "--sp", "--model", "opt-val"], "--sp"),
    (["pp", "--nproc", "8"], "need at least 8"), (["pp", "--nproc", "4", "--schedule", "interleaved"], "need at least 8"),
    (["pp", "--chunks", "1"], "--chunks"), (["pp", "--chunks", "9"], "--chunks"), (["pp", "--repeats", "0"], "--repeats"),
    (["pp", "--repeats", "101"], "--repeats"), (["pp", "--micro-batches", "0"], "--micro-batches"),
    (["pp", "--micro-batches", "2,2"], "once"), (["pp", "--micro-batches", "1,,2"], "--micro-batches"),
    (["pp", "--schedule", "zigzag"], "--schedule"), (["pp", "--schedule", "gpipe,gpipe"], "once"),
    (["ddp", "--repeats", "3"], "--repeats applies to pp only"), (["tp", "--micro-batches", "2"], "applies to pp only"),
    (["ddp", "--schedule", "1f1b"], "--schedule applies to pp only"), (["ddp", "--chunks", "2"], "applies to pp only"),
    (["tp", "--bucket-cap-mb", "2"], "--bucket-cap-mb applies to ddp only"), (["ddp", "--sp"], "--sp applies to tp only"),
    (["pp", "--gradient-as-bucket-view"], "applies to ddp only"),
    (["zero"], "invalid choice"), ([], "required"), (["ddp", "--model", "gpt5"], "--model"),
    (["ddp", "--backend", "mpi"], "--backend"), (["ddp", "--precision", "fp8"], "--precision"),
    (["ddp", "--recompute", "most"], "--recompute"), (["ddp", "--bogus"], "unrecognized arguments"),
]


@pytest.mark.parametrize("argv, says", PARLAB, ids=[" ".join(a) or "(none)" for a, _ in PARLAB])
def test_parlab_refuses_in_one_line_before_any_rank_starts(argv, says, capsys):
    line = refused(parlab.main, argv, capsys)
    assert line.startswith("python -m vramlab.parlab: error: ") and says in line, line


def test_parlab_out_is_checked_first_and_named_parlab(afile, tmp_path, capsys):
    """The --out error named commbench (the launcher's module); a file where a folder should be is
    refused before any rank starts."""
    for out in (afile / "x.json", tmp_path):
        line = refused(parlab.main, ["ddp", "--out", str(out)], capsys)
        assert line.startswith("python -m vramlab.parlab: error: --out") and "commbench" not in line, line


# ----------------------------------------------------------------------------- zerolab

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


@pytest.mark.parametrize("argv, says", ZEROLAB, ids=[" ".join(a) or "(none)" for a, _ in ZEROLAB])
def test_zerolab_refuses_in_one_line_before_any_rank_starts(argv, says, capsys):
    line = refused(zerolab.main, argv, capsys)
    assert line.startswith("python -m vramlab.zerolab: error: ") and says in line, line


@pytest.mark.parametrize("fake", [False, True])
def test_zerolab_out_is_checked_before_the_experiment(fake, afile, tmp_path, capsys):
    """`--out nodir/x.json` ran every setup, then died with a traceback and lost the results."""
    extra = ["--backend", "fake", "--setups", "fsdp2", "--nproc", "8"] if fake else []
    for out, says in ((tmp_path / "nodir" / "x.json", "does not exist"), (afile / "x.json", "not a folder"),
                      (tmp_path, "is a folder")):
        line = refused(zerolab.main, [*extra, "--out", str(out)], capsys)
        assert "--out" in line and says in line, line


# ----------------------------------------------------------------------------- commbench

COMMBENCH = [
    (["--port", "70000"], "--port"), (["--nproc", "0"], "--nproc"), (["--nproc", "257"], "--nproc"),
    (["--timeout", "nan"], "--timeout must be"), (["--timeout", "-1"], "--timeout must be"),
    (["--warmup-s", "nan"], "--warmup-s must be from 0 to 60"), (["--warmup-s", "x"], "--warmup-s"),
    (["--iters", "0"], "--iters"), (["--runs", "0"], "--runs"), (["--warmup", "-1"], "--warmup"),
    (["--sizes", "3"], "multiples of 4"), (["--sizes", "8,8"], "each size once"), (["--op", "scan"], "--op"),
    (["--order", "random"], "--order"), (["--bogus"], "unrecognized arguments"),
]


@pytest.mark.parametrize("argv, says", COMMBENCH, ids=[" ".join(a) for a, _ in COMMBENCH])
def test_commbench_refuses_in_one_line_before_any_rank_starts(argv, says, capsys):
    line = refused(commbench.main, argv, capsys)
    assert line.startswith("python -m vramlab.commbench: error: ") and says in line, line


def test_commbench_out_is_checked_before_any_rank_starts(afile, tmp_path, capsys):
    for out in (afile / "x.json", tmp_path):
        assert "--out" in refused(commbench.main, ["--out", str(out)], capsys)


# ----------------------------------------------------------------------------- ckptlab

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


@pytest.mark.parametrize("argv, says", CKPTLAB, ids=[" ".join(a) or "(none)" for a, _ in CKPTLAB])
def test_ckptlab_refuses_in_one_line_before_any_measurement(argv, says, capsys):
    line = refused(ckptlab.main, argv, capsys)
    assert line.startswith("python -m vramlab.ckptlab: error: ") and says in line, line


@pytest.mark.skipif(CUDA, reason="this machine has a GPU")
def test_ckptlab_and_complab_refuse_cuda_without_a_gpu(capsys):
    assert "needs a CUDA GPU" in refused(ckptlab.main, ["--mode", "cuda"], capsys)
    assert "needs a CUDA GPU" in refused(complab.main, ["--mode", "cuda"], capsys)


def test_ckptlab_out_is_checked_before_the_experiment(afile, tmp_path, capsys):
    """`--out afile/x.json` measured every plan, then died with a traceback in write_results."""
    for out in (afile / "x.json", tmp_path):
        assert "--out" in refused(ckptlab.main, ["--out", str(out)], capsys)


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
    assert json.loads(out.read_text())["command"].startswith("python -m vramlab.ckptlab ")


# ----------------------------------------------------------------------------- complab

PROBE = {"method": "full", "targets": "-", "optimizer": "adamw", "batch_size": 8, "seq_len": 128, "mode": "cpu"}
COMPLAB = [
    (["--probe", "{not json"], "--probe must be a JSON object"), (["--probe", ""], "--probe must be a JSON object"),
    (["--probe", "[1, 2]"], "--probe must be a JSON object"), (["--probe", '{"method": "full"}'], "--probe needs"),
    (["--probe", json.dumps({**PROBE, "seq_len": 1000})], "reads at most 256 positions"),
    (["--probe", json.dumps({**PROBE, "batch_size": 0})], "--probe batch_size"),
    (["--probe", json.dumps({**PROBE, "batch_size": True})], "--probe batch_size"),
    (["--probe", json.dumps({**PROBE, "method": "dora"})], "--probe method"),
    (["--probe", json.dumps({**PROBE, "mode": "gpu"})], "--probe mode"),
    (["--probe", json.dumps({**PROBE, "autocast": "yes"})], "--probe autocast"),
    (["--probe", json.dumps({**PROBE, "recompute": "selective"})], "not measured"),
    (["--probe", json.dumps({**PROBE, "bogus": 1})], "unknown argument bogus"),
    (["--steps", "0"], "--steps"), (["--steps", "-1"], "--steps"), (["--steps", "2.5"], "--steps"),
    (["--mode", "gpu"], "--mode"), (["--bogus"], "unrecognized arguments"),
]


@pytest.mark.parametrize("argv, says", COMPLAB, ids=[" ".join(a)[:40] or "(none)" for a, _ in COMPLAB])
def test_complab_refuses_in_one_line_before_any_measurement(argv, says, capsys):
    line = refused(complab.main, argv, capsys)
    assert line.startswith("python -m vramlab.complab: error: ") and says in line, line


def test_complab_out_is_checked_before_the_lab(afile, tmp_path, capsys):
    for out in (afile / "x.json", tmp_path):
        assert "--out" in refused(complab.main, ["--out", str(out)], capsys)


def test_complab_valid_arguments_still_run(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(complab, "run", lambda mode, steps, progress: {"mode": mode, "steps": steps})
    monkeypatch.setattr(complab, "_probe", lambda cfg: {"measured_bytes": 1, "cfg": cfg})
    out = tmp_path / "new" / "c.json"
    assert complab.main(["--steps", "3", "--mode", "cpu", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["steps"] == 3
    assert complab.main(["--probe", json.dumps(PROBE)]) == 0
    assert json.loads(capsys.readouterr().out)["cfg"] == PROBE


# ----------------------------------------------------------------------------- offloadlab

def test_offloadlab_refuses_in_one_line_before_any_probe(afile, tmp_path, capsys):
    assert "required" in refused(offloadlab.main, [], capsys)
    assert "--probe" in refused(offloadlab.main, ["--probe", "nope", "--out", str(tmp_path / "p.json")], capsys)
    assert "--out" in refused(offloadlab.main, ["--probe", "bandwidth"], capsys)
    for out in (tmp_path / "nodir" / "p.json", afile / "p.json", tmp_path):
        assert "--out" in refused(offloadlab.main, ["--probe", "bandwidth", "--out", str(out)], capsys)
    if not CUDA:
        line = refused(offloadlab.main, ["--probe", "baseline", "--out", str(tmp_path / "p.json")], capsys)
        assert "needs a CUDA GPU" in line


# ----------------------------------------------------------------------------- end to end

END_TO_END = [
    ("parlab", ["ddp", "--timeout", "nan"], "--timeout"), ("parlab", ["ddp", "--port", "70000"], "--port"),
    ("parlab", ["pp", "--chunks", "x"], "--chunks"), ("zerolab", ["--timeout", "-5"], "--timeout"),
    ("zerolab", ["--out", "nodir/x.json"], "does not exist"), ("commbench", ["--iters", "0"], "--iters"),
    ("ckptlab", ["--seq-len", "5000"], "reads at most 1,024 positions"),
    ("ckptlab", ["--out", "afile/x.json"], "not a folder"), ("complab", ["--probe", "{not json"], "--probe"),
    ("offloadlab", ["--probe", "nope", "--out", "p.json"], "--probe"),
]


@pytest.mark.parametrize("lab, argv, says", END_TO_END, ids=[f"{lab} {' '.join(a)}" for lab, a, _ in END_TO_END])
def test_commands_print_one_line_and_exit_2(lab, argv, says, tmp_path, monkeypatch):
    monkeypatch.undo()  # a real child process
    (tmp_path / "afile").write_text("")
    r = subprocess.run([sys.executable, "-m", f"vramlab.{lab}", *argv], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.splitlines()) == 1 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"python -m vramlab.{lab}: error: "), r.stderr
    assert not r.stdout and not (tmp_path / "nodir").exists()


# ----------------------------------------------------------------------------- random bad values (hypothesis)

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

# (command, arguments before the option, the option): numeric options of every lab command
NUMERIC = [
    (parlab.main, ["ddp"], "--timeout"), (parlab.main, ["ddp"], "--port"), (parlab.main, ["ddp"], "--nproc"),
    (parlab.main, ["ddp"], "--bucket-cap-mb"), (parlab.main, ["ddp"], "--micro-batch"),
    (parlab.main, ["pp"], "--chunks"), (parlab.main, ["pp"], "--repeats"),
    (zerolab.main, [], "--timeout"), (zerolab.main, [], "--port"), (zerolab.main, [], "--micro-batch"),
    (zerolab.main, [], "--steps"), (zerolab.main, [], "--nproc"),
    (commbench.main, [], "--nproc"), (commbench.main, [], "--iters"), (commbench.main, [], "--warmup"),
    (commbench.main, [], "--port"), (ckptlab.main, [], "--batch-size"), (ckptlab.main, [], "--seq-len"),
    (complab.main, [], "--steps"),
]
JUNK_TEXT = st.one_of(st.sampled_from(["", " ", "nan", "NaN", "inf", "-inf", "1e400", "-1", "0x10", "abc", "1,5",
                                        "10" * 30, "--", "1e-400"]),
                      st.integers(-10**30, -1).map(str), st.integers(10**12, 10**40).map(str))


@pytest.mark.parametrize("main,before,option", NUMERIC, ids=lambda v: v if isinstance(v, str) else None)
def test_random_bad_values_are_one_line_and_exit_2(main, before, option, capsys):
    @settings(max_examples=12, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(JUNK_TEXT)
    def check(text):
        refused(main, [*before, f"{option}={text}"], capsys)

    check()
