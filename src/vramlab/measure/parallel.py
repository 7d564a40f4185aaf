"""Lab 3's experiments: data, tensor and pipeline parallelism in real processes, measured per rank.

    python -m vramlab.measure.parallel ddp --nproc 2                 # gloo, CPU processes on this machine
    python -m vramlab.measure.parallel tp  --nproc 2
    python -m vramlab.measure.parallel pp  --nproc 2 --micro-batches 1,2,4,8 --schedule gpipe,1f1b
    python -m vramlab.measure.parallel cp  --method ring --nproc 4    # context parallelism (`cp_main`'s options)
    python -m vramlab.measure.parallel ep  --ep 2 --dp 4 --capacity-factor 1.5 --zero 1  # expert parallelism (`ep_main`)
    python -m vramlab.measure.parallel ddp --backend nccl --nproc 8  # one process per GPU
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 -m vramlab.measure.parallel ddp --backend nccl

    # other models and layouts (the estimator's validation: benchmarks/layout_validation.py)
    python -m vramlab.measure.parallel ddp --model opt-val --gradient-as-bucket-view --optimizer-impl for-loop
    python -m vramlab.measure.parallel tp  --model llama-gqa-val --sp --recompute selective --precision bf16
    python -m vramlab.measure.parallel pp  --model neox-val --nproc 4 --schedule gpipe,1f1b,interleaved --chunks 2

Under torchrun (RANK/WORLD_SIZE set) it runs in place; otherwise it spawns --nproc local processes
(as `vramlab.measure.collectives`). Every experiment trains a small model built from a config (random init;
`--model`, default lab 3's Llama, `MODELS` lists the others: OPT-like with tied embeddings,
GPT-NeoX-like with a fused query_key_value, Llama-like with grouped-query attention) and reports,
per rank, what `vramlab.parallel` predicts (lab 3's model, the lab's settings only) and what was
measured:

- ddp: `DistributedDataParallel`; the gradients after one step against a single process's on the
  whole batch; DDP's gradient buckets (its own logging data) against `parallel.ddp_buckets`; the
  rank's memory against `parallel.estimate_layout`.
- tp: the model's blocks split with DTensor's `parallelize_module` (`tp_plan`: q/k/v or the fused qkv
  and the MLP's first projections column-wise, the attention output and the MLP's last projection
  row-wise, embedding and head by vocabulary with a vocabulary-parallel loss; `--sp` adds sequence
  parallelism on the norms); each rank's parameter bytes and memory against the prediction, the loss
  and logits against the unsplit model.
- pp: the blocks split into `nproc` stages (`--chunks` v per rank for the interleaved schedule) run by
  `torch.distributed.pipelining` (GPipe, 1F1B, interleaved 1F1B); each stage's peak, the micro-batches
  in flight, the bytes sent across stage boundaries and the measured bubble against the formula.

Memory, two ways:

- `measured` (lab 3's accounting, kept as it was): MemTracker over one steady-state step for ddp and tp
  (DDP's buckets, allocated by its C++ reducer, added to the gradients from its logging data), live
  storages created during the step on top of the resident states for pp. MemTracker registers DDP's
  buckets a second time, as temporaries, once c10d.allreduce_ hands them back: where its peak falls
  after the first bucket's all-reduce, `measured` counts those buckets twice (`measured_note`).
- `memory` (every run): `_Ledger`, a dispatch-level record of every storage from the start of the rank
  (model build, DDP's construction, warm-up steps included), each with its bytes, dtype, shape, the
  operation that created it and the phase it was created in; DTensor operations are followed into
  their local tensors (so DTensor's internal buffers are seen). Over one steady-state step (optimizer
  states exist, gradients kept allocated, `zero_grad(set_to_none=False)`, as Megatron-LM's contiguous
  gradient buffers are) it reports the peak, the phase it falls in (forward, loss, backward,
  optimizer, schedule), the peak of each phase, the bytes at each of those points by category
  (parameters, gradients, optimizer states, inputs, buffers, persistent other = storages that existed
  before the step and are none of these, activations = created by forward passes, backward / optimizer
  transients, step other), the 10 largest non-state storages at the peak and the largest storages each
  phase created. Not seen: memory allocated outside PyTorch's dispatcher (gloo's own buffers,
  allocator slack) and operations run on threads other than the rank's main and autograd threads.
  Imports torch.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from .. import checks
from .. import context_parallel as CP
from .. import expert_parallel as EP
from .. import parallel as P
from .. import pipeline as PIPE
from ..memory import LOSSES, loss_chunk_size
from ..specs import ModelSpec, from_config

# The lab's model: Llama's architecture (nn.Linear everywhere, so DTensor's plans apply), small
# enough for two CPU processes, with activations dominating as in real training, and a small
# vocabulary so that the pipeline's last stage computes about what the others do.
LAB_CONFIG = dict(model_type="llama", hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=8, vocab_size=512, max_position_embeddings=512,
                  tie_word_embeddings=False)
EXPERIMENTS = ("ddp", "tp", "pp")

# Validation models: other families than lab 3's, each all nn.Linear (DTensor's plans apply; GPT-2's
# Conv1D does not), 8 layers (p = 4 stages x v = 2 chunks), a vocabulary large enough for the
# embedding and head to matter, a rank's step in about a second on one CPU core. No dropout.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "lab": ("llama-lab3", LAB_CONFIG),
    # OPT: learned positions, LayerNorm with bias, ReLU MLP (fc1/fc2 in the block), tied embeddings
    "opt-val": ("opt-val", dict(model_type="opt", hidden_size=256, ffn_dim=1024, num_hidden_layers=8,
                                num_attention_heads=8, vocab_size=8192, max_position_embeddings=512,
                                word_embed_proj_dim=256, do_layer_norm_before=True, enable_bias=True,
                                activation_function="relu", tie_word_embeddings=True, dropout=0.0,
                                attention_dropout=0.0, layerdrop=0.0)),
    # GPT-NeoX / Pythia: fused query_key_value (laid out head by head, so column-wise = by heads),
    # parallel residual, partial rotary, untied head (lm_head in transformers 5; embed_out before)
    "neox-val": ("neox-val", dict(model_type="gpt_neox", hidden_size=256, intermediate_size=1024,
                                  num_hidden_layers=8, num_attention_heads=8, vocab_size=4096,
                                  max_position_embeddings=512, rotary_pct=0.25, use_parallel_residual=True,
                                  hidden_act="gelu", tie_word_embeddings=False, hidden_dropout=0.0,
                                  attention_dropout=0.0)),
    # Llama 3.2-like: grouped-query attention 8 query heads / 2 key-value heads, tied embeddings
    "llama-gqa-val": ("llama-gqa-val", dict(model_type="llama", hidden_size=256, intermediate_size=768,
                                            num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                                            vocab_size=6144, max_position_embeddings=512,
                                            tie_word_embeddings=True)),
}

# Where each family keeps its parts (transformers 5.x module names) and how tensor parallelism splits
# it: `col` column-wise (by heads / MLP width), `row` row-wise (one all-reduce each); `attn`/`mlp` the
# modules whose input sequence parallelism gathers (`attn_kw`: the block passes it as hidden_states=).
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(embed="model.embed_tokens", layers="model.layers", norm="model.norm", head="lm_head",
                  rotary="model.rotary_emb", col=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                   "mlp.gate_proj", "mlp.up_proj"),
                  row=("self_attn.o_proj", "mlp.down_proj"), attn="self_attn", attn_kw=True, mlp="mlp",
                  block_norms=("input_layernorm", "post_attention_layernorm"), sp=True),
    "gpt_neox": dict(embed="gpt_neox.embed_in", layers="gpt_neox.layers", norm="gpt_neox.final_layer_norm",
                     head="lm_head", rotary="gpt_neox.rotary_emb",
                     col=("attention.query_key_value", "mlp.dense_h_to_4h"),
                     row=("attention.dense", "mlp.dense_4h_to_h"), attn="attention", attn_kw=False, mlp="mlp",
                     block_norms=("input_layernorm", "post_attention_layernorm"), sp=True),
    # OPT: no sequence parallelism (its block flattens (b, s, h) to (b*s, h) before the MLP, which a
    # sequence-sharded DTensor cannot take without a gather, and its learned positions are added as a
    # plain tensor)
    "opt": dict(embed="model.decoder.embed_tokens", layers="model.decoder.layers",
                norm="model.decoder.final_layer_norm", head="lm_head", rotary=None, positions="model.decoder.embed_positions",
                col=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "fc1"),
                row=("self_attn.out_proj", "fc2"), attn="self_attn", attn_kw=True, mlp=None,
                block_norms=("self_attn_layer_norm", "final_layer_norm"), sp=False),
}


def model_spec(name: str = "lab") -> ModelSpec:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    label, cfg = MODELS[name]
    return from_config(cfg, name=label)


def lab_model() -> ModelSpec:
    return model_spec("lab")


class ParlabError(RuntimeError):
    """A rank could not finish: the message says which and why, in one line."""


# ----------------------------------------------------------------------------- helpers (torch)

def rank_device(backend: str, rank: int):
    import torch

    if backend == "nccl":
        dev = torch.device(f"cuda:{rank % torch.cuda.device_count()}")
        torch.cuda.set_device(dev)
        return dev
    torch.set_num_threads(1)  # one compute thread per rank, each on its own core when there are enough
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) >= int(os.environ.get("WORLD_SIZE", "1")):
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    return torch.device("cpu")


def _build(spec: ModelSpec, dev):
    import torch

    from .models import build_model

    torch.manual_seed(0)  # the same weights on every rank
    return build_model(spec, attention="sdpa", device=dev)


def _batch(spec: ModelSpec, rows: int, seq: int, dev, seed: int = 1):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, spec.vocab_size, (rows, seq), generator=g).to(dev)


def _mode(dev) -> str:
    return "cuda" if dev.type == "cuda" else "cpu"


def _get(module, path: str):
    for part in path.split("."):
        module = getattr(module, part)
    return module


def _family(spec: ModelSpec) -> dict[str, Any]:
    if spec.family not in FAMILIES:
        raise ParlabError(f"{spec.name}: family {spec.family} has no parallel plan here (known: {', '.join(FAMILIES)})")
    return FAMILIES[spec.family]


def _autocast(precision: str, dev):
    """bf16 autocast around forward passes and the loss (`precision="bf16"`), nothing for fp32."""
    import torch

    if precision == "bf16":
        return torch.autocast(dev.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _apply_recompute(model, spec: ModelSpec, how: str) -> None:
    """Activation recomputation, non-reentrant `torch.utils.checkpoint`: `full` checkpoints every block
    (only its input is kept; the block runs again in the backward), `selective` only the attention core
    (transformers' sdpa attention function: GQA's key/value expansion where transformers does it, the SDPA
    kernel and what it saves, its output and log-sum-exp), as Megatron-LM's selective recomputation does.

    early_stop=False: with early stopping (torch's default) the recomputation stops at the last tensor the
    backward needs, and under DTensor tensor parallelism a block that ends in two row-parallel all-reduces
    (GPT-NeoX's parallel residual) leaves one issued, never-waited functional all-reduce per block behind,
    whose output is never freed: b s h bytes per block and step, growing without bound (measured with
    the ledger; absent without early stopping)."""
    import functools

    from torch.utils.checkpoint import checkpoint

    if how == "full":
        for layer in _get(model, _family(spec)["layers"]):
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False, early_stop=False)
    elif how == "selective":
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

        core = ALL_ATTENTION_FUNCTIONS["sdpa"]
        if getattr(core, "_vramlab_selective", False):
            return

        def selective(module, query, key, value, attention_mask, *args, **kwargs):
            return checkpoint(core, module, query, key, value, attention_mask, *args, use_reentrant=False,
                              early_stop=False, **kwargs)

        selective._vramlab_selective = True
        AttentionInterface.register("sdpa", selective)  # this process only (one process per rank)


class _Tracked:
    """MemTracker around a step, with the current bytes by category readable at chosen points."""

    def __init__(self, model, optimizer, inputs):
        from .memory import ignore_frozen, storage_tracker, tensors_in

        self.tracker = storage_tracker()
        self.tracker.track_external(model, optimizer, *tensors_in(inputs))
        ignore_frozen(self.tracker, model)
        self.points: dict[str, dict[str, int]] = {}

    def mark(self, name: str) -> None:
        self.points[name] = self._snap("current")

    def set_phase(self, name: str) -> None:
        pass

    def _snap(self, which: str) -> dict[str, int]:
        snaps = self.tracker.get_tracker_snapshot(which)
        snap = next(iter(snaps.values())) if snaps else {}
        return {str(k.value if hasattr(k, "value") else k): int(v) for k, v in snap.items()}

    def peak(self) -> dict[str, int]:
        return self._snap("peak")


def _categories(snap: dict[str, int], *, opt, extra_grad: int = 0) -> dict[str, int]:
    """MemTracker's categories -> the estimate's (`measure.to_breakdown`), as a dict with the total;
    `extra_grad`: gradient bytes the tracker cannot see."""
    from .memory import state_bytes, to_breakdown

    bd = to_breakdown(snap, opt_state_bytes=state_bytes(opt), label="measured")
    return _with_total({"parameters": bd.parameters, "gradients": bd.gradients + extra_grad,
                        "optimizer_states": bd.optimizer_states, "activations": bd.activations,
                        "temporaries": bd.temporaries, "inputs": bd.inputs, "other": bd.other})


def _measure_step(step, model, opt, inputs, *, extra_grad: int = 0) -> tuple[dict[str, int], dict[str, int]]:
    """One step under MemTracker: (the peak, the end of the forward pass) by category. `step(tr)` calls
    `tr.mark("forward end")` once its loss exists."""
    tr = _Tracked(model, opt, inputs)
    with tr.tracker:
        step(tr)
    return (_categories(tr.peak(), opt=opt, extra_grad=extra_grad),
            _categories(tr.points["forward end"], opt=opt, extra_grad=extra_grad))


def _predicted(b) -> dict[str, int]:
    return {"parameters": b.parameters, "gradients": b.gradients, "optimizer_states": b.optimizer_states,
            "activations": b.activations, "temporaries": b.temporaries, "total": b.total, "phase": b.phase}


def _with_total(d: dict[str, int]) -> dict[str, int]:
    return {**d, "total": sum(d.values())}


def _optimizer(params, foreach: bool = True):
    """AdamW (lr 1e-4), foreach by default (lab 3's setting) or one parameter at a time; with foreach, split
    parameters (DTensors) in a group of their own: a foreach kernel cannot mix them with plain tensors
    (the replicated norms)."""
    import torch
    from torch.distributed.tensor import DTensor

    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    return torch.optim.AdamW([{"params": g} for g in groups if g], lr=1e-4, foreach=foreach)


def _steady(opt, params) -> None:
    """Create the optimizer's states (one step on zero gradients) and keep the gradients allocated."""
    import torch

    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    _zero(opt)


def _zero(opt) -> None:
    """zero_grad(set_to_none=False) one tensor at a time (its foreach kernel cannot mix DTensors and tensors):
    the gradients stay allocated."""
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.grad.zero_()


def _lm_loss(logits, labels):
    """The next-token loss as transformers computes it (`ForCausalLMLoss`): the labels shifted left and
    padded with -100 (ignored), the logits flattened as a view. Slicing the logits instead
    (`logits[:, :-1]`) would copy them, one b x s x V tensor that no real training loop holds."""
    import torch.nn.functional as F

    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=-100)


def _train_step(model, batch, opt, loss_context=None, precision: str = "fp32"):
    """One steady-state training step, `step(tr=None)`: forward and loss (inside `loss_context()`, e.g.
    tensor parallelism's `loss_parallel`, with the backward; in bf16 autocast for precision="bf16"), the
    forward's end marked and the phases named on a tracker when one is given, optimizer step, gradients
    zeroed but kept."""

    def step(tr=None):
        phase = tr.set_phase if tr else (lambda name: None)
        with (loss_context or contextlib.nullcontext)():
            phase("forward")
            with _autocast(precision, batch.device):
                logits = model(batch).logits
                phase("loss")
                loss = _lm_loss(logits, batch)
                del logits
            if tr:
                tr.mark("forward end")
            phase("backward")
            loss.backward()
        phase("optimizer")
        opt.step()
        _zero(opt)
        phase("after step")
    return step


# ----------------------------------------------------------------------------- the ledger

_FORWARD_PHASES = ("forward", "loss")
_STATE_CATEGORIES = ("parameters", "gradients", "optimizer_states")


def _storage_key(t) -> int | None:
    """The data pointer of a tensor's storage (a DTensor's local tensor), None when it has none."""
    import torch

    if not isinstance(t, torch.Tensor):
        return None
    if hasattr(t, "_local_tensor"):
        t = t._local_tensor
    if t.device.type == "meta":
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


class _ModeContext:
    """A tracker that is entered as its dispatch mode (`self.mode`), and can pause it."""

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)

    @contextlib.contextmanager
    def paused(self):
        """Nothing recorded inside (timed steps: no dispatch overhead). Frees of known storages are still
        seen (they are weakref callbacks); what is created inside and outlives it is unknown to the ledger."""
        self.mode.__exit__(None, None, None)
        try:
            yield
        finally:
            self.mode.__enter__()


class _Ledger(_ModeContext):
    """Every storage created through PyTorch's dispatcher in this process (on the threads that run with the
    mode: the rank's main thread and, on the CPU, the autograd engine's), from creation to free, with its
    bytes, dtype, shape, creating operation and the phase it was created in.

    Used as a context manager around the whole experiment, so that what exists before a measured step
    (parameters, DDP's buckets, the pipeline's receive buffers, leftovers) is known. DTensor operations
    are passed on to DTensor (the mode returns NotImplemented), whose operations on local tensors then come
    back through the mode: DTensor's own temporaries are seen. Fake and meta tensors (DTensor's sharding
    propagation) are skipped. `begin(groups)` ... `end()` measure one step: every allocation and free in
    between is logged, so that the storages alive at the peak, at each phase's peak and at marked points
    can be replayed and sorted into categories."""

    def __init__(self):
        import torch
        from torch.distributed.tensor import DTensor
        from torch.utils._python_dispatch import TorchDispatchMode

        self.live: dict[int, tuple] = {}  # key -> (bytes, dtype, shape, op, phase, in_step)
        self.now, self.phase, self.recording = 0, "setup", False
        self.context = None  # () -> dict, read at each new peak of a measured step
        self.comm: dict[str, list[int]] = {}
        self._ops: dict = {}  # operation -> (name, is a collective)
        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if any(issubclass(t, DTensor) for t in types):
                    return NotImplemented
                out = func(*args, **(kwargs or {}))
                outer._track(func, out, args)
                return out

        import weakref

        from torch._subclasses.fake_tensor import FakeTensor
        from torch.utils._pytree import tree_flatten

        self._torch, self._fake, self._flatten, self._weakref = torch, FakeTensor, tree_flatten, weakref
        self.mode = Mode()

    # -- bookkeeping
    def _track(self, func, out, args) -> None:
        torch, FakeTensor, tree_flatten, weakref = self._torch, self._fake, self._flatten, self._weakref
        known = self._ops.get(func)
        if known is None:
            name = str(func)
            known = self._ops[func] = (name, (name.startswith("_c10d_functional.") or name.startswith("c10d."))
                                       and not name.startswith("_c10d_functional.wait") and "wrap_tensor" not in name)
        name, is_comm = known
        if self.recording and is_comm:
            sent = sum(a.numel() * a.element_size() for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor))
            c = self.comm.setdefault(name, [0, 0])
            c[0] += 1
            c[1] += sent
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or isinstance(t, FakeTensor) or t.device.type == "meta":
                continue
            if hasattr(t, "_local_tensor"):
                t = t._local_tensor
            try:
                st = t.untyped_storage()
                key, n = st.data_ptr(), st.nbytes()
            except (RuntimeError, NotImplementedError):
                continue
            if n == 0:
                continue
            if self.recording and key not in self.lab_counted and key not in self.lab_excluded:
                # lab 3's pipeline accounting (`LiveBytes`): a storage counts from the first operation that
                # returns it during the step (created then, or existing but not a resident state) until freed
                self.lab_counted[key] = n
                self.lab_now += n
                self.lab_peak = max(self.lab_peak, self.lab_now)
            if key in self.live:
                continue
            info = (n, str(t.dtype).replace("torch.", ""), list(t.shape), name, self.phase, self.recording)
            self.live[key] = info
            self.now += n
            weakref.finalize(st, self._free, key)
            if self.recording:
                self.events.append((key, info))
                self.step_now += n
                self.step_peak = max(self.step_peak, self.step_now)
                big = self.biggest.setdefault(self.phase, [])
                if len(big) < 5 or n > big[-1][0]:
                    big.append(info)
                    big.sort(key=lambda i: -i[0])
                    del big[5:]
                self._peaks()

    def _peaks(self) -> None:
        if self.now > self.phase_peaks.get(self.phase, (-1, 0))[0]:
            self.phase_peaks[self.phase] = (self.now, len(self.events))
        if self.now > self.peak:
            self.peak, self.peak_at, self.peak_phase = self.now, len(self.events), self.phase
            self.peak_context = self.context() if self.context else None

    def _free(self, key: int) -> None:
        info = self.live.pop(key, None)
        if info is None:
            return
        self.now -= info[0]
        if self.recording:
            self.events.append((key, None))
            if info[5]:
                self.step_now -= info[0]
            self.lab_now -= self.lab_counted.pop(key, 0)

    def set_phase(self, name: str) -> None:
        self.phase = name
        if self.recording:
            self._peaks()

    def mark(self, name: str) -> None:
        if self.recording:
            self.marks[name] = (self.now, len(self.events))


    # -- one measured step
    def begin(self, groups: dict[str, list]) -> None:
        """Start measuring a step; `groups`: the resident tensors by category (parameters, gradients,
        optimizer_states, inputs, buffers)."""
        import gc

        gc.collect()
        self.groups = groups
        self.start_live = dict(self.live)
        self.start_now = self.now
        self.events: list = []
        self.marks: dict[str, tuple[int, int]] = {}
        self.biggest: dict[str, list] = {}
        self.phase_peaks: dict[str, tuple[int, int]] = {}
        self.comm = {}
        self.peak, self.peak_at, self.peak_phase, self.peak_context = self.now, 0, self.phase, \
            (self.context() if self.context else None)
        self.step_now = self.step_peak = 0
        self.lab_excluded = {k for cat in _STATE_CATEGORIES + ("inputs",) for k in map(_storage_key, groups.get(cat, []))
                             if k is not None}
        self.lab_counted: dict[int, int] = {}
        self.lab_now = self.lab_peak = 0
        self.recording = True

    def end(self, groups: dict[str, list] | None = None) -> dict[str, Any]:
        self.recording = False
        keys: dict[str, set] = {}
        for g in (self.groups, groups or {}):
            for cat, tensors in g.items():
                keys.setdefault(cat, set()).update(k for k in map(_storage_key, tensors) if k is not None)
        # resident storages the ledger never saw (allocated outside it): counted at every point from their tensors
        unseen = {}
        for cat, ks in keys.items():
            for t in (self.groups.get(cat, []) + (groups or {}).get(cat, [])):
                k = _storage_key(t)
                if k is not None and k not in self.start_live and k not in unseen:
                    tt = t._local_tensor if hasattr(t, "_local_tensor") else t
                    unseen[k] = (cat, tt.untyped_storage().nbytes())
        unseen_bytes: dict[str, int] = {}
        for cat, n in unseen.values():
            unseen_bytes[cat] = unseen_bytes.get(cat, 0) + n
        states = [(i, self._replay(i)) for i in sorted({self.peak_at, *(i for _, i in self.phase_peaks.values()),
                                                        *(i for _, i in self.marks.values())})]
        at = dict(states)

        def point(index: int, top: int = 0) -> dict[str, Any]:
            cats, items = self._categorize(at[index], keys, unseen_bytes)
            out: dict[str, Any] = {"total": sum(cats.values()), "categories": cats, "coarse": _coarse(cats)}
            if top:
                out["largest"] = [_item(info, cat) for info, cat in items[:top]]
            return out

        result = {
            "peak": self.peak + sum(unseen_bytes.values()), "peak_phase": self.peak_phase,
            "at_peak": point(self.peak_at, top=10),
            "peak_context": self.peak_context,
            "phases": {ph: point(i, top=3) | {"peak": n + sum(unseen_bytes.values())}
                       for ph, (n, i) in self.phase_peaks.items()},
            "marks": {name: point(i) for name, (n, i) in self.marks.items()},
            "created_in_step_peak": self.step_peak, "lab_accounting_peak": self.lab_peak,
            "largest_created": {ph: [_item(info) for info in big] for ph, big in self.biggest.items()},
            "collectives_seen": {k: {"calls": c, "input_bytes": b} for k, (c, b) in sorted(self.comm.items())},
            "resident_unseen_by_ledger": unseen_bytes,
            "before_step": self.start_now + sum(unseen_bytes.values()),
        }
        del self.events, self.start_live
        return result

    def _replay(self, index: int) -> dict[int, tuple]:
        live = dict(self.start_live)
        for key, info in self.events[:index]:
            if info is None:
                live.pop(key, None)
            else:
                live[key] = info
        return live

    def _categorize(self, live: dict[int, tuple], keys: dict[str, set], unseen: dict[str, int]):
        cats = {c: 0 for c in ("parameters", "gradients", "optimizer_states", "inputs", "buffers", "persistent_other",
                               "activations", "backward_transients", "optimizer_transients", "step_other")}
        for cat, n in unseen.items():
            cats[cat] = cats.get(cat, 0) + n
        items = []
        for key, info in live.items():
            cat = next((c for c, ks in keys.items() if key in ks), None)
            if cat is None:
                if key in self.start_live:
                    cat = "persistent_other"
                elif info[4] in _FORWARD_PHASES:
                    cat = "activations"
                elif info[4] == "backward":
                    cat = "backward_transients"
                elif info[4] == "optimizer":
                    cat = "optimizer_transients"
                else:
                    cat = "step_other"
                items.append((info, cat))
            cats[cat] = cats.get(cat, 0) + info[0]
        items.sort(key=lambda x: -x[0][0])
        return cats, items


