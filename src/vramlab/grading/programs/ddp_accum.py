"""Lab 4's gradient accumulation under DDP's `no_sync` on one rank: for each k of the case's "ks", the
case's MLP (`common.mlp_model`, the same on every rank), its `.grad` filled beforehand with noise drawn
from the case's seed + 1 (what the previous step left, the same on every rank: the step must clear it),
then the answer's `fn(model, micro_batches, loss_fn, rank, world_size)` on this rank's k micro-batches,
dealt by the grader. A forward pre-hook and the parameters' post-accumulate-grad hooks note the order
of the forwards (with their rows) and the backwards; a mark opens each k's calls in the log. Only
all_reduce is available. Reports, per k, the gradients the answer left and that order."""

from __future__ import annotations

import torch

from . import common, ranks

ALLOWED = ("all_reduce",)
HINT = "DDP reduces the gradients with dist.all_reduce (a sum), then divides by the number of ranks"


def loss_fn(out, y):
    """The mean squared error over the micro-batch's rows (and outputs)."""
    return ((out - y) ** 2).mean()


def _one(case, c, micro, fn, rank, world):
    model = common.mlp_model(case)
    params = list(model.parameters())
    g = torch.Generator().manual_seed(case["seed"] + 1)
    for p in params:  # what the previous step left, if nothing clears it
        p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64)
    order, arrived = [], [0]

    def forward(mod, args):
        x = args[0] if args else None
        order.append(["F", int(x.shape[0]) if isinstance(x, torch.Tensor) and x.dim() else -1])
        arrived[0] = 0

    def accumulated(p):  # one backward is over when every parameter's gradient has arrived
        arrived[0] += 1
        if arrived[0] == len(params):
            order.append(["B"])
            arrived[0] = 0

    model.register_forward_pre_hook(forward)
    for p in params:
        p.register_post_accumulate_grad_hook(accumulated)
    batches = [(torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)) for x, y in micro]
    ranks.mark({"step": c})
    ranks.PHASE[0] = "accumulate"
    fn(model, batches, loss_fn, rank, world)
    ranks.PHASE[0] = "after"
    return {"grads": [None if p.grad is None else p.grad.detach().reshape(-1).tolist() for p in params],
            "order": order}


def run(case, rank, world, secret, answer, names):
    fn = common.defined(answer, names[0])
    return [_one(case, c, secret[c], fn, rank, world) for c in range(len(case["ks"]))]
