"""Lab 3's tensor parallelism (Megatron-LM's MLP, Shoeybi+19 §3) on one rank: the answer's f (identity
forward, all-reduce backward) and g (all-reduce forward, identity backward), autograd Functions, each
alone, then its column- then row-parallel MLP built with them. The rank is dealt the whole input x
(b, s, h), the output gradient dy, its own shards of w1 (h, f; columns) and w2 (f, h; rows), and its
own t (g's input) and u (the gradient f's backward gets). Only all_reduce is available, logged with
the phase it ran in. `names`: the MLP function, f, g."""

from __future__ import annotations

import torch

from . import common, ranks

ALLOWED = ("all_reduce",)
HINT = "Megatron's f and g need only dist.all_reduce"


def _answer(call):
    """Run one call of the answer; what it raised, as text, for the report."""
    try:
        return call(), None
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"[:300]


def run(case, rank, world, secret, answer, names):
    mlp, f_op, g_op = names
    # what the grader dealt this rank: the shared input and output gradient, this rank's weight
    # shards (the others' are known to no rank), its own t and u
    d = {k: torch.tensor(v, dtype=torch.float64) for k, v in secret.items()}
    x, w1, w2, dy, t, u = d["x"], d["w1"], d["w2"], d["dy"], d["t"], d["u"]
    out = {}
    # f alone: the input is the same on every rank, the gradient arriving from above differs (u)
    ranks.PHASE[0] = "f forward"
    a = x.clone().requires_grad_()
    y, out["f_error"] = _answer(lambda: common.defined(answer, f_op).apply(a))
    out["f_forward"] = common.tolist(y)
    if isinstance(y, torch.Tensor) and y.requires_grad:
        ranks.PHASE[0] = "f backward"
        _, out["f_error"] = _answer(lambda: y.backward(u.clone()))
    out["f_backward"] = common.tolist(a.grad)
    # g alone: each rank's partial sum t, summed; the gradient from above is the same on every rank (dy)
    ranks.PHASE[0] = "g forward"
    c = t.clone().requires_grad_()
    y, out["g_error"] = _answer(lambda: common.defined(answer, g_op).apply(c))
    out["g_forward"] = common.tolist(y)
    if isinstance(y, torch.Tensor) and y.requires_grad:
        ranks.PHASE[0] = "g backward"
        _, out["g_error"] = _answer(lambda: y.backward(dy.clone()))
    out["g_backward"] = common.tolist(c.grad)
    # the MLP
    ranks.PHASE[0] = "mlp forward"
    xs = x.clone().requires_grad_()
    w1s = w1.clone().requires_grad_()  # this rank's columns of w1
    w2s = w2.clone().requires_grad_()  # this rank's rows of w2
    y = common.defined(answer, mlp)(xs, w1s, w2s)
    out["y"] = common.tolist(y)
    ranks.PHASE[0] = "mlp backward"
    if isinstance(y, torch.Tensor) and y.requires_grad:
        y.backward(dy)
    ranks.PHASE[0] = "done"
    out.update(dx=common.tolist(xs.grad), dw1=common.tolist(w1s.grad), dw2=common.tolist(w2s.grad))
    return out
