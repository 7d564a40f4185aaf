"""vramlab.grading.zero: lab 4's checks pass the lab's solution and name what is wrong in a wrong answer."""

from __future__ import annotations

import pytest

from vramlab.grading import zero as GZ

from .conftest import answer, edited, solution  # noqa: F401


ZERO2 = solution("lab04_zero", "ex2-solution")


def test_zero2_passes():
    GZ.check_zero2(answer(ZERO2, "Zero2Gradients"), cases=((2, 1000), (3, 1000), (3, 10**6)))


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
