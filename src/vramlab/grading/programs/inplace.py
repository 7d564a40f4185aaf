"""Lab 1's in-place MLP sublayer, in a process of its own: the answer's `mlp_forward(x, w1, b1, w2, b2,
*, act, drop1, drop2)` on inputs built from the case's seed (`build`, which the check's own process
draws too, to compute its reference), run twice.

- Counted: under the counting the check sends in the case ("counting": the source of
  `vramlab.measure.inplace`'s LiveBytes and saved_bytes and of the check's per-kernel log, which this
  process cannot import), exactly as the check counts its own in-place forward: the bytes autograd
  saved for backward, the forward's peak of live bytes, and each kernel's name and new bytes.
- Plain: with autograd's checks on (saved-tensor hooks switch off its version-counter check), the
  output and, after backward, the gradients of x, the weights and the biases; or autograd's refusal.
"""

from __future__ import annotations

import __future__
import weakref
from typing import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from . import common


def build(case):
    """The case's input x (tokens x hidden), fc1's and fc2's weights and biases, the two dropout masks
    (0 or 1/(1-p) in x's dtype, None where p = 0) and the gradient of the output, from its seed."""
    g = torch.Generator().manual_seed(case["seed"])
    dtype = getattr(torch, case["dtype"])
    t, h, i = case["tokens"], case["hidden"], case["inner"]

    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    def mask(shape, p):
        keep = torch.rand(*shape, generator=g, dtype=torch.float64) >= p
        return (keep.double() / (1 - p)).to(dtype) if p > 0 else None

    x = draw(t, h)
    params = [draw(i, h, scale=h ** -0.5), draw(i, scale=0.1), draw(h, i, scale=i ** -0.5), draw(h, scale=0.1)]
    drops = [mask((t, i), case["p1"]), mask((t, h), case["p2"])]
    grad_out = draw(t, h)
    return x, params, drops, grad_out


def counting(source: str) -> tuple[type, Callable]:
    """The check's counting, from the source it sent: (the per-kernel logging LiveBytes, saved_bytes)."""
    ns = {"torch": torch, "weakref": weakref, "TorchDispatchMode": TorchDispatchMode, "tree_leaves": tree_leaves,
          "Iterable": Iterable, "Callable": Callable}
    exec(compile(source, "<counting>", "exec", flags=__future__.annotations.compiler_flag), ns)  # noqa: S102
    return ns["op_log"](ns["LiveBytes"]), ns["saved_bytes"]


def _inputs(case):
    """Fresh inputs: x a non-leaf (as inside a model: a leaf cannot be written in place at all), the
    weights and biases leaves that require grad."""
    x0, params, drops, grad_out = build(case)
    x0.requires_grad_(True)
    for p in params:
        p.requires_grad_(True)
    return x0, x0.clone(), params, drops, grad_out


def _shape(out, case) -> str | None:
    """What is wrong with what the answer returned, or None."""
    want = (case["tokens"], case["hidden"])
    if not isinstance(out, torch.Tensor):
        return f"returned {type(out).__name__}, not a tensor"
    if tuple(out.shape) != want or out.dtype != getattr(torch, case["dtype"]):
        return f"returned a {out.dtype} tensor of shape {tuple(out.shape)}, expected x's: {want}, {case['dtype']}"
    return None


def run(case, answer, names):
    fn = common.defined(answer, names[0])
    op_log, saved_bytes = counting(case["counting"])
    kw = lambda drops: dict(act=case["act"], drop1=drops[0], drop2=drops[1])  # noqa: E731

    _, x, params, drops, _ = _inputs(case)
    masks = [d for d in drops if d is not None]
    tracker = op_log(existing=[x, *params, *masks])
    with tracker:
        out, saved = saved_bytes(lambda: fn(x, *params, **kw(drops)), exclude=[*params, *masks])
    wrong = _shape(out, case)
    if wrong:
        return {"error": wrong}
    counted = {"saved": saved, "peak": tracker.peak, "ops": tracker.ops}
    del out, tracker

    x0, x, params, drops, grad_out = _inputs(case)
    out = fn(x, *params, **kw(drops))
    wrong = _shape(out, case)
    if wrong:
        return {"error": wrong}
    report = dict(counted, out=out.detach().double().reshape(-1).tolist(), refused=None, grads=None)
    if not out.requires_grad:
        return dict(report, refused="detached")
    try:
        out.backward(grad_out)
    except RuntimeError as e:
        return dict(report, refused=str(e).split(" Hint:")[0].strip().splitlines()[0][:400])
    report["grads"] = [None if t.grad is None else t.grad.double().reshape(-1).tolist() for t in (x0, *params)]
    return report
