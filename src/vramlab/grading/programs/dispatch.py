"""Lab 3's MoE token dispatch, in a process of its own: the answer's `dispatch(router_logits, top_k,
capacity)` on router logits drawn from the case's seed (`build`, which the check's own process calls
too, to compute the reference). Reports, for each of the four tensors it returned (expert, slot,
weight, kept: one row a token, one column a choice), its type, shape, dtype and values; or what the
return value lacks."""

from __future__ import annotations

import torch

from . import common

FIELDS = ("expert", "slot", "weight", "kept")


def build(case):
    """The case's router logits (tokens x experts, float64) from its seed: a standard normal score for
    every (token, expert), plus a bias per expert of standard deviation `skew` (a router that prefers
    some experts, so that the busiest ones overflow). Continuous values: no two probabilities tie."""
    g = torch.Generator().manual_seed(case["seed"])
    t, e = case["tokens"], case["experts"]
    bias = torch.randn(e, generator=g, dtype=torch.float64) * case["skew"]
    return torch.randn(t, e, generator=g, dtype=torch.float64) + bias


def describe(x) -> dict:
    """One returned value as the check reads it: its type, and for a tensor its shape, dtype and values."""
    if not isinstance(x, torch.Tensor):
        return {"type": type(x).__name__}
    return {"type": "Tensor", "shape": list(x.shape), "dtype": str(x.dtype).removeprefix("torch."),
            "values": x.detach().reshape(-1).tolist() if x.numel() <= 1 << 20 else None}


def run(case, answer, names):
    logits = build(case)
    got = common.defined(answer, names[0])(logits.clone(), case["top_k"], case["capacity"])
    if not isinstance(got, tuple) or len(got) != len(FIELDS):
        n = f" of {len(got)}" if isinstance(got, (tuple, list)) else ""
        return {"error": f"return Routing(expert, slot, weight, kept): four tensors, got {type(got).__name__}{n}"}
    return {name: describe(x) for name, x in zip(FIELDS, got)}
