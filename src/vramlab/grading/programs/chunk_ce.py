"""Lab 7's chunked cross-entropy, in a process of its own: the answer's
`chunked_cross_entropy(hidden, weight, targets, chunk_size)` on inputs drawn from the case's seed
(`build`, which the check's own process calls too, to compute the reference), then `backward()` on
what it returned. Both run under `VocabTracker`, a TorchDispatchMode that sees every operator's
outputs (the checkpointed recomputation and a custom autograd.Function's backward included) and
keeps, through weak references to their storages, which vocabulary-sized tensors are alive: the
most elements they held at once, and the largest one. Reports the loss, the gradients of `hidden`
and `weight`, and those counts."""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from . import common


def build(case):
    """The case's last hidden states (N x h), LM head (V x h), both float64, and targets (N), from its
    seed."""
    g = torch.Generator().manual_seed(case["seed"])
    n, h, v = case["n"], case["h"], case["v"]
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.7
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets


class VocabTracker(TorchDispatchMode):
    """Every tensor an operator makes with at least V elements (its storage's: a view counts as the
    whole storage it keeps), except those shaped like the head (V x h or h x V: the weight, its
    transpose, their gradients) and the storages of `inputs`, is a vocabulary-sized tensor. After
    each operator, the ones still alive (their storage not freed) are added up: `peak` is the most,
    `largest` the largest one (elements, shape, op, phase)."""

    def __init__(self, v: int, h: int, inputs=()):
        super().__init__()
        self.v, self.head = v, ((v, h), (h, v))
        self.inputs = [StorageWeakRef(t.untyped_storage()) for t in inputs]
        self.skip = {r.cdata for r in self.inputs}
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.phase, self.peak, self.peak_phase = "forward", 0, ""
        self.largest = [0, [], "", ""]
        self.ops = 0  # operators seen that made a vocabulary-sized tensor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.is_meta or tuple(t.shape) in self.head:
                continue
            st = t.untyped_storage()
            n = st.nbytes() // max(1, t.element_size())
            if n < self.v:
                continue
            ref = StorageWeakRef(st)
            if ref.cdata in self.skip or ref.cdata in self.live:
                continue
            self.live[ref.cdata] = (ref, n)
            self.ops += 1
            if n > self.largest[0]:
                self.largest = [n, list(t.shape), str(func), self.phase]
        total = 0
        for key, (ref, n) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
            else:
                total += n
        if total > self.peak:
            self.peak, self.peak_phase = total, self.phase
        return out


def measure(fn, case):
    """`fn(hidden, weight, targets, chunk_size)` and backward() on what it returns, under a
    VocabTracker: (loss, hidden, weight, tracker), or a string saying what the return value lacks."""
    hidden, weight, targets = build(case)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    with VocabTracker(case["v"], case["h"], (hidden, weight, targets)) as tracker:
        loss = fn(hidden, weight, targets, case["chunk_size"])
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return (f"return the mean loss as a tensor of one element, got "
                    f"{type(loss).__name__}{' of shape ' + str(tuple(loss.shape)) if isinstance(loss, torch.Tensor) else ''}")
        if not loss.requires_grad:
            return ("the loss returned does not require grad: backward() cannot reach hidden and weight (do not "
                    "detach it, or compute it under torch.no_grad())")
        tracker.phase = "backward"
        loss.reshape(()).backward()
    return loss, hidden, weight, tracker


def report(measured) -> dict:
    if isinstance(measured, str):
        return {"error": measured}
    loss, hidden, weight, tracker = measured
    return {"loss": float(loss.detach().reshape(())), "peak": tracker.peak, "peak_phase": tracker.peak_phase,
            "largest": tracker.largest, "ops": tracker.ops,
            "hidden_grad": None if hidden.grad is None else hidden.grad.reshape(-1).tolist(),
            "weight_grad": None if weight.grad is None else weight.grad.reshape(-1).tolist()}


def run(case, answer, names):
    return report(measure(common.defined(answer, names[0]), case))
