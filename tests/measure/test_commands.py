"""Every lab command (parlab ddp|tp|pp, zerolab, ckptlab, complab, commbench,
offloadlab) checks all of its arguments and its output path before any process or measurement
starts: one line on stderr, exit status 2.

In process: `main([...])` with everything that would start work (torch's spawn, the launcher, the
measurement entry points, subprocess) replaced by a function that fails the test if reached. A few
real `python -m vramlab.<lab>` runs show the one line end to end."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from vramlab.measure import zero as zerolab  # noqa: E402
from vramlab.measure import checkpointing as ckptlab
from vramlab.measure import collectives as commbench
from vramlab.measure import compression as complab
from vramlab.measure import parallel as parlab

from .conftest import refused  # noqa: E402


# ----------------------------------------------------------------------------- end to end

END_TO_END = [
    ("parallel", ["ddp", "--timeout", "nan"], "--timeout"), ("parallel", ["ddp", "--port", "70000"], "--port"),
    ("parallel", ["pp", "--chunks", "x"], "--chunks"), ("zero", ["--timeout", "-5"], "--timeout"),
    ("zero", ["--out", "nodir/x.json"], "does not exist"), ("collectives", ["--iters", "0"], "--iters"),
    ("checkpointing", ["--seq-len", "5000"], "reads at most 1,024 positions"),
    ("checkpointing", ["--out", "afile/x.json"], "not a folder"), ("compression", ["--probe", "{not json"], "--probe"),
    ("offload", ["--probe", "nope", "--out", "p.json"], "--probe"),
]


@pytest.mark.slow
@pytest.mark.parametrize("lab, argv, says", END_TO_END, ids=[f"{lab} {' '.join(a)}" for lab, a, _ in END_TO_END])
def test_commands_print_one_line_and_exit_2(lab, argv, says, tmp_path):
    (tmp_path / "afile").write_text("")
    r = subprocess.run([sys.executable, "-m", f"vramlab.measure.{lab}", *argv], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.splitlines()) == 1 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"python -m vramlab.measure.{lab}: error: "), r.stderr
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


@pytest.mark.usefixtures("nothing_starts")
@pytest.mark.parametrize("main,before,option", NUMERIC, ids=lambda v: v if isinstance(v, str) else None)
def test_random_bad_values_are_one_line_and_exit_2(main, before, option, capsys):
    @settings(max_examples=12, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(JUNK_TEXT)
    def check(text):
        refused(main, [*before, f"{option}={text}"], capsys)

    check()
