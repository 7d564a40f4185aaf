"""Record the order in which a real training step allocates and frees its tensors, to replay it
through `vramlab.allocator` (the caching allocator's model).

`record_training_events` runs the same steps as the H100 measurements in `gpu-truth` (build the
model, create AdamW's states, one warm-up step, `reset_peak_memory_stats()`, one measured step) under
a `TorchDispatchMode` that sees every operator's outputs: each new tensor storage is an `("alloc",
id, bytes)` event, and a weak-reference callback on the storage gives its `("free", id)` the moment
the last reference goes, as on a GPU. In trace mode (`FakeTensorMode`, the default) nothing is
allocated, so GPU-sized steps record in seconds.

What the CPU run does differently from CUDA, and what the recorder does about it:
- CUDA's scaled-dot-product attention kernels (flash, memory-efficient) apply dropout without
  keeping a mask; the CPU falls back to the math kernel with dropout and keeps the s x s scores. The
  recorder runs SDPA with dropout_p=0 so the CPU's flash kernel (output + log-sum-exp) is used.
- CUDA autocast runs `pow`, `layer_norm`, `group_norm`, `softmax`, `log_softmax` in fp32 (its fp32
  op list); CPU autocast keeps them in 16 bits. Under autocast the recorder casts their 16-bit
  inputs to fp32 first, as CUDA's autocast does (transformers' `gelu_new` then keeps fp32
  intermediates, as measured on the H100).
- CUDA's dropout is one fused kernel that keeps a 1-byte mask (`native_dropout`); the CPU's
  `dropout` multiplies by a noise tensor of the input's dtype (4 bytes in fp32) and keeps that. The
  recorder runs `native_dropout` on the CPU too.
- cuBLAS takes its workspaces from the caching allocator: 32 MiB at the first matmul and 37.25 MiB
  more at the first matmul of the backward (measured on the H100: gpu-truth/overheads_h100.jsonl).
  The recorder inserts both as allocations that are never freed (`cublas_workspaces=False` leaves
  them out).
Known limitations: CPU kernels' internal scratch buffers are not seen (CUDA kernels' are not either
unless they use the caching allocator); the backward of CPU attention kernels may allocate
temporaries of other sizes than CUDA's.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from ..activations import Recompute
from ..memory import Optimizer, OptimizerImpl, check_positive
from ..precision import Precision
from ..specs import ModelSpec
from .memory import AUTOCAST, fake_mode, make_optimizer, training_model
from .models import Attention, make_batch

CUBLAS_WORKSPACE = 33554432  # bytes at the first matmul (H100, gpu-truth/overheads_h100.jsonl)
CUBLAS_BACKWARD_EXTRA = 39063552  # bytes more at the first Linear backward (same file)
_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "_scaled_mm"}


class EventRecorder(TorchDispatchMode):
    """Every new tensor storage an operator returns is an ("alloc", id, bytes) event in `events`;
    its ("free", id) follows when the storage dies. `mark(name)` adds a ("mark", name) event (a
    phase boundary, ignored by the replay) and `reset_peak()` a ("reset_peak",) event."""

    def __init__(self, *, cublas_workspaces: bool = True):
        super().__init__()
        self.events: list[tuple] = []
        self._seen = WeakIdKeyDictionary()
        self._next = 0
        self._workspaces = ["forward", "backward"] if cublas_workspaces else []

    def track(self, *tensors) -> None:
        """Record tensors made outside the mode (before it started) as allocations, in order."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._see(t)

    def mark(self, name: str) -> None:
        self.events.append(("mark", name))

    def reset_peak(self) -> None:
        self.events.append(("reset_peak",))

    def _see(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if st in self._seen:
            return
        i = self._next
        self._next += 1
        self._seen[st] = i
        self.events.append(("alloc", i, int(st.nbytes())))
        weakref.finalize(st, self.events.append, ("free", i))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self._workspaces and name in _MATMULS:
            backward = torch._C._current_graph_task_id() != -1
            if self._workspaces[0] == "forward":
                self._workspaces.pop(0)
                self.events.append(("alloc", "cublas_workspace", CUBLAS_WORKSPACE))
            if backward and self._workspaces == ["backward"]:
                self._workspaces.pop(0)
                self.events.append(("alloc", "cublas_backward", CUBLAS_BACKWARD_EXTRA))
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._see(t)
        return out


_FP32_OPS = [(torch, "pow"), (torch.Tensor, "pow"), (torch.nn.functional, "layer_norm"),
             (torch.nn.functional, "group_norm"), (torch.nn.functional, "softmax"),
             (torch.nn.functional, "log_softmax"), (torch.Tensor, "softmax")]


@contextlib.contextmanager
def cuda_like_kernels(*, autocast_fp32: bool = True, sdpa_without_dropout_mask: bool = True,
                      fused_dropout: bool = True):
    """Make the CPU's choices CUDA's where they change memory (see the module's docstring)."""
    saved = []

    def up(x):
        low = isinstance(x, torch.Tensor) and x.dtype in (torch.bfloat16, torch.float16)
        return x.float() if low else x

    def fp32(f: Callable) -> Callable:
        @functools.wraps(f)
        def run(*args, **kwargs):
            if torch.is_autocast_enabled("cpu"):
                args = [up(a) for a in args]
                kwargs = {k: up(v) for k, v in kwargs.items()}
            return f(*args, **kwargs)
        return run

    if autocast_fp32:
        saved += [(owner, attr, getattr(owner, attr)) for owner, attr in _FP32_OPS]
    if sdpa_without_dropout_mask:
        saved.append((torch.nn.functional, "scaled_dot_product_attention",
                      torch.nn.functional.scaled_dot_product_attention))
    if fused_dropout:
        saved.append((torch.nn.functional, "dropout", torch.nn.functional.dropout))
    try:
        for owner, attr, f in saved:
            if attr == "dropout":
                @functools.wraps(f)
                def dropout(input, p=0.5, training=True, inplace=False, _f=f):
                    if not (training and 0 < p < 1 and input.numel()):
                        return _f(input, p, training, inplace)
                    out = torch.native_dropout(input, p, True)[0]  # CUDA's fused kernel: a bool mask
                    return input.copy_(out) if inplace else out
                setattr(owner, attr, dropout)
            elif attr == "scaled_dot_product_attention":
                @functools.wraps(f)
                def sdpa(*args, _f=f, **kwargs):
                    kwargs["dropout_p"] = 0.0
                    return _f(*args, **kwargs)
                setattr(owner, attr, sdpa)
            else:
                setattr(owner, attr, fp32(f))
        yield
    finally:
        for owner, attr, f in saved:
            setattr(owner, attr, f)


def record_training_events(spec: ModelSpec, *, batch_size: int, seq_len: int, precision: Precision = "fp32",
                           optimizer: Optimizer = "adamw", optimizer_impl: OptimizerImpl = "foreach",
                           attention: Attention = "sdpa", recompute: Recompute = "none", mode: str = "trace",
                           warmup_steps: int = 1, cuda_like: bool = True, cublas_workspaces: bool = True,
                           extra_phase: Callable[..., None] | None = None) -> list[tuple]:
    """The allocation events of gpu-truth's method on the CPU (`mode` "trace" or "cpu"): build the
    model, create the optimizer's states (one step on zero gradients), `warmup_steps` steps, a
    ("reset_peak",) event, one measured step (forward, backward, optimizer.step(),
    zero_grad(set_to_none=True)). ("mark", phase) events separate the phases. `extra_phase(model=,
    recorder=, step=, spec=)` runs after the measured step (e.g. an evaluation at another batch size,
    then `step("label")` for one more training step)."""
    check_positive(batch_size=batch_size, seq_len=seq_len)
    if mode not in ("trace", "cpu"):
        raise ValueError(f"mode must be 'trace' or 'cpu', got {mode!r}")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    amp = AUTOCAST.get(precision)
    rec = EventRecorder(cublas_workspaces=cublas_workspaces)
    kernels = cuda_like_kernels() if cuda_like else contextlib.nullcontext()
    with fake_mode(mode == "trace"), kernels, rec:
        rec.mark("build")
        model = training_model(spec, attention=attention, dtype=dtype, device="cpu", recompute=recompute)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = make_optimizer(params, optimizer=optimizer, optimizer_impl=optimizer_impl)
        rec.mark("optimizer states")
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        batch = make_batch(spec, batch_size=batch_size, seq_len=seq_len, device="cpu")

        def step(label: str) -> None:
            rec.mark(f"{label}: forward")
            with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
                loss = model(**batch).loss
            rec.mark(f"{label}: backward")
            loss.backward()
            del loss
            rec.mark(f"{label}: optimizer.step()")
            opt.step()
            opt.zero_grad(set_to_none=True)

        for k in range(warmup_steps):
            step(f"warm-up {k + 1}")
        rec.reset_peak()
        step("measured")
        if extra_phase is not None:
            extra_phase(model=model, recorder=rec, step=step, spec=spec)
        rec.mark("end")
    return list(rec.events)


def evaluate_then_train(eval_batch_size: int, seq_len: int) -> Callable[..., None]:
    """An `extra_phase`: a phase change. An evaluation pass at `eval_batch_size` under no_grad (all
    logits kept until it returns, as `model(ids)` does), then one more training step."""
    def phase(*, model, recorder, step, spec) -> None:
        ids = make_batch(spec, batch_size=eval_batch_size, seq_len=seq_len, device="cpu", with_labels=False)
        recorder.mark(f"evaluation (batch {eval_batch_size}, no_grad)")
        model.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(**ids)
        del out, ids
        model.train()
        step("training after the evaluation")
    return phase


def replayable(events: list[tuple]) -> list[tuple]:
    """The events without ("mark", ...) entries, for `vramlab.allocator.replay`."""
    return [e for e in events if e[0] != "mark"]



def events_from_snapshot(snapshot: dict, *, device: int = 0) -> list[tuple]:
    """The allocation events of a CUDA run, from `torch.cuda.memory._snapshot()` with
    `torch.cuda.memory._record_memory_history()` turned on before the first allocation: each trace
    entry "alloc" becomes ("alloc", id, requested bytes) and the "free_completed" of its address
    ("free", id) (addresses are reused, so ids are numbered in order). A free of an address the trace
    never allocated (made before recording started) is dropped."""
    traces = snapshot.get("device_traces") or []
    if device >= len(traces):
        raise ValueError(f"the snapshot has no trace for device {device} (was _record_memory_history on?)")
    events: list[tuple] = []
    live: dict[int, int] = {}
    for e in traces[device]:
        action = e.get("action")
        if action == "alloc":
            n = live[e["addr"]] = len(events)  # unique: the event's index
            events.append(("alloc", n, int(e["size"])))
        elif action == "free_completed" and e["addr"] in live:
            events.append(("free", live.pop(e["addr"])))
    return events
