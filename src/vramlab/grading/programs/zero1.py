"""Lab 4's ZeRO-1 step on one rank: every rank holds the whole flat parameter vector (drawn from the
case's "seed", the same on every rank) and is dealt its own gradients for each of "steps" steps; the
answer's `fn(params, grads, state, rank, world_size)` must average them, update only this rank's shard
with AdamW (its states the shard's size) and all-gather the updated shards into the parameters. The
report: the parameters after each step, and the numbers the rank holds after its steps beyond what it
held before the answer's code ran (`common.held`: the optimizer state, however kept)."""

from __future__ import annotations

import torch

from . import common

ALLOWED = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter",
           "all_gather")
HINT = ("use reduce_scatter_tensor (or all_reduce) for the gradients and all_gather_into_tensor for the "
        "parameters")

# what the harness and torch hold before the answer's code runs (the rank program imports this module
# before it reads its secret and runs the answer)
BEFORE_ANSWER = common.held(values=True)


def run(case, rank, world, secret, answer, names):
    params = torch.randn(case["numel"], generator=torch.Generator().manual_seed(case["seed"]), dtype=torch.float64)
    state, history = {}, []
    for k in range(case["steps"]):
        grads = torch.tensor(secret[k], dtype=torch.float64)  # this rank's gradients, dealt by the grader
        common.defined(answer, names[0])(params, grads, state, rank, world)
        history.append(params.tolist())
    del grads
    held = common.held([params, state, history, *history, secret, *secret], values=True) - BEFORE_ANSWER
    return {"history": history, "state_numel": held}
