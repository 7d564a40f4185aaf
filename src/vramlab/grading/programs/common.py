"""What the programs and their harnesses share. Runs where the answer runs: no vramlab here."""

from __future__ import annotations

import array
import collections
import gc
import json
import math
import os
import statistics
import sys
import types

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy


def block(packages) -> None:
    """Make the answer packages unimportable in this process (`import vramlab` raises ImportError):
    each name, and every submodule of one already loaded."""
    for name in list(sys.modules):
        if name.split(".")[0] in packages:
            sys.modules[name] = None
    for name in packages:
        sys.modules[name] = None


def run_answer(source: str) -> types.ModuleType:
    """The answer's source run in a module of its own, this process's `__main__` (as in the notebook,
    and so that what it defines can be pickled by name), which starts with what the answer may use
    without importing it: gc, json, math, os, statistics, sys, torch, dist (torch.distributed, its
    collectives replaced by the rank's link), mp (torch.multiprocessing), F (torch.nn.functional) and
    CheckpointPolicy. What it raises is the caller's."""
    module = types.ModuleType("__main__")
    module.__dict__.update(gc=gc, json=json, math=math, os=os, statistics=statistics, sys=sys, torch=torch, dist=dist,
                           mp=mp, F=F, CheckpointPolicy=CheckpointPolicy)
    sys.modules["__main__"] = module
    exec(compile(source, "<answer>", "exec"), module.__dict__)  # noqa: S102 - the answer, in its own process
    return module


def defined(answer: types.ModuleType, name: str):
    """The answer's function or class `name` (NameError, as Python words it, if its code defines none)."""
    try:
        return vars(answer)[name]
    except KeyError:
        raise NameError(f"name {name!r} is not defined") from None


def tolist(x):
    """A tensor's values as nested lists (None for anything else)."""
    return x.detach().tolist() if isinstance(x, torch.Tensor) else None


class Misuse(Exception):
    """A misuse of a harness's simulated device (labs 6), raised where it happens."""


def held(skip=(), *, values: bool = False) -> int:
    """What this process holds, wherever it is kept (a dict, an optimizer object, a closure, a module
    global, an attribute: gc finds it), beyond the objects of `skip` (by identity, and tensors by
    storage): the bytes of every live tensor's storage, each counted once; with `values`, numbers
    instead: each storage in elements (of the first tensor found viewing it), and also every list,
    tuple, set, frozenset, dict or deque of at least 8 floats, and every array.array and numpy array
    (elements) and bytearray (8-byte values) that any object refers to."""
    gc.collect()
    skip_ids = {id(o) for o in skip}
    storages = {t.untyped_storage().data_ptr() for t in skip if isinstance(t, torch.Tensor)}
    seen, n = set(), 0
    objs = gc.get_objects()
    is_tensor: dict[type, bool] = {}  # by real type: `isinstance` would ask each object's __class__ (slow, and forgeable)
    for o in objs:
        if id(o) in skip_ids:
            continue
        tp = type(o)
        hit = is_tensor.get(tp)
        if hit is None:
            hit = is_tensor[tp] = issubclass(tp, torch.Tensor)
        if hit:
            if o.is_meta:
                continue
            try:
                st = o.untyped_storage()
                ptr, size = st.data_ptr(), st.nbytes() // (max(1, o.element_size()) if values else 1)
            except Exception:
                continue
            if ptr and ptr not in storages and ptr not in seen:
                seen.add(ptr)
                n += size
        elif values and type(o) in (list, tuple, set, frozenset, dict, collections.deque):
            vals = o.values() if type(o) is dict else o
            if len(vals) >= 8 and all(type(v) is float for v in vals):
                n += len(vals)
    if values:
        for o in gc.get_referents(*objs):
            if id(o) in skip_ids or ("id", id(o)) in seen:
                continue
            if isinstance(o, array.array) or type(o).__name__ == "ndarray":
                seen.add(("id", id(o)))
                n += len(o) if isinstance(o, array.array) else int(o.size)
            elif isinstance(o, bytearray):
                seen.add(("id", id(o)))
                n += len(o) // 8
    return n


# --- the MLP of the bucketed-DDP and ZeRO-2 checks: its sizes, seed and learning rate come in the case ---

def mlp_model(case: dict) -> torch.nn.Sequential:
    """Linear, Tanh, ..., Linear of the case's "dims" (float64), drawn from its "seed": the same on
    every rank and in the check's own reference."""
    dims = case["dims"]
    layers = []
    g = torch.Generator().manual_seed(case["seed"])
    for k, (i, o) in enumerate(zip(dims[:-1], dims[1:])):
        lin = torch.nn.Linear(i, o, dtype=torch.float64, device="meta").to_empty(device="cpu")
        with torch.no_grad():
            lin.weight.copy_(torch.randn(o, i, generator=g, dtype=torch.float64) * 0.4)
            lin.bias.copy_(torch.randn(o, generator=g, dtype=torch.float64) * 0.1)
        layers += [lin, torch.nn.Tanh()] if k < len(dims) - 2 else [lin]
    return torch.nn.Sequential(*layers)


def mlp_batch(secret: dict, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the step's batch, dealt by the grader: the others' are known to no rank."""
    return (torch.tensor(secret["x"][step], dtype=torch.float64), torch.tensor(secret["y"][step], dtype=torch.float64))


def mlp_steps(case: dict, cap, secret: dict, model, params: list, mark, phase: list):
    """The steps of labs 3-4's MLP checks on one rank: each clears the gradients, marks where it begins
    (`mark`, the link's), runs this rank's batch forward and backward with `phase` set as it goes, and
    yields (x, y, loss) in phase "finish", where the harness calls the answer's finish()."""
    for step in range(case["steps"]):
        for p in params:
            p.grad = None
        mark({"step": step, "cap": cap})
        x, y = mlp_batch(secret, step)
        phase[0] = "forward"
        loss = ((model(x) - y) ** 2).mean()
        phase[0] = "backward"
        loss.backward()
        phase[0] = "finish"
        yield x, y, loss


def grads_held(params, but=None) -> list[int]:
    """Which parameters hold a gradient (all but `but`)."""
    return [j for j, q in enumerate(params) if j != but and q.grad is not None]