def _coarse(cats: dict[str, int]) -> dict[str, int]:
    """The ledger's categories folded into the five of the estimate's breakdown."""
    return {"parameters": cats["parameters"], "gradients": cats["gradients"],
            "optimizer_states": cats["optimizer_states"],
            "activations_transients": cats["activations"] + cats["backward_transients"] + cats["optimizer_transients"]
            + cats["step_other"],
            "other": cats["inputs"] + cats["buffers"] + cats["persistent_other"]}


def _item(info: tuple, category: str | None = None) -> dict[str, Any]:
    out = {"bytes": info[0], "dtype": info[1], "shape": info[2], "op": info[3], "phase": info[4]}
    if category:
        out["category"] = category
    return out


_LEDGER: _Ledger | None = None


def _groups(modules, opt, inputs) -> dict[str, list]:
    params = [p for m in modules for p in m.parameters()]
    return {"parameters": params, "gradients": [p.grad for p in params if p.grad is not None],
            "optimizer_states": [v for s in opt.state.values() for v in s.values() if hasattr(v, "untyped_storage")],
            "inputs": list(inputs), "buffers": [b for m in modules for b in m.buffers()]}


def _ledger_step(step, modules, opt, inputs) -> dict[str, Any]:
    """One step measured by the process's ledger."""
    led = _LEDGER
    groups = _groups(modules, opt, inputs)
    led.begin(groups)
    try:
        step(led)
    finally:
        led.set_phase("after step")
    return led.end(_groups(modules, opt, inputs))


def _shard_bytes(params) -> int:
    """Bytes of this rank's parameters (a DTensor's local shard)."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in params)


def _run_info(spec: ModelSpec, args, layout: dict[str, int]) -> dict[str, Any]:
    """What a run measured, exactly: the model and the step's settings. `param_count` is the whole model's
    (spec.params, equal to the built model's parameter count, tied weights once)."""
    return {"model_name": args.model, "model_config": MODELS[args.model][1], "hf_config": spec.to_hf_config(),
            "param_count": spec.params, "layout": layout,
            "precision": "bf16 autocast (CPU), fp32 parameters, gradients and states" if args.precision == "bf16"
            else "fp32", "optimizer": {"name": "AdamW", "lr": 1e-4, "foreach": args.foreach},
            "attention": "sdpa", "gradients_kept_between_steps": True, "zero_grad": "set_to_none=False",
            "recompute": args.recompute, "sequence_parallel": bool(args.sp),
            **({"checkpoint": "torch.utils.checkpoint, use_reentrant=False, early_stop=False"}
               if args.recompute != "none" else {})}


# ----------------------------------------------------------------------------- DDP

def _run_ddp(rank: int, world: int, args, dev) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    spec, b, s = model_spec(args.model), args.micro_batch, args.seq
    view = bool(args.gradient_as_bucket_view)
    batch = _batch(spec, b * world, s, dev)
    mine = batch[rank * b:(rank + 1) * b]
    # 1. gradients: DDP on this rank's rows against one process on the whole batch
    model = _build(spec, dev)
    ref = copy.deepcopy(model)
    ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None, bucket_cap_mb=args.bucket_cap_mb,
              gradient_as_bucket_view=view)
    _lm_loss(ddp(mine).logits, mine).backward()
    _lm_loss(ref(batch).logits, batch).backward()
    # relative to each tensor's largest gradient, or to 1e-6 of the model's largest where a tensor's gradient is
    # nothing but rounding (a key projection's bias: zero in exact arithmetic, the softmax ignores it)
    floor = 1e-6 * max(q.grad.abs().max().item() for q in ref.parameters())
    worst = max(((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(max(floor, 1e-30))).item()
                for p, q in zip(model.parameters(), ref.parameters()))
    del ddp, model, ref
    gc.collect()
    # 2. memory of a steady-state step, and the buckets DDP settled on
    model = _build(spec, dev)
    _apply_recompute(model, spec, args.recompute)
    _LEDGER.set_phase("ddp construction")
    ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None, bucket_cap_mb=args.bucket_cap_mb,
              gradient_as_bucket_view=view)
    _LEDGER.set_phase("setup")
    params = list(model.parameters())
    opt = _optimizer(params, args.foreach)
    _steady(opt, params)

    step = _train_step(ddp, mine, opt, precision=args.precision)
    step()  # DDP records the order in which gradients became ready,
    step()  # and rebuilds its buckets in that order at the start of the second forward
    # the reducer's buckets as they are now (zero tensors shaped like them: their bytes, in reduction order)
    order = [int(i) for i in str(ddp._get_ddp_logging_data().get("prev_iteration_grad_ready_order_indices", "")).split(",")
             if i.strip()]
    buckets = [g.buffer().numel() * g.buffer().element_size() for g in ddp.reducer._get_zeros_like_grad_buckets()]
    # MemTracker cannot see the buckets (allocated by DDP's C++ reducer): with gradient_as_bucket_view the
    # gradients are views of them and already counted, otherwise they are a second copy of the gradients
    peak, forward_end = _memtracker(step, model, opt, mine, extra_grad=0 if view else sum(buckets))
    memory = _ledger_step(step, [model], opt, [batch])
    if peak is None:
        peak, forward_end = _measured_from_ledger(memory), None
    pred = P.estimate_layout(spec, P.Layout(dp=world), micro_batch_size=b, seq_len=s, precision="fp32",
                             device=dev.type)[0] if _predicts(args) else None
    return {"rank": rank, "grad_max_rel_diff": worst, "buckets": buckets,
            "buckets_predicted": P.ddp_buckets([p.numel() * p.element_size() for p in params],
                                               bucket_cap_mb=args.bucket_cap_mb),
            # the same rule fed the order DDP recorded (ddp_buckets takes parameter order and reverses it)
            "buckets_predicted_ready_order": P.ddp_buckets([params[i].numel() * params[i].element_size()
                                                            for i in reversed(order)], bucket_cap_mb=args.bucket_cap_mb)
            if sorted(order) == list(range(len(params))) else None,
            "measured": peak, "measured_forward_end": forward_end,
            "predicted": _predicted(pred) if pred is not None else None,
            "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "gradient_as_bucket_view": view, "memory": memory,
            "measured_note": None if view else (
                "MemTracker registers DDP's existing buckets as new temporaries when c10d.allreduce_ returns them, "
                "on top of extra_grad: 'measured' double-counts the buckets already all-reduced at its peak; "
                "'memory' (the ledger) knows them from DDP's construction and counts them once"),
            "run": _run_info(spec, args, {"dp": world, "tp": 1, "pp": 1}) | {"micro_batches": 1}}


def _memtracker(step, model, opt, inputs, **kw):
    """MemTracker's (peak, forward end), or (None, None) where it cannot follow the step."""
    try:
        return _measure_step(step, model, opt, inputs, **kw)
    except Exception as e:  # noqa: BLE001 - the ledger still measures
        print(f"parlab: MemTracker could not follow this step ({type(e).__name__}: {str(e)[:120]}); "
              f"'measured' is the ledger's", file=sys.stderr)
        return None, None


def _measured_from_ledger(memory: dict) -> dict[str, int]:
    """lab 3's `measured` categories from the ledger's peak (where MemTracker cannot run)."""
    c = memory["at_peak"]["categories"]
    return _with_total({"parameters": c["parameters"], "gradients": c["gradients"],
                        "optimizer_states": c["optimizer_states"],
                        "activations": c["activations"] + c["backward_transients"] + c["step_other"],
                        "temporaries": c["optimizer_transients"], "inputs": c["inputs"],
                        "other": c["buffers"] + c["persistent_other"]})


def _predicts(args) -> bool:
    """`vramlab.parallel`'s prediction is reported for lab 3's own settings only."""
    return (args.model == "lab" and args.precision == "fp32" and args.recompute == "none" and not args.sp
            and args.foreach and not args.gradient_as_bucket_view)


# ----------------------------------------------------------------------------- TP

