"""The rank checks of labs 3 and 4 (vramlab.grading): the instructor's answer passes, and each kind of
wrong answer fails with the message that names its mistake. Answers are the lab sources' solution
cells, edited; they reach the checks as the grader hands them over (a name and the cell's source)."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest

from vramlab import grading as G

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("labtools", ROOT / "labs" / "tools.py")
tools = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tools)


def solution(lab: str, gid: str) -> str:
    return next(c.source for c in tools.source_notebook(lab).cells
                if c.metadata.get("nbgrader", {}).get("grade_id") == gid)


def answer(source: str, name: str):
    """What a check receives from the grader: the object's name and its cell's source."""
    return types.SimpleNamespace(__name__=name, __vramlab_source__=source)


def edited(source: str, old: str, new: str) -> str:
    assert old in source, old
    return source.replace(old, new)


# ----------------------------------------------------------------------------- 1F1B (no ranks: a replay)

def _function(source: str, name: str):
    ns: dict = {}
    exec(compile(source, "<answer>", "exec"), ns)
    return ns[name]


ONE_F_ONE_B = _function(solution("lab03_parallelism", "ex1-solution"), "one_f_one_b")


def test_one_f_one_b_passes_and_matches_the_library_schedule():
    G.check_one_f_one_b(ONE_F_ONE_B, cases=((1, 1), (2, 4), (4, 8), (3, 5), (4, 2), (5, 16), (4, 4)))
    from vramlab import parallel as P

    for p, m in ((2, 4), (4, 8), (3, 7)):  # the same step time and in-flight counts as the library's 1F1B
        run = P.simulate(p, m, "1f1b", forward=1, backward=2)
        replay = G.pipeline_replay(ONE_F_ONE_B(p, m))
        assert replay["end"] == run.makespan and replay["in_flight"] == list(run.in_flight)


def _gpipe(p, m):
    return [[("F", i) for i in range(m)] + [("B", i) for i in range(m)] for _ in range(p)]


def _no_warmup(p, m):
    return [[op for i in range(m) for op in (("F", i), ("B", i))] for _ in range(p)]


def _backward_first(p, m):  # warm-up right, then a backward before each forward: the last stage waits on itself
    out = []
    for d in range(p):
        w = min(p - d - 1, m)
        order = [("F", i) for i in range(w)]
        for i in range(m):
            order.append(("B", i))
            if w + i < m:
                order.append(("F", w + i))
        out.append(order)
    return out


def _one_missing(p, m):
    orders = ONE_F_ONE_B(p, m)
    orders[1] = orders[1][:-1]
    return orders


def _one_twice(p, m):
    orders = ONE_F_ONE_B(p, m)
    orders[0] = orders[0] + [("F", 0)]
    return orders


@pytest.mark.parametrize("fn, cases, message", [
    (_gpipe, ((4, 8),), "holds the activations of 8 micro-batches"),
    (_gpipe, ((4, 2),), "device 3 holds the activations of 2"),  # GPipe fails even with m < p
    (lambda p, m: ONE_F_ONE_B(p + 1, m)[:p], ((4, 8),), "at most p - d = 4"),  # one warm-up forward too many
    (_no_warmup, ((4, 8),), "your step takes 96; GPipe and 1F1B take (m + p - 1)(tf + tb) = 33"),
    (_backward_first, ((4, 8),), "the orders deadlock"),
    (_one_missing, ((4, 8),), "device 1 never runs the backward of micro-batch(es) [7]"),
    (_one_twice, ((4, 8),), "runs the forward of micro-batch(es) [0] twice"),
    (lambda p, m: ONE_F_ONE_B(p, m)[:-1], ((4, 8),), "one list of operations per device (4 lists), got 3"),
    (lambda p, m: [[("X", 0)]] * p, ((2, 2),), 'a pair ("F" or "B", micro-batch in 0..1)'),
    (lambda p, m: [[(True, 0)]] * p, ((2, 2),), "each operation is a pair"),
], ids=["gpipe", "gpipe-m<p", "warmup+1", "no-warmup", "deadlock", "missing", "twice", "devices", "kind", "bool"])
def test_one_f_one_b_wrong_orders(fn, cases, message):
    with pytest.raises(AssertionError) as e:
        G.check_one_f_one_b(fn, cases=cases)
    assert message in str(e.value), str(e.value)


# ----------------------------------------------------------------------------- tensor parallelism (gloo ranks)

TP = solution("lab03_parallelism", "ex2-solution")


def _tp(source: str) -> None:
    G.check_tp_mlp(answer(source, "tp_mlp"), answer(source, "CopyToTP"), answer(source, "ReduceFromTP"),
                   cases=((2, 2, 3, 8, 16),))


def test_tp_mlp_passes():
    G.check_tp_mlp(answer(TP, "tp_mlp"), answer(TP, "CopyToTP"), answer(TP, "ReduceFromTP"),
                   cases=((2, 2, 3, 8, 16), (3, 1, 2, 6, 10)))


@pytest.mark.parametrize("source, message", [
    (edited(TP, "        total = grad.clone()\n        dist.all_reduce(total)", "        total = grad"),
     "CopyToTP.backward called dist.all_reduce 0 times"),  # the forward-only MLP of the old exercise
    (edited(TP, "        return grad  # the output's", "        grad = grad.clone()\n        dist.all_reduce(grad)\n"
                                                      "        return grad  # the output's"),
     "ReduceFromTP.backward communicated"),
    (edited(TP, "    x = CopyToTP.apply(x)\n", ""), "made 0 all-reduces in the MLP's backward"),
    (edited(TP, "        return x.view_as(x)", "        x = x.clone()\n        dist.all_reduce(x)\n        return x"),
     "CopyToTP.forward communicated"),
    (TP + "\n\ndef tp_mlp(x, w1_shard, w2_shard):\n    return ReduceFromTP.apply(CopyToTP.apply(x) @ w1_shard @ w2_shard)\n",
     "all-reduced something other than this rank's partial output"),  # the right count, no GeLU
    (TP.replace("dist.all_reduce(", "torch.distributed.distributed_c10d._get_default_group().allreduce("),
     "no attribute 'allreduce'"),  # the process group behind dist's back: there is none
], ids=["f-no-backward-all-reduce", "g-backward-all-reduce", "mlp-without-f", "f-forward-all-reduce", "no-gelu",
        "process-group-back-door"])
def test_tp_mlp_wrong_answers(source, message):
    with pytest.raises(AssertionError) as e:
        _tp(source)
    assert message in str(e.value), str(e.value)


def test_tp_mlp_through_distributed_c10d_is_the_same_traffic():
    """Issue 28: distributed_c10d's all_reduce was a back door around the logged dist.all_reduce. The
    ranks' collectives now all go through the check's switchboard, whichever module they are called
    from: the same answer through distributed_c10d communicates, is seen, and passes."""
    _tp(TP.replace("dist.all_reduce(", "torch.distributed.distributed_c10d.all_reduce("))


# ----------------------------------------------------------------------------- bucketed DDP (linked ranks)

DDP = solution("lab03_parallelism", "ex3-solution")


def test_grad_buckets():
    numels = [128, 16, 256, 16, 64, 4]  # the check's MLP: Linear(8, 16), Linear(16, 16), Linear(16, 4)
    assert G.grad_buckets(numels, 1000) == [[5, 4, 3], [2], [1], [0]]  # 2048 bytes > cap: alone
    assert G.grad_buckets(numels, 3000) == [[5, 4, 3, 2, 1], [0]]
    assert G.grad_buckets(numels, 600) == [[5, 4], [3], [2], [1], [0]]
    assert G.grad_buckets(numels, 10**6) == [[5, 4, 3, 2, 1, 0]]


def test_bucketed_ddp_passes():
    G.check_bucketed_ddp(answer(DDP, "BucketedDDP"), cases=((2, 1000), (2, 600), (3, 10**6)))


@pytest.mark.parametrize("source, message", [
    (edited(edited(DDP, "self.in_flight.append((k, flat, dist.all_reduce(flat, async_op=True)))",
                   "self.in_flight.append((k, flat, None))"), "handle.wait()", "dist.all_reduce(flat)"),
     "after loss.backward() returned (in finish)"),  # synchronous, after the backward
    (edited(DDP, "dist.all_reduce(flat, async_op=True)", "dist.all_reduce(flat) or types.SimpleNamespace(wait=int)")
     .replace("import torch\n", "import types\nimport torch\n", 1),
     "without async_op=True"),  # in the hook, but blocking the backward
    (edited(DDP, "if self.buckets[-1] and size + nbytes > bucket_bytes:", "if self.buckets[-1]:"),
     "made 6 all-reduces of [4, 16, 16, 64, 128, 256] values"),  # one all-reduce a parameter
    (edited(DDP, "            if self.waiting[k] == 0:", "            if self.waiting[k] == 0 and k == len(self.buckets) - 1:\n"
                                                           "                for b in range(k + 1):\n"
                                                           "                    flat = torch.cat([q.grad.flatten() for q in self.buckets[b]])\n"
                                                           "                    self.in_flight.append((b, flat, dist.all_reduce(flat, async_op=True)))\n"
                                                           "            if False:"),
     "only after the gradient of"),  # every bucket launched at the end of the backward
    (edited(DDP, "            flat /= self.world\n", ""), "divided by their number"),
], ids=["sync-after-backward", "blocking-in-hook", "per-parameter", "launched-late", "not-averaged"])
def test_bucketed_ddp_wrong_answers(source, message):
    with pytest.raises(AssertionError) as e:
        G.check_bucketed_ddp(answer(source, "BucketedDDP"), cases=((2, 1000),))
    assert message in str(e.value), str(e.value)


# ----------------------------------------------------------------------------- ZeRO-2 (gloo ranks)

ZERO2 = solution("lab04_zero", "ex2-solution")


def test_zero2_passes():
    G.check_zero2(answer(ZERO2, "Zero2Gradients"), cases=((2, 1000), (3, 1000), (3, 10**6)))


@pytest.mark.parametrize("source, world, message", [
    (edited(ZERO2, "q.grad = None  # sent", "pass  # kept"), 2, "free a bucket's gradients (p.grad = None)"),
    (edited(ZERO2, "shard, flat, handle = self.in_flight.pop(k)", "shard, flat, handle = self.in_flight[k]"), 2,
     "keeps 5808 bytes of other tensors alive after finish()"),  # the padded buckets kept
    (edited(ZERO2, "q.grad = None  # sent", "_stash.append(q.grad); q.grad = None  # hidden") + "\n_stash = []\n", 2,
     "bytes of other tensors alive after finish()"),  # gradients hidden in a global list
    (edited(ZERO2, "dist.reduce_scatter_tensor(shard, flat, async_op=True)", "dist.all_reduce(flat, async_op=True)"), 2,
     "dist.all_reduce is not available here: ZeRO-2 reduce-scatters"),
    (edited(ZERO2, "shards.append(shard / self.world)", "shards.append(shard)"), 2, "the reduce-scatter's sum divided by"),
    (edited(ZERO2, "flat = torch.cat([flat, flat.new_zeros(c * self.world - flat.numel())])",
            "flat = torch.cat([flat.new_zeros(c * self.world - flat.numel()), flat])"), 3,
     "zero-padded at the end"),  # padded at the front (3 ranks: the buckets need padding)
], ids=["keeps-gradients", "keeps-buckets", "hides-gradients", "all-reduce", "not-averaged", "padded-in-front"])
def test_zero2_wrong_answers(source, world, message):
    with pytest.raises(AssertionError) as e:
        G.check_zero2(answer(source, "Zero2Gradients"), cases=((world, 1000),))
    assert message in str(e.value), str(e.value)


def test_answers_defined_in_a_kernelless_cell_reach_the_ranks():
    """labs/kernelless.py (the GPU campaign's way to run a lab without Jupyter) compiles each cell as
    "<lab cell N>" with its lines in linecache, as IPython does: a class or function defined there is
    handed to the ranks with its whole cell (imports and helpers), not refused as sourceless."""
    import linecache

    name = "<lab03_parallelism cell 5>"
    linecache.cache[name] = (len(TP), None, TP.splitlines(keepends=True), name)
    ns: dict = {"__name__": "__main__"}
    exec(compile(TP, name, "exec"), ns)  # noqa: S102 - the lab's own solution
    assert G._cell_source(ns["CopyToTP"]) == TP  # a class: inspect alone cannot find it
    assert G._cell_source(ns["tp_mlp"], ns["CopyToTP"], ns["ReduceFromTP"]) == TP  # the cell once
    G.check_tp_mlp(ns["tp_mlp"], ns["CopyToTP"], ns["ReduceFromTP"], cases=((2, 2, 3, 8, 16),))


# ----------------------------------------------------------------------------- the ranks' switchboard (issue 28)

_LINKED = r'''
import json, os, sys
import torch
import torch.distributed as dist

_ALLOWED = ("send", "recv", "isend", "irecv", "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor",
            "all_gather", "batch_isend_irecv")
_HINT = "not in this test"
_SOURCE = ""


def _case(case, rank, world):
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


def _linked(tmp_path, case, world=3):
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "linked.py"
    script.write_text(_LINKED + G._HARNESS_RANKS)
    return G._run_world(str(script), world, case, tmp=str(tmp_path / "run"), timeout=60, log="calls",
                        on_timeout="linked ranks: no answer within 60 s")


def test_the_switchboard_computes_collectives_as_gloo_would(tmp_path):
    """The ranks' collectives are computed by the check's process from what each rank sent: the
    expected values here are written out by hand for 3 ranks holding [r + 1, 10 r]."""
    reports = _linked(tmp_path, "plain")
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


def test_the_switchboard_names_mismatches_and_deadlocks(tmp_path):
    """Ranks that call different collectives at the same point fail at once, saying which; ranks that
    all wait on a receive nobody sends are a deadlock, named at once (not at the timeout)."""
    reports = _linked(tmp_path / "a", "mismatch", world=2)
    assert all("different collectives" in rep["error"] for rep in reports), reports
    with pytest.raises(AssertionError, match=r"a deadlock\): rank 0 in recv \(peer 1\); rank 1 in recv \(peer 0\)"):
        _linked(tmp_path / "b", "deadlock", world=2)


def test_a_rank_cannot_write_a_call_into_its_log():
    """The harness's notes (which gradient became ready) come over the same link as the calls; a note
    shaped like a call is refused, so that the log's calls are only what was communicated."""
    forged = DDP.replace("    def finish(self) -> None:", "    def finish(self) -> None:\n        _mark({\"call\": \"all_reduce\", "
                                                   "\"phase\": \"backward\", \"async\": True, \"values\": []})", 1)
    assert forged != DDP
    with pytest.raises(AssertionError, match="a note the harness does not write"):
        G.check_bucketed_ddp(answer(forged, "BucketedDDP"), cases=((2, 1000),))
