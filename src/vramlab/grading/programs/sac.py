"""Lab 7's selective-checkpointing policy, in a process of its own: a Transformer block (or an MLP
with biases) run under torch.utils.checkpoint with create_selective_checkpoint_contexts(make_policy()),
the answer's `make_policy` called afresh for the checkpointed call. Every forward decision is logged
with the op and its matmul shapes, the backward's FLOPs counted (FlopCounterMode) without
checkpointing, with full recompute and with the policy, and the gradients compared with the plain
block's."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import common


def _block(p, attn):
    b, s, h, heads = p["b"], p["s"], p["h"], p["heads"]
    def norm(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    def fn(x):
        if attn:
            n = norm(x)
            q, k, v = (F.linear(n, p[c]).view(b, s, heads, h // heads).transpose(1, 2) for c in "qkv")
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
            x = x + F.linear(a, p["o"])
            n = norm(x)
            return x + F.linear(F.silu(F.linear(n, p["g"])) * F.linear(n, p["u"]), p["d"])
        return x + F.linear(F.gelu(F.linear(norm(x), p["g"], p["gb"])), p["d"], p["db"])
    return fn


def run(case, answer, names):
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(case["seed"])
    b, s, h, f = case["b"], case["s"], case["h"], case["f"]
    shapes = dict(q=(h, h), k=(h, h), v=(h, h), o=(h, h), g=(f, h), u=(f, h), d=(h, f), gb=(f,), db=(h,))
    p = {k: (torch.randn(*v, dtype=torch.float64) * 0.1).requires_grad_() for k, v in shapes.items()}
    p.update(b=b, s=s, h=h, heads=case["heads"])
    x = torch.randn(b, s, h, dtype=torch.float64, requires_grad=True)
    fn = _block(p, case["attention"])
    leaves = [x] + [p[k] for k in shapes]
    decisions = []

    def logged(policy):
        def wrapped(ctx, op, *args, **kwargs):
            d = policy(ctx, op, *args, **kwargs)
            if not ctx.is_recompute:
                mm = [list(a.shape) for a in args if isinstance(a, torch.Tensor) and a.dim() == 2][-2:] \
                    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) else []
                decisions.append([str(op), getattr(d, "name", repr(d)), mm])
            return d
        return wrapped

    def step(run):
        for t in leaves:
            t.grad = None
        y = run(x)
        with FlopCounterMode(display=False) as fc:
            y.square().sum().backward()
        return fc.get_total_flops(), [None if t.grad is None else t.grad.clone() for t in leaves]

    plain, g0 = step(fn)
    full, _ = step(lambda x: checkpoint(fn, x, use_reentrant=False))
    sac, g1 = step(lambda x: checkpoint(fn, x, use_reentrant=False, context_fn=lambda: create_selective_checkpoint_contexts(
        logged(common.defined(answer, names[0])()))))
    same = all((a is None and c is None) or (a is not None and c is not None and torch.allclose(a, c, rtol=1e-9, atol=1e-12))
               for a, c in zip(g0, g1))
    return {"decisions": decisions, "plain": plain, "full": full, "sac": sac, "grads_match": same}