def tp_plan(spec: ModelSpec, sp: bool = False) -> dict[str, Any]:
    """Megatron's split as a DTensor plan for the model's family (`FAMILIES`): q/k/v (or the fused
    query_key_value, laid out head by head) and the MLP's first projections (gate/up, fc1, dense_h_to_4h)
    column-wise, by heads and by MLP width; the attention output (o_proj, out_proj, dense) and the MLP's
    last projection (down_proj, fc2, dense_4h_to_h) row-wise, one all-reduce each; the embedding and the
    head by vocabulary (the head's logits stay split for a vocabulary-parallel loss).

    `sp`: sequence parallelism (Korthikanti et al.): the norms run on a sequence shard (`SequenceParallel`),
    the residual stream stays split by sequence between blocks, each attention and MLP block gathers its
    input once (`PrepareModuleInput`: all-gather) and its row-wise output is reduce-scattered back to
    sequence shards (`output_layouts=Shard(1)`)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    fam = _family(spec)
    if sp and not fam["sp"]:
        raise ParlabError(f"{spec.name}: sequence parallelism is not supported for the {spec.family} family here")
    if not sp:
        plan: dict[str, Any] = {fam["embed"]: RowwiseParallel(input_layouts=Replicate()),
                                fam["head"]: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    else:
        plan = {fam["embed"]: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
                fam["norm"]: SequenceParallel(),
                fam["head"]: ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}
    for i in range(spec.num_layers):
        pre = f"{fam['layers']}.{i}"
        for name in fam["col"]:
            plan[f"{pre}.{name}"] = ColwiseParallel()
        for name in fam["row"]:
            plan[f"{pre}.{name}"] = (RowwiseParallel(output_layouts=Shard(1), use_local_output=False) if sp
                                     else RowwiseParallel())
        if sp:
            for name in fam["block_norms"]:
                plan[f"{pre}.{name}"] = SequenceParallel()
            plan[f"{pre}.{fam['attn']}"] = (
                PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                   desired_input_kwarg_layouts={"hidden_states": Replicate()}, use_local_output=True)
                if fam["attn_kw"] else
                PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True))
            plan[f"{pre}.{fam['mlp']}"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                             use_local_output=True)
    return plan


def _after_tp(model, spec: ModelSpec, world: int) -> None:
    """What `parallelize_module` leaves to the model: OPT's attention reshapes by its own head count (set it
    to the rank's), and a tied head gets its own copy of the split embedding (tie them again)."""
    fam = _family(spec)
    if spec.family == "opt":
        for layer in _get(model, fam["layers"]):
            layer.self_attn.num_heads = spec.num_heads // world
    if spec.tie_word_embeddings:
        _get(model, fam["head"]).weight = _get(model, fam["embed"]).weight


def tp_problem(spec: ModelSpec, t: int, *, sp: bool = False, seq: int = 0) -> str | None:
    """Why `spec` cannot be split t ways here (None when it can)."""
    sizes = {"num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
             "vocab_size": spec.vocab_size, "intermediate_size": spec.intermediate_size}
    if sp:
        sizes["seq_len"] = seq
    bad = [f"{k} {v}" for k, v in sizes.items() if v % t]
    if bad:
        return f"{spec.name} cannot be split {t} ways: {', '.join(bad)} not divisible by {t}"
    if sp and not _family(spec)["sp"]:
        return f"--sp is not supported for the {spec.family} family (supported: " \
               f"{', '.join(f for f, d in FAMILIES.items() if d['sp'])})"
    return None


def _run_tp(rank: int, world: int, args, dev) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    spec, b, s = model_spec(args.model), args.micro_batch, args.seq
    why = tp_problem(spec, world, sp=args.sp, seq=s)
    if why:
        raise ParlabError(why)
    batch = _batch(spec, b, s, dev)  # the same rows on every rank: TP splits the model, not the data
    mesh = init_device_mesh(dev.type, (world,))
    ref = _build(spec, dev)
    model = parallelize_module(_build(spec, dev), mesh, tp_plan(spec, sp=args.sp))
    _after_tp(model, spec, world)

    def loss_of(m):
        logits = m(batch).logits
        with loss_parallel():
            return _lm_loss(logits, batch), logits

    # 1. the split model computes what the unsplit one does
    with torch.no_grad():
        want = ref(batch).logits
        loss_ref = _lm_loss(want, batch)
        loss_tp, logits = loss_of(model)
        got = logits.full_tensor()
    rel = ((got - want).abs().max() / want.abs().max()).item()
    loss_diff = abs(loss_tp.item() - loss_ref.item())
    del ref, want, got, logits
    # 2. the gradients DTensor hands back where there is none yet (a first step, or zero_grad(set_to_none=True)):
    # their layout and local size where it differs from the parameter's
    logits = model(batch).logits
    with loss_parallel():
        _lm_loss(logits, batch).backward()
    fresh = _grad_layouts(model)
    for p in model.parameters():
        p.grad = None
    del logits
    gc.collect()
    _apply_recompute(model, spec, args.recompute)
    params = list(model.parameters())
    local = _shard_bytes(params)
    full = sum(p.numel() * p.element_size() for p in params)  # a DTensor's numel is the global one
    opt = _optimizer(params, args.foreach)
    _steady(opt, params)

    step = _train_step(model, batch, opt, loss_parallel, precision=args.precision)
    step()
    peak, forward_end = _memtracker(step, model, opt, batch)
    memory = _ledger_step(step, [model], opt, [batch])
    if peak is None:
        peak, forward_end = _measured_from_ledger(memory), None
    layouts = _grad_layouts(model)  # in the steady state: the gradients exist and are accumulated into
    pred = P.estimate_layout(spec, P.Layout(tp=world), micro_batch_size=b, seq_len=s, precision="fp32",
                             device=dev.type)[0] if _predicts(args) else None
    return {"rank": rank, "logits_max_rel_diff": rel, "loss_abs_diff": loss_diff, "param_bytes_local": local,
            "param_bytes_full": full,
            "param_bytes_predicted": P.rank_params(spec, P.Layout(tp=world), 0) * 4 if _predicts(args) else None,
            "measured": peak, "measured_forward_end": forward_end,
            "predicted": _predicted(pred) if pred is not None else None,
            "grad_layouts_differing": layouts, "grad_layouts_differing_fresh": fresh, "memory": memory,
            "run": _run_info(spec, args, {"dp": 1, "tp": world, "pp": 1}) | {"micro_batches": 1}}


def _grad_layouts(model) -> dict[str, dict[str, Any]]:
    """Gradients whose DTensor layout differs from their parameter's (DTensor's vocabulary-parallel
    embedding hands back a replicated, full-vocabulary gradient), with the local shapes."""
    from torch.distributed.tensor import DTensor

    return {n: {"param": [str(x) for x in p.placements], "grad": [str(x) for x in p.grad.placements],
                "param_local_shape": list(p.to_local().shape), "grad_local_shape": list(p.grad.to_local().shape)}
            for n, p in model.named_parameters()
            if isinstance(p, DTensor) and isinstance(p.grad, DTensor) and p.grad.placements != p.placements}


# ----------------------------------------------------------------------------- PP

def _stage_module(model, layers: range, first: bool, last: bool, spec: ModelSpec | None = None,
                  precision: str = "fp32"):
    """Blocks `layers` of a transformers causal LM (Llama, GPT-NeoX or OPT), with the embedding (and OPT's
    learned positions) on the first stage and the final norm and head on the last; forward in bf16
    autocast for precision="bf16". The stage keeps no reference to `model`: the blocks it does not hold
    are freed with the model."""
    import torch

    fam = FAMILIES[spec.family if spec is not None else "llama"]
    parts = {"embed_tokens": _get(model, fam["embed"]) if first else None,
             "embed_positions": _get(model, fam["positions"]) if first and fam.get("positions") else None,
             "layers": torch.nn.ModuleList(_get(model, fam["layers"])[i] for i in layers),
             "rotary_emb": _get(model, fam["rotary"]) if fam.get("rotary") else None,
             "norm": _get(model, fam["norm"]) if last else None,
             "lm_head": _get(model, fam["head"]) if last else None}
    return _stage_class()(parts, precision)


def _stage_class():
    import torch

    class Stage(torch.nn.Module):
        def __init__(self, parts: dict, precision: str):
            super().__init__()
            for name, module in parts.items():
                setattr(self, name, module)
            self.precision = precision

        def forward(self, x):
            with _autocast(self.precision, x.device):
                h = self.embed_tokens(x) if self.embed_tokens is not None else x
                pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
                if self.embed_positions is not None:  # as OPTDecoder: one position row per sequence
                    h = h + self.embed_positions(None, 0, position_ids=pos.expand(h.shape[0], -1))
                kw = {"position_embeddings": self.rotary_emb(h, pos)} if self.rotary_emb is not None else {}
                for layer in self.layers:
                    out = layer(h, attention_mask=None, position_ids=pos, **kw)
                    h = out[0] if isinstance(out, tuple) else out
                return self.lm_head(self.norm(h)) if self.lm_head is not None else h

    return Stage


def pp_problem(spec: ModelSpec, p: int, schedules: list[str], chunks: int, micro_batches: list[int]) -> str | None:
    """Why these pipeline settings cannot run (None when they can)."""
    need = p * (chunks if "interleaved" in schedules else 1)
    if spec.num_layers < need:
        return (f"{spec.name} has {spec.num_layers} layers: {p} stages"
                f"{f' x {chunks} chunks' if need > p else ''} need at least {need}")
    if "interleaved" in schedules:
        bad = [m for m in micro_batches if m % max(1, m // p)]
        if bad:
            return f"interleaved 1F1B needs micro-batches a multiple of max(1, m // {p}); not {bad}"
    return None


def _run_pp(rank: int, world: int, args, dev) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    spec, b, s = model_spec(args.model), args.micro_batch, args.seq
    why = pp_problem(spec, world, args.schedules, args.chunks, args.micro_batches)
    if why:
        raise ParlabError(why)
    led = _LEDGER
    rows = []
    for schedule in args.schedules:
        v = args.chunks if schedule == "interleaved" else 1
        n_stages = world * v
        split = P.stage_layers(spec.num_layers, n_stages)
        mine = [rank + k * world for k in range(v)]  # virtual stages r, r + p, ... (Megatron's interleaving)
        for m in args.micro_batches:
            if schedule == "1f1b" and m < world:  # torch's 1F1B needs a micro-batch per stage to start
                continue
            led.set_phase("setup")
            model = _build(spec, dev)
            _apply_recompute(model, spec, args.recompute)
            mods = [_stage_module(model, split[k], k == 0, k == n_stages - 1, spec, args.precision) for k in mine]
            del model
            params = [p for mod in mods for p in mod.parameters()]
            opt = _optimizer(params, args.foreach)
            _steady(opt, params)
            stages = [PipelineStage(mod, k, n_stages, dev) for mod, k in zip(mods, mine)]

            def loss_fn(out, target):
                led.set_phase("loss")
                with _autocast(args.precision, dev):
                    loss = _lm_loss(out, target)
                led.set_phase("schedule")
                return loss

            if schedule == "interleaved":
                sched = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss_fn)
            else:
                sched = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](stages[0], n_microbatches=m,
                                                                                 loss_fn=loss_fn)
            batch = _batch(spec, b * m, s, dev)
            first, last = 0 in mine, n_stages - 1 in mine
            state = _instrument_pp(stages, dev, led)

            def step(tr=None):
                # return_outputs=False: the last stage would otherwise keep every micro-batch's logits
                # to hand them back merged
                led.set_phase("schedule")
                if first:
                    sched.step(batch, return_outputs=False)
                elif last:
                    sched.step(target=batch, return_outputs=False)
                else:
                    sched.step(return_outputs=False)
                led.set_phase("optimizer")
                opt.step()
                _zero(opt)
                led.set_phase("after step")

            step()  # warm-up: the stage's buffers and the p2p connections
            dist.barrier()
            holder = torch.nn.ModuleList(mods)
            resident = _resident(holder, opt, batch)
            state.reset()
            led.context = state.snapshot
            memory = _ledger_step(step, mods, opt, [batch])
            led.context = None
            memory["in_flight"] = {"max": state.max_in_flight, "max_per_virtual_stage": state.max_per_stage,
                                   "at_peak": memory.pop("peak_context")}
            p2p = state.p2p_counts()
            # lab 3's accounting (as `LiveBytes` counted it): the resident states plus the most bytes of storages
            # returned by operations during the step that are not resident states (the ledger's `peak` also holds
            # what exists before the step untouched: the stage's receive buffers, leftovers)
            measured = {**{k: v for k, v in resident.items() if k != "storages"},
                        "activations": memory["lab_accounting_peak"]}
            # time: every forward and backward of this stage, on the machine's monotonic clock (one clock
            # for all processes of a machine), in each of `repeats` steps
            steps = []
            with led.paused():  # the ledger's dispatch overhead would lengthen every operation
                for _ in range(args.repeats):
                    dist.barrier()
                    state.ops.clear()
                    t0 = time.perf_counter()
                    step()
                    ops = state.ops if schedule == "interleaved" else [o[:3] for o in state.ops]
                    steps.append({"start": t0, "end": time.perf_counter(), "ops": list(ops)})
            pred = None
            if _predicts(args) and schedule in ("gpipe", "1f1b"):
                pred = P.estimate_layout(spec, P.Layout(pp=world, micro_batches=m, schedule=schedule),
                                         micro_batch_size=b, seq_len=s, precision="fp32", device=dev.type)[rank]
            layers = [[split[k].start, split[k].stop] for k in mine]
            rows.append({"schedule": schedule, "micro_batches": m, "rank": rank,
                         "layers": layers[0] if v == 1 else layers, "virtual_stages": mine,
                         "param_bytes": _shard_bytes(params),
                         "measured": _with_total(measured), "predicted": _predicted(pred) if pred is not None else None,
                         "memory": memory, "p2p": p2p, "steps": steps,
                         "run": _run_info(spec, args, {"dp": 1, "tp": 1, "pp": world, "virtual_per_rank": v})
                         | {"micro_batches": m, "schedule": schedule}})
            del sched, stages, mods, holder, opt, params, state
            gc.collect()
    return {"rank": rank, "rows": rows}


class _PipeState:
    """What `_instrument_pp` records: each forward and backward (kind, start, end, virtual stage), the
    micro-batches in flight per virtual stage (forwards begun minus backwards finished), and the bytes
    of the p2p operations the stages post (activations forward, gradients backward)."""

    def __init__(self, stage_ids):
        self.ops: list = []
        self.ids = list(stage_ids)
        self.reset()

    def reset(self) -> None:
        self.in_flight = {k: 0 for k in self.ids}
        self.max_per_stage = {k: 0 for k in self.ids}
        self.max_in_flight = 0
        self.p2p = {k: 0 for k in ("sent_forward_bytes", "sent_backward_bytes", "received_forward_bytes",
                                   "received_backward_bytes", "sent_messages", "received_messages")}

    def snapshot(self) -> dict[str, Any]:
        return {"total": sum(self.in_flight.values()), "per_virtual_stage": dict(self.in_flight)}

    def p2p_counts(self) -> dict[str, int]:
        return {**self.p2p, "sent_bytes": self.p2p["sent_forward_bytes"] + self.p2p["sent_backward_bytes"]}


def _instrument_pp(stages, dev, led) -> _PipeState:
    import torch

    state = _PipeState([st.stage_index for st in stages])
    for stage in stages:
        idx = stage.stage_index
        for kind, name in (("F", "forward_one_chunk"), ("B", "backward_one_chunk")):
            fn = getattr(stage, name)

            def timed(*a, _fn=fn, _kind=kind, _idx=idx, **kw):
                if _kind == "F":
                    state.in_flight[_idx] += 1
                    state.max_per_stage[_idx] = max(state.max_per_stage[_idx], state.in_flight[_idx])
                    state.max_in_flight = max(state.max_in_flight, sum(state.in_flight.values()))
                led.set_phase("forward" if _kind == "F" else "backward")
                t0 = time.perf_counter()
                try:
                    out = _fn(*a, **kw)
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                finally:
                    led.set_phase("schedule")
                state.ops.append((_kind, t0, time.perf_counter(), _idx))
                if _kind == "B":
                    state.in_flight[_idx] -= 1
                return out

            setattr(stage, name, timed)
        for name, key in (("get_fwd_send_ops", "sent_forward"), ("get_bwd_send_ops", "sent_backward"),
                          ("get_fwd_recv_ops", "received_forward"), ("get_bwd_recv_ops", "received_backward")):
            fn = getattr(stage, name)

            def counted(*a, _fn=fn, _key=key, **kw):
                ops = _fn(*a, **kw)
                state.p2p[_key + "_bytes"] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
                state.p2p[_key.split("_")[0] + "_messages"] += len(ops)
                return ops

            setattr(stage, name, counted)
    return state


def _storage_bytes(tensors, seen) -> int:
    total = 0
    for t in tensors:
        if hasattr(t, "to_local"):
            t = t.to_local()
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def _resident(mod, opt, batch) -> dict:
    """The bytes that exist before a step, by category, and their storages."""
    seen: set[int] = set()
    params = list(mod.parameters())
    out = {"parameters": _storage_bytes(params, seen),
           "gradients": _storage_bytes([p.grad for p in params if p.grad is not None], seen),
           "optimizer_states": _storage_bytes([v for s in opt.state.values() for v in s.values()
                                               if hasattr(v, "untyped_storage")], seen),
           "inputs": _storage_bytes([batch], seen)}
    return {**out, "storages": seen}


