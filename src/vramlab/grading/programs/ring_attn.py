"""Lab 3's ring attention (context parallelism, Liu+23) on one rank: the answer's
`ring_attention(q, k, v, rank, world_size)` on this rank's contiguous shard of the sequence, q, k and v
(b, heads, s/cp, d, float64), dealt by the grader (the other ranks' shards are known to no rank). Only
point-to-point messages go through the link; the check's process logs each one and checks the output
against one process's causal attention and the traffic against a ring's."""

from __future__ import annotations

import torch

from . import common

# what the answer may call (the link implements them); every other collective raises
ALLOWED = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
HINT = ("a collective would hand every rank the whole sequence's K/V, which ring attention avoids: pass the blocks "
        "round the ring with dist.send/isend to rank + 1 and dist.recv/irecv from rank - 1, one block a step")


def run(case, rank, world, secret, answer, names):
    q, k, v = (torch.tensor(secret[key], dtype=torch.float64) for key in ("q", "k", "v"))
    out = common.defined(answer, names[0])(q, k, v, rank, world)
    if not isinstance(out, torch.Tensor):
        return {"type": type(out).__name__}
    return {"shape": list(out.shape), "dtype": str(out.dtype).replace("torch.", ""),
            "out": out.detach().double().flatten().tolist()}
