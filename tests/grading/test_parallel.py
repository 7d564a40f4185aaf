"""The rank checks of labs 3 and 4 (vramlab.grading.parallel, vramlab.grading.zero): the instructor's answer passes, and each kind of
wrong answer fails with the message that names its mistake. Answers are the lab sources' solution
cells, edited; they reach the checks as the grader hands them over (a name and the cell's source)."""

from __future__ import annotations

import pytest

from vramlab.grading import parallel as GP
from vramlab.grading import run as GR

from .conftest import _function, answer, edited, solution  # noqa: F401


# ----------------------------------------------------------------------------- 1F1B (no ranks: a replay)

ONE_F_ONE_B = _function(solution("lab03_parallelism", "ex1-solution"), "one_f_one_b")


def test_one_f_one_b_passes_and_matches_the_library_schedule():
    GP.check_one_f_one_b(ONE_F_ONE_B, cases=((1, 1), (2, 4), (4, 8), (3, 5), (4, 2), (5, 16), (4, 4)))
    from vramlab import pipeline as PIPE

    for p, m in ((2, 4), (4, 8), (3, 7)):  # the same step time and in-flight counts as the library's 1F1B
        run = PIPE.simulate(p, m, "1f1b", forward=1, backward=2)
        replay = GP.pipeline_replay(ONE_F_ONE_B(p, m))
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
        GP.check_one_f_one_b(fn, cases=cases)
    assert message in str(e.value), str(e.value)


# ----------------------------------------------------------------------------- tensor parallelism (gloo ranks)

TP = solution("lab03_parallelism", "ex2-solution")


def _tp(source: str) -> None:
    GP.check_tp_mlp(answer(source, "tp_mlp"), answer(source, "CopyToTP"), answer(source, "ReduceFromTP"),
                   cases=((2, 2, 3, 8, 16),))


@pytest.mark.slow
def test_tp_mlp_passes():
    GP.check_tp_mlp(answer(TP, "tp_mlp"), answer(TP, "CopyToTP"), answer(TP, "ReduceFromTP"),
                   cases=((2, 2, 3, 8, 16), (3, 1, 2, 6, 10)))


@pytest.mark.slow
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


@pytest.mark.slow
def test_tp_mlp_through_distributed_c10d_is_the_same_traffic():
    """distributed_c10d's all_reduce was a back door around the logged dist.all_reduce. The
    ranks' collectives now all go through the check's switchboard, whichever module they are called
    from: the same answer through distributed_c10d communicates, is seen, and passes."""
    _tp(TP.replace("dist.all_reduce(", "torch.distributed.distributed_c10d.all_reduce("))


# ----------------------------------------------------------------------------- bucketed DDP (linked ranks)

DDP = solution("lab03_parallelism", "ex3-solution")


def test_grad_buckets():
    numels = [128, 16, 256, 16, 64, 4]  # the check's MLP: Linear(8, 16), Linear(16, 16), Linear(16, 4)
    assert GP.grad_buckets(numels, 1000) == [[5, 4, 3], [2], [1], [0]]  # 2048 bytes > cap: alone
    assert GP.grad_buckets(numels, 3000) == [[5, 4, 3, 2, 1], [0]]
    assert GP.grad_buckets(numels, 600) == [[5, 4], [3], [2], [1], [0]]
    assert GP.grad_buckets(numels, 10**6) == [[5, 4, 3, 2, 1, 0]]


@pytest.mark.slow
def test_bucketed_ddp_passes():
    GP.check_bucketed_ddp(answer(DDP, "BucketedDDP"), cases=((2, 1000), (2, 600), (3, 10**6)))


@pytest.mark.slow
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
        GP.check_bucketed_ddp(answer(source, "BucketedDDP"), cases=((2, 1000),))
    assert message in str(e.value), str(e.value)


# ----------------------------------------------------------------------------- ZeRO-2 (gloo ranks)


@pytest.mark.slow
def test_answers_defined_in_a_kernelless_cell_reach_the_ranks():
    """labs/kernelless.py (the GPU campaign's way to run a lab without Jupyter) compiles each cell as
    "<lab cell N>" with its lines in linecache, as IPython does: a class or function defined there is
    handed to the ranks with its whole cell (imports and helpers), not refused as sourceless."""
    import linecache

    name = "<lab03_parallelism cell 5>"
    linecache.cache[name] = (len(TP), None, TP.splitlines(keepends=True), name)
    ns: dict = {"__name__": "__main__"}
    exec(compile(TP, name, "exec"), ns)  # noqa: S102 - the lab's own solution
    assert GR.cell_source(ns["CopyToTP"]) == TP  # a class: inspect alone cannot find it
    assert GR.cell_source(ns["tp_mlp"], ns["CopyToTP"], ns["ReduceFromTP"]) == TP  # the cell once
    GP.check_tp_mlp(ns["tp_mlp"], ns["CopyToTP"], ns["ReduceFromTP"], cases=((2, 2, 3, 8, 16),))


# ----------------------------------------------------------------------------- the ranks' switchboard


@pytest.mark.slow
def test_a_rank_cannot_write_a_call_into_its_log():
    """The harness's notes (which gradient became ready) come over the same link as the calls; a note
    shaped like a call is refused, so that the log's calls are only what was communicated. (The answer
    runs in a module of its own, but in the rank's process: it can reach the rank program's `mark`.)"""
    forged = DDP.replace("    def finish(self) -> None:", "    def finish(self) -> None:\n        sys.modules[\"programs.ranks\"]"
                                                   ".mark({\"call\": \"all_reduce\", \"phase\": \"backward\", \"async\": True, "
                                                   "\"values\": []})", 1)
    assert forged != DDP
    with pytest.raises(AssertionError, match="a note the harness does not write"):
        GP.check_bucketed_ddp(answer(forged, "BucketedDDP"), cases=((2, 1000),))