class LiveBytes(_ModeContext):
    """Live-tensor tracking without module hooks (MemTracker's refuse a pipeline's interleaved forward
    and backward passes): every storage an operation creates is counted from its creation until it
    is freed; `peak` is the most alive at once. Storages that existed before (`resident`) are not."""

    def __init__(self, resident: dict):
        from torch.utils._python_dispatch import TorchDispatchMode

        self.seen, self.now, self.peak = set(resident["storages"]), 0, 0
        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                outer._track(out)
                return out

        self.mode = Mode()

    def _track(self, out) -> None:
        import weakref

        import torch
        from torch.utils._pytree import tree_flatten

        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            try:
                st = t.untyped_storage()
                key = st.data_ptr()
            except (RuntimeError, NotImplementedError):  # a wrapper subclass (DTensor): its local tensor is counted
                continue
            if key in self.seen or st.nbytes() == 0:
                continue
            self.seen.add(key)
            self.now += st.nbytes()
            self.peak = max(self.peak, self.now)
            weakref.finalize(st, self._free, key, st.nbytes())

    def _free(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.now -= nbytes


def measured_bubble(ranks: list[dict], schedule: str, micro_batches: int) -> dict[str, Any]:
    """The bubble of a pipeline run from the stages' recorded operations. In each timed step the span
    T runs from the first operation's start to the last one's end over all stages; the bubble is
    1 - W / T, W the busiest stage's own forward and backward time in that step (the formula's equal
    stages, each taking what the slowest one takes). Reported: the median over steps, the median of
    `replayed_bubble` (the same step with free communication), and each stage's mean forward and
    backward time."""
    rows = [next((r for r in rank["rows"] if r["schedule"] == schedule and r["micro_batches"] == micro_batches), None)
            for rank in ranks]
    if any(r is None for r in rows):
        raise ValueError(f"no {schedule} run with {micro_batches} micro-batches in these results")
    fractions, replayed = [], []
    for k in range(len(rows[0]["steps"])):
        ops = [row["steps"][k]["ops"] for row in rows]
        span = max(o[2] for stage in ops for o in stage) - min(o[1] for stage in ops for o in stage)
        fractions.append(1 - max(sum(o[2] - o[1] for o in stage) for stage in ops) / span)
        replayed.append(replayed_bubble(ops))
    per_stage = [{kind: statistics.fmean(o[2] - o[1] for step in row["steps"] for o in step["ops"] if o[0] == kind)
                  for kind in "FB"} for row in rows]
    return {"bubble": statistics.median(fractions), "per_step": fractions,
            "replayed": statistics.median(replayed), "forward_s": [x["F"] for x in per_stage],
            "backward_s": [x["B"] for x in per_stage]}


def replayed_bubble(stage_ops: list[list]) -> float:
    """The bubble of one measured step replayed with nothing but its computation: each stage runs its
    recorded operations in their recorded order, each taking exactly its measured time, each as soon
    as its input exists (the dependencies of `parallel.simulate`: a forward needs the previous stage's
    forward of that micro-batch, a backward the next stage's backward or, on the last stage, its own
    forward); sends and the time between operations cost nothing. Measured minus replayed is what
    communication and scheduling overhead add; replayed minus the formula is what unequal and varying
    operation times add."""
    orders, took = [], []
    for ops in stage_ops:
        count = {"F": 0, "B": 0}
        order = []
        for kind, _, _ in ops:
            order.append((kind, count[kind], 0))
            count[kind] += 1
        orders.append(order)
        took.append([end - start for _, start, end in ops])
    ticks = PIPE.replay_orders(orders, took)
    return 1 - max(sum(t) for t in took) / max(end for *_, end in ticks)


def error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured."""
    return (predicted - measured) / measured


def layout_estimate(result: dict, row: dict):
    """`parallel.estimate_layout` for the stage one measured row ran, configured as the run was (its
    model, layout, schedule, chunks, micro-batches, precision, recompute, sequence parallelism, DDP's
    bucket view, AdamW one tensor at a time or foreach, DTensor's tensor parallelism, the device)."""
    info = result["settings"]
    lay = info["layout"]
    schedule = row.get("schedule") or "1f1b"
    v = result.get("chunks", 2) if schedule == "interleaved" else 1
    layout = P.Layout(dp=lay["dp"], tp=lay["tp"], pp=lay["pp"], sp=bool(info["sequence_parallel"]),
                      micro_batches=row.get("micro_batches", 1), schedule=schedule, chunks=v)
    stages = P.estimate_layout(
        model_spec(info["model_name"]), layout, micro_batch_size=result["micro_batch_size"], seq_len=result["seq_len"],
        precision="fp32" if info["precision"] == "fp32" else "bf16-mixed",
        optimizer_impl="foreach" if info["optimizer"].get("foreach") else "for-loop",
        device="cuda" if result.get("backend") == "nccl" else "cpu", recompute=info["recompute"],
        gradient_as_bucket_view=bool(result.get("gradient_as_bucket_view")),
        implementation="dtensor" if lay["tp"] > 1 else "megatron")
    return stages[row["rank"] % lay["pp"]]


def memory_rows(result: dict) -> list[dict[str, Any]]:
    """One row per rank (ddp, tp) or per schedule, micro-batch count and stage (pp): the measured step
    peak (the ledger's: every live storage through one steady-state step; on a GPU the allocator's
    where the run recorded it), `layout_estimate`'s prediction, the relative error and both phases."""
    out = []
    items = ([row for rank in result["per_rank"] for row in rank["rows"]] if result["experiment"] == "pp"
             else result["per_rank"])
    for row in items:
        mem = row["memory"]
        pred = layout_estimate(result, row)
        out.append({"schedule": row.get("schedule", ""), "micro_batches": row.get("micro_batches", 1),
                    "rank": row["rank"], "measured": mem["peak"], "measured_phase": mem["peak_phase"],
                    "predicted": pred.total, "predicted_phase": pred.phase, "error": error(pred.total, mem["peak"]),
                    "states_measured": sum(mem["at_peak"]["categories"].get(k, 0) for k in _STATE_CATEGORIES),
                    "states_predicted": pred.parameters + pred.gradients + pred.optimizer_states})
    return sorted(out, key=lambda r: (r["schedule"], r["micro_batches"], r["rank"]))


def bubble_rows(result: dict) -> list[dict[str, Any]]:
    """Measured bubble against the formula (share of the step's time, equal stages) per schedule and m
    (GPipe and 1F1B: one stage per rank)."""
    seen = sorted({(row["schedule"], row["micro_batches"]) for rank in result["per_rank"] for row in rank["rows"]
                   if row["schedule"] in ("gpipe", "1f1b")})
    p = result["ranks"]
    out = []
    for schedule, m in seen:
        got = measured_bubble(result["per_rank"], schedule, m)
        formula = float(PIPE.bubble_fraction(p, m, schedule, of="total"))
        out.append({"schedule": schedule, "micro_batches": m, "formula": formula, "measured": got["bubble"],
                    "replayed": got["replayed"], "error": error(formula, got["bubble"]), "forward_s": got["forward_s"],
                    "backward_s": got["backward_s"]})
    return out


# ----------------------------------------------------------------------------- processes

# what the CPU ranks import, loaded once by the fork server they start from (collectives.launch)
RANK_IMPORTS = ("transformers", "transformers.modeling_utils", "transformers.masking_utils", "torch.distributed.tensor",
                "torch.distributed.tensor.parallel", "torch.distributed.pipelining", "torch.distributed.fsdp",
                "torch.nn.parallel", "torch.distributed.optim", "vramlab.measure.memory", "vramlab.measure.models")


def _worker(rank: int, world: int, args, port: int) -> None:
    import torch.distributed as dist

    from .collectives import first_line
    from .memory import settle_imports

    global _LEDGER
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    os.environ["WORLD_SIZE"] = str(world)
    try:
        dist.init_process_group(args.backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=args.timeout))
    except Exception as e:  # noqa: BLE001
        raise ParlabError(f"rank {rank} of {world}: the process group did not form within {args.timeout:g} s: "
                          f"{first_line(e)}") from None
    try:
        dev = rank_device(args.backend, rank)
        settle_imports(RANK_IMPORTS)  # each gc.collect of a step walks only what was made since
        _LEDGER = _Ledger()
        run, report = {"ddp": (_run_ddp, _report), "tp": (_run_tp, _report), "pp": (_run_pp, _report),
                       "cp": (_run_cp, _cp_report), "ep": (_run_ep, _ep_report)}[args.experiment]
        with _LEDGER:
            result = run(rank, world, args, dev)
        _LEDGER = None
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            report(gathered, args, world)
    except ParlabError as e:
        raise ParlabError(f"rank {rank} of {world}: {e}") from None
    except Exception as e:  # noqa: BLE001
        raise ParlabError(f"rank {rank} of {world}: {type(e).__name__}: {first_line(e)}") from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _report(ranks: list[dict], args, world: int) -> None:
    from .record import provenance

    rows = [r for rank in ranks for r in rank["rows"]] if args.experiment == "pp" else ranks
    run = {k: v for k, v in rows[0]["run"].items() if k not in ("micro_batches", "schedule")} if rows else {}
    for r in rows:
        r.pop("run", None)
    run.pop("model_config", None)
    out = {"experiment": args.experiment, "backend": args.backend, "ranks": world,
           "model": MODELS[args.model][1], "model_name": args.model, "micro_batch_size": args.micro_batch,
           "seq_len": args.seq, "micro_batches": args.micro_batches if args.experiment == "pp" else [1],
           **({"schedules": args.schedules, "chunks": args.chunks} if args.experiment == "pp" else {}),
           "gradient_as_bucket_view": bool(args.gradient_as_bucket_view), "settings": run,
           "command": " ".join(["python -m vramlab.measure.parallel", *sys.argv[1:]]),
           "provenance": provenance("cuda" if args.backend == "nccl" else "cpu"), "per_rank": ranks}
    from ..units import fmt_bytes

    spec = model_spec(args.model)
    extra = ["--sp" if args.sp else "", f"recompute {args.recompute}" if args.recompute != "none" else "",
             "bf16 autocast" if args.precision == "bf16" else "",
             "gradient_as_bucket_view" if args.gradient_as_bucket_view else ""]
    print(f"# vramlab.measure.parallel {args.experiment}: backend {args.backend}, {world} ranks, {spec.name}, "
          f"micro-batch {args.micro_batch} x {args.seq}{''.join(', ' + e for e in extra if e)}")
    print(f"#{'schedule':>11}{'m':>4}{'rank':>6}{'predicted':>12}{'measured':>12}{'error':>8}"
          f"{'peak':>12}  {'phase':<10}{'in flight':>10}{'p2p sent':>12}")
    peaks = {(r.get("schedule", ""), r.get("micro_batches", 1), r["rank"]): r for r in rows}
    for r in memory_rows(out):
        row = peaks[(r["schedule"], r["micro_batches"], r["rank"])]
        mem = row.get("memory") or {}
        fl = (mem.get("in_flight") or {}).get("at_peak") or {}
        p2p = row.get("p2p")
        err = f"{100 * r['error']:+.1f}%" if r["error"] is not None else "-"
        print(f" {r['schedule'] or '-':>11}{r['micro_batches']:>4}{r['rank']:>6}"
              f"{fmt_bytes(r['predicted']) if r['predicted'] is not None else '-':>12}"
              f"{fmt_bytes(r['measured']):>12}{err:>8}"
              f"{fmt_bytes(mem['peak']) if mem else '-':>12}  {mem.get('peak_phase', '-'):<10}"
              f"{fl.get('total', '-') if fl else '-':>10}{fmt_bytes(p2p['sent_bytes']) if p2p else '-':>12}")
    if args.experiment == "pp" and any(s in ("gpipe", "1f1b") for s in args.schedules):
        print(f"#{'schedule':>9}{'m':>4}{'bubble: formula':>17}{'replayed':>10}{'measured':>10}")
        for b in bubble_rows(out):
            print(f" {b['schedule']:>9}{b['micro_batches']:>4}{b['formula']:>17.3f}{b['replayed']:>10.3f}{b['measured']:>10.3f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"# wrote {args.out}")


def _ints(text: str) -> list[int]:
    try:
        xs = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None
    if not xs or any(not 1 <= x <= 64 for x in xs):
        raise argparse.ArgumentTypeError(f"each value must be from 1 to 64, got {text!r}")
    if len(set(xs)) != len(xs):
        raise argparse.ArgumentTypeError(f"each value once, got {text!r}")
    return xs


SCHEDULES = ("gpipe", "1f1b", "interleaved")


def _schedules(text: str) -> list[str]:
    xs = text.split(",")
    bad = [x for x in xs if x not in SCHEDULES]
    if bad:
        raise argparse.ArgumentTypeError(f"schedules are {', '.join(SCHEDULES)}, got {bad}")
    if len(set(xs)) != len(xs):
        raise argparse.ArgumentTypeError(f"each schedule once, got {text!r}")
    return xs


PROG = "python -m vramlab.measure.parallel"
# options that only one experiment reads (given to another, they would be ignored): their defaults
ONLY_FOR = {"bucket_cap_mb": ("ddp", 1.0), "micro_batches": ("pp", [1, 2, 4, 8]),
            "schedules": ("pp", ["gpipe", "1f1b"]), "chunks": ("pp", 2), "repeats": ("pp", 3)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["cp"]:  # context parallelism: its own options (`cp_main`)
        return cp_main(argv[1:])
    if argv[:1] == ["ep"]:  # expert parallelism: its own options (`ep_main`)
        return ep_main(argv[1:])
    A, whole = checks.argtype, checks.whole
    p = checks.Parser(prog=PROG, description="Lab 3's parallelism experiments, measured per rank.")
    p.add_argument("experiment", choices=EXPERIMENTS)
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    p.add_argument("--nproc", type=A(whole, int, lo=1, hi=64), default=2,
                   help="local processes to spawn, 1 to 64 (ignored under torchrun)")
    p.add_argument("--model", default="lab", choices=list(MODELS),
                   help="the model (default: lab 3's Llama; the others validate vramlab.parallel)")
    p.add_argument("--micro-batch", type=A(whole, int, lo=1, hi=4096), default=4,
                   help="sequences per micro-batch and rank (default 4)")
    p.add_argument("--seq", type=A(whole, int, lo=2), default=128,
                   help="tokens per sequence, at most the model's positions (default 128)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                   help="fp32, or bf16 autocast around forward and loss (fp32 parameters, gradients, states)")
    p.add_argument("--optimizer-impl", default="foreach", choices=("foreach", "for-loop"),
                   help="AdamW's implementation (default foreach, lab 3's)")
    p.add_argument("--recompute", default="none", choices=("none", "selective", "full"),
                   help="activation recomputation: none, selective (the attention core), full (every block)")
    p.add_argument("--bucket-cap-mb", type=A(checks.positive, float, hi=1 << 20), default=None,
                   help="ddp: DDP's bucket_cap_mb, a positive number (default 1)")
    p.add_argument("--gradient-as-bucket-view", action="store_true", help="ddp: gradients as views of DDP's buckets")
    p.add_argument("--sp", action="store_true", help="tp: sequence parallelism on the norms")
    p.add_argument("--micro-batches", type=_ints, default=None, help="pp: micro-batches per step (default 1,2,4,8)")
    p.add_argument("--schedule", dest="schedules", type=_schedules, default=None,
                   help="pp: schedules, from gpipe, 1f1b, interleaved (default gpipe,1f1b)")
    p.add_argument("--chunks", type=A(whole, int, lo=2, hi=8), default=None,
                   help="pp, interleaved: model chunks (virtual stages) per rank, 2 to 8 (default 2)")
    p.add_argument("--repeats", type=A(whole, int, lo=1, hi=100), default=None,
                   help="pp: timed steps per setting (median), 1 to 100 (default 3)")
    p.add_argument("--out", default=None, help="write the results as JSON here (checked before any rank starts)")
    p.add_argument("--port", type=A(whole, int, lo=0, hi=65535), default=0,
                   help="rendezvous port, 1 to 65535 (default 0: a free one)")
    p.add_argument("--timeout", type=A(checks.positive, float, hi=86400), default=120.0,
                   help="seconds a rendezvous or collective may take (default 120)")
    args = p.parse_args(argv)
    for name, (experiment, default) in ONLY_FOR.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
        elif args.experiment != experiment:
            option = "--schedule" if name == "schedules" else "--" + name.replace("_", "-")
            p.error(f"{option} applies to {experiment} only")
    if args.sp and args.experiment != "tp":
        p.error("--sp applies to tp only")
    if args.gradient_as_bucket_view and args.experiment != "ddp":
        p.error("--gradient-as-bucket-view applies to ddp only")
    args.foreach = args.optimizer_impl == "foreach"
    spec = model_spec(args.model)
    try:
        checks.positions(spec, args.seq, name="--seq")
    except ValueError as e:
        p.error(str(e))
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if torchrun else args.nproc
    why = (tp_problem(spec, world, sp=args.sp, seq=args.seq) if args.experiment == "tp" else
           pp_problem(spec, world, args.schedules, args.chunks, args.micro_batches) if args.experiment == "pp" else None)
    if why:
        p.error(why)
    from .collectives import launch

    checks.output_path(PROG, args.out, make_folder=True)
    return launch(_worker, args, prog=PROG, error=ParlabError, torchrun_port=29512, preload=RANK_IMPORTS)



# ----------------------------------------------------------------------------- CP (context parallelism)
# `python -m vramlab.measure.parallel cp --method ring|ulysses --nproc 2|4`: the sequence split
# over cp ranks, each rank running the whole model on its own tokens. Attention is replaced (a registered
# transformers attention function, this process only) by
# - ring attention (Liu et al. 2023; Megatron-LM's context parallelism): each rank's K/V block travels
#   round the ring (P2P send/recv, the next block received while the current one is attended to), the
#   partial outputs merged by their log-sum-exp (online softmax); in the backward K/V travel again, with
#   their gradient accumulators, which come home after cp steps. Zig-zag: rank r holds sequence chunks r
#   and 2cp-1-r (`parallel.cp_positions`), so every rank does the same causal work;
# - Ulysses (Jacobs et al. 2023, DeepSpeed-Ulysses): all-to-all from sequence-sharded to head-sharded q, k,
#   v, full-sequence causal attention on heads/cp heads, all-to-all of the output back.
# Each rank's outputs and (all-reduced) gradients are checked against one process on the whole sequence,
# its peak through a steady-state training step is measured with the ledger (`_Ledger`), and the bytes
# each attention sends are counted, against `vramlab.parallel.context_parallel`.
# `--fsdp`: the model states sharded over the CP ranks too (torchtitan's dp_shard x cp mesh): FSDP2's
# `fully_shard` of every block, then of the root (a module running the loss), fp32; its gradients gathered
# whole are checked against one process, the ledger sees its in-place storage resizes (`_track_resizes`), and
# each rank's shards are counted in storage bytes (`shard_states=True` of the calculator).

CP_METHODS = ("ring", "ulysses")
CP_ATTENTION = "vramlab_cp"  # the name the attention function is registered under
# a model for CP only: attention-heavy (an MLP as narrow as the model, 4 key/value heads, 1024 positions), so
# that the moments inside attention, where CP's blocks are in flight, are the step's peak
CP_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "cp-val": ("llama-cp-val", dict(model_type="llama", hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=8, num_key_value_heads=4, vocab_size=256,
                                    max_position_embeddings=1024, tie_word_embeddings=False)),
}


def cp_model_spec(name: str) -> ModelSpec:
    """A model the CP experiment runs: `CP_MODELS`' or a Llama of `MODELS`."""
    if name in CP_MODELS:
        label, cfg = CP_MODELS[name]
        return from_config(cfg, name=label)
    return model_spec(name)


class _CPState:
    """What the replaced attention needs on this rank, and the bytes it sent (forward, backward)."""

    def __init__(self, method: str, rank: int, cp: int, zigzag: bool):
        self.method, self.rank, self.cp, self.zigzag = method, rank, cp, zigzag
        self.sent = {"forward": 0, "backward": 0, "recompute": 0}
        self.messages = {"forward": 0, "backward": 0, "recompute": 0}


_CP: _CPState | None = None


def _forward_kind() -> str:
    """'recompute' for a forward that runs inside the backward (activation checkpointing re-runs the block),
    else 'forward'."""
    import torch

    return "recompute" if torch._C._current_graph_task_id() != -1 else "forward"


@contextlib.contextmanager
def _cp_phase(name: str):
    """Name the ledger's phase while CP's attention runs (its peak there is reported as that phase's), then
    restore the step's."""
    led = _LEDGER
    before = led.phase if led is not None else None
    if led is not None:
        led.set_phase(name)
    try:
        yield
    finally:
        if led is not None:
            led.set_phase(before)


def _ring_block(rank: int, src: int, n: int, zigzag: bool):
    """Which of this rank's query rows attend to which of `src`'s key columns, and whether causally
    (None: none). Zig-zag, rank r holding chunks r and 2cp-1-r: its own block is causal over its n tokens
    (chunk r precedes chunk 2cp-1-r); an earlier rank's first chunk is seen by all rows, its second by none;
    a later rank's two chunks are seen by the second half of the rows only. Contiguous: earlier ranks whole."""
    if src == rank:
        return slice(None), slice(None), True
    if not zigzag:
        return (slice(None), slice(None), False) if src < rank else None
    half = n // 2
    if src < rank:
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False


# Gloo runs a collective on a worker thread, whose reference to the collective's tensors (its Work's) can
# outlive the wait by a thread switch: a buffer the rank drops right after the collective was then freed on
# that thread after the rank had allocated more, and a peak came and went with thread timing (FSDP2's
# gathered block at once with the next one, +4 % one run in five; a Ulysses all-to-all buffer, +3 %). NCCL's
# buffers go back to the caching allocator on the rank's own stream order. So FSDP2's collectives and Ulysses'
# all-to-alls wait, after their wait, until the worker has let go (the tensors' use counts back to what they
# were before): frees happen where the program means them, the same peak every run (20 runs each). Left
# alone: the ring's point-to-point buffers (gloo keeps a reference to a receive buffer past its Work, so a
# use count never comes back; the ring's peaks were the same in every run seen) and EP's all-to-alls (within
# 5 % in every run so far; the same race could reach them).
_GLOO_UNSETTLED = [0]  # collectives whose tensors gloo still held after 60 s (reported; stays 0)


def _use_counts(tensors) -> list[int]:
    return [t._use_count() for t in tensors]


def _settle(tensors, before: list[int]) -> None:
    """Wait until gloo's worker has dropped a finished collective's references to `tensors` (use counts back to
    `before`, read before the collective started); at most 60 s, then counted in `_GLOO_UNSETTLED` (the worker
    lets go within a thread switch, microseconds; the bound is for a machine so busy it never switches, not a
    budget a busy machine could miss)."""
    import time

    deadline = time.monotonic() + 60.0
    while any(t._use_count() > n for t, n in zip(tensors, before)):
        if time.monotonic() > deadline:
            _GLOO_UNSETTLED[0] += 1
            return
        time.sleep(1e-5)


def _rotate(tensors, st: _CPState, phase: str):
    """Send `tensors` to the next rank and receive as many from the previous one (new buffers); returns
    (received, requests to wait on)."""
    import torch
    import torch.distributed as dist

    nxt, prev = (st.rank + 1) % st.cp, (st.rank - 1) % st.cp
    got = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt) for t in tensors] + [dist.P2POp(dist.irecv, g, prev) for g in got]
    st.sent[phase] += sum(t.numel() * t.element_size() for t in tensors)
    st.messages[phase] += len(tensors)
    return got, dist.batch_isend_irecv(ops)


_CP_FUNCTIONS: dict[str, Any] = {}  # the autograd functions, defined once per process (they import torch)


def _ring_function():
    if "ring" in _CP_FUNCTIONS:
        return _CP_FUNCTIONS["ring"]
    import torch

    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

    class RingAttention(torch.autograd.Function):
        """Causal ring attention over the CP group. Saves what a flash kernel saves on one device (q, k, v
        at the key/value heads, the output, the log-sum-exp), at the rank's tokens."""

        @staticmethod
        def forward(ctx, q, k, v, scale):
            st = _CP
            with _cp_phase("attention forward"):
                return RingAttention._forward(ctx, q, k, v, scale, st)

        @staticmethod
        def _forward(ctx, q, k, v, scale, st):
            k, v = k.contiguous(), v.contiguous()
            n = q.shape[2]
            out = lse = None
            cur, reqs = (k, v), []
            for i in range(st.cp):
                src = (st.rank - i) % st.cp
                nxt = None
                if i < st.cp - 1:  # the next block is received while this one is attended to
                    nxt, reqs = _rotate(cur, st, _forward_kind())
                blk = _ring_block(st.rank, src, n, st.zigzag)
                if blk is not None:
                    rows, cols, causal = blk
                    o, l = flash(q[:, :, rows], cur[0][:, :, cols], cur[1][:, :, cols], 0.0, causal, scale=scale)
                    if out is None:  # the rank's own block comes first and covers every row
                        out, lse = o, l
                    else:
                        old_l, old_o = lse[:, :, rows], out[:, :, rows]
                        new = torch.logaddexp(old_l, l)
                        merged = old_o * torch.exp(old_l - new).unsqueeze(-1) + o * torch.exp(l - new).unsqueeze(-1)
                        out[:, :, rows] = merged
                        lse[:, :, rows] = new
                        del o, l, old_l, old_o, new, merged
                for r in reqs:
                    r.wait()
                if nxt is not None:
                    cur = tuple(nxt)
                reqs = []
            del cur
            ctx.scale = scale
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, dout):
            with _cp_phase("attention backward"):
                return RingAttention._backward(ctx, dout, _CP)

        @staticmethod
        def _backward(ctx, dout, st):
            q, k, v, out, lse = ctx.saved_tensors
            n = q.shape[2]
            dq = torch.zeros_like(q)
            cur = (k, v)
            acc = (torch.zeros_like(k), torch.zeros_like(v))
            for i in range(st.cp):
                src = (st.rank - i) % st.cp
                nxt, reqs = (None, [])
                if i < st.cp - 1:
                    nxt, reqs = _rotate(cur, st, "backward")
                blk = _ring_block(st.rank, src, n, st.zigzag)
                if blk is not None:
                    rows, cols, causal = blk
                    gq, gk, gv = flash_backward(dout[:, :, rows], q[:, :, rows], cur[0][:, :, cols],
                                                cur[1][:, :, cols], out[:, :, rows], lse[:, :, rows], 0.0, causal,
                                                scale=ctx.scale)
                    dq[:, :, rows] += gq
                    acc[0][:, :, cols] += gk
                    acc[1][:, :, cols] += gv
                    del gq, gk, gv
                # the block's gradient travels with it; after cp steps each rank's comes home
                back, reqs2 = _rotate(acc, st, "backward")
                for r in reqs + reqs2:
                    r.wait()
                acc = tuple(back)
                if nxt is not None:
                    cur = tuple(nxt)
            return dq, acc[0], acc[1], None

    _CP_FUNCTIONS["ring"] = RingAttention
    return RingAttention


