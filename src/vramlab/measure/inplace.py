"""In-place operations, measured (chapter 1): what a block saves for backward and its forward peak,
with and without `inplace=True` activations, in-place dropout and `branch.add_(x)`, against
`vramlab.activations.mlp_block_memory` (the ledger's prediction).

Two independent counts on real tensors (CPU kernels):
- saved: `torch.autograd.graph.saved_tensors_hooks` sees every tensor autograd saves; the distinct
  storages behind them are counted once (views share their base's), parameters left out.
- peak: a TorchDispatchMode sees every tensor each kernel returns and a weak reference on its storage
  sees it freed: the most bytes alive at once beyond what existed before (parameters, the input).

Saved-tensor hooks switch off autograd's version-counter check, so `backward_refusal` runs the block
again without them: that is where autograd's own refusal shows.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..activations import MLPBlock, _inplace_set

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages kernels create while the mode is on, alive at once: `now`, `peak`.
    Storages alive before (`existing` tensors: parameters, inputs) are not counted."""

    def __init__(self, existing: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in existing}
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st.data_ptr()
                if key and key not in self.known and key not in self.live:
                    self.live[key] = st.nbytes()
                    self.now += st.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(st, self._free, key)
        return out


def saved_bytes(fn: Callable[[], object], *, exclude: Iterable[torch.Tensor] = ()) -> tuple[object, int]:
    """Run `fn()`; return its result and the bytes of the distinct storages autograd saved for backward
    (those of `exclude`, the parameters, left out)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


class _T5Norm(torch.nn.Module):
    """T5's T5LayerNorm (transformers 5.x), op for op."""

    def __init__(self, h: int, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(h, dtype=dtype))

    def forward(self, hs: torch.Tensor) -> torch.Tensor:
        variance = hs.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hs = hs * torch.rsqrt(variance + 1e-6)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            hs = hs.to(self.weight.dtype)
        return self.weight * hs


class MLPBlockModule(torch.nn.Module):
    """`vramlab.activations.MLPBlock` in torch, with the ops named in `inplace` run in place."""

    def __init__(self, block: MLPBlock, inplace: Iterable[str] = (), dtype: torch.dtype = torch.float32):
        super().__init__()
        self.block, self.ops = block, _inplace_set(inplace)
        h, i = block.hidden_size, block.intermediate_size
        if "activation" in self.ops and block.activation == "gelu":
            raise ValueError("torch has no in-place GELU (nn.GELU and F.gelu take no inplace argument)")
        self.norm = {"layernorm": lambda: torch.nn.LayerNorm(h, dtype=dtype), "rmsnorm": lambda: _T5Norm(h, dtype),
                     "none": lambda: None}[block.norm]()
        self.fc1 = torch.nn.Linear(h, i, dtype=dtype)
        self.fc2 = torch.nn.Linear(i, h, dtype=dtype)

    def _dropout(self, x: torch.Tensor, p: float, where: str) -> torch.Tensor:
        return F.dropout(x, p, self.training, inplace=where in self.ops) if p > 0 else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one name rebound at each step, as in transformers' blocks: a tensor nothing saved dies at once
        hs = self.norm(x) if self.norm is not None else x
        hs = self.fc1(hs)
        act, inplace = self.block.activation, "activation" in self.ops
        if act in ("relu", "silu"):
            hs = getattr(F, act)(hs, inplace=inplace)
        elif act == "gelu":
            hs = F.gelu(hs)  # (no in-place GELU in torch: refused before)
        else:  # sigmoid, tanh
            hs = getattr(hs, f"{act}_")() if inplace else getattr(torch, act)(hs)
        hs = self._dropout(hs, self.block.inner_dropout, "inner_dropout")
        hs = self.fc2(hs)
        if self.block.branch_ref:  # T5LayerFF: the name stays on fc2's output during the dropout and the add
            branch = self._dropout(hs, self.block.outer_dropout, "outer_dropout")
        else:
            hs = branch = self._dropout(hs, self.block.outer_dropout, "outer_dropout")
        if "residual_into_input" in self.ops:
            return x.add_(branch)
        return branch.add_(x) if "residual" in self.ops else branch + x


@dataclass(frozen=True, kw_only=True)
class BlockMemory:
    """Measured bytes of one forward (same names as `mlp_block_memory`)."""

    saved: int
    forward_peak: int
    end: int


def measure_forward(module: torch.nn.Module, x: torch.Tensor) -> BlockMemory:
    """Saved bytes and forward peak of `module(x)` in training mode, measured on real tensors."""
    params = list(module.parameters()) + list(module.buffers())
    module.train()
    tracker = LiveBytes(existing=[*params, x])
    with tracker:
        out, saved = saved_bytes(lambda: module(x), exclude=params)
        end = tracker.now
    del out
    return BlockMemory(saved=saved, forward_peak=tracker.peak, end=end)


def measure_mlp_block(block: MLPBlock, *, batch_size: int, seq_len: int, precision: str = "fp32",
                      inplace: Iterable[str] = (), seed: int = 0) -> BlockMemory:
    """Build `block` in torch (CPU) and measure one forward's saved bytes and peak."""
    torch.manual_seed(seed)
    dtype = _DTYPES[precision]
    module = MLPBlockModule(block, inplace, dtype=dtype)
    x = torch.randn(batch_size, seq_len, block.hidden_size, dtype=dtype, requires_grad=True)
    return measure_forward(module, x * 1)  # a non-leaf input, as inside a model


def backward_refusal(fn: Callable[[], torch.Tensor]) -> str | None:
    """Run `fn()` and its backward with autograd's checks on (no hooks): None, or autograd's message
    (its first line) if it refuses."""
    try:
        fn().float().sum().backward()
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return None


def set_inplace(model: torch.nn.Module, *, activations: bool = True, dropouts: bool = True) -> list[str]:
    """Switch the model's `nn.ReLU` (and other modules with an `inplace` flag: ReLU6, LeakyReLU, SiLU,
    Hardtanh...) and `nn.Dropout` modules to in-place; return the names switched. Functional calls
    (`F.dropout` in OPT's blocks) and the residual adds inside transformers' code are left as they are."""
    names = []
    for name, m in model.named_modules():
        is_drop = isinstance(m, torch.nn.modules.dropout._DropoutNd)
        if hasattr(m, "inplace") and ((dropouts and is_drop) or (activations and not is_drop)):
            m.inplace = True
            names.append(name)
    return names
