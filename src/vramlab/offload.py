"""Offload: tensors kept in host memory instead of the GPU's, and what moving them costs. Pure Python
(no torch): runs in the browser too.

What is here:
- `host_link_GBps`: a GPU's PCIe link per direction (generation x lanes), pinned or pageable;
- `transfer_seconds`: bytes over that link;
- `activation_offload`: `torch.autograd.graph.save_on_cpu(pin_memory=True)`: every tensor saved for
  backward goes to host memory in the forward and comes back in the backward. The GPU keeps the
  model states and what the loss's backward unpacks; the step pays both copies, which save_on_cpu
  makes on the compute stream (not overlapped). Checked against the H100 (tests/test_offload.py);
- `stream_layers` / `smallest_resident`: BMInf's schedule for a model bigger than the GPU (Han et
  al., BMInf 2021): k of n layers resident, the others copied in before their turn through a few
  GPU buffers, on a copy stream beside the compute stream; the time per pass, the GPU and host
  bytes, and the smallest k whose copies hide behind compute.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

from . import memory as _mem
from .specs import GPUSpec, ModelSpec, gpu as _gpu

# PCIe per lane and direction after line coding, decimal GB/s (PCI-SIG: 8, 16, 32 GT/s with 128b/130b)
PCIE_LANE_GBps: dict[int, float] = {3: 0.985, 4: 1.969, 5: 3.938}
# save_on_cpu's effective rate as a share of the link's nominal: calibrated on the H100 host (PCIe 5.0
# x16) with llama-3.2-1b (b 4 x 2048, bf16-mixed: 2 x 23.8 GB in 1.22 s more than the baseline step,
# benchmarks/results/h100/offload_h100.jsonl) and checked on GPT-2 there (tests/test_offload.py).
# What it folds in: the copies are synchronous on the compute stream (nothing overlaps them), one copy
# per saved tensor (hundreds per step, each with its launch and sync), and pinned buffers from
# the caching host allocator.
SAVE_ON_CPU_EFFICIENCY = 0.62
# Pageable copies are staged through a pinned bounce buffer by the driver: about half the pinned rate
# (NVIDIA's CUDA C best practices guide, "pinned memory"); an assumption, not measured here.
PAGEABLE_FRACTION = 0.5


def pcie_generation(gpu: GPUSpec) -> int:
    """The PCIe generation of `gpu`'s host link, from the catalogue's interconnect text."""
    m = re.search(r"PCIe\s+(\d)", gpu.interconnect)
    if not m:
        raise ValueError(f"{gpu.name}: no PCIe generation in {gpu.interconnect!r}")
    return int(m.group(1))


def host_link_GBps(gpu: GPUSpec | str, *, pinned: bool = True, lanes: int = 16) -> float:
    """Nominal bytes per second (decimal GB/s), one direction, between host memory and `gpu`: the PCIe
    generation's per-lane rate x lanes; pageable memory at `PAGEABLE_FRACTION` of it."""
    g = _gpu(gpu)
    if isinstance(lanes, bool) or lanes not in (1, 2, 4, 8, 16):
        raise ValueError(f"lanes must be 1, 2, 4, 8 or 16, got {lanes!r}")
    rate = PCIE_LANE_GBps[pcie_generation(g)] * lanes
    return rate if pinned else rate * PAGEABLE_FRACTION