def _a2a(x, to_heads: bool, phase: str):
    """Ulysses' all-to-all on (b, heads, tokens, d): sequence-sharded (all heads, the rank's tokens) to
    head-sharded (heads/cp, the whole sequence), or back (`to_heads=False`; the result laid out
    (b, tokens, heads, d) in memory, a transposed view, as the projection after attention reads it)."""
    import torch
    import torch.distributed as dist

    st = _CP
    cp = st.cp
    b, H, n, d = x.shape
    if to_heads:
        send = x.reshape(b, cp, H // cp, n, d).permute(1, 0, 2, 3, 4).contiguous()
    else:
        send = x.reshape(b, H, cp, n // cp, d).permute(2, 0, 1, 3, 4).contiguous()
    got = torch.empty_like(send)
    before = _use_counts([got, send])
    dist.all_to_all_single(got, send)
    _settle([got, send], before)
    st.sent[phase] += send.numel() * send.element_size() * (cp - 1) // cp  # its own chunk stays
    st.messages[phase] += cp - 1
    del send
    c, b, h, m, d = got.shape  # got[j]: rank j's part
    if to_heads:  # got[j] = rank j's tokens of this rank's heads
        return got.permute(1, 2, 0, 3, 4).reshape(b, h, c * m, d)
    # got[j] = this rank's tokens of rank j's heads -> (b, m, c, h, d) in memory
    return got.permute(1, 3, 0, 2, 4).reshape(b, m, c * h, d).transpose(1, 2)


def _ulysses_function():
    if "ulysses" in _CP_FUNCTIONS:
        return _CP_FUNCTIONS["ulysses"]
    import torch

    class AllToAll(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, to_heads):
            ctx.to_heads = to_heads
            return _a2a(x, to_heads, _forward_kind())

        @staticmethod
        def backward(ctx, g):
            return _a2a(g, not ctx.to_heads, "backward"), None

    _CP_FUNCTIONS["ulysses"] = AllToAll
    return AllToAll


def _cp_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The transformers attention function CP models run: (b, heads, tokens, d) in, (b, tokens, heads, d) out."""
    import torch.nn.functional as F

    st = _CP
    if st.method == "ring":
        out = _ring_function().apply(query, key, value, scaling)
    else:
        a2a = _ulysses_function()
        with _cp_phase("attention forward"):
            q, k, v = (a2a.apply(t, True) for t in (query, key, value))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
            del q, k, v
            out = a2a.apply(o, False)
    return out.transpose(1, 2), None


def _no_mask(*args, **kwargs):
    """No mask: the CP attention applies causality by global positions itself."""
    return None


def _register_cp() -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(CP_ATTENTION, _cp_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(CP_ATTENTION, _no_mask)


def cp_problem(spec: ModelSpec, cp: int, method: str, seq: int, zigzag: bool = True) -> str | None:
    """Why `spec` cannot run `method` over cp ranks at `seq` tokens here (None when it can)."""
    if spec.family != "llama":
        return f"{spec.name}: the CP experiment replaces Llama-family attention only, not {spec.family}'s"
    try:
        CP.context_parallel(spec, cp=cp, method=method, batch_size=1, seq_len=seq, precision="fp32",
                           device="cpu", zigzag=zigzag)
    except ValueError as e:
        return str(e)
    return None


def _cp_loss(logits, labels, count: int):
    """The rank's share of the whole sequence's mean next-token loss: its tokens' sum over all tokens."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                           reduction="sum") / count


def _cp_step_loss(model, mine, pos, labels, count: int, loss: str, chunk: int):
    """The rank's share of the mean loss, by the loss's implementation: the whole one (the LM head's logits,
    then cross-entropy), torchtune's chunked loss (the head on each chunk of `chunk` tokens, each chunk's
    logits upcast and reduced) or Liger's fused linear cross-entropy (`measure.memory`), on the rank's tokens
    with the targets already shifted over the whole sequence."""
    import torch.nn.functional as F

    from .memory import FusedLinearCrossEntropy

    if loss == "whole":
        logits = model(input_ids=mine, position_ids=pos[None]).logits
        out = _cp_loss(logits, labels, count)
        del logits
        return out
    hidden = model.model(input_ids=mine, position_ids=pos[None])[0]
    flat, targets = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    head = model.get_output_embeddings()
    if loss == "chunked":
        logits = [F.linear(x, head.weight) for x in flat.split(chunk)]
        total = 0.0
        for z, y in zip(logits, targets.split(chunk)):
            total = total + F.cross_entropy(z.float(), y, ignore_index=-100, reduction="sum")
        del logits
        return total / count
    mean = FusedLinearCrossEntropy.apply(flat, head.weight, targets, chunk)  # over the rank's valid targets
    return mean * (int((targets != -100).sum()) / count)


def _run_cp(rank: int, world: int, args, dev) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        return _run_cp_in(rank, world, args, dev, stack)


def _run_cp_in(rank: int, world: int, args, dev, stack) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    global _CP
    spec, b, s = cp_model_spec(args.model), args.micro_batch, args.seq
    why = cp_problem(spec, world, args.method, s, args.zigzag)
    if why:
        raise ParlabError(why)
    _register_cp()
    _CP = _CPState(args.method, rank, world, args.zigzag)
    zig = args.zigzag and args.method == "ring"  # Ulysses gathers the whole sequence: contiguous shards
    pos = torch.tensor(CP.cp_positions(s, world, rank, zigzag=zig), device=dev)
    batch = _batch(spec, b, s, dev)  # the same sequences on every rank: CP splits them, not the batch
    labels_all = F.pad(batch, (0, 1), value=-100)[:, 1:]
    count = int((labels_all != -100).sum())
    mine = batch[:, pos]
    # 1. outputs and gradients against one process on the whole sequence
    recompute = getattr(args, "recompute", "none") == "full"

    def checkpointed(m):  # every block re-run in its backward (torch.utils.checkpoint, non-reentrant)
        if recompute:
            m.train()
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return m

    ref = _build(spec, dev)
    model = checkpointed(_build(spec, dev))
    model.config._attn_implementation = CP_ATTENTION
    logits_ref = ref(batch).logits
    _cp_loss(logits_ref, labels_all, count).backward()
    logits = model(input_ids=mine, position_ids=pos[None]).logits
    _cp_loss(logits, labels_all[:, pos], count).backward()
    want = logits_ref.detach()[:, pos]
    out_rel = ((logits.detach() - want).abs().max() / want.abs().max()).item()
    floor = 1e-6 * max(q.grad.abs().max().item() for q in ref.parameters())
    worst = 0.0
    for p, q in zip(model.parameters(), ref.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g)
        worst = max(worst, ((g - q.grad).abs().max() / q.grad.abs().max().clamp_min(max(floor, 1e-30))).item())
    ref_grads = [q.grad.detach().clone() for q in ref.parameters()] if getattr(args, "fsdp", False) else []
    del ref, model, logits, logits_ref, want, g, p, q  # (p, q: the last parameters of both models)
    gc.collect()
    # 2. a steady-state step: forward and backward on the rank's tokens, gradients all-reduced over the group
    #    (or, --fsdp, the model states sharded over it by FSDP2 and the gradients reduce-scattered)
    shard = getattr(args, "fsdp", False)
    model = checkpointed(_build(spec, dev))
    model.config._attn_implementation = CP_ATTENTION
    loss_kind = getattr(args, "loss", "whole")
    chunk = loss_chunk_size(spec, tokens=b * len(pos), loss=loss_kind, loss_chunk_tokens=getattr(args, "loss_chunk", None))
    runner = _cp_loss_module_class()(model, loss_kind, chunk, count)
    shard_check = None
    if shard:
        stack.enter_context(_track_resizes(_LEDGER))  # FSDP2 frees and reallocates its gathered parameters so
        _cp_fully_shard(runner, world)
        shard_check = _cp_fsdp_check(runner, ref_grads, mine, pos, labels_all[:, pos], world)
    del ref_grads
    gc.collect()
    params = list(model.parameters())
    opt = _optimizer(params, args.foreach)
    if not shard:
        _steady(opt, params)

    def step(tr=None):
        phase = tr.set_phase if tr else (lambda name: None)
        phase("forward")
        loss = runner(mine, pos, labels_all[:, pos])
        if tr:
            tr.mark("forward end")
        phase("backward")
        loss.backward()
        del loss
        if not shard:
            for p in params:
                dist.all_reduce(p.grad)
        phase("optimizer")
        opt.step()
        if shard:  # FSDP2's recipe: nothing of the gradients between steps
            opt.zero_grad(set_to_none=True)
        else:
            _zero(opt)
        phase("after step")

    step()
    step()
    _CP.sent = {"forward": 0, "backward": 0, "recompute": 0}
    _CP.messages = {"forward": 0, "backward": 0, "recompute": 0}
    memory = _ledger_step(step, [model], opt, [batch, pos, labels_all])
    sent = {k: v // spec.num_layers for k, v in _CP.sent.items()}
    messages = {k: v // spec.num_layers for k, v in _CP.messages.items()}
    out = {"rank": rank, "logits_max_rel_diff": out_rel, "grad_max_rel_diff": worst,
           "memory": memory, "sent_per_layer": sent, "messages_per_layer": messages,
           "gloo_unsettled": _GLOO_UNSETTLED[0],
           "positions": [int(x) for x in pos]}
    if shard:
        out |= {"fsdp_grad_max_rel_diff": shard_check, "states": _cp_state_bytes(model, opt)}
    return out


@contextlib.contextmanager
def _track_resizes(led: _Ledger):
    """Show the ledger the storages FSDP2 frees and reallocates in place (`UntypedStorage.resize_`: its
    gathered parameters, `_fsdp_param.alloc_storage` / `free_storage`), which no operation returns: a resize to
    0 is a free, a resize up an allocation (measure.zero's tracker does the same). Known limitation: the
    storage's finalizer still names its first address (harmless while the module lives, as in a run)."""
    import torch

    orig = torch.UntypedStorage.resize_

    def resize_(st, size):
        old_ptr, old_n = st.data_ptr(), st.nbytes()
        out = orig(st, size)
        ptr, n = st.data_ptr(), st.nbytes()
        if (ptr, n) != (old_ptr, old_n):
            if old_n:
                led._free(old_ptr)
            if n and ptr not in led.live:
                info = (n, "storage", [n], "UntypedStorage.resize_", led.phase, led.recording)
                led.live[ptr] = info
                led.now += n
                led._weakref.finalize(st, led._free, ptr)
                if led.recording:
                    led.events.append((ptr, info))
                    led.step_now += n
                    led.step_peak = max(led.step_peak, led.step_now)
                    led._peaks()
        return out

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = orig


def _cp_loss_module_class():
    import torch

    class CPLoss(torch.nn.Module):
        """The rank's loss as one module (`_cp_step_loss`), so that FSDP2's root unit (embeddings, final norm,
        LM head) is gathered by its own forward whatever the loss reads (the chunked and fused losses call the
        head outside the model's forward)."""

        def __init__(self, model, loss: str, chunk: int, count: int):
            super().__init__()
            self.model, self.loss, self.chunk, self.count = model, loss, chunk, count

        def forward(self, mine, pos, labels):
            return _cp_step_loss(self.model, mine, pos, labels, self.count, self.loss, self.chunk)

    return CPLoss


def _cp_fully_shard(runner, world: int) -> None:
    """FSDP2 over the CP group (the whole world here): `fully_shard` on every decoder block, then on the root
    (embeddings, final norm, LM head), fp32, as torchtitan's dp_shard x cp mesh shards states over the CP ranks.
    FSDP2 averages the reduce-scattered gradients (gloo has no PREMUL_SUM: it divides in place, no memory of its
    own), so each rank holds 1/cp of the sum over the ranks' losses (each its share of the whole mean)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    gather, scatter = _cp_fsdp_comms()
    for unit in [*runner.model.model.layers, runner]:
        fully_shard(unit, mesh=mesh)
        unit.set_custom_all_gather(gather)
        unit.set_custom_reduce_scatter(scatter)


def _cp_fsdp_comms():
    """FSDP2's all-gather and reduce-scatter with a GPU's memory on gloo, so that a rank's peak is the same
    every run: each collective settled before FSDP2 goes on (`_settle`: FSDP2 frees its buffers where it means
    to), and the reduce-scatter an in-place all-reduce of FSDP2's input with this rank's chunk copied to its
    output -- gloo's own reduce-scatter copies the whole input into a storage of its own (NCCL does not), freed
    on gloo's thread (+8 % one run in four). FSDP2's two buffers, nothing else, the same sums. An asynchronous
    call still returns a Work (completed), so that FSDP2 keeps its asynchronous bookkeeping. (Twice a
    reduce-scatter's bytes are sent; the bytes counted here are attention's.)"""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    class Done(dist.Work):
        def wait(self, timeout=None):
            return True

        def is_completed(self):
            return True

    def released(run, tensors, async_op):
        before = _use_counts(tensors)
        run()
        _settle(tensors, before)
        return Done() if async_op else None

    class AllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            return released(lambda: dist.all_gather_into_tensor(output_tensor, input_tensor, group=group),
                            [output_tensor, input_tensor], async_op)

    class ReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            def run():
                dist.all_reduce(input_tensor, op=op, group=group)
                output_tensor.copy_(input_tensor.view(dist.get_world_size(group), -1)[dist.get_rank(group)])
            return released(run, [output_tensor, input_tensor], async_op)

    return AllGather(), ReduceScatter()


def _cp_fsdp_check(runner, ref_grads: list, mine, pos, labels, world: int) -> float:
    """One more forward and backward of the FSDP2 model; its gradients (gathered whole from the shards, times
    cp: FSDP2 averages) against one process on the whole sequence: the largest relative difference."""
    runner(mine, pos, labels).backward()
    worst = 0.0
    floor = 1e-6 * max(g.abs().max().item() for g in ref_grads)
    for p, want in zip(runner.model.parameters(), ref_grads):
        got = p.grad.full_tensor() * world
        worst = max(worst, ((got - want).abs().max() / want.abs().max().clamp_min(max(floor, 1e-30))).item())
    runner.zero_grad(set_to_none=True)
    return worst


def _cp_state_bytes(model, opt) -> dict[str, int]:
    """This rank's parameter shards and optimizer states, in bytes of storage (the states are checked exactly)."""
    seen: set = set()
    params = [getattr(p, "_local_tensor", p) for p in model.parameters()]
    states = [getattr(v, "_local_tensor", v) for st in opt.state.values() for v in st.values() if hasattr(v, "untyped_storage")]
    return {"parameters": _storage_bytes(params, seen), "optimizer_states": _storage_bytes(states, seen)}


def cp_prediction(spec: ModelSpec, *, cp: int, method: str, batch_size: int, seq_len: int, zigzag: bool = True,
                  foreach: bool = True, recompute: str = "none", loss: str = "whole",
                  loss_chunk: int | None = None, fsdp: bool = False) -> dict[str, Any]:
    """What `vramlab.parallel` predicts for one rank of a CP run (fp32 on the CPU, AdamW; `fsdp`: the states
    sharded over the CP ranks, `shard_states`)."""
    return CP.context_parallel(spec, cp=cp, method=method, batch_size=batch_size, seq_len=seq_len, precision="fp32",
                              device="cpu", zigzag=zigzag, optimizer_impl="foreach" if foreach else "for-loop",
                              recompute=recompute, loss=loss, loss_chunk_tokens=loss_chunk, shard_states=fsdp)


def cp_rows(result: dict) -> list[dict[str, Any]]:
    """One row per rank: measured peak against the prediction, bytes sent per layer against it."""
    spec = cp_model_spec(result["model_name"])
    recompute = result.get("recompute", "none")  # (runs stored before recompute and the loss were options)
    pred = cp_prediction(spec, cp=result["ranks"], method=result["method"], batch_size=result["micro_batch_size"],
                         seq_len=result["seq_len"], zigzag=result["zigzag"], foreach=result["foreach"],
                         recompute=recompute, loss=result.get("loss", "whole"), loss_chunk=result.get("loss_chunk"),
                         fsdp=result.get("fsdp", False))
    block = "the recomputed last block" if recompute == "full" else "the last block"
    # the calculator's in-flight moments are the busiest rank's (zig-zag ranks differ in which rows a step updates)
    busiest = {ph: max(r["memory"]["phases"][ph]["peak"] for r in result["per_rank"] if ph in r["memory"]["phases"])
               for ph in ("attention forward", "attention backward")
               if any(ph in r["memory"]["phases"] for r in result["per_rank"])}
    out = []
    for r in result["per_rank"]:
        mem = r["memory"]
        out.append({"rank": r["rank"], "measured": mem["peak"], "measured_phase": mem["peak_phase"],
                    "predicted": pred["peak"], "predicted_phase": pred["peak_phase"],
                    "error": error(pred["peak"], mem["peak"]),
                    "sent_forward": r["sent_per_layer"]["forward"], "sent_backward": r["sent_per_layer"]["backward"],
                    "predicted_sent_forward": pred["sent_per_layer"]["forward"],
                    "predicted_sent_backward": pred["sent_per_layer"]["backward"],
                    "sent_recompute": r["sent_per_layer"].get("recompute", 0),
                    "predicted_sent_recompute": pred["sent_per_layer"]["recompute"],
                    "logits_max_rel_diff": r["logits_max_rel_diff"], "grad_max_rel_diff": r["grad_max_rel_diff"]})
        if "states" in r:  # --fsdp: the rank's shards and optimizer states, storage bytes, against the calculator's
            out[-1] |= {"states_measured": r["states"],
                        "states_predicted": {k: pred["states"][k] for k in ("parameters", "optimizer_states")},
                        "fsdp_grad_max_rel_diff": r["fsdp_grad_max_rel_diff"]}
        # the peaks inside CP's attention (the last block's, where the most is alive) against those moments
        for phase in ("attention forward", "attention backward"):
            got, want = mem["phases"].get(phase), pred["moments"].get(f"{phase} of {block}")
            if got is not None and want is not None:
                key = phase.replace(" ", "_")
                out[-1] |= {f"{key}_measured": got["peak"], f"{key}_busiest_rank": busiest[phase],
                            f"{key}_predicted": want, f"{key}_error": error(want, busiest[phase])}
    return out


def _cp_report(ranks: list[dict], args, world: int) -> None:
    from ..units import fmt_bytes
    from .record import provenance

    out = {"experiment": "cp", "backend": "gloo", "ranks": world, "method": args.method, "zigzag": args.zigzag,
           "model": {**MODELS, **CP_MODELS}[args.model][1], "model_name": args.model,
           "micro_batch_size": args.micro_batch, "seq_len": args.seq, "foreach": args.foreach, "precision": "fp32",
           "recompute": args.recompute, "loss": args.loss, "loss_chunk": args.loss_chunk,
           "fsdp": getattr(args, "fsdp", False),
           "command": " ".join([PROG, *sys.argv[1:]]), "provenance": provenance("cpu"), "per_rank": ranks}
    out["rows"] = cp_rows(out)
    print(f"# vramlab.measure.parallel cp: {args.method}{' zig-zag' if args.zigzag and args.method == 'ring' else ''}, "
          f"gloo, {world} ranks, {cp_model_spec(args.model).name}, batch {args.micro_batch} x {args.seq} tokens"
          + (", states sharded by FSDP2" if getattr(args, "fsdp", False) else ""))
    print(f"#{'rank':>5}{'predicted':>12}{'measured':>12}{'error':>8}  {'phase':<10}{'sent fwd':>11}{'bwd':>11}"
          f"{'logits':>10}{'grads':>10}")
    for r in out["rows"]:
        print(f" {r['rank']:>5}{fmt_bytes(r['predicted']):>12}{fmt_bytes(r['measured']):>12}{100 * r['error']:>+7.1f}%"
              f"  {r['measured_phase']:<10}{fmt_bytes(r['sent_forward']):>11}{fmt_bytes(r['sent_backward']):>11}"
              f"{r['logits_max_rel_diff']:>10.1e}{r['grad_max_rel_diff']:>10.1e}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"# wrote {args.out}")


def cp_main(argv: list[str]) -> int:
    """`python -m vramlab.measure.parallel cp ...`: context parallelism on gloo ranks."""
    A, whole = checks.argtype, checks.whole
    p = checks.Parser(prog=f"{PROG} cp", description="Context parallelism (ring attention, Ulysses) on gloo ranks, "
                                                      "measured per rank against vramlab.parallel.context_parallel.")
    p.add_argument("--method", default="ring", choices=CP_METHODS)
    # (one rank is no CP: the ring would send to itself, which gloo refuses; one process on the whole sequence is
    # measured by `python -m vramlab.measure.memory`)
    p.add_argument("--nproc", type=A(whole, int, lo=2, hi=64), default=2, help="CP ranks (local processes), 2 to 64")
    p.add_argument("--model", default="lab", choices=[m for m in MODELS if MODELS[m][1]["model_type"] == "llama"]
                   + list(CP_MODELS), help="the model (Llama family; default lab 3's)")
    p.add_argument("--micro-batch", type=A(whole, int, lo=1, hi=4096), default=2, help="sequences (default 2)")
    p.add_argument("--seq", type=A(whole, int, lo=2), default=256, help="tokens per sequence (default 256)")
    p.add_argument("--no-zigzag", dest="zigzag", action="store_false",
                   help="ring: contiguous sequence shards instead of the zig-zag (chunks r and 2cp-1-r)")
    p.add_argument("--optimizer-impl", default="foreach", choices=("foreach", "for-loop"))
    p.add_argument("--recompute", default="none", choices=CP.CP_RECOMPUTE,
                   help="full: every block checkpointed (torch.utils.checkpoint), its attention re-run in the backward")
    p.add_argument("--loss", default="whole", choices=LOSSES,
                   help="whole, chunked (torchtune's) or fused (Liger's linear cross-entropy) on the rank's tokens")
    p.add_argument("--loss-chunk", type=A(whole, int), default=None, metavar="N",
                   help="with --loss chunked or fused: tokens a chunk (default: torchtune's 8 chunks, Liger's rule)")
    p.add_argument("--fsdp", action="store_true",
                   help="shard the model states over the CP ranks too (FSDP2 fully_shard of every block, then the root)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--port", type=A(whole, int, lo=0, hi=65535), default=0)
    p.add_argument("--timeout", type=A(checks.positive, float, hi=86400), default=120.0)
    args = p.parse_args(argv)
    if args.loss_chunk is not None and args.loss == "whole":
        p.error("--loss-chunk applies to --loss chunked or fused")
    args.foreach = args.optimizer_impl == "foreach"
    args.backend, args.experiment = "gloo", "cp"  # _worker runs it as it runs ddp, tp and pp
    if args.method == "ulysses":
        args.zigzag = False
    spec = cp_model_spec(args.model)
    try:
        checks.positions(spec, args.seq, name="--seq")
    except ValueError as e:
        p.error(str(e))
    why = cp_problem(spec, args.nproc, args.method, args.seq, args.zigzag)
    if why:
        p.error(why)
    from .collectives import launch

    checks.output_path(PROG, args.out, make_folder=True)
    return launch(_worker, args, prog=f"{PROG} cp", error=ParlabError, torchrun_port=29513, preload=RANK_IMPORTS)


# the campaign stored in benchmarks/results/context_parallel/cpu.json: both methods, 2 and 4 ranks, MHA (lab 3's
# Llama) and GQA (8 query / 2 key-value heads), two shapes each, zig-zag and contiguous rings; full recompute and
# the chunked and fused losses
CP_CAMPAIGN: tuple[dict[str, Any], ...] = (
    dict(model="lab", method="ring", nproc=2, micro_batch=2, seq=256),
    dict(model="lab", method="ring", nproc=4, micro_batch=2, seq=256),
    dict(model="lab", method="ulysses", nproc=2, micro_batch=2, seq=256),
    dict(model="lab", method="ulysses", nproc=4, micro_batch=2, seq=256),
    dict(model="lab", method="ring", nproc=2, micro_batch=4, seq=512),
    dict(model="lab", method="ring", nproc=4, micro_batch=4, seq=512, zigzag=False),
    dict(model="lab", method="ulysses", nproc=4, micro_batch=4, seq=512),
    dict(model="llama-gqa-val", method="ring", nproc=2, micro_batch=2, seq=256),
    dict(model="llama-gqa-val", method="ring", nproc=4, micro_batch=4, seq=512),
    dict(model="llama-gqa-val", method="ulysses", nproc=2, micro_batch=4, seq=512),
    dict(model="cp-val", method="ring", nproc=2, micro_batch=2, seq=1024),
    dict(model="cp-val", method="ring", nproc=4, micro_batch=2, seq=1024),
    dict(model="cp-val", method="ulysses", nproc=4, micro_batch=2, seq=1024),
    # with every block checkpointed (the re-run forward passes K/V again) and the loss chunked or fused
    dict(model="cp-val", method="ring", nproc=2, micro_batch=2, seq=1024, recompute="full"),
    dict(model="cp-val", method="ulysses", nproc=4, micro_batch=2, seq=1024, recompute="full", loss="chunked"),
    dict(model="llama-gqa-val", method="ring", nproc=2, micro_batch=4, seq=512, recompute="full", loss="chunked"),
    dict(model="lab", method="ring", nproc=4, micro_batch=2, seq=512, loss="fused"),
    dict(model="cp-val", method="ring", nproc=4, micro_batch=2, seq=1024, zigzag=False, loss="fused"),
    # the model states sharded over the CP ranks too (FSDP2, --fsdp): both methods, 2 and 4 ranks, full recompute,
    # the chunked and fused losses, three models
    dict(model="cp-val", method="ring", nproc=2, micro_batch=2, seq=1024, fsdp=True),
    dict(model="cp-val", method="ulysses", nproc=4, micro_batch=2, seq=1024, fsdp=True),
    dict(model="cp-val", method="ring", nproc=4, micro_batch=2, seq=1024, recompute="full", fsdp=True),
    dict(model="lab", method="ring", nproc=2, micro_batch=2, seq=256, fsdp=True),
    dict(model="llama-gqa-val", method="ulysses", nproc=2, micro_batch=4, seq=512, fsdp=True),
    dict(model="llama-gqa-val", method="ring", nproc=4, micro_batch=4, seq=512, recompute="full", loss="chunked",
         fsdp=True),
    dict(model="lab", method="ring", nproc=4, micro_batch=2, seq=512, loss="fused", fsdp=True),
    dict(model="cp-val", method="ulysses", nproc=2, micro_batch=2, seq=1024, recompute="full", fsdp=True),
)


def cp_argv(config: dict[str, Any], out: str) -> list[str]:
    """The command line of one CP run (`CP_CAMPAIGN`'s keys)."""
    argv = ["cp", "--model", config["model"], "--method", config["method"], "--nproc", str(config["nproc"]),
            "--micro-batch", str(config["micro_batch"]), "--seq", str(config["seq"]), "--out", out]
    argv += [] if config.get("recompute", "none") == "none" else ["--recompute", config["recompute"]]
    argv += [] if config.get("loss", "whole") == "whole" else ["--loss", config["loss"]]
    argv += [] if config.get("loss_chunk") is None else ["--loss-chunk", str(config["loss_chunk"])]
    argv += ["--fsdp"] if config.get("fsdp", False) else []
    return argv + ([] if config.get("zigzag", True) else ["--no-zigzag"])


def _run_in_subprocess(argv_of, config: dict[str, Any], timeout: float) -> dict[str, Any]:
    """`python -m vramlab.measure.parallel <argv_of(config, out)>` in a subprocess (its ranks spawned there), the
    JSON it wrote to `out` read back; a ParlabError in one line when it fails or runs past `timeout` seconds."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "vramlab.measure.parallel", *argv_of(config, out)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ParlabError(f"{' '.join(cmd[2:])}: no result within {timeout:g} s") from None
        if done.returncode or not os.path.exists(out):
            last = [ln for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
            raise ParlabError(f"{' '.join(cmd[2:])}: {last[-1] if last else f'exit status {done.returncode}'}")
        return json.loads(Path(out).read_text())


def run_cp(config: dict[str, Any], *, timeout: float = 600) -> dict[str, Any]:
    """One CP run in a subprocess, its results read back (`_run_in_subprocess`)."""
    return _run_in_subprocess(cp_argv, config, timeout)


def _campaign(path: str, configs, run, label, *, what: str, name: str) -> dict[str, Any]:
    """Run every configuration (`run(config)`), keep each rank's ledger summary, print each run's worst error
    (`label(config)` names it) and store them all with provenance in one JSON file at `path`."""
    from .record import provenance

    runs = []
    for config in configs:
        result = run(config)
        for r in result["per_rank"]:
            r["memory"] = {k: r["memory"][k] for k in ("peak", "peak_phase", "at_peak", "phases")}
        runs.append({"config": dict(config), "result": result})
        print(f"{label(config)}: worst error {max(abs(r['error']) for r in result['rows']):.2%}", flush=True)
    out = {"what": what, "command": f"python -c \"from vramlab.measure.parallel import {name}; {name}('{path}')\"",
           "provenance": provenance("cpu"), "runs": runs}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1) + "\n")
    return out


def _cp_label(config: dict[str, Any]) -> str:
    argv = cp_argv(config, "")
    del argv[argv.index("--out"):argv.index("--out") + 2]
    return " ".join(argv)


def cp_campaign(path: str, configs=CP_CAMPAIGN) -> dict[str, Any]:
    """Run every configuration and store them, with each row's error, in one JSON file at `path`."""
    return _campaign(path, configs, run_cp, _cp_label, name="cp_campaign",
                     what="context parallelism on gloo ranks (CPU): each rank's peak through a steady-state training "
                          "step (the ledger) and the bytes its attention sent per layer, against "
                          "vramlab.parallel.context_parallel")



# ----------------------------------------------------------------------------- EP (expert parallelism)
# `python -m vramlab.measure.parallel ep --ep N --dp N` (issue H2): a small mixture-of-experts transformer
# (written here, parameter for parameter the tensors `ModelSpec.param_tensors` lists for a Mixtral or
# Qwen2-MoE config: embedding, per layer q/k/v/o with their biases, two RMSNorms, a dense gated MLP or a
# router + routed experts stored as transformers 5 stores them -- 3-D `gate_up_proj` (E, 2i, h) and
# `down_proj` (E, h, i) -- + an optional shared expert and its gate, final norm, LM head; no rotary
# embedding) on dp gloo ranks whose routed experts are split over ep: rank r holds experts
# (r % ep) E/ep ... of every MoE layer; the EP group is the ep consecutive ranks, the expert-data-parallel
# group the dp/ep ranks holding the same experts (Megatron-Core's layout, `parallel_state`).
# Tokens travel with `dist.all_to_all_single` (gloo supports it on CPU, variable splits included):
# - dropless: the per-expert counts are exchanged first (an all-to-all of E/ep counts per peer), then the
#   rows, sorted by expert (Megatron-Core's `MoEAlltoAllTokenDispatcher`, `token_dispatcher.py`);
# - capacity factor: every rank sends a fixed E x C buffer, C = moe.expert_capacity of its own tokens, the
#   choices beyond an expert's capacity dropped in token order (GShard; DeepSpeed's `sharded_moe.py`).
# Forward and backward each run two all-to-alls per MoE layer (dispatch, combine), an autograd Function
# here that counts the bytes each sends to other ranks at the call. Gradients: dense over the whole world,
# experts over the expert-data-parallel group only, both divided by dp; AdamW (foreach), ZeRO 0.
# The trained parameters are checked against one process running the same MoE with all experts on every
# rank's tokens (the same drops), and one steady-state step is measured with the ledger.

EP_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # Mixtral-like: every layer MoE, 4 experts
    "ep-mixtral": ("ep-mixtral", dict(model_type="mixtral", hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                      num_experts_per_tok=2, vocab_size=128, max_position_embeddings=512,
                                      tie_word_embeddings=False)),
    # Mixtral-like with 8 experts (2 per rank at ep 4), wider experts
    "ep-mixtral8": ("ep-mixtral8", dict(model_type="mixtral", hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, num_local_experts=8,
                                        num_experts_per_tok=2, vocab_size=128, max_position_embeddings=512,
                                        tie_word_embeddings=False)),
    # top-1 routing (Switch), 8 experts
    "ep-switch8": ("ep-switch8", dict(model_type="mixtral", hidden_size=96, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, num_local_experts=8,
                                      num_experts_per_tok=1, vocab_size=128, max_position_embeddings=512,
                                      tie_word_embeddings=False)),
    # Qwen2-MoE-like: a dense first layer, then MoE layers with a gated shared expert
    "ep-qwen2": ("ep-qwen2", dict(model_type="qwen2_moe", hidden_size=64, intermediate_size=128,
                                  moe_intermediate_size=128, shared_expert_intermediate_size=64, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                  vocab_size=128, max_position_embeddings=512, mlp_only_layers=[0],
                                  tie_word_embeddings=False)),
}


def ep_model_spec(name: str) -> ModelSpec:
    if name not in EP_MODELS:
        raise ValueError(f"unknown EP model {name!r}; known: {', '.join(EP_MODELS)}")
    label, cfg = EP_MODELS[name]
    return from_config(cfg, name=label)


class _EPComm:
    """The groups of this rank and the bytes its all-to-alls sent to other ranks, by direction."""

    def __init__(self, ep_group=None, ep: int = 1, ep_rank: int = 0):
        self.group, self.ep, self.ep_rank = ep_group, ep, ep_rank
        self.reset()

    def reset(self) -> None:
        self.sent = {"forward": 0, "backward": 0}
        self.calls = {"forward": 0, "backward": 0}
        self.counts_sent = 0
        self.received: list[int] = []  # rows each MoE layer's dispatch received (forward)
        self.kept: list[int] = []  # choices each MoE layer kept (all of them dropless)
        self.home: list[int] = []  # rows each MoE layer's dispatch routed to this rank's own experts


def _a2a_function():
    import torch
    import torch.distributed as dist

    class A2A(torch.autograd.Function):
        """all_to_all_single of rows (send_splits rows to each EP peer, recv_splits from each); its backward
        is the all-to-all of the gradients the other way. Counts the bytes that leave the rank."""

        @staticmethod
        def forward(ctx, x, send, recv, comm):
            ctx.send, ctx.recv, ctx.comm = send, recv, comm
            return _a2a_rows(x, send, recv, comm, "forward")

        @staticmethod
        def backward(ctx, g):
            return _a2a_rows(g.contiguous(), ctx.recv, ctx.send, ctx.comm, "backward"), None, None, None

    def _a2a_rows(x, send, recv, comm, direction):
        if comm.ep == 1:  # the reference process: nothing leaves
            return x.clone()
        out = x.new_empty((sum(recv), *x.shape[1:]))
        row = (x.numel() // max(x.shape[0], 1)) * x.element_size()  # bytes per row
        comm.sent[direction] += (sum(send) - send[comm.ep_rank]) * row  # all but the rows that stay here
        comm.calls[direction] += 1
        dist.all_to_all_single(out, x, list(recv), list(send), group=comm.group)
        return out

    return A2A


_A2A = None


def _capacity_keep(top_i, num_experts: int, capacity: int):
    """Which (token, choice) pairs keep their expert under a capacity, and their slot in its buffer: choices in
    token order (token 0's first choice, its second, token 1's ...), each expert's first `capacity` kept."""
    import torch.nn.functional as F

    flat = top_i.reshape(-1)  # (T k,)
    onehot = F.one_hot(flat, num_experts)  # (T k, E)
    pos = (onehot.cumsum(0) - 1).gather(1, flat[:, None])[:, 0]  # place in its expert's queue
    return pos < capacity, pos


def _ep_classes():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class RMSNorm(nn.Module):
        def __init__(self, h, eps):
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.ones(h)), eps

        def forward(self, x):
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    class MLP(nn.Module):
        def __init__(self, h, width, names=("gate_proj", "up_proj", "down_proj")):
            super().__init__()
            for n, (i, o) in zip(names, ((h, width), (h, width), (width, h))):
                setattr(self, n, nn.Linear(i, o, bias=False))
            self.names = names

        def forward(self, x):
            g, u, dn = (getattr(self, n) for n in self.names)
            return dn(F.silu(g(x)) * u(x))

    class Attention(nn.Module):
        def __init__(self, spec):
            super().__init__()
            h, a, kv, d = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
            bias = spec.qkv_bias if hasattr(spec, "qkv_bias") else False
            self.a, self.kv, self.d = a, kv, d
            self.q_proj, self.k_proj = nn.Linear(h, a * d, bias=bias), nn.Linear(h, kv * d, bias=bias)
            self.v_proj, self.o_proj = nn.Linear(h, kv * d, bias=bias), nn.Linear(a * d, h, bias=False)

        def forward(self, x):  # x (b, s, h)
            b, s, _ = x.shape
            q = self.q_proj(x).view(b, s, self.a, self.d).transpose(1, 2)
            k = self.k_proj(x).view(b, s, self.kv, self.d).transpose(1, 2)
            v = self.v_proj(x).view(b, s, self.kv, self.d).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != self.a)
            return self.o_proj(o.transpose(1, 2).reshape(b, s, self.a * self.d))

    class Experts(nn.Module):
        def __init__(self, n, h, i):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * i, h))
            self.down_proj = nn.Parameter(torch.empty(n, h, i))

    class MoE(nn.Module):
        """Router (top-k of a softmax, renormalised when k > 1), the rank's experts, the dispatch."""

        def __init__(self, spec, ep_rank: int, ep: int, comm, capacity_factor):
            super().__init__()
            h, E = spec.hidden_size, spec.num_experts
            self.E, self.k, self.El, self.ep, self.ep_rank = E, spec.num_experts_per_tok, E // ep, ep, ep_rank
            self.comm, self.cf = comm, capacity_factor
            self.gate = nn.Linear(h, E, bias=False)
            self.experts = Experts(E // ep, h, spec.moe_intermediate_size)
            self.shared_expert = self.shared_expert_gate = None
            if spec.num_shared_experts:
                w = spec.num_shared_experts * (spec.shared_expert_intermediate_size or spec.moe_intermediate_size)
                self.shared_expert = MLP(h, w)
                if spec.shared_expert_gate:
                    self.shared_expert_gate = nn.Linear(h, 1, bias=False)
            self.shards = 1  # the reference: the batch is `shards` ranks' tokens, each dropped on its own

        def route(self, x):  # x (T, h)
            probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float)  # (T, E)
            w, i = torch.topk(probs, self.k, dim=-1)  # (T, k)
            if self.k > 1:
                w = w / w.sum(dim=-1, keepdim=True)
            return w.to(x.dtype), i

        def forward(self, hidden):  # (b, s, h)
            b, s, h = hidden.shape
            x = hidden.reshape(-1, h)
            w, i = self.route(x)
            if self.shards > 1:  # the reference process: every rank's tokens routed (and dropped) as that rank would
                parts = [self.dispatch(xs, ws, is_) for xs, ws, is_ in
                         zip(x.chunk(self.shards), w.chunk(self.shards), i.chunk(self.shards))]
                y = torch.cat(parts)
            else:
                y = self.dispatch(x, w, i)
            if self.shared_expert is not None:
                sh = self.shared_expert(x)
                if self.shared_expert_gate is not None:
                    sh = torch.sigmoid(self.shared_expert_gate(x)) * sh
                y = y + sh
            return y.view(b, s, h)

        def dispatch(self, x, w, i):
            if self.cf is None:
                return self.dropless(x, w, i)
            return self.capacity(x, w, i)

        def expert(self, e, rows):  # rows (n, h) -> (n, h), the transformers expert: down(act(gate) * up)
            gate, up = F.linear(rows, self.experts.gate_up_proj[e]).chunk(2, dim=-1)
            return F.linear(F.silu(gate) * up, self.experts.down_proj[e])

        def dropless(self, x, w, i):
            import torch.distributed as dist

            T, k, E, El, ep = x.shape[0], self.k, self.E, self.El, self.ep
            flat = i.reshape(-1)  # (T k,) expert of each choice
            order = torch.argsort(flat, stable=True)  # the choices sorted by expert
            counts = torch.bincount(flat, minlength=E)  # (E,) rows this rank sends to each expert
            if ep > 1:  # every peer's counts for my experts: (ep, El)
                got = torch.empty_like(counts)
                dist.all_to_all_single(got, counts, group=self.comm.group)
                self.comm.counts_sent += (ep - 1) * El * counts.element_size()
            else:
                got = counts
            got = got.view(ep, El)
            send = counts.view(ep, El).sum(1).tolist()
            recv = got.sum(1).tolist()
            rows = x[order.div(k, rounding_mode="floor")]  # (T k, h) the send buffer, sorted by expert
            self.comm.received.append(sum(recv))
            self.comm.kept.append(T * k)
            self.comm.home.append(send[self.ep_rank])
            recv_rows = _A2A.apply(rows, send, recv, self.comm)  # (R, h), by source rank, then expert
            del rows
            # regroup by my expert: source-major -> expert-major
            loc_e = torch.arange(El).repeat(ep).repeat_interleave(got.reshape(-1))
            by_e = torch.argsort(loc_e, stable=True)
            mine = recv_rows[by_e]  # (R, h) expert-major
            del recv_rows
            outs = [self.expert(e, part) for e, part in enumerate(mine.split(got.sum(0).tolist()))]
            out = torch.cat(outs) if outs else mine[:0]
            del outs, mine
            back_in = torch.empty_like(by_e)
            back_in[by_e] = torch.arange(by_e.numel())
            out = out[back_in]  # source-major again
            back = _A2A.apply(out, recv, send, self.comm)  # (T k, h) sorted by expert
            del out
            unsort = torch.empty_like(order)
            unsort[order] = torch.arange(order.numel())
            contrib = back[unsort] * w.reshape(-1, 1)  # (T k, h) in choice order, weighted
            del back
            return contrib.view(T, k, -1).sum(1)

        def capacity(self, x, w, i):
            from .. import moe as _moe

            T, h, k, E, El, ep = x.shape[0], x.shape[1], self.k, self.E, self.El, self.ep
            C = _moe.expert_capacity(T, E, k, self.cf)  # rows per expert buffer, from this rank's tokens
            keep, pos = _capacity_keep(i, E, C)
            kept = keep.nonzero()[:, 0]  # the choices kept (index into T k)
            slot = i.reshape(-1)[kept] * C + pos[kept]  # their rows in the E x C send buffer
            tok = kept.div(k, rounding_mode="floor")
            self.comm.received.append(ep * El * C)
            self.comm.kept.append(kept.numel())
            self.comm.home.append(El * C)
            buf = x.new_zeros(E * C, h).index_copy(0, slot, x[tok])  # (E C, h) zero-padded send buffer
            recv = _A2A.apply(buf, [El * C] * ep, [El * C] * ep, self.comm)  # (ep El C, h): [source][expert][slot]
            del buf
            rows = recv.view(ep, El, C, h).transpose(0, 1).reshape(El, ep * C, h)  # expert-major copy
            del recv
            gate, up = torch.bmm(rows, self.experts.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # (El, ep C, 2i)
            out = torch.bmm(F.silu(gate) * up, self.experts.down_proj.transpose(1, 2))  # (El, ep C, h)
            del gate, up, rows
            out = out.view(El, ep, C, h).transpose(0, 1).reshape(ep * El * C, h)  # source-major copy
            back = _A2A.apply(out, [El * C] * ep, [El * C] * ep, self.comm)  # (E C, h) my buffer, processed
            del out
            contrib = back[slot] * w.reshape(-1)[kept][:, None]  # (kept, h) weighted
            del back
            return x.new_zeros(T, h).index_add(0, tok, contrib)

    return RMSNorm, MLP, Attention, MoE


def _ep_model(spec: ModelSpec, *, ep: int, ep_rank: int, comm, capacity_factor, dev, seed: int = 0):
    """The EP model of one rank (all experts when ep = 1): every tensor of `spec.param_tensors()` in its
    order and shape, the routed experts E/ep of them; the weights drawn from the full model's, the same on
    every rank (the rank keeps its experts' slices)."""
    import torch
    import torch.nn as nn

    RMSNorm, MLP, Attention, MoE = _ep_classes()
    h, eps = spec.hidden_size, 1e-6

    class Block(nn.Module):
        def __init__(self, layer: int):
            super().__init__()
            self.self_attn = Attention(spec)
            if layer in spec.moe_layer_ids:
                self.mlp = MoE(spec, ep_rank, ep, comm, capacity_factor)
            else:
                self.mlp = MLP(h, spec.intermediate_size)
            self.input_layernorm, self.post_attention_layernorm = RMSNorm(h, eps), RMSNorm(h, eps)

        def forward(self, x):
            x = x + self.self_attn(self.input_layernorm(x))
            return x + self.mlp(self.post_attention_layernorm(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(spec.vocab_size, h)
            self.layers = nn.ModuleList(Block(i) for i in range(spec.num_layers))
            self.norm = RMSNorm(h, eps)
            self.lm_head = nn.Linear(h, spec.vocab_size, bias=False)

        def forward(self, ids):
            x = self.embed_tokens(ids)
            for block in self.layers:
                x = block(x)
            return self.lm_head(self.norm(x))

    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Model()
    model = model.to_empty(device=dev)
    g = torch.Generator().manual_seed(seed)
    El = spec.num_experts // ep
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
                continue
            if ".experts." in name:  # draw all E experts, keep mine
                full = torch.randn((spec.num_experts, *p.shape[1:]), generator=g) * 0.08
                p.copy_(full[ep_rank * El:(ep_rank + 1) * El])
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.08)
    return model


class _EPZero:
    """ZeRO-1 for EP with `torch.distributed.optim.ZeroRedundancyOptimizer`: the dense parameters' AdamW states
    sharded over the whole world, the experts' over their expert-data-parallel group (two optimizers, stepped
    one after the other; each broadcasts its updated parameters from their owners)."""

    def __init__(self, named, edp_group, lr: float, optimizer_class=None):
        import torch
        from torch.distributed.optim import ZeroRedundancyOptimizer

        dense = [p for n, p in named if ".experts." not in n]
        experts = [p for n, p in named if ".experts." in n]
        kw = dict(optimizer_class=optimizer_class or torch.optim.AdamW, lr=lr, foreach=True)
        self.zs = [ZeroRedundancyOptimizer(dense, **kw), ZeroRedundancyOptimizer(experts, process_group=edp_group, **kw)]

    def step(self) -> None:
        for z in self.zs:
            z.step()

    @property
    def state(self) -> dict:  # this rank's shard of both
        return {p: st for z in self.zs for p, st in z.optim.state.items()}

    @property
    def param_groups(self) -> list:
        return [g for z in self.zs for g in z.param_groups]


def ep_problem(spec: ModelSpec, ep: int, dp: int, capacity_factor) -> str | None:
    """Why the EP experiment cannot run this layout (None when it can)."""
    if spec.model_type not in ("mixtral", "qwen2_moe"):
        return f"{spec.name}: the EP experiment builds Mixtral- and Qwen2-MoE-shaped models, not {spec.model_type}"
    try:
        EP.expert_parallel(spec, ep=ep, dp=dp, batch_size=1, seq_len=8, capacity_factor=capacity_factor,
                          precision="fp32", device="cpu")
    except ValueError as e:
        return str(e)
    return None


def _ep_loss(logits, ids):
    return _lm_loss(logits, ids)


def _run_ep(rank: int, world: int, args, dev) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    global _A2A
    _A2A = _a2a_function()
    spec, b, s, ep, cf = ep_model_spec(args.model), args.micro_batch, args.seq, args.ep, args.capacity_factor
    dp = world
    El = spec.num_experts // ep
    # groups: EP = ep consecutive ranks; expert-data-parallel = the ranks holding the same experts
    ep_groups = [dist.new_group(list(range(g * ep, (g + 1) * ep))) for g in range(dp // ep)]
    edp_groups = [dist.new_group(list(range(j, dp, ep))) for j in range(ep)]
    comm = _EPComm(ep_groups[rank // ep], ep, rank % ep)
    edp = edp_groups[rank % ep]
    # the rank's own sequences (a copy: the measured step holds only these); the check trains on every rank's
    ids = _batch(spec, b * dp, s, dev)[rank * b:(rank + 1) * b].clone()

    def expert_param(name: str) -> bool:
        return ".experts." in name

    def sync(model):  # gradients: dense over the world, experts over their edp group, both / dp
        for name, p in model.named_parameters():
            dist.all_reduce(p.grad, group=edp if expert_param(name) else None)
            p.grad.div_(dp)

    # 1. a steady-state step, measured (first: nothing of the check below is alive)
    model = _ep_model(spec, ep=ep, ep_rank=rank % ep, comm=comm, capacity_factor=cf, dev=dev)
    params = list(model.parameters())
    opt = _EPZero(list(model.named_parameters()), edp, 1e-4) if args.zero else _optimizer(params, True)
    _steady(opt, params)
    names = [n for n, _ in model.named_parameters()]

    def step(tr=None):
        phase = tr.set_phase if tr else (lambda name: None)
        phase("forward")
        logits = model(ids)
        phase("loss")
        loss = _ep_loss(logits, ids)
        del logits
        if tr:
            tr.mark("forward end")
        phase("backward")
        loss.backward()
        sync(model)
        phase("optimizer")
        opt.step()
        _zero(opt)
        phase("after step")

    step()
    comm.reset()
    memory = _ledger_step(step, [model], opt, [ids])
    # 2. one step against one process with all experts on every rank's tokens (same drops)
    ids_all = _batch(spec, b * dp, s, dev)
    ref = _ep_model(spec, ep=1, ep_rank=0, comm=_EPComm(), capacity_factor=cf, dev=dev)
    for m in ref.modules():
        if hasattr(m, "shards"):
            m.shards = dp
    check_comm = _EPComm(comm.group, ep, rank % ep)
    model_c = _ep_model(spec, ep=ep, ep_rank=rank % ep, comm=check_comm, capacity_factor=cf, dev=dev)
    # SGD for this check: Adam's first step is lr x sign(g), which turns float noise in a gradient that is zero in
    # exact arithmetic (a key bias: softmax ignores it) into a full step
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, foreach=True)
    opt_c = _EPZero(list(model_c.named_parameters()), edp, 0.1, torch.optim.SGD) if args.zero else \
        torch.optim.SGD(model_c.parameters(), lr=0.1, foreach=True)
    # the reference's loss: the mean of the dp ranks' mean losses (each rank's own sequences)
    logits_ref = ref(ids_all)
    sum(_ep_loss(logits_ref[r * b:(r + 1) * b], ids_all[r * b:(r + 1) * b]) for r in range(dp)).div(dp).backward()
    _ep_loss(model_c(ids), ids).backward()
    sync(model_c)
    opt_ref.step()
    opt_c.step()
    lo, hi = (rank % ep) * El, (rank % ep + 1) * El
    worst, worst_name = 0.0, ""
    mine = dict(model_c.named_parameters())
    for name, q in ref.named_parameters():
        p = mine[name]
        want = q[lo:hi] if expert_param(name) else q
        rel = ((p - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
        if rel > worst:
            worst, worst_name = rel, name
    del ref, model_c, opt_c, opt_ref, logits_ref, mine, p, q, want, ids_all
    by = {"dense": 0, "experts": 0}
    opt_by = {"dense": 0, "experts": 0}
    for n, p in zip(names, params):
        key = "experts" if expert_param(n) else "dense"
        by[key] += p.untyped_storage().nbytes()
        opt_by[key] += sum(v.untyped_storage().nbytes() for v in opt.state.get(p, {}).values() if torch.is_tensor(v))
    grads = sum(p.grad.untyped_storage().nbytes() for p in params)
    moe_layers = len(spec.moe_layer_ids)
    return {"rank": rank, "param_max_rel_diff": worst, "param_worst": worst_name, "memory": memory,
            "states": {"parameters": by, "gradients": grads, "optimizer_states": opt_by},
            "sent_per_layer": {k: v // moe_layers for k, v in comm.sent.items()},
            "a2a_calls": dict(comm.calls), "counts_sent": comm.counts_sent,
            "sent_total": dict(comm.sent), "received_rows": comm.received[-moe_layers:],
            "kept_rows": comm.kept[-moe_layers:], "home_rows": comm.home[-moe_layers:]}


def ep_prediction(spec: ModelSpec, *, ep: int, dp: int, batch_size: int, seq_len: int,
                  capacity_factor=None, received_rows=None, kept_rows=None, home_rows=None, zero: int = 0,
                  rank: int = 0) -> dict[str, Any]:
    """What `vramlab.parallel.expert_parallel` predicts for one rank of this experiment (fp32, CPU, AdamW),
    given the rows the rank's router really sent it (dropless routing depends on the data)."""
    return EP.expert_parallel(spec, ep=ep, dp=dp, batch_size=batch_size, seq_len=seq_len,
                             capacity_factor=capacity_factor, precision="fp32", device="cpu",
                             received_rows=received_rows, kept_rows=kept_rows, home_rows=home_rows, zero_stage=zero,
                             zero_partition="greedy", rank=rank)


def ep_rows(result: dict) -> list[dict[str, Any]]:
    """One row per rank: states, the peak and the all-to-all bytes against the prediction. Dropless, the
    bytes a rank sends depend on its router: the prediction is checked on the rank's own counts."""
    spec = ep_model_spec(result["model_name"])
    out = []
    for r in result["per_rank"]:
        pred = ep_prediction(spec, ep=result["ep"], dp=result["ranks"], batch_size=result["micro_batch_size"],
                             seq_len=result["seq_len"], capacity_factor=result["capacity_factor"],
                             received_rows=tuple(r["received_rows"]), kept_rows=tuple(r["kept_rows"]),
                             home_rows=tuple(r["home_rows"]), zero=result.get("zero", 0), rank=r["rank"])
        mem = r["memory"]
        row = {"rank": r["rank"], "measured": mem["peak"], "measured_phase": mem["peak_phase"],
               "predicted": pred["peak"], "predicted_phase": pred["peak_phase"],
               "error": error(pred["peak"], mem["peak"]), "param_max_rel_diff": r["param_max_rel_diff"],
               "sent_forward": r["sent_per_layer"]["forward"], "sent_backward": r["sent_per_layer"]["backward"]}
        row["predicted_sent_forward"] = pred["sent_per_layer"]["forward"]
        row["predicted_sent_backward"] = pred["sent_per_layer"]["backward"]
        out.append(row)
    return out


def _ep_report(ranks: list[dict], args, world: int) -> None:
    from ..units import fmt_bytes
    from .record import provenance

    out = {"experiment": "ep", "backend": "gloo", "ranks": world, "ep": args.ep, "model": EP_MODELS[args.model][1],
           "model_name": args.model, "micro_batch_size": args.micro_batch, "seq_len": args.seq,
           "capacity_factor": args.capacity_factor, "precision": "fp32", "zero": args.zero,
           "optimizer": "AdamW foreach" + (", ZeRO-1: ZeroRedundancyOptimizer, dense over the world, experts over edp"
                                           if args.zero else ", ZeRO 0"),
           "command": " ".join([PROG, *sys.argv[1:]]), "provenance": provenance("cpu"), "per_rank": ranks}
    out["rows"] = ep_rows(out)
    print(f"# vramlab.measure.parallel ep: ep {args.ep} x dp {world}, gloo, {args.model}, batch {args.micro_batch} x "
          f"{args.seq}, " + ("dropless" if args.capacity_factor is None else f"capacity factor {args.capacity_factor}"))
    print(f"#{'rank':>5}{'predicted':>12}{'measured':>12}{'error':>8}  {'phase':<10}{'sent fwd':>11}{'params':>10}")
    for r in out["rows"]:
        print(f" {r['rank']:>5}{fmt_bytes(r['predicted']):>12}{fmt_bytes(r['measured']):>12}{100 * r['error']:>+7.1f}%"
              f"  {r['measured_phase']:<10}{fmt_bytes(r['sent_forward']):>11}{r['param_max_rel_diff']:>10.1e}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"# wrote {args.out}")


def ep_main(argv: list[str]) -> int:
    """`python -m vramlab.measure.parallel ep ...`: expert parallelism on gloo ranks."""
    A, whole = checks.argtype, checks.whole
    p = checks.Parser(prog=f"{PROG} ep", description="Expert parallelism (all-to-all dispatch) on gloo ranks, "
                                                      "measured per rank against vramlab.parallel.expert_parallel.")
    p.add_argument("--ep", type=A(whole, int, lo=1, hi=64), default=2, help="expert-parallel ranks (default 2)")
    p.add_argument("--dp", type=A(whole, int, lo=1, hi=64), default=2, help="data-parallel ranks = processes (default 2)")
    p.add_argument("--model", default="ep-mixtral", choices=list(EP_MODELS))
    p.add_argument("--micro-batch", type=A(whole, int, lo=1, hi=4096), default=2, help="sequences per rank (default 2)")
    p.add_argument("--seq", type=A(whole, int, lo=2), default=64, help="tokens per sequence (default 64)")
    p.add_argument("--capacity-factor", type=A(checks.positive, float, hi=1024), default=None,
                   help="route with a capacity (fixed E x C buffers, drops); default dropless")
    p.add_argument("--zero", type=int, choices=(0, 1), default=0,
                   help="1: ZeroRedundancyOptimizer, dense states over all ranks, expert states over edp")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--port", type=A(whole, int, lo=0, hi=65535), default=0)
    p.add_argument("--timeout", type=A(checks.positive, float, hi=86400), default=120.0)
    args = p.parse_args(argv)
    args.backend, args.experiment, args.nproc = "gloo", "ep", args.dp
    spec = ep_model_spec(args.model)
    try:
        checks.positions(spec, args.seq, name="--seq")
    except ValueError as e:
        p.error(str(e))
    why = ep_problem(spec, args.ep, args.dp, args.capacity_factor)
    if why:
        p.error(why)
    from .collectives import launch

    checks.output_path(PROG, args.out, make_folder=True)
    return launch(_worker, args, prog=f"{PROG} ep", error=ParlabError, torchrun_port=29514, preload=RANK_IMPORTS)



# the campaign stored in benchmarks/results/expert_parallel/cpu.json: ep 2 and 4 (dp 4 with ep 2: edp = 2), top-1
# and top-2, dropless and capacity factors 1.0 and 1.5, 1 and 2 experts per rank, a shared expert and a dense
# first layer (ep-qwen2), several shapes
EP_CAMPAIGN: tuple[dict[str, Any], ...] = (
    dict(model="ep-mixtral", ep=2, dp=2, micro_batch=2, seq=64),
    dict(model="ep-mixtral", ep=4, dp=4, micro_batch=2, seq=64, capacity_factor=1.0),
    dict(model="ep-mixtral", ep=2, dp=4, micro_batch=2, seq=96, capacity_factor=1.5),
    dict(model="ep-mixtral8", ep=4, dp=4, micro_batch=1, seq=128),
    dict(model="ep-switch8", ep=4, dp=4, micro_batch=2, seq=64, capacity_factor=1.5),
    dict(model="ep-switch8", ep=2, dp=2, micro_batch=2, seq=128),
    dict(model="ep-qwen2", ep=2, dp=2, micro_batch=2, seq=96),
    dict(model="ep-qwen2", ep=2, dp=4, micro_batch=2, seq=64, capacity_factor=1.0),
    dict(model="ep-qwen2", ep=2, dp=4, micro_batch=1, seq=64, zero=1),
    dict(model="ep-mixtral8", ep=2, dp=2, micro_batch=2, seq=64, capacity_factor=1.5, zero=1),
)


def ep_argv(config: dict[str, Any], out: str) -> list[str]:
    argv = ["ep", "--model", config["model"], "--ep", str(config["ep"]), "--dp", str(config["dp"]),
            "--micro-batch", str(config["micro_batch"]), "--seq", str(config["seq"]), "--out", out]
    return argv + (["--capacity-factor", str(config["capacity_factor"])] if config.get("capacity_factor") else []) \
        + (["--zero", "1"] if config.get("zero") else [])


def run_ep(config: dict[str, Any], *, timeout: float = 600) -> dict[str, Any]:
    """One EP run in a subprocess, its results read back (`_run_in_subprocess`)."""
    return _run_in_subprocess(ep_argv, config, timeout)


def ep_campaign(path: str, configs=EP_CAMPAIGN) -> dict[str, Any]:
    """Run every configuration and store them, with each row's error, in one JSON file at `path`."""
    return _campaign(path, configs, run_ep, str, name="ep_campaign",
                     what="expert parallelism on gloo ranks (CPU): each rank's states, peak through a steady-state "
                          "training step (the ledger) and the bytes its all-to-alls sent per MoE layer, against "
                          "vramlab.parallel.expert_parallel")


if __name__ == "__main__":
    sys.exit(main())
