"""`vramlab.measure.collectives`: the collectives chapter's measurement command."""

from __future__ import annotations


import pytest

pytest.importorskip("torch")

from vramlab.measure import collectives as commbench  # noqa: E402
from .conftest import refused  # noqa: E402


# --------------------------------------------------------------- the command refuses bad arguments before any work

COMMBENCH = [
    (["--port", "70000"], "--port"), (["--nproc", "0"], "--nproc"), (["--nproc", "257"], "--nproc"),
    (["--timeout", "nan"], "--timeout must be"), (["--timeout", "-1"], "--timeout must be"),
    (["--warmup-s", "nan"], "--warmup-s must be from 0 to 60"), (["--warmup-s", "x"], "--warmup-s"),
    (["--iters", "0"], "--iters"), (["--runs", "0"], "--runs"), (["--warmup", "-1"], "--warmup"),
    (["--sizes", "3"], "multiples of 4"), (["--sizes", "8,8"], "each size once"), (["--op", "scan"], "--op"),
    (["--order", "random"], "--order"), (["--bogus"], "unrecognized arguments"),
]


@pytest.mark.usefixtures("nothing_starts")
@pytest.mark.parametrize("argv, says", COMMBENCH, ids=[" ".join(a) for a, _ in COMMBENCH])
def test_commbench_refuses_in_one_line_before_any_rank_starts(argv, says, capsys):
    line = refused(commbench.main, argv, capsys)
    assert line.startswith("python -m vramlab.measure.collectives: error: ") and says in line, line


@pytest.mark.usefixtures("nothing_starts")
def test_commbench_out_is_checked_before_any_rank_starts(afile, tmp_path, capsys):
    for out in (afile / "x.json", tmp_path):
        assert "--out" in refused(commbench.main, ["--out", str(out)], capsys)


@pytest.mark.parametrize("argv", [["--runs", "0"], ["--iters", "0"], ["--warmup-s", "-1"], ["--sizes", "2"],
                                  ["--order", "random"]])
def test_commbench_rejects_bad_arguments(argv, capsys):
    from vramlab.measure import collectives as commbench

    with pytest.raises(SystemExit) as e:
        commbench.main(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def _bench(*args, env=None, timeout=180):
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "vramlab.measure.collectives", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("args, needle", [
    (["--warmup-s", "inf"], "--warmup-s must be from 0 to 60"),
    (["--sizes", "5,7,4"], "multiples of 4"),
    (["--sizes", "8,8"], "each size once"),
    (["--timeout", "0"], "--timeout must be"),
    (["--out", "/proc/nope/results.json"], "cannot write --out"),
])
def test_commbench_refuses_bad_arguments_before_running(args, needle):
    r = _bench(*args, timeout=120)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_commbench_rank_that_never_starts_ends_with_a_message():
    """Launched as rank 0 of 2 (as torchrun would) with no rank 1: it stops after --timeout, saying so."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    r = _bench("--timeout", "3", "--sizes", "1024", env={"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                                          "MASTER_PORT": str(port)}, timeout=180)
    assert time.perf_counter() - t0 < 120  # a hang guard: it gave up (3 s) instead of waiting forever
    assert r.returncode == 1 and "rank 0 of 2" in r.stderr and "did not form within 3 s" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_two_commbench_runs_at_once_do_not_collide_and_p90_is_not_below_the_median(tmp_path):
    """Free ports by default; with two operations per size the 90th percentile interpolates."""
    import json
    import subprocess
    import sys

    outs = [tmp_path / f"r{i}.json" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-m", "vramlab.measure.collectives", "--sizes", "1024,4096", "--runs", "1",
                               "--iters", "2", "--warmup-s", "0", "--no-pin", "--out", str(o)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for o in outs]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    for o in outs:
        for row in json.loads(o.read_text())["rows"]:
            assert row["op_p90_us"] >= row["op_median_us"]
            assert row["size"] in (1024, 4096)  # sizes reported as measured
