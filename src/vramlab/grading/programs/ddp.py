"""Lab 3's bucketed, overlapped data parallelism (PyTorch DDP, Li+20; CS336's assignment 2) on one
rank: the case's MLP (`common.mlp_model`, the same on every rank), the answer's class
`cls(model, bucket_bytes)` for each cap of the case's "caps", then "steps" SGD steps (learning rate
"lr") on this rank's slices of the batches, each ended by the answer's `finish()`. The harness's own
post-accumulate-grad hooks, registered before the answer's, note when each gradient is ready; the
answer's all-reduces are logged with the phase (backward, or after it in finish())."""

from __future__ import annotations

import torch

from . import common, ranks

ALLOWED = ("all_reduce",)
HINT = "DDP all-reduces each bucket with dist.all_reduce(flat, async_op=True)"


def _one(case, cap, secret, cls):
    model = common.mlp_model(case)
    params = list(model.parameters())
    for k, p in enumerate(params):  # before the answer's hooks: runs first, when p's gradient is ready
        p.register_post_accumulate_grad_hook(lambda p, k=k: ranks.mark({"ready": k}))
    ranks.PHASE[0] = "init"
    ddp = cls(model, cap)
    steps = []
    for _ in common.mlp_steps(case, cap, secret, model, params, ranks.mark, ranks.PHASE):
        ddp.finish()
        ranks.PHASE[0] = "optimizer"
        steps.append([common.tolist(p.grad) for p in params])
        if any(p.grad is None for p in params):
            break
        with torch.no_grad():
            for p in params:
                p -= case["lr"] * p.grad
    return steps


def run(case, rank, world, secret, answer, names):
    return [_one(case, cap, secret, common.defined(answer, names[0])) for cap in case["caps"]]
