"""vramlab.grading.zero: lab 4's checks pass the lab's solution and name what is wrong in a wrong answer."""

from __future__ import annotations

import pytest

from vramlab.grading import zero as GZ

from .conftest import answer, edited, solution  # noqa: F401


ZERO2 = solution("lab04_zero", "ex2-solution")


@pytest.mark.slow
def test_zero2_passes():
    GZ.check_zero2(answer(ZERO2, "Zero2Gradients"), cases=((2, 1000), (3, 1000), (3, 10**6)))


@pytest.mark.slow
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
        GZ.check_zero2(answer(source, "Zero2Gradients"), cases=((world, 1000),))
    assert message in str(e.value), str(e.value)


# ----------------------------------------------------------------------------- exercise 3: DDP's no_sync
ACCUM = solution("lab04_zero", "ex3-solution")
ACCUM_LOOP = "(loss_fn(model(x), y) / k).backward()"

EVERY_MICRO_BATCH = '''
def accumulate_ddp(model, micro_batches, loss_fn, rank, world_size):
    import torch.distributed as dist

    params = list(model.parameters())
    for p in params:
        p.grad = None
    for x, y in micro_batches:  # DDP without no_sync: every backward all-reduces what .grad holds
        (loss_fn(model(x), y) / len(micro_batches)).backward()
        for p in params:
            dist.all_reduce(p.grad)
            p.grad /= world_size
'''


def test_accumulate_ddp_harness_builds_the_checks_model():
    """programs/ddp_accum.py's model (common.mlp_model) and the check's reference draw the same weights."""
    import torch

    from vramlab.grading.programs import common

    model = common.mlp_model({"dims": list(GZ.ACCUM_DIMS), "seed": 123})
    for p, q in zip(model.parameters(), GZ._accum_params(123), strict=True):
        assert torch.equal(p.detach(), q)


@pytest.mark.slow
def test_accumulate_ddp_passes():
    GZ.check_accumulate_ddp(answer(ACCUM, "accumulate_ddp"), cases=((2, 2), (2, 4), (3, 3), (3, 2)))


@pytest.mark.slow
@pytest.mark.parametrize("source, case, message", [
    (EVERY_MICRO_BATCH, (2, 3), "sent 3 times the bytes DDP's no_sync sends"),
    (edited(ACCUM, "dist.all_reduce(flat)", "pass"), (2, 3),
     "the ranks disagree after the step: rank 1's gradients differ from rank 0's (each holds the gradient of its own"),
    (edited(ACCUM, ACCUM_LOOP, "loss_fn(model(x), y).backward()"), (2, 3),
     "are 3 times the global batch's mean-loss gradient: each micro-batch's loss is a mean"),  # averaged over ranks only
    (edited(ACCUM, "flat /= world_size", "pass"), (3, 2), "the all-reduce sums over the ranks, so divide"),
    (edited(ACCUM, ACCUM_LOOP, "loss_fn(model(x), y).backward()"), (2, 2), "with k = world_size = 2 one of the two"),
    (edited(edited(ACCUM, ACCUM_LOOP, "loss_fn(model(x), y).backward()"), "flat /= world_size", "pass"), (2, 3),
     "k x world_size = 6 times"),
    (edited(ACCUM, ACCUM_LOOP, "model.zero_grad(); " + ACCUM_LOOP), (2, 3), "are the last micro-batch's only"),
    (edited(ACCUM, ACCUM_LOOP, "model.zero_grad(); loss_fn(model(x), y).backward()"), (3, 4),
     "are the last micro-batch's only"),
    (edited(ACCUM, "p.grad = None  # what the previous step left", "pass"), (2, 3),
     "also hold what .grad held before the step"),
    (edited(ACCUM, f"for x, y in micro_batches:  # micro-batches 1..k-1 as under no_sync: accumulated here, not sent\n"
                   f"        {ACCUM_LOOP}", "(sum(loss_fn(model(x), y) for x, y in micro_batches) / k).backward()"),
     (2, 3), "ran one backward for all 3 micro-batches"),
    (edited(ACCUM, ACCUM_LOOP, "(loss_fn(model(torch.cat([a for a, _ in micro_batches])), torch.cat([b for _, b in "
                               "micro_batches])) / 1).backward(); break"), (2, 3), "ran the model once, on all 3"),
    (edited(ACCUM, "dist.all_reduce(flat)", "dist.all_gather_object([None] * world_size, flat)"), (2, 3),
     "dist.all_gather_object is not available here"),
], ids=["reduces-every-micro-batch", "no-reduction", "no-1/k", "no-1/world", "no-1/k-k-equals-world", "neither",
        "zeroed-between", "zeroed-between-unscaled", "not-cleared", "one-backward", "one-forward", "object-collective"])
def test_accumulate_ddp_wrong_answers(source, case, message):
    with pytest.raises(AssertionError) as e:
        GZ.check_accumulate_ddp(answer(source, "accumulate_ddp"), cases=(case,))
    assert message in str(e.value), str(e.value)
    assert "\n" not in str(e.value) and "Traceback" not in str(e.value)
