"""Measure the memory a training step or an inference prefill really uses, by category.

Three modes, one result type (`Measurement`, whose `.breakdown` is a `MemoryBreakdown` like the
estimator's, so predicted minus measured is a subtraction):

- "cuda":  a real step on a GPU. Categories from tensor tracking (PyTorch's MemTracker, which
           applies the allocator's 512-byte rounding); also the allocator's own peak allocated and
           reserved bytes and the device's total in use (CUDA context included).
- "cpu":   a real step on the CPU, categories from live-tensor tracking.
- "trace": the same step under `FakeTensorMode`: every tensor has a shape, dtype and device but no
           storage, so a GPU-sized model is measured on a laptop in seconds. The peak equals real
           CPU tensor tracking.

Known limitations: CPU and trace runs execute CPU kernels, whose choices differ from CUDA's
(the SDPA kernel with dropout, autocast's op lists, optimizer implementations' defaults); GradScaler
is not run under trace (its `found_inf` check needs real values; it holds a few scalars).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import platform
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch

from .memory import FP32_STATES, MemoryBreakdown, Optimizer, OptimizerImpl, Precision, Recompute
from .models import Attention, build_model, make_batch
from .specs import ModelSpec

Mode = Literal["auto", "cuda", "cpu", "trace"]


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """A measured peak. `breakdown` is by category at the tracked peak; on CUDA the allocator's
    view (`peak_allocated`, `peak_reserved`) and the whole device's (`device_in_use`) are added."""

    breakdown: MemoryBreakdown
    mode: str
    device: str
    seconds: float
    peak_allocated: int | None = None  # torch.cuda.max_memory_allocated(): live tensors, rounded
    peak_reserved: int | None = None  # torch.cuda.max_memory_reserved(): the caching allocator's pool
    device_in_use: int | None = None  # total - free from cudaMemGetInfo: + CUDA context, cuBLAS, NCCL
    provenance: dict[str, Any] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.breakdown.total


def provenance(device: str | None = None) -> dict[str, Any]:
    """Where and when a measurement was taken: host, torch, transformers, GPU and driver."""
    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    if device and device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
        info["gpu_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
        try:
            info["driver"] = _nvidia_driver()
        except Exception:  # pragma: no cover - nvidia-smi missing
            pass
    return info


def _nvidia_driver() -> str:
    import subprocess

    out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=20, check=True)
    return out.stdout.strip().splitlines()[0]


def resolve_mode(mode: Mode) -> str:
    if mode == "auto":
        return "cuda" if torch.cuda.is_available() else "trace"
    if mode == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("mode='cuda' needs a CUDA GPU; use mode='trace' (any model, no memory) or 'cpu'")
    if mode not in ("cuda", "cpu", "trace"):
        raise ValueError(f"unknown mode {mode!r}: expected auto, cuda, cpu or trace")
    return mode


# ----------------------------------------------------------------------------- tracking

class _NoHook:
    def remove(self) -> None:
        pass


def _tracker():
    from torch.distributed._tools.mem_tracker import MemTracker

    return MemTracker()


def _ignore_frozen(tracker, model: torch.nn.Module) -> None:
    """MemTracker (torch 2.13) registers a gradient hook on every parameter and crashes on frozen
    ones ("cannot register a hook on a tensor that doesn't require gradient"), i.e. on every PEFT
    model. Frozen parameters never get a gradient: give them hook handles that do nothing."""
    for p in model.parameters():
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())


def _state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    if optimizer is None:
        return 0
    seen, total = set(), 0
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                key = id(v.untyped_storage()) if v.device.type != "meta" else id(v)
                if key not in seen:
                    seen.add(key)
                    total += v.untyped_storage().nbytes()
    return total


def _to_breakdown(snap: dict[str, int], *, opt_state_bytes: int, label: str) -> MemoryBreakdown:
    """MemTracker's categories -> vramlab's. Everything allocated inside optimizer.step() is tagged
    'Optstate' by MemTracker: the part beyond the persistent states is the step's temporaries."""
    opt = snap.get("Optstate", 0)
    states = min(opt, opt_state_bytes)
    return MemoryBreakdown(
        parameters=snap.get("Parameter", 0),
        gradients=snap.get("Gradient", 0),
        optimizer_states=states,
        activations=snap.get("Activation", 0),
        temporaries=snap.get("Temp", 0) + opt - states,
        inputs=snap.get("Other", 0),
        other=snap.get("Buffer", 0),
        label=label,
    )


