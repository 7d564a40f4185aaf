"""Lab 2's ring all-reduce on one rank: the answer's `ring_all_reduce(tensor, rank, world_size)` on the
numbers the grader dealt this rank (random integers, exact in float64 whatever the order of the
additions). Only point-to-point messages go through the link; the check's process logs each one and
checks the result and the traffic against a ring's."""

from __future__ import annotations

import torch

from . import common

# what the answer may call (the link implements them); every other collective raises
ALLOWED = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
HINT = "build the all-reduce from dist.send/isend and dist.recv/irecv"


def run(numel, rank, world, secret, answer, names):
    got = torch.tensor(secret, dtype=torch.float64)  # this rank's own numbers, dealt by the grader
    ret = common.defined(answer, names[0])(got, rank, world)
    if ret is not None and isinstance(ret, torch.Tensor):
        got = ret
    return got.detach().flatten().tolist()
