"""Lab 1's gradient accumulation, in a process of its own: the answer's `accumulate(model, loss_fn,
inputs, targets, micro_batch_size)` on a small MLP built from the case's seed (`build`, which the
check's own process calls too, to compute the full-batch reference), with `.grad` filled with noise
beforehand (the step must start from zero) and a forward pre-hook logging the rows of every call.
Reports the gradients the answer left, the rows of each forward and what it returned."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import common


def build(case):
    """The case's model (float64 MLP: Linear, GELU, Linear), inputs and class targets, from its seed."""
    g = torch.Generator().manual_seed(case["seed"])
    d, h, c, n = case["d"], case["h"], case["c"], case["n"]
    model = torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.GELU(), torch.nn.Linear(h, c)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
    inputs = torch.randn(n, d, generator=g, dtype=torch.float64)
    targets = torch.randint(0, c, (n,), generator=g)
    return model, inputs, targets


def loss_fn(logits, targets):
    """The mean over rows: what the full batch's loss is."""
    return F.cross_entropy(logits, targets)


def run(case, answer, names):
    model, inputs, targets = build(case)
    g = torch.Generator().manual_seed(case["seed"] + 1)
    for p in model.parameters():  # what the previous step left, if nothing cleared it
        p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64)
    rows = []
    model.register_forward_pre_hook(lambda mod, args: rows.append(int(args[0].shape[0]) if args and
                                                                  isinstance(args[0], torch.Tensor) else -1))
    returned = common.defined(answer, names[0])(model, loss_fn, inputs, targets, case["micro_batch_size"])
    grads = [None if p.grad is None else p.grad.detach().reshape(-1).tolist() for p in model.parameters()]
    return {"grads": grads, "rows": rows, "returned": returned if isinstance(returned, int) and
            not isinstance(returned, bool) else repr(returned)[:80]}
