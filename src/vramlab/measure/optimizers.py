"""Optimizer memory, measured: what the real libraries allocate, for the
estimator of optimizer states and step peaks to be checked against. Imports torch.

Four measurements, each written to one JSON file (`python -m vramlab.measure.optimizers`):

- **state bytes**, exact: one real `optimizer.step()` on the CPU (states are created lazily in the
  step) for each model x parameter dtype x optimizer, then every storage the optimizer holds, counted
  once (`count_state`): every tensor in `opt.state[p]`; a tensor subclass (torchao's
  `OptimState8bit` / `OptimState4bit` / `OptimStateFp8`) by the inner tensors its
  `__tensor_flatten__()` names; an object in the state (GaLore's `GaLoreProjector`) by the tensors in
  its attributes (`ortho_matrix`); a storage shared between parameters (bitsandbytes' quantization
  maps) once; views by their whole storage. Tensors the optimizer keeps outside `state` (a tensor
  learning rate in `param_groups`, bitsandbytes' `name2qmap`) count too, separately. Per parameter
  tensor: name, shape, dtype and bytes by state key, so a disagreement can be traced to one tensor.
- **optimizer in backward**, whole-step peak: PyTorch's tutorial "How to save memory by fusing the
  optimizer step into the backward pass" (one optimizer per parameter, stepped in a
  `register_post_accumulate_grad_hook`, then `p.grad = None`) beside the normal loop (forward,
  backward, `opt.step()`, `zero_grad(set_to_none=True)`), through the step harness
  (`vramlab.measure.memory.measure`, MemTracker) in trace mode (FakeTensorMode) and on the CPU.
- **other optimizers' whole-step peak** (Adafactor, torchao 8-bit) in the normal loop.
- **step time on the CPU**: median seconds of `optimizer.step()` (benchmark only; CPU kernels).

Nothing here models anything: the numbers are what the libraries did.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from ..specs import ModelSpec, preset

PROG = "python -m vramlab.measure.optimizers"
DEFAULT_OUT = Path("benchmarks/results/optimizers/cpu.json")


# ----------------------------------------------------------------------------- the models

def small_gpt2() -> ModelSpec:
    """GPT-2 scaled down: width 256, 4 blocks, 4 heads, vocabulary 5000, 512 positions. Its
    projections are transformers' Conv1D, weights stored (in, out)."""
    return dataclasses.replace(preset("gpt2"), name="gpt2-small-256", hidden_size=256, num_layers=4, num_heads=4,
                               num_kv_heads=4, head_dim=64, intermediate_size=1024, vocab_size=5000,
                               max_position_embeddings=512)


def small_llama() -> ModelSpec:
    """Llama with grouped-query attention and widths that are no multiple of 128 or 256: width 200,
    5 heads of 40, 1 KV head (k, v: 40 x 200 = 8,000 values), MLP 520, vocabulary 3001, 2 blocks,
    untied head. No tensor here divides into 128- or 256-value blocks."""
    return dataclasses.replace(preset("llama-3.2-1b"), name="llama-gqa-200", hidden_size=200, num_heads=5,
                               num_kv_heads=1, head_dim=40, intermediate_size=520, vocab_size=3001, num_layers=2,
                               tie_word_embeddings=False, max_position_embeddings=2048)


def small_moe() -> ModelSpec:
    """Qwen1.5-MoE scaled down: width 128, 2 blocks, 8 routed experts (top 2) of width 64, one shared
    expert of width 64, vocabulary 2000: 3-D expert tensors (8, 128, 128) and (8, 128, 64)."""
    return dataclasses.replace(preset("qwen1.5-moe-a2.7b"), name="qwen-moe-128", hidden_size=128, num_layers=2,
                               num_heads=4, num_kv_heads=4, head_dim=32, intermediate_size=256, num_experts=8,
                               num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                               vocab_size=2000, max_position_embeddings=2048)


def small_t5() -> ModelSpec:
    """T5 scaled down: width 128, 2 encoder and 2 decoder blocks, 4 heads of 32, MLP 512, vocabulary
    2000, head tied to the embedding (t5-small's layout)."""
    return dataclasses.replace(preset("t5-small"), name="t5-128", hidden_size=128, num_layers=2, num_decoder_layers=2,
                               num_heads=4, num_kv_heads=4, head_dim=32, intermediate_size=512, vocab_size=2000)


MODELS: dict[str, Callable[[], ModelSpec]] = {
    "gpt2-small-256": small_gpt2, "llama-gqa-200": small_llama, "qwen-moe-128": small_moe, "t5-128": small_t5}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ----------------------------------------------------------------------------- counting storages

def _is_subclass(t: Any) -> bool:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return isinstance(t, torch.Tensor) and is_traceable_wrapper_subclass(t)


