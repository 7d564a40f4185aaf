"""vramlab.grading.run: the switchboard that links the ranks of a check: collectives as gloo
computes them, mismatches and deadlocks named (a log no rank can write into: tests/grading/test_parallel.py)."""

from __future__ import annotations

import pytest

from vramlab.grading import run as GR


# a harness module of the test's own, beside the real ones in a copy of programs/
_LINKED = r'''
import torch
import torch.distributed as dist

ALLOWED = ("send", "recv", "isend", "irecv", "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor",
           "all_gather", "batch_isend_irecv")
HINT = "not in this test"


def run(case, rank, world, secret, answer, names):
    out = {}
    x = torch.tensor([float(rank + 1), float(10 * rank)], dtype=torch.float32)
    for op in ("SUM", "MAX", "MIN", "PRODUCT"):
        t = x.clone()
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        out[op] = t.tolist()
    t = x.clone()
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    out["async"] = t.tolist()
    try:
        dist.all_reduce(x.clone(), op=dist.ReduceOp.AVG)
    except RuntimeError as e:
        out["avg"] = str(e)
    whole = torch.arange(2 * world, dtype=torch.float64) + 100 * rank
    mine = torch.empty(2, dtype=torch.float64)
    dist.reduce_scatter_tensor(mine, whole)
    out["reduce_scatter"] = mine.tolist()
    gathered = torch.empty(world, dtype=torch.float64)
    dist.all_gather_into_tensor(gathered, torch.tensor([float(rank)], dtype=torch.float64))
    out["all_gather"] = gathered.tolist()
    got = torch.empty(3)
    if rank == 0:
        dist.send(torch.tensor([1.0, 2.0, 3.0]), 1)
    elif rank == 1:
        out["recv_from"] = dist.recv(got)
        out["recv"] = got.tolist()
    try:
        dist.broadcast(x, 0)
    except RuntimeError as e:
        out["broadcast"] = str(e)
    if case == "mismatch":
        if rank == 0:
            dist.all_reduce(x)
        else:
            dist.all_gather_into_tensor(torch.empty(2 * world), x)
    if case == "deadlock":
        dist.recv(got, (rank + 1) % world)
    out["rank"], out["world"] = dist.get_rank(), dist.get_world_size()
    return out
'''


def _linked(tmp_path, monkeypatch, case, world=3):
    import shutil

    programs = tmp_path / "programs"
    shutil.copytree(GR.PROGRAMS, programs, ignore=shutil.ignore_patterns("__pycache__"))
    (programs / "linked.py").write_text(_LINKED)
    monkeypatch.setattr(GR, "PROGRAMS", str(programs))
    return GR.run_world("linked", world, case, source="", names=[], tmp=str(tmp_path / "run"), timeout=60, log="calls",
                        on_timeout="linked ranks: no answer within 60 s")


@pytest.mark.slow
def test_the_switchboard_computes_collectives_as_gloo_would(tmp_path, monkeypatch):
    """The ranks' collectives are computed by the check's process from what each rank sent: the
    expected values here are written out by hand for 3 ranks holding [r + 1, 10 r]."""
    reports = _linked(tmp_path, monkeypatch, "plain")
    for rank, rep in enumerate(reports):
        res = rep["result"]
        assert res["SUM"] == [6.0, 30.0] and res["MAX"] == [3.0, 20.0] and res["MIN"] == [1.0, 0.0], res
        assert res["PRODUCT"] == [6.0, 0.0] and res["async"] == [6.0, 30.0]
        assert "AVG" in res["avg"] and "not available" in res["broadcast"]
        # reduce-scatter of arange(6) + 100 r over r = 0, 1, 2: (3 i + 300), this rank's pair of it
        assert res["reduce_scatter"] == [3.0 * i + 300 for i in (2 * rank, 2 * rank + 1)]
        assert res["all_gather"] == [0.0, 1.0, 2.0]
        assert (res["rank"], res["world"]) == (rank, 3)
    assert reports[1]["result"]["recv"] == [1.0, 2.0, 3.0] and reports[1]["result"]["recv_from"] == 0
    # the log is the switchboard's: each call with what this rank sent
    sums = [e for e in reports[2]["log"] if e.get("call") == "all_reduce" and e.get("op") == "SUM"]
    assert [e["values"] for e in sums] == [[3.0, 20.0], [3.0, 20.0]] and [e["async"] for e in sums] == [False, True]
    assert [e["values"] for e in reports[0]["log"] if e.get("call") == "send"] == [[1.0, 2.0, 3.0]]


@pytest.mark.slow
def test_the_switchboard_names_mismatches_and_deadlocks(tmp_path, monkeypatch):
    """Ranks that call different collectives at the same point fail at once, saying which; ranks that
    all wait on a receive nobody sends are a deadlock, named at once (not at the timeout)."""
    reports = _linked(tmp_path / "a", monkeypatch, "mismatch", world=2)
    assert all("different collectives" in rep["error"] for rep in reports), reports
    with pytest.raises(AssertionError, match=r"a deadlock\): rank 0 in recv \(peer 1\); rank 1 in recv \(peer 0\)"):
        _linked(tmp_path / "b", monkeypatch, "deadlock", world=2)
