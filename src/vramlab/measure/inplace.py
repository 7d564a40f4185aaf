"""In-place operations, measured (chapter 1): what a block saves for backward and its forward peak,
with and without `inplace=True` activations, in-place dropout and `branch.add_(x)`, against
`vramlab.inplace.mlp_block_memory` (the ledger's prediction).

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

from ..inplace import MLPBlock, inplace_set

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
    """`vramlab.inplace.MLPBlock` in torch, with the ops named in `inplace` run in place."""

    def __init__(self, block: MLPBlock, inplace: Iterable[str] = (), dtype: torch.dtype = torch.float32):
        super().__init__()
        self.block, self.ops = block, inplace_set(inplace)
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
                      inplace: Iterable[str] = (), seed: int = 0, device: str = "cpu") -> BlockMemory:
    """Build `block` in torch (on the CPU, or "cuda" for CUDA's kernels) and measure one forward's saved
    bytes and peak."""
    torch.manual_seed(seed)
    dtype = _DTYPES[precision]
    module = MLPBlockModule(block, inplace, dtype=dtype).to(device)
    x = torch.randn(batch_size, seq_len, block.hidden_size, dtype=dtype, requires_grad=True, device=device)
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


# The blocks the campaign measures on a GPU (where CUDA's dropout differs from the CPU's: a 1-byte mask
# out of place, a noise tensor in the dtype in place): GPT-2's and OPT's feed-forward sublayers with
# their output dropout, T5's with its inner one.
PROBE_BLOCKS = {
    "gpt2-like (gelu, output dropout)": MLPBlock(hidden_size=768, intermediate_size=3072, activation="gelu",
                                                 norm="layernorm", outer_dropout=0.1),
    "opt-like (relu, output dropout)": MLPBlock(hidden_size=768, intermediate_size=3072, activation="relu",
                                                norm="layernorm", outer_dropout=0.1),
    "t5-like (relu, inner and output dropout)": MLPBlock(hidden_size=512, intermediate_size=2048, activation="relu",
                                                         norm="rmsnorm", inner_dropout=0.1, outer_dropout=0.1,
                                                         branch_ref=True),
}
PROBE_CHOICES = ((), ("activation",), ("outer_dropout",), ("activation", "outer_dropout", "residual"))


def probe(device: str = "cpu", *, batch_size: int = 4, seq_len: int = 256,
          precisions: Iterable[str] = ("fp32", "bf16")) -> list[dict]:
    """Every probe block x allowed in-place choice x precision on `device`: measured beside
    `mlp_block_memory`'s prediction for that device's kernels."""
    from ..inplace import inplace_refusal, mlp_block_memory

    torch.set_num_threads(1)
    rows = []
    for name, block in PROBE_BLOCKS.items():
        for ops in PROBE_CHOICES:
            if inplace_refusal(block, ops) or ("activation" in ops and block.activation == "gelu"):
                continue
            for precision in precisions:
                pred = mlp_block_memory(block, batch_size=batch_size, seq_len=seq_len, precision=precision,
                                        device=device, inplace=ops)
                meas = measure_mlp_block(block, batch_size=batch_size, seq_len=seq_len, precision=precision,
                                         inplace=ops, device=device)
                rows.append({"block": name, "inplace": list(ops), "precision": precision, "batch_size": batch_size,
                             "seq_len": seq_len, "predicted": {k: pred[k] for k in ("saved", "forward_peak", "end")},
                             "measured": {"saved": meas.saved, "forward_peak": meas.forward_peak, "end": meas.end}})
    return rows


def main(argv=None) -> int:
    """`python -m vramlab.measure.inplace [--device cuda] --out FILE`: the probe blocks measured on this
    machine's kernels, with provenance (the GPU campaign's `inplace` step runs it on CUDA)."""
    import json
    import sys
    from pathlib import Path

    from .. import checks
    from .record import provenance

    ap = checks.Parser(prog="python -m vramlab.measure.inplace",
                       description="in-place ops measured on one block: saved bytes and forward peak")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--out", required=True, help="the JSON file to write")
    ns = ap.parse_args(argv)
    if ns.device == "cuda" and not torch.cuda.is_available():
        print("vramlab.measure.inplace: --device cuda needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = probe(ns.device)
    out = {"what": "in-place ops on one feed-forward sublayer: measured saved bytes and forward peak beside "
                   "vramlab.inplace.mlp_block_memory", "device": ns.device,
           "provenance": provenance(ns.device),
           "command": f"python -m vramlab.measure.inplace --device {ns.device} --out {ns.out}", "rows": rows}
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(out, indent=1) + "\n")
    bad = [r for r in rows if r["predicted"]["saved"] != r["measured"]["saved"]]
    print(f"{len(rows)} rows, {len(rows) - len(bad)} with saved bytes as predicted -> {ns.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