def leaves(label: str, value: Any, _depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(label, plain tensor) for every tensor `value` holds: itself; a tensor subclass's inner tensors
    (`__tensor_flatten__()` names them: label "exp_avg.codes"); the items of a list, tuple or dict;
    the tensor attributes of a plain object (GaLore's projector: "projector.ortho_matrix").
    Numbers and other objects hold none."""
    if _depth > 8:
        return
    if isinstance(value, torch.Tensor):
        if _is_subclass(value):
            names, _ = value.__tensor_flatten__()
            for n in names:
                yield from leaves(f"{label}.{n}", getattr(value, n), _depth + 1)
        else:
            yield label, value
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from leaves(f"{label}[{i}]", v, _depth + 1)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from leaves(f"{label}.{k}", v, _depth + 1)
    elif hasattr(value, "__dict__") and not isinstance(value, (type, torch.nn.Module, torch.optim.Optimizer)):
        for k, v in vars(value).items():
            yield from leaves(f"{label}.{k}", v, _depth + 1)


def _storage_key(t: torch.Tensor) -> tuple:
    s = t.untyped_storage()
    ptr = s.data_ptr()
    return (t.device.type, ptr) if ptr else ("object", id(s))


class StorageCounter:
    """Counts storages once each: `add(tensor)` returns the storage's bytes the first time a
    storage is seen (through any view of it, any tensor sharing it), 0 after; `owners` says how
    many times each storage was reached."""

    def __init__(self) -> None:
        self.total = 0
        self.first: dict[tuple, str] = {}
        self.nbytes: dict[tuple, int] = {}
        self.owners: dict[tuple, int] = {}

    def add(self, t: torch.Tensor, owner: str = "") -> int:
        key = _storage_key(t)
        self.owners[key] = self.owners.get(key, 0) + 1
        if key in self.first:
            return 0
        n = t.untyped_storage().nbytes()
        self.first[key], self.nbytes[key] = owner, n
        self.total += n
        return n

    def shared(self) -> list[dict[str, Any]]:
        """The storages reached more than once: counted with their first owner."""
        return [{"first": self.first[k], "bytes": self.nbytes[k], "references": n}
                for k, n in self.owners.items() if n > 1 and self.nbytes[k]]


def storage_total(*values: Any) -> int:
    """Bytes of the distinct storages behind everything in `values` (tensors, tensor subclasses,
    containers, objects holding tensors), each storage once."""
    c = StorageCounter()
    for v in values:
        for _, t in leaves("", v):
            c.add(t)
    return c.total


def count_state(opt: torch.optim.Optimizer, named: list[tuple[str, torch.nn.Parameter]]) -> dict[str, Any]:
    """The optimizer's state bytes, exactly: per parameter tensor (in `named`'s order) the bytes of
    each state key's storages first seen there, then tensors outside `state` (in `param_groups` and
    the optimizer's own attributes), each storage once. `total` is their sum."""
    c = StorageCounter()
    tensors = []
    for name, p in named:
        per: dict[str, int] = {}
        logical: dict[str, int] = {}
        for key, value in opt.state.get(p, {}).items():
            for label, t in leaves(str(key), value):
                per[label] = per.get(label, 0) + c.add(t, f"{name}:{label}")
                logical[label] = logical.get(label, 0) + t.numel() * t.element_size()
        row = {"name": name, "shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch."), "numel": p.numel(),
               "state": per, "bytes": sum(per.values())}
        kinds = {str(key): _describe(v) for key, v in opt.state.get(p, {}).items()}
        if kinds:
            row["kinds"] = kinds
        if logical != per:  # views of a larger storage, or storages counted with another tensor
            row["view_bytes"] = logical
        tensors.append(row)
    in_state = c.total
    outside: dict[str, int] = {}
    own = {_storage_key(p) for group in opt.param_groups for p in group["params"]}  # the parameters are no state
    for key in own - set(c.first):
        c.first[key], c.nbytes[key], c.owners[key] = "(a parameter)", 0, -1
    for i, group in enumerate(opt.param_groups):
        for k, v in group.items():
            if k == "params":
                continue
            for label, t in leaves(f"param_groups[{i}].{k}", v):
                outside[label] = outside.get(label, 0) + c.add(t, label)
    for attr, v in vars(opt).items():
        if attr in ("state", "param_groups", "defaults") or attr.startswith("_"):
            continue
        for label, t in leaves(attr, v):
            outside[label] = outside.get(label, 0) + c.add(t, label)
    return {"total": c.total, "in_state": in_state, "outside_state": outside, "shared": c.shared(), "tensors": tensors}


def _describe(v: Any) -> str:
    """What one state entry is: "Tensor float32 (200, 200)", "OptimState8bit bfloat16 (256, 768)",
    "int", "GaLoreProjector"."""
    if isinstance(v, torch.Tensor):
        return f"{type(v).__name__} {str(v.dtype).removeprefix('torch.')} {tuple(v.shape)}"
    return type(v).__name__


# ----------------------------------------------------------------------------- the optimizers

OPTIMIZERS = ("adamw", "adafactor", "adafactor-hf", "adafactor-momentum", "adamw-8bit", "adamw-bnb-32bit",
              "adamw-8bit-ao", "adamw-4bit-ao", "adamw-fp8-ao", "galore-adamw", "paged-adamw", "paged-adamw-8bit",
              "cpu-offload-adamw-ao")
GALORE_RANKS = (128, 512)  # 512: larger than the smaller dimension of every 2-D weight here
NEEDS_CUDA = ("paged-adamw", "paged-adamw-8bit", "cpu-offload-adamw-ao")

_ATTN_MLP = re.compile(r"attn|attention|mlp|densereludense", re.IGNORECASE)
_ROUTER = re.compile(r"(^|_)gate$|router", re.IGNORECASE)


def _is_projection(module: torch.nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, (torch.nn.Linear, Conv1D))