def transfer_seconds(nbytes: int | float, gpu: GPUSpec | str, *, pinned: bool = True, efficiency: float = 1.0) -> float:
    """Seconds to move `nbytes` one way over `gpu`'s host link at `efficiency` of its nominal rate."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not nbytes >= 0:
        raise ValueError(f"nbytes must be a number of bytes >= 0, got {nbytes!r}")
    if isinstance(efficiency, bool) or not isinstance(efficiency, (int, float)) or not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency!r}")
    return nbytes / (host_link_GBps(gpu, pinned=pinned) * efficiency * 1e9)


# ----------------------------------------------------------------------------- activation offload
@dataclasses.dataclass(frozen=True)
class ActivationOffload:
    gpu_peak: _mem.MemoryBreakdown  # with save_on_cpu
    baseline_peak: _mem.MemoryBreakdown  # without
    host_bytes: int  # the saved tensors, in host memory at the end of the forward
    moved_bytes: int  # each way, per step
    transfer_seconds: float  # both ways, not overlapped
    step_seconds: float | None  # baseline_seconds + transfer_seconds, when a baseline time is given


def activation_offload(model: ModelSpec | str, *, batch_size: int, seq_len: int, precision: str = "bf16-mixed",
                       gpu: GPUSpec | str = "h100-80gb", optimizer_impl: str = "foreach",
                       baseline_seconds: float | None = None,
                       efficiency: float = SAVE_ON_CPU_EFFICIENCY) -> ActivationOffload:
    """A training step under `save_on_cpu(pin_memory=True)` on `gpu`.

    GPU: every phase of `memory.training_phases` without the saved activations, except at the
    backward's start, where the loss's backward unpacks its saved fp32 log-probabilities back onto
    the GPU beside the two logit-sized gradients it makes: parameters + optimizer states + the
    workspaces + one fp32 logits tensor + the logits' gradients. The optimizer step is unchanged.
    Host: every saved tensor (the activations' ledger), pinned. Time: the baseline step plus both
    copies of the saved bytes at `efficiency` of the link's nominal rate (see SAVE_ON_CPU_EFFICIENCY)."""
    if baseline_seconds is not None and not (isinstance(baseline_seconds, (int, float)) and baseline_seconds >= 0):
        raise ValueError(f"baseline_seconds must be seconds >= 0, got {baseline_seconds!r}")
    spec = _mem._resolve(model)
    g = _gpu(gpu)
    phases = _mem.training_phases(spec, batch_size=batch_size, seq_len=seq_len, precision=precision,
                                  optimizer_impl=optimizer_impl, device="cuda", gpu=g)
    baseline = max(phases, key=lambda p: p.total)
    act = _mem.activation_bytes(spec, batch_size=batch_size, seq_len=seq_len, precision=precision, device="cuda")
    saved = act["layers"] + act["outside"] + act["weight_copies"]
    logits32 = batch_size * seq_len * spec.vocab_size * 4
    offloaded = []
    for p in phases:
        unpacked = logits32 if p.phase.startswith("backward start") else 0
        offloaded.append(dataclasses.replace(p, activations=unpacked,
                                             label=f"{p.label}, save_on_cpu"))
    peak = max(offloaded, key=lambda p: p.total)
    moving = 2 * transfer_seconds(saved, g, efficiency=efficiency)
    return ActivationOffload(gpu_peak=peak, baseline_peak=baseline, host_bytes=saved, moved_bytes=saved,
                             transfer_seconds=moving,
                             step_seconds=None if baseline_seconds is None else baseline_seconds + moving)


# ----------------------------------------------------------------------------- streaming (BMInf)
@dataclasses.dataclass(frozen=True)
class Streaming:
    seconds: float  # one pass over the layers, in steady state
    compute_seconds: float  # the same pass with every layer resident
    gpu_bytes: int  # resident layers + the streaming buffers
    host_bytes: int  # the streamed layers
    streamed: tuple[int, ...]
    events: tuple[tuple[str, int, float, float], ...]  # ("copy" | "compute", layer, start, end), last pass

    @property
    def hidden(self) -> bool:
        """True when the copies cost nothing: the pass takes what compute alone takes."""
        return self.seconds <= self.compute_seconds * (1 + 1e-9)


def _numbers(name: str, values, *, positive: bool) -> list[float]:
    try:
        out = [float(v) for v in values]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a list of numbers") from None
    if not out or any(not (v > 0 if positive else v >= 0) or v != v or v == float("inf") for v in out):
        raise ValueError(f"{name} must be a non-empty list of {'positive' if positive else 'non-negative'} finite numbers")
    return out


def spaced(n_layers: int, n_streamed: int) -> tuple[int, ...]:
    """`n_streamed` of `n_layers` layer indices spaced as far apart as possible (BMInf's choice: the
    copies have the most compute between them to hide behind)."""
    if not 0 <= n_streamed <= n_layers:
        raise ValueError(f"cannot stream {n_streamed} of {n_layers} layers")
    if n_streamed == 0:
        return ()
    step = n_layers / n_streamed
    return tuple(sorted({int(i * step) for i in range(n_streamed)}))


def stream_layers(layer_bytes, layer_seconds, *, streamed, link_GBps: float, buffers: int = 2,
                  passes: int = 3) -> Streaming:
    """Run `passes` passes over the layers (each a forward over every layer, as one generated token is):
    layer i computes after layer i-1 and, when i is in `streamed`, after its copy has arrived. The
    streamed layers are copied in order, one at a time on the copy stream, each into one of `buffers`
    GPU buffers (each as large as the largest streamed layer); a buffer is free again once the layer
    in it has computed. The first copy of a pass may start during the previous pass: that is the
    prefetch. Returns the last pass (steady state)."""
    sizes = _numbers("layer_bytes", layer_bytes, positive=True)
    secs = _numbers("layer_seconds", layer_seconds, positive=False)
    n = len(sizes)
    if len(secs) != n:
        raise ValueError(f"layer_bytes has {n} layers and layer_seconds {len(secs)}")
    try:
        stream = tuple(sorted({int(i) for i in streamed}))
    except (TypeError, ValueError):
        raise ValueError("streamed must be a list of layer indices") from None
    if any(not 0 <= i < n for i in stream):
        raise ValueError(f"streamed layers must be indices from 0 to {n - 1}")
    if not (isinstance(link_GBps, (int, float)) and link_GBps > 0):
        raise ValueError(f"link_GBps must be positive, got {link_GBps!r}")
    if isinstance(buffers, bool) or not isinstance(buffers, int) or buffers < 1:
        raise ValueError(f"buffers must be a whole number >= 1, got {buffers!r}")
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError(f"passes must be a whole number >= 1, got {passes!r}")
    copy_s = {i: sizes[i] / (link_GBps * 1e9) for i in stream}
    t = copy_end = 0.0
    computed: list[float] = []  # compute end of each streamed layer, in copy order over all passes
    pass_start, events = 0.0, []
    for _ in range(passes):
        pass_start, events = t, []
        for i in range(n):
            ready = t
            if i in copy_s:
                m = len(computed)  # the m-th copy overall, into buffer m % buffers
                start = max(copy_end, computed[m - buffers] if m >= buffers else 0.0)
                copy_end = start + copy_s[i]
                events.append(("copy", i, start, copy_end))
                ready = max(t, copy_end)
            t = ready + secs[i]
            events.append(("compute", i, ready, t))
            if i in copy_s:
                computed.append(t)
    streamed_bytes = [sizes[i] for i in stream]
    buf = min(buffers, len(stream)) * max(streamed_bytes, default=0)
    return Streaming(seconds=t - pass_start, compute_seconds=sum(secs),
                     gpu_bytes=int(sum(sizes) - sum(streamed_bytes) + buf), host_bytes=int(sum(streamed_bytes)),
                     streamed=stream,
                     events=tuple(sorted(((kind, i, s - pass_start, e - pass_start) for kind, i, s, e in events),
                                         key=lambda e: (e[2], e[0]))))


EXHAUSTIVE_UP_TO = 12  # layers: above this, smallest_resident tries BMInf's spaced choice only


def smallest_resident(layer_bytes, layer_seconds, *, link_GBps: float, buffers: int = 2) -> Streaming:
    """The fewest resident layers whose copies hide behind compute (the pass takes no longer than
    with every layer resident), and which layers to stream; among equally many, the one with the least
    GPU memory. Up to EXHAUSTIVE_UP_TO layers every choice of streamed layers is tried (exact); above,
    only BMInf's choice of layers spaced as far apart as possible (`spaced`), which is exact for equal
    layers but can keep more resident than needed when they differ. Every layer resident always
    hides (nothing is copied)."""
    n = len(_numbers("layer_bytes", layer_bytes, positive=True))
    for m in range(n, -1, -1):
        choices = itertools.combinations(range(n), m) if n <= EXHAUSTIVE_UP_TO else [spaced(n, m)]
        runs = [stream_layers(layer_bytes, layer_seconds, streamed=c, link_GBps=link_GBps, buffers=buffers)
                for c in choices]
        hiding = [r for r in runs if r.hidden]
        if hiding:
            return min(hiding, key=lambda r: (r.gpu_bytes, r.streamed))
    raise AssertionError("unreachable: nothing streamed always hides")