def measure(step: Callable[[], Any], *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
            inputs: Any = (), label: str = "measured", mode: str = "cpu") -> Measurement:
    """Run `step()` once and return its peak memory by category.

    `model`, `optimizer` and `inputs` must already exist (they are what is resident before the
    step: parameters, optimizer states, the batch). `mode` only labels the result and, on "cuda",
    adds the allocator's and device's peaks; build the objects on the device (or under
    FakeTensorMode for "trace") yourself, or use `measure_training` / `measure_inference`.
    """
    tracker = _tracker()
    tracker.track_external(model, *([optimizer] if optimizer is not None else []), *_tensors(inputs))
    _ignore_frozen(tracker, model)
    dev = "cpu"
    if mode == "cuda":
        dev = str(next(model.parameters()).device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with tracker:
        step()
    seconds = time.perf_counter() - t0
    snaps = tracker.get_tracker_snapshot("peak")
    snap = next(iter(snaps.values())) if snaps else {}
    snap = {str(k.value if hasattr(k, "value") else k): v for k, v in snap.items()}
    bd = _to_breakdown(snap, opt_state_bytes=_state_bytes(optimizer), label=label)
    extra: dict[str, Any] = {}
    if mode == "cuda":
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        extra = dict(peak_allocated=torch.cuda.max_memory_allocated(), peak_reserved=torch.cuda.max_memory_reserved(),
                     device_in_use=total - free)
    return Measurement(breakdown=bd, mode=mode, device=dev, seconds=seconds, provenance=provenance(dev), **extra)


def _tensors(inputs: Any) -> list[torch.Tensor]:
    if isinstance(inputs, torch.Tensor):
        return [inputs]
    if isinstance(inputs, dict):
        inputs = list(inputs.values())
    return [t for t in inputs if isinstance(t, torch.Tensor)]


# ----------------------------------------------------------------------------- training step

_AUTOCAST = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def make_optimizer(params, *, optimizer: Optimizer, optimizer_impl: OptimizerImpl, lr: float = 1e-4):
    kw: dict[str, Any] = {"foreach": optimizer_impl == "foreach"}
    if optimizer_impl == "fused":
        kw = {"fused": True}
    if optimizer in ("adamw", "adam"):
        cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.Adam
        return cls(params, lr=lr, **kw)
    if optimizer in ("sgd", "sgd-momentum"):
        return torch.optim.SGD(params, lr=lr, momentum=0.9 if optimizer == "sgd-momentum" else 0.0, **kw)
    raise NotImplementedError(f"measuring optimizer {optimizer!r} is not supported (needs bitsandbytes on a GPU)")


@contextlib.contextmanager
def _fake_mode(enabled: bool):
    if not enabled:
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=False), _unpadded_masks():
        yield


@contextlib.contextmanager
def _unpadded_masks():
    """With real tensors, transformers sees that an unpadded batch needs no attention mask and lets
    SDPA apply causality itself; with fake tensors it cannot read the mask and materialises a
    (b, 1, s, s) fp32 mask that a real run never holds. Our batches are never padded: tell it so."""
    import transformers.masking_utils as mu

    originals = {n: f for n, f in vars(mu).items() if callable(f) and n.startswith(("_ignore_", "_can_skip_"))}

    def unpadded(f):
        def wrapper(padding_mask, *args, **kwargs):
            return f(None, *args, **kwargs)
        return wrapper

    for n, f in originals.items():
        setattr(mu, n, unpadded(f))
    originals["find_packed_sequence_indices"] = mu.find_packed_sequence_indices
    mu.find_packed_sequence_indices = lambda position_ids: None  # one sequence per row, never packed
    try:
        yield
    finally:
        for n, f in originals.items():
            setattr(mu, n, f)


def measure_training(spec: ModelSpec, *, batch_size: int, seq_len: int, precision: Precision = "fp32",
                     optimizer: Optimizer = "adamw", optimizer_impl: OptimizerImpl = "foreach",
                     attention: Attention = "sdpa", recompute: Recompute = "none", mode: Mode = "auto",
                     device: str | None = None, model_hook: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
                     ) -> Measurement:
    """Peak of one steady-state training step of `spec`: optimizer states already exist; forward,
    backward, optimizer.step(), zero_grad(set_to_none=True). Same arguments as
    `vramlab.estimate_training`, plus `mode` (auto = cuda if available, else trace).
    `model_hook` may change the model before the step (e.g. wrap it with PEFT)."""
    if precision in FP32_STATES:
        raise NotImplementedError(f"measuring precision {precision!r} needs an optimizer with fp32 states (or master "
                                  "weights) for 16-bit parameters, which torch.optim does not provide")
    mode_ = resolve_mode(mode)
    dev = device or ("cuda" if mode_ == "cuda" else "cpu")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    with _fake_mode(mode_ == "trace"):
        model = build_model(spec, attention=attention, dtype=dtype, device=dev)
        if model_hook is not None:
            model = model_hook(model)
        if recompute == "full":
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        params = [p for p in model.parameters() if p.requires_grad]
        opt = make_optimizer(params, optimizer=optimizer, optimizer_impl=optimizer_impl)
        # steady state: create the optimizer's states with one step on zero gradients
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        batch = make_batch(spec, batch_size=batch_size, seq_len=seq_len, device=dev)
        amp = _AUTOCAST.get(precision)
        dev_type = torch.device(dev).type

        def step() -> None:
            with torch.autocast(dev_type, dtype=amp, enabled=amp is not None):
                loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        label = f"{spec.name} train b={batch_size} s={seq_len} {precision} ({mode_})"
        return measure(step, model=model, optimizer=opt, inputs=batch, label=label, mode=mode_)


def measure_inference(spec: ModelSpec, *, batch_size: int, seq_len: int, precision: Literal["fp32", "bf16", "fp16"] = "bf16",
                      attention: Attention = "sdpa", mode: Mode = "auto", device: str | None = None) -> Measurement:
    """Peak of one prefill forward pass (no gradients) of `batch_size` x `seq_len` tokens, with the
    KV cache on (transformers' DynamicCache) for decoder models."""
    mode_ = resolve_mode(mode)
    dev = device or ("cuda" if mode_ == "cuda" else "cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    with _fake_mode(mode_ == "trace"):
        model = build_model(spec, attention=attention, dtype=dtype, device=dev, train=False)
        batch = make_batch(spec, batch_size=batch_size, seq_len=seq_len, device=dev, with_labels=False)
        if spec.family == "t5":
            batch["decoder_input_ids"] = batch["input_ids"][:, :1]
        out: list[Any] = []

        def step() -> None:
            with torch.no_grad():
                kw = {"use_cache": True} if spec.family != "bert" else {}
                out.append(model(**batch, **kw))  # keep the outputs (logits, cache) alive, as a server would

        label = f"{spec.name} prefill b={batch_size} s={seq_len} {precision} ({mode_})"
        return measure(step, model=model, inputs=batch, label=label, mode=mode_)