def galore_split(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """GaLore's usual split (its torchrun_main.py: the weights of the nn.Linear modules whose name
    contains "attn" or "mlp"), widened to what the brief names: the 2-D weights of the attention and
    MLP projections of every family (GPT-2's Conv1D too; T5's SelfAttention / EncDecAttention /
    DenseReluDense), routers (`mlp.gate`, `shared_expert_gate`) excepted. 3-D expert tensors, embeddings,
    norms, the head and biases go to the plain group. Returns (projected names, the names the
    script's own rule would project)."""
    names = {id(p): n for n, p in model.named_parameters()}
    projected, script = [], []
    for mname, module in model.named_modules():
        w = getattr(module, "weight", None)
        if not isinstance(w, torch.Tensor) or id(w) not in names:
            continue
        if isinstance(module, torch.nn.Linear) and any(k in mname for k in ("attn", "mlp")):
            script.append(names[id(w)])
        if (_is_projection(module) and w.ndim == 2 and _ATTN_MLP.search(mname)
                and not _ROUTER.search(mname.rsplit(".", 1)[-1])):
            projected.append(names[id(w)])
    return projected, script


def make_optimizer(key: str, model: torch.nn.Module, *, rank: int | None = None,
                   params: list[torch.nn.Parameter] | None = None) -> tuple[torch.optim.Optimizer, dict[str, Any]]:
    """The optimizer `key` (one of OPTIMIZERS) over `model`'s parameters (or `params`), with the
    library's defaults except where the brief names settings. Returns (optimizer, what was built)."""
    ps = params if params is not None else [p for p in model.parameters() if p.requires_grad]
    info: dict[str, Any] = {}
    if key == "adamw":
        return torch.optim.AdamW(ps), {"class": "torch.optim.AdamW"}
    if key == "adafactor":
        return torch.optim.Adafactor(ps), {"class": "torch.optim.Adafactor"}
    if key in ("adafactor-hf", "adafactor-momentum"):
        from transformers.optimization import Adafactor

        beta1 = 0.9 if key == "adafactor-momentum" else None
        return Adafactor(ps, lr=1e-3, relative_step=False, scale_parameter=False, warmup_init=False, beta1=beta1), \
            {"class": "transformers.optimization.Adafactor", "beta1": beta1}
    if key in ("adamw-8bit", "adamw-bnb-32bit", "paged-adamw", "paged-adamw-8bit"):
        import bitsandbytes as bnb

        cls = {"adamw-8bit": bnb.optim.AdamW8bit, "adamw-bnb-32bit": bnb.optim.AdamW,
               "paged-adamw": bnb.optim.PagedAdamW, "paged-adamw-8bit": bnb.optim.PagedAdamW8bit}[key]
        return cls(ps), {"class": f"bitsandbytes.optim.{cls.__name__}"}
    if key in ("adamw-8bit-ao", "adamw-4bit-ao", "adamw-fp8-ao"):
        import torchao.optim as ao

        cls = {"adamw-8bit-ao": ao.AdamW8bit, "adamw-4bit-ao": ao.AdamW4bit, "adamw-fp8-ao": ao.AdamWFp8}[key]
        opt = cls(ps)
        return opt, {"class": f"torchao.optim.{cls.__name__}", "block_size": opt.block_size}
    if key == "cpu-offload-adamw-ao":
        from torchao.optim import CPUOffloadOptimizer

        return CPUOffloadOptimizer(ps, torch.optim.AdamW), {"class": "torchao.optim.CPUOffloadOptimizer(AdamW)"}
    if key == "galore-adamw":
        from galore_torch import GaLoreAdamW

        if rank is None:
            raise ValueError("galore-adamw needs a rank")
        projected, script = galore_split(model)
        by_name = dict(model.named_parameters())
        chosen = {id(p) for p in ps}
        galore = [by_name[n] for n in projected if id(by_name[n]) in chosen]
        ids = {id(p) for p in galore}
        regular = [p for p in ps if id(p) not in ids]
        groups = [g for g in ({"params": regular},
                              {"params": galore, "rank": rank, "update_proj_gap": 200, "scale": 0.25,
                               "proj_type": "std"}) if g["params"]]
        info = {"class": "galore_torch.GaLoreAdamW", "rank": rank, "update_proj_gap": 200, "scale": 0.25,
                "proj_type": "std", "projected": [n for n in projected if id(by_name[n]) in chosen],
                "script_rule_projects": script}
        return GaLoreAdamW(groups), info
    raise ValueError(f"unknown optimizer {key!r}; known: {', '.join(OPTIMIZERS)}")


def _random_grads(params: Iterable[torch.Tensor], seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(p.dtype)


def build(spec: ModelSpec, dtype: torch.dtype) -> torch.nn.Module:
    """The model, random weights, on the CPU: built in fp32 and cast with `.to(dtype)`."""
    from .models import build_model

    model = build_model(spec, attention="sdpa", dtype=torch.float32, device="cpu")
    return model.to(dtype) if dtype != torch.float32 else model


_PAGED_OR_CUDA = re.compile(r"paged|cuda|xpu", re.IGNORECASE)


def measure_states(spec: ModelSpec, dtype: str, key: str, *, rank: int | None = None,
                   model: torch.nn.Module | None = None) -> dict[str, Any]:
    """One real step of optimizer `key` on `spec` with parameters in `dtype` ("fp32" or "bf16"),
    gradients small random values; then `count_state`. A combination the library refuses returns
    {"skipped": its one-line reason}; a paged optimizer that falls back to ordinary buffers on the
    CPU too (with what the fallback held, labelled so)."""
    row: dict[str, Any] = {"model": spec.name, "dtype": dtype, "optimizer": key}
    if rank is not None:
        row["rank"] = rank
    model = model if model is not None else build(spec, DTYPES[dtype])
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    try:
        opt, info = make_optimizer(key, model, rank=rank)
    except Exception as e:  # noqa: BLE001 - the library's refusal, recorded
        return {**row, "skipped": _one_line(e)}
    row.update(info)
    _random_grads(p for _, p in named)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            opt.step()
        except Exception as e:  # noqa: BLE001
            return {**row, "skipped": _one_line(e)}
    row["first_step_seconds"] = round(time.perf_counter() - t0, 3)
    counted = count_state(opt, named)
    said = [str(w.message).strip().splitlines()[0] for w in caught if _PAGED_OR_CUDA.search(str(w.message))]
    if key in NEEDS_CUDA and said:
        return {**row, "skipped": said[0], "cpu_fallback_bytes": counted["total"]}
    row["param_bytes"] = sum(p.numel() * p.element_size() for _, p in named)
    row.update(counted)
    return row


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".strip()


# ----------------------------------------------------------------------------- whole-step peaks

class _Merged(torch.optim.Optimizer):
    """The per-parameter optimizers of the in-backward loop seen as one by the step harness: its
    `state` is theirs (what `measure` tracks as optimizer states and counts as their bytes)."""

    def __init__(self, optimizers: dict) -> None:  # noqa: D107 - no super().__init__: nothing to own
        self.optimizers = optimizers
        self.state = {p: s for o in optimizers.values() for p, s in o.state.items()}
        self.param_groups = [g for o in optimizers.values() for g in o.param_groups]

    def step(self, closure=None):  # pragma: no cover - never stepped as one
        raise RuntimeError("the in-backward optimizers step in the backward pass")


def fuse_into_backward(model: torch.nn.Module, factory: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
                       on_step: Callable[[str, bool], None] | None = None) -> tuple[dict, list]:
    """PyTorch's "optimizer in backward" (the tutorial's pattern): one optimizer per parameter, built
    by `factory([p])`, stepped by a post-accumulate-grad hook as soon as p's gradient is complete,
    then `zero_grad(set_to_none=True)` frees the gradient. Returns ({param: optimizer}, hook handles).
    `on_step(name, before)` is called around each hook's step (the peak's phase)."""
    names = {p: n for n, p in model.named_parameters()}
    optimizers = {p: factory([p]) for p in model.parameters() if p.requires_grad}

    def hook(p: torch.Tensor) -> None:
        if on_step:
            on_step(names[p], True)
        optimizers[p].step()
        optimizers[p].zero_grad(set_to_none=True)
        if on_step:
            on_step(names[p], False)

    handles = [p.register_post_accumulate_grad_hook(hook) for p in optimizers]
    return optimizers, handles


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Expected a tensor or a traceable wrapper-subclass.*")
        yield


def _watch_peak(phase: list[str], at_peak: dict[str, Any]) -> None:
    """Inside a measured step: note the phase in which the tracker's peak last rose, and the
    highest total tracked in each phase (`at_peak["phases"]`; the in-backward steps of all
    parameters are one phase, "in-backward step", with the parameter whose step was highest)."""
    from . import memory as harness

    tracker = harness.ACTIVE
    if tracker is None or getattr(tracker, "_vramlab_watched", False):
        return
    original = tracker._update_peak_stats
    phases: dict[str, dict[str, Any]] = at_peak.setdefault("phases", {})

    def update(peak_state):
        before = dict(tracker._peak_mem)
        original(peak_state)
        if tracker._peak_mem != before:
            at_peak["phase"] = phase[0]
        now = sum(snap.get("Total", 0) for snap in tracker._curr_mem_snap.values())
        coarse = "in-backward step" if phase[0].startswith("in-backward step") else phase[0]
        seen = phases.get(coarse)
        if seen is None or now > seen["peak"]:
            phases[coarse] = {"peak": now, **({"at": phase[0]} if coarse != phase[0] else {})}

    tracker._update_peak_stats = update
    tracker._vramlab_watched = True


def optimizer_factory(key: str) -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
    """The optimizer a whole-step peak runs: "adamw" is torch's AdamW with foreach=True (the harness's
    default, `measure_training`); the others are their library's defaults."""
    if key == "adamw":
        return lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True)
    if key == "adafactor":
        return lambda ps: torch.optim.Adafactor(ps)
    if key == "adamw-8bit-ao":
        import torchao.optim as ao

        return lambda ps: ao.AdamW8bit(ps)
    raise ValueError(f"whole-step peaks are measured for adamw, adafactor, adamw-8bit-ao, not {key!r}")


def measure_step_peak(spec: ModelSpec, *, batch_size: int, seq_len: int, precision: str = "fp32",
                      loop: str = "normal", optimizer: str = "adamw", mode: str = "trace") -> dict[str, Any]:
    """Peak of one steady-state training step (states made by a first step on zero gradients, as
    `measure_training` does), measured by the step harness: the normal loop, or the optimizer fused
    into the backward pass (`fuse_into_backward`). precision "fp32" or "bf16" (a pure bf16 model).
    Returns the peak, the harness's categories, MemTracker's own and the phase of the peak."""
    from .memory import fake_mode, measure, training_model
    from .models import make_batch
    from .record import resolve_mode

    if loop not in ("normal", "in-backward"):
        raise ValueError(f"loop must be normal or in-backward, got {loop!r}")
    mode_ = resolve_mode(mode)
    dtype = DTYPES[precision]
    factory = optimizer_factory(optimizer)
    phase = ["setup"]
    at_peak: dict[str, Any] = {}
    raw: dict[str, int] = {}

    def on_step(name: str, before: bool) -> None:
        phase[0] = f"in-backward step of {name}" if before else "backward"

    with fake_mode(mode_ == "trace"), _quiet():
        model = training_model(spec, attention="sdpa", dtype=dtype, device="cpu")
        params = [p for p in model.parameters() if p.requires_grad]
        if loop == "normal":
            opt = factory(params)
            for p in params:
                p.grad = torch.zeros_like(p)
            opt.step()
            opt.zero_grad(set_to_none=True)
            handles: list = []
        else:
            optimizers, handles = fuse_into_backward(model, factory, on_step)
            for p, o in optimizers.items():  # the states, made once as a first step would
                p.grad = torch.zeros_like(p)
                o.step()
                o.zero_grad(set_to_none=True)
            opt = _Merged(optimizers)
        batch = make_batch(spec, batch_size=batch_size, seq_len=seq_len, device="cpu")

        def step() -> None:
            from . import memory as harness

            _watch_peak(phase, at_peak)
            phase[0] = "forward"
            loss = model(**batch).loss
            phase[0] = "backward"
            loss.backward()
            del loss
            if loop == "normal":
                phase[0] = "optimizer.step"
                opt.step()
                phase[0] = "zero_grad"
                opt.zero_grad(set_to_none=True)
            phase[0] = "end"
            tracker = harness.ACTIVE
            snap = next(iter(tracker.get_tracker_snapshot("peak").values()), {})
            raw.update({str(getattr(k, "value", k)): v for k, v in snap.items()})
            leftover = [n for n, p in model.named_parameters() if p.grad is not None]
            at_peak["grads_after_step"] = len(leftover)

        label = f"{spec.name} train b={batch_size} s={seq_len} {precision} {optimizer} {loop} ({mode_})"
        m = measure(step, model=model, optimizer=opt, inputs=batch, label=label, mode=mode_, warmup_steps=0,
                    timing_steps=0, precision=precision)
        for h in handles:
            h.remove()
    bd = m.breakdown
    return {"model": spec.name, "batch_size": batch_size, "seq_len": seq_len, "precision": precision,
            "optimizer": optimizer, "loop": loop, "mode": mode_, "peak": m.total,
            "categories": {k: getattr(bd, k) for k in ("parameters", "gradients", "optimizer_states", "activations",
                                                        "temporaries", "inputs", "other")},
            "memtracker": raw, "peak_phase": at_peak.get("phase"), "phase_peaks": at_peak.get("phases", {}),
            "grads_left": at_peak.get("grads_after_step"),
            "seconds": round(m.seconds, 3)}


def profiled_step_peak(spec: ModelSpec, *, batch_size: int, seq_len: int, precision: str = "fp32",
                       optimizer: str = "adamw") -> dict[str, Any]:
    """The whole-step peak of the normal loop on the CPU without MemTracker, for optimizers whose
    step MemTracker cannot run (torchao's compiled step: under a dispatch mode torch.compile finds
    no frame to compile): the memory events of torch's profiler (`profile_memory=True`: every CPU
    allocation and free, compiled kernels' too) over one steady-state step (after a first step
    that makes the states, and compiles, and a warm-up step). peak = the bytes resident before the
    step (parameters, buffers, optimizer storages, the batch; each storage once) + the highest
    running sum of the step's allocations minus frees. `phase_peaks` by `record_function` range."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from .models import make_batch

    dtype = DTYPES[precision]
    factory = optimizer_factory(optimizer)
    with _quiet():
        model = build(spec, torch.float32)
        model = model.to(dtype) if dtype != torch.float32 else model
        params = [p for p in model.parameters() if p.requires_grad]
        opt = factory(params)
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        batch = make_batch(spec, batch_size=batch_size, seq_len=seq_len, device="cpu")

        def step(mark: bool) -> None:
            with record_function("forward") if mark else contextlib.nullcontext():
                loss = model(**batch).loss
            with record_function("backward") if mark else contextlib.nullcontext():
                loss.backward()
                del loss
            with record_function("optimizer.step") if mark else contextlib.nullcontext():
                opt.step()
            with record_function("zero_grad") if mark else contextlib.nullcontext():
                opt.zero_grad(set_to_none=True)

        step(False)  # warm-up: a steady-state step
        named = [(n, p) for n, p in model.named_parameters()]
        resident = StorageCounter()
        for _, t in leaves("", [p for _, p in named] + list(model.buffers())):
            resident.add(t)
        before_states = resident.total
        for _, t in leaves("", [opt.state, [g for g in opt.param_groups]]):
            resident.add(t)
        states = resident.total - before_states
        for t in batch.values():
            resident.add(t)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step(True)
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    ranges = [(e.start_ns(), e.end_ns(), e.name()) for e in events
              if e.name() in ("forward", "backward", "optimizer.step", "zero_grad")]
    running = high = 0
    at = None
    phases: dict[str, int] = {}
    for e in events:
        if e.name() != "[memory]" or not str(e.device_type()).endswith("CPU"):
            continue
        running += e.nbytes()
        where = next((name for a, b, name in ranges if a <= e.start_ns() <= b), "between phases")
        phases[where] = max(phases.get(where, running), running)
        if running > high:
            high, at = running, where
    return {"model": spec.name, "batch_size": batch_size, "seq_len": seq_len, "precision": precision,
            "optimizer": optimizer, "loop": "normal", "mode": "cpu (profiler memory events)",
            "peak": resident.total + high, "resident_before_step": resident.total, "optimizer_storages": states,
            "highest_rise": high, "peak_phase": at,
            "phase_peaks": {k: {"peak": resident.total + v} for k, v in phases.items()}}


def peak_in_child(spec: ModelSpec, *, timeout: float = 900, **options) -> dict[str, Any]:
    """`measure_step_peak(spec, **options)` in a fresh Python process: its result, or {"error": one
    line} (the child's exception, or how it died)."""
    import os
    import subprocess

    env = dict(os.environ)
    here = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([here, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    request = json.dumps({"spec": dataclasses.asdict(spec), "options": options})
    code = "import sys; from vramlab.measure.optimizers import _child; sys.exit(_child())"
    try:
        r = subprocess.run([sys.executable, "-c", code], input=request, capture_output=True, text=True, env=env,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"no answer in {timeout:.0f} s"}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if lines:
        return json.loads(lines[-1])
    how = f"killed by signal {-r.returncode}" if r.returncode < 0 else f"exit status {r.returncode}"
    last = [ln for ln in r.stderr.strip().splitlines() if ln.strip()][-1:] or ["no output"]
    return {"error": f"the process died ({how}); last line: {last[0][:200]}"}


def _child() -> int:
    request = json.loads(sys.stdin.read())
    spec = ModelSpec(**{**request["spec"], "dense_layer_ids": tuple(request["spec"].get("dense_layer_ids", ()))})
    try:
        out = measure_step_peak(spec, **request["options"])
    except Exception as e:  # noqa: BLE001 - one line for the parent
        out = {"error": _one_line(e)}
    print(json.dumps(out), flush=True)
    return 0


# ----------------------------------------------------------------------------- step time

def step_seconds(spec: ModelSpec, key: str, *, rank: int | None = None, steps: int = 5, warmup: int = 1) -> dict:
    """Median seconds of `optimizer.step()` over `steps` steps after `warmup` (torchao's first step
    compiles) on the CPU, fp32. Benchmark only: CPU kernels, a shared machine."""
    model = build(spec, torch.float32)
    opt, _ = make_optimizer(key, model, rank=rank)
    params = [p for p in model.parameters() if p.requires_grad]
    _random_grads(params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(warmup):
            opt.step()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t)
    row = {"model": spec.name, "dtype": "fp32", "optimizer": key, "device": "cpu", "median_seconds": statistics.median(times),
           "seconds": times, "warmup_steps": warmup}
    if rank is not None:
        row["rank"] = rank
    return row


# ----------------------------------------------------------------------------- the benchmark

PEAK_CASES = (  # (model, batch, seq, precision, mode): torch AdamW foreach, both loops
    ("gpt2", 2, 512, "fp32", "trace"), ("gpt2", 2, 512, "bf16", "trace"),
    ("llama-3.2-1b", 1, 1024, "fp32", "trace"), ("llama-3.2-1b", 1, 1024, "bf16", "trace"),
    ("llama-gqa-200", 4, 128, "fp32", "trace"), ("llama-gqa-200", 4, 128, "bf16", "trace"),
    ("gpt2-small-256", 2, 128, "fp32", "trace"), ("gpt2-small-256", 2, 128, "fp32", "cpu"),
    ("gpt2", 1, 128, "fp32", "trace"),  # few tokens: the step phase, not the backward's start, is the peak
)
OTHER_PEAKS = ("adamw", "adafactor", "adamw-8bit-ao")  # normal loop, gpt2-small-256 b=4 s=128 fp32
SECTIONS = ("states", "in-backward", "peaks", "time")


def _spec(name: str) -> ModelSpec:
    return MODELS[name]() if name in MODELS else preset(name)


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for dist in ("torch", "transformers", "bitsandbytes", "torchao", "galore-torch"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def _state_runs(models: list[str], optimizers: list[str]) -> Iterator[tuple[str, str, str, int | None]]:
    for m in models:
        for dt in DTYPES:
            for key in optimizers:
                for rank in (GALORE_RANKS if key == "galore-adamw" else (None,)):
                    yield m, dt, key, rank


def run(*, sections: Iterable[str] = SECTIONS, models: Iterable[str] = tuple(MODELS),
        optimizers: Iterable[str] = OPTIMIZERS, progress: Callable[[str], None] = print,
        checkpoint: Callable[[dict[str, Any]], None] = lambda res: None) -> dict[str, Any]:
    """The benchmark: the sections asked for, over the models and optimizers asked for;
    `checkpoint(results so far)` after each section."""
    from .models import count_parameters
    from .record import provenance

    sections, models, optimizers = list(sections), list(models), list(optimizers)
    res: dict[str, Any] = {
        "experiment": "optimizer memory, measured", "device": "cpu",
        "provenance": {**provenance("cpu"), "versions": _versions()},
        "counting": "state bytes: every storage an optimizer holds after one real step, once each (views by their "
                    "whole storage, tensor subclasses by their __tensor_flatten__ inner tensors, shared storages once, "
                    "objects in the state by their tensor attributes); per tensor 'state' gives bytes by key, "
                    "'view_bytes' the tensors' own numel x itemsize where that differs",
        "models": {}, "states": [], "in_backward": [], "peaks": [], "step_time_cpu": []}
    for name in models:
        spec = _spec(name)
        model = build(spec, torch.float32)
        res["models"][name] = {"hf_config": spec.to_hf_config(), "spec": dataclasses.asdict(spec),
                               "params": count_parameters(model), "param_tensors": len(list(model.parameters()))}
        del model
    if "in-backward" in sections:  # the presets the peaks run: counted from the spec (the same count)
        for name in dict.fromkeys(m for m, *_ in PEAK_CASES if m not in MODELS):
            spec = preset(name)
            res["models"][name] = {"hf_config": spec.to_hf_config(), "spec": dataclasses.asdict(spec),
                                   "params": spec.params, "preset": True}
    if "states" in sections:
        for m, dt, key, rank in _state_runs(models, optimizers):
            t = time.perf_counter()
            row = measure_states(_spec(m), dt, key, rank=rank)
            res["states"].append(row)
            what = f"skipped: {row['skipped']}" if "skipped" in row else f"{row['total']:,} B"
            progress(f"states  {m:15s} {dt:4s} {_okey(row):22s} {what}  ({time.perf_counter() - t:.1f} s)")
    checkpoint(res)
    if "in-backward" in sections:
        for m, b, s, prec, mode in PEAK_CASES:
            case = {"model": m, "batch_size": b, "seq_len": s, "precision": prec, "mode": mode, "optimizer": "adamw",
                    "foreach": True}
            for loop in ("normal", "in-backward"):
                t = time.perf_counter()
                r = measure_step_peak(_spec(m), batch_size=b, seq_len=s, precision=prec, loop=loop, mode=mode)
                case[loop] = {k: r[k] for k in ("peak", "categories", "memtracker", "peak_phase", "phase_peaks", "grads_left")}
                progress(f"step    {m:15s} b={b} s={s} {prec} {mode:5s} {loop:11s} peak {r['peak']:,} B "
                         f"at {r['peak_phase']}  ({time.perf_counter() - t:.1f} s)")
            case["saved"] = case["normal"]["peak"] - case["in-backward"]["peak"]
            res["in_backward"].append(case)
        checkpoint(res)
    if "peaks" in sections:
        spec = small_gpt2()
        for key in OTHER_PEAKS:
            if key not in optimizers:
                continue
            tried = []
            for mode in ("trace", "cpu"):  # MemTracker: on fake tensors, then on real ones (a fresh process each:
                t = time.perf_counter()  # torchao's compiled step under a dispatch mode can crash the process)
                r = peak_in_child(spec, batch_size=4, seq_len=128, precision="fp32", optimizer=key, mode=mode)
                if "error" in r:
                    tried.append({"mode": mode, "error": r["error"]})
                    progress(f"peak    {spec.name} {key:15s} {mode:9s} failed: {r['error'][:100]}")
                    continue
                res["peaks"].append({**r, "method": "MemTracker"})
                progress(f"peak    {spec.name} {key:15s} {mode:9s} {r['peak']:,} B at {r['peak_phase']}  "
                         f"({time.perf_counter() - t:.1f} s)")
            t = time.perf_counter()  # the profiler's memory events: every optimizer, MemTracker's check
            r = profiled_step_peak(spec, batch_size=4, seq_len=128, precision="fp32", optimizer=key)
            res["peaks"].append({**r, "method": "profiler", "memtracker_failed": tried})
            progress(f"peak    {spec.name} {key:15s} profiler  {r['peak']:,} B at {r['peak_phase']}  "
                     f"({time.perf_counter() - t:.1f} s)")
        checkpoint(res)
    if "time" in sections:
        spec = small_gpt2()
        for key in optimizers:
            if key in NEEDS_CUDA:
                continue
            r = step_seconds(spec, key, rank=128 if key == "galore-adamw" else None)
            res["step_time_cpu"].append(r)
            progress(f"time    {spec.name} {_okey(r):22s} {r['median_seconds'] * 1e3:.1f} ms (CPU)")
    return res


def _okey(row: dict) -> str:
    return row["optimizer"] + (f" r{row['rank']}" if row.get("rank") is not None else "")


def table(res: dict[str, Any]) -> str:
    """The state bytes as a table (model x dtype rows, optimizer columns) and the peaks."""
    lines = []
    rows = res.get("states", [])
    if rows:
        keys = list(dict.fromkeys(_okey(r) for r in rows))
        head = f"{'model':15s} {'dtype':5s}" + "".join(f"{k:>22s}" for k in keys)
        lines += ["state bytes after one step (CPU):", head]
        for m in dict.fromkeys(r["model"] for r in rows):
            for dt in dict.fromkeys(r["dtype"] for r in rows if r["model"] == m):
                cells = {_okey(r): r for r in rows if r["model"] == m and r["dtype"] == dt}
                line = f"{m:15s} {dt:5s}"
                for k in keys:
                    r = cells.get(k)
                    line += f"{'-' if r is None else 'skipped' if 'skipped' in r else format(r['total'], ','):>22s}"
                lines.append(line)
    if res.get("in_backward"):
        lines += ["", "step peak, torch AdamW foreach: normal loop vs optimizer in backward"]
    for c in res.get("in_backward", []):
        lines.append(f"{c['model']:15s} b={c['batch_size']} s={c['seq_len']:<5d} {c['precision']:5s} {c['mode']:5s} "
                     f"normal {c['normal']['peak']:>15,}  in-backward {c['in-backward']['peak']:>15,}  "
                     f"saved {c['saved']:>14,}  (in-backward peak at: {c['in-backward']['peak_phase']})")
    if res.get("peaks"):
        lines += ["", "whole-step peak, normal loop"]
    for r in res.get("peaks", []):
        lines.append(f"{r['model']} b=4 s=128 fp32 {r['optimizer']:15s} {r['mode']:30s} peak {r['peak']:>13,} "
                     f"(at {r['peak_phase']}; optimizer.step phase {r['phase_peaks'].get('optimizer.step', {}).get('peak', 0):,})")
    if res.get("step_time_cpu"):
        lines += ["", "optimizer.step() on the CPU, median of 5 (benchmark only)"]
    for r in res.get("step_time_cpu", []):
        lines.append(f"CPU step time {r['model']} fp32 {_okey(r):22s} {r['median_seconds'] * 1e3:9.2f} ms")
    return "\n".join(lines)


def _merge(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """A partial run (--only) replaces the matching entries of an earlier results file."""
    out = dict(old)
    out["models"] = {**old.get("models", {}), **new["models"]}
    for sec, ident in (("states", ("model", "dtype", "optimizer", "rank")),
                       ("in_backward", ("model", "batch_size", "seq_len", "precision", "mode")),
                       ("peaks", ("model", "optimizer", "mode", "method")), ("step_time_cpu", ("optimizer", "rank"))):
        fresh = {tuple(r.get(k) for k in ident) for r in new[sec]}
        out[sec] = [r for r in old.get(sec, []) if tuple(r.get(k) for k in ident) not in fresh] + new[sec]
    out["provenance"] = new["provenance"]
    out["complete"] = old.get("complete", False) and new["complete"]
    out["partial_runs"] = old.get("partial_runs", []) + ([new["command"]] if new["complete"] else [])
    return out


def dumps(res: dict[str, Any]) -> str:
    """The results as JSON, indented, with each parameter tensor's row on one line."""
    rows: dict[str, str] = {}

    def compact(row: dict) -> str:
        token = f"@@row{len(rows)}@@"
        rows[f'"{token}"'] = json.dumps(row, separators=(", ", ": "))
        return token

    shown = {**res, "states": [{**r, "tensors": [compact(t) for t in r["tensors"]]} if "tensors" in r else r
                               for r in res.get("states", [])]}
    text = json.dumps(shown, indent=1)
    return re.sub(r'"@@row\d+@@"', lambda m: rows[m.group(0)], text) + "\n"


def main(argv: list[str] | None = None) -> int:
    from .. import checks

    ap = checks.Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"the JSON file to write (default {DEFAULT_OUT})")
    ap.add_argument("--only", default=None,
                    help="comma-separated: sections (" + ", ".join(SECTIONS) + "), optimizers (" + ", ".join(OPTIMIZERS)
                         + ") and models (" + ", ".join(MODELS) + "); each kind given narrows that kind; the results "
                         "are merged into an existing --out file")
    a = ap.parse_args(argv)
    sections, models, optimizers = list(SECTIONS), list(MODELS), list(OPTIMIZERS)
    if a.only is not None:
        items = [x.strip() for x in a.only.split(",") if x.strip()]
        bad = [x for x in items if x not in (*SECTIONS, *OPTIMIZERS, *MODELS)]
        if not items or bad:
            checks.fail(PROG, f"--only: unknown {', '.join(map(repr, bad)) or 'empty list'}; choose from sections "
                              f"{', '.join(SECTIONS)}, optimizers {', '.join(OPTIMIZERS)}, models {', '.join(MODELS)}")
        sections = [x for x in items if x in SECTIONS] or sections
        models = [x for x in items if x in MODELS] or models
        optimizers = [x for x in items if x in OPTIMIZERS] or optimizers
    checks.output_path(PROG, a.out, make_folder=True)
    command = f"{PROG} " + " ".join(argv if argv is not None else sys.argv[1:])
    earlier = json.loads(a.out.read_text()) if a.only is not None and a.out.exists() else None

    def save(res: dict[str, Any], complete: bool) -> dict[str, Any]:
        out = {**res, "command": command, "complete": complete}
        if earlier is not None:  # a partial run replaces its entries in the earlier file
            out = _merge(earlier, out)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(dumps(out))
        return out

    res = run(sections=sections, models=models, optimizers=optimizers, progress=lambda s: print(s, flush=True),
              checkpoint=lambda r: save(r, False))
    res = save(res, True)
    print(table(res))
    print(f"-> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
