"""Lab 4's ZeRO-2 gradient partitioning (Rajbhandari+20 §5.2) on one rank: the MLP of the DDP check
(`common.mlp_model`), the answer's class `cls(model, bucket_bytes)` for each cap of the case's "caps",
whose `finish()` returns this rank's shards, for "steps" backward passes. The harness's own hooks note,
when each gradient is ready, which other parameters still hold a gradient; after the backward and
after finish() it notes them again and counts the bytes of every live tensor that is neither a
parameter, the batch, nor a shard finish() returned. Only reduce_scatter_tensor (named
reduce_scatter_single from torch 2.13) is available, logged with the phase it ran in."""

from __future__ import annotations

import torch

from . import common, ranks

ALLOWED = ("reduce_scatter_tensor", "reduce_scatter_single")
HINT = "ZeRO-2 reduce-scatters each bucket: dist.reduce_scatter_tensor(shard, flat, async_op=True)"


def _one(case, cap, secret, cls):
    model = common.mlp_model(case)
    params = list(model.parameters())
    for k, p in enumerate(params):  # before the answer's hooks: runs first, when p's gradient is ready
        p.register_post_accumulate_grad_hook(lambda p, k=k: ranks.mark({"ready": k, "held": common.grads_held(params, k)}))
    base = common.held(params)  # what earlier cases left alive (hooks make cycles gc cannot see)
    ranks.PHASE[0] = "init"
    zero = cls(model, cap)
    steps = []
    for x, y, loss in common.mlp_steps(case, cap, secret, model, params, ranks.mark, ranks.PHASE):
        after_backward = common.grads_held(params)
        shards = zero.finish()
        ranks.PHASE[0] = "after"
        shards = list(shards) if isinstance(shards, (list, tuple)) else shards
        mine = [t for t in shards if isinstance(t, torch.Tensor)] if isinstance(shards, list) else []
        steps.append({"shards": [common.tolist(t) for t in shards] if isinstance(shards, list) else repr(shards)[:100],
                      "after_backward": after_backward, "after_finish": common.grads_held(params),
                      "extra_bytes": common.held([*params, x, y, loss, *mine]) - base})
        del loss, shards, mine
    return steps


def run(case, rank, world, secret, answer, names):
    return [_one(case, cap, secret, common.defined(answer, names[0])) for cap in case["caps"]]
