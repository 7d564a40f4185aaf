"""Offload: tensors kept in host memory instead of the GPU's, and what moving them costs. Pure Python
(no torch): runs in the browser too.

What is here:
- `host_link_GBps`: a GPU's PCIe link per direction (generation x lanes), pinned or pageable;
- `transfer_seconds`: bytes over that link;
- `activation_offload`: `torch.autograd.graph.save_on_cpu(pin_memory=True)`: every tensor saved for
  backward goes to host memory in the forward and comes back in the backward. The GPU keeps the
  model states and what the loss's backward unpacks; the step pays both copies, which save_on_cpu
  makes on the compute stream (not overlapped). Checked against the H100 (tests/test_offload.py);
- `model_offload`: the model states in host memory. "zero-offload" (DeepSpeed ZeRO-Offload, Ren et
  al. 2021): 16-bit parameters stay on the GPU, the fp32 master weights, Adam's moments, the
  gradients and the Adam step go to the CPU. "fsdp2-cpu" (FSDP2's `CPUOffloadPolicy`, as
  ZeRO-Infinity's parameter offload): the parameters too, copied in one unit at a time;
- `stream_layers` / `smallest_resident` / `least_memory`: BMInf's schedule for a model bigger than
  the GPU (Han et al., BMInf 2021): k of n layers resident, the others copied in before their turn through a few
  GPU buffers, on a copy stream beside the compute stream; the time per pass, the GPU and host
  bytes, the smallest k whose copies hide behind compute, and the hiding choice that needs the
  least GPU memory (not the same when the layers differ: the buffers take the largest streamed one);
- `loader_memory`: a `DataLoader(pin_memory=True)`'s batches in flight, its pinned host memory and
  one batch's copy, pinned against pageable (checked against a real DataLoader: tests/test_outofcore.py);
- `infinity` / `needed_placement` / `deepspeed_config`: ZeRO-Infinity's tiers (Rajbhandari et al.
  2021): parameters and optimizer states on the GPU, the CPU or NVMe, DeepSpeed's pinned swap buffers,
  bytes and seconds per step on PCIe and NVMe against compute, the fastest placement that fits a GPU
  and a host, and the DeepSpeed config for it (accepted by DeepSpeed's own config model);
- `disk_streaming`: layers streamed from disk through a few host buffers for a forward and backward,
  the host's peak and the bytes read and written (measured by `vramlab.measure.offload.stream_from_disk`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re

from . import checks as _checks
from . import memory as _mem
from . import specs as _specs
from . import precision as _prec
from . import activations as _act
from .specs import MAX_LAYERS, GPUSpec, ModelSpec, gpu as _gpu
from .zero import REDUCE_BUCKET, block_index, block_tensor_sizes, zero_units

# PCIe per lane and direction after line coding, decimal GB/s (PCI-SIG: 8, 16, 32 GT/s with 128b/130b)
PCIE_LANE_GBps: dict[int, float] = {3: 0.985, 4: 1.969, 5: 3.938}
# save_on_cpu's effective rate as a share of the link's nominal: calibrated on the H100 host (PCIe 5.0
# x16) with llama-3.2-1b (b 4 x 2048, bf16-mixed: 2 x 23.8 GB in 1.22 s more than the baseline step,
# benchmarks/results/h100/offload_h100.jsonl) and checked on GPT-2 there (tests/test_offload.py).
# What it folds in: the copies run on the compute stream (non_blocking since torch 2.4, so the host
# goes on, but the kernels after each copy wait for it: nothing overlaps them), one copy per saved
# tensor (hundreds per step, each with its launch), and pinned buffers from the caching host allocator.
SAVE_ON_CPU_EFFICIENCY = 0.62
# Pageable copies are staged through a pinned bounce buffer by the driver: about half the pinned rate
# (NVIDIA's CUDA C best practices guide, "pinned memory"); an assumption, not measured here.
PAGEABLE_FRACTION = 0.5


LANES = (1, 2, 4, 8, 16)
WEIGHT_BYTES = {1: "int8", 2: "fp16/bf16", 4: "fp32"}
# The streaming schedules' sizes: the most blocks a ModelSpec can have (an encoder and a decoder of
# specs.MAX_LAYERS each) and the most passes one simulation runs (the steady state comes in a few)
MAX_STREAM_LAYERS = 2 * MAX_LAYERS
MAX_PASSES = 1000


def _choice(name: str, value, choices) -> object:
    """`checks.one_of` (no bool stands for 1, an unhashable value is refused) in this module's wording:
    "name must be one of a, b, got x"."""
    try:
        return _checks.one_of(name, value, choices)
    except ValueError:
        raise ValueError(f"{name} must be one of {', '.join(str(c) for c in choices)}, got {_checks.show(value)}") from None


def _whole_choice(name: str, value, choices: dict) -> int:
    """A whole number (numpy's too; no bool, no float, no string) among `choices`' keys, as an int."""
    what = ", ".join(f"{k} ({v})" if v else str(k) for k, v in choices.items())
    try:
        v = _checks.whole(name, value, lo=min(choices), hi=max(choices))
    except ValueError:
        v = None
    if v not in choices:
        raise ValueError(f"{name} must be one of {what}, got {_checks.show(value)}")
    return v


def pcie_generation(gpu: GPUSpec | str) -> int:
    """The PCIe generation of `gpu`'s host link, from the catalogue's interconnect text."""
    gpu = _gpu(gpu)
    m = re.search(r"PCIe\s+(\d)", gpu.interconnect)
    if not m:
        raise ValueError(f"{gpu.name}: no PCIe generation in {gpu.interconnect!r}")
    return int(m.group(1))


def host_link_GBps(gpu: GPUSpec | str, *, pinned: bool = True, lanes: int = 16) -> float:
    """Nominal bytes per second (decimal GB/s), one direction, between host memory and `gpu`: the PCIe
    generation's per-lane rate x lanes; pageable memory at `PAGEABLE_FRACTION` of it."""
    g = _gpu(gpu)
    pinned = _checks.flag("pinned", pinned)
    lanes = _whole_choice("lanes", lanes, dict.fromkeys(LANES, ""))
    rate = PCIE_LANE_GBps[pcie_generation(g)] * lanes
    return rate if pinned else rate * PAGEABLE_FRACTION


def transfer_seconds(nbytes: int | float, gpu: GPUSpec | str, *, pinned: bool = True, efficiency: float = 1.0) -> float:
    """Seconds to move `nbytes` one way over `gpu`'s host link at `efficiency` of its nominal rate."""
    nbytes = _checks.number("nbytes", nbytes, hi=_checks.MAX_BYTES)
    efficiency = _checks.fraction("efficiency", efficiency)
    return nbytes / (host_link_GBps(gpu, pinned=pinned) * efficiency * 1e9)


# ----------------------------------------------------------------------------- activation offload
@dataclasses.dataclass(frozen=True)
class ActivationOffload:
    gpu_peak: _mem.MemoryBreakdown  # with save_on_cpu
    baseline_peak: _mem.MemoryBreakdown  # without
    host_bytes: int  # pinned host memory at the end of the forward: each saved tensor in its power-of-two block
    moved_bytes: int  # each way, per step: the saved tensors' bytes
    transfer_seconds: float  # both ways, not overlapped
    step_seconds: float | None  # baseline_seconds + transfer_seconds, when a baseline time is given


def pinned_block(nbytes: int) -> int:
    """What PyTorch's pinned (page-locked) caching host allocator reserves for a request of `nbytes`:
    the next power of two (c10's CachingHostAllocator rounds every block up so blocks can be reused)."""
    nbytes = _checks.whole("nbytes", nbytes, lo=0, hi=_checks.MAX_BYTES)
    return 1 << max(nbytes - 1, 0).bit_length() if nbytes > 0 else 0


def _saved_tensors(spec: ModelSpec, *, batch_size: int, seq_len: int, precision: str) -> list[int]:
    """The size of every tensor one training step saves for backward on CUDA (per block, times the
    blocks; outside the blocks; autocast's weight casts as one tensor per linear weight)."""
    nb = _prec.dtype_sizes(precision, "cuda")
    tokens, scores = batch_size * seq_len, batch_size * spec.num_heads * seq_len * seq_len
    size = lambda x: _act.saved_tensor_bytes(x, tokens=tokens, scores=scores, nbytes=nb, batch=batch_size)  # noqa: E731
    kw = dict(precision=precision, device="cuda", batch_size=batch_size)
    sizes = [size(x) for x in _act.layer_saved(spec, **kw)] * spec.num_layers
    if spec.num_decoder_layers:
        sizes += [size(x) for x in _act.layer_saved(spec, decoder=True, **kw)] * spec.num_decoder_layers
    sizes += [size(x) for x in _act.model_saved(spec)]
    if _act.cuda_amp(precision, "cuda"):  # each linear's weight cast, saved for its input's gradient
        sizes += [2 * n for name, n in spec.param_tensors() if name.endswith("weight") and n > spec.hidden_size
                  and "norm" not in name and "wpe" not in name]
    return sizes


def activation_offload(model: ModelSpec | str, *, batch_size: int, seq_len: int, precision: str = "bf16-mixed",
                       gpu: GPUSpec | str = "h100-80gb", optimizer_impl: str = "foreach",
                       baseline_seconds: float | None = None,
                       efficiency: float = SAVE_ON_CPU_EFFICIENCY) -> ActivationOffload:
    """A training step under `save_on_cpu(pin_memory=True)` on `gpu`.

    GPU: every phase of `memory.training_phases` without the saved activations, except at the
    backward's start, where the loss's backward unpacks its saved fp32 log-probabilities back onto
    the GPU beside the two logit-sized gradients it makes: parameters + optimizer states + the
    workspaces + one fp32 logits tensor + the logits' gradients. The optimizer step is unchanged.
    Host: every saved tensor (the activations' ledger), each in its own pinned block rounded up to a
    power of two (`pinned_block`): a lower bound (GPT-2 within 5 % of the H100 host's RSS growth,
    Llama 23 % under it; tests/test_offload.py). Time: the baseline step plus both
    copies of the saved bytes at `efficiency` of the link's nominal rate (see SAVE_ON_CPU_EFFICIENCY)."""
    if baseline_seconds is not None:
        baseline_seconds = _checks.number("baseline_seconds", baseline_seconds)
    efficiency = _checks.fraction("efficiency", efficiency)
    spec = _specs.resolve(model)
    g = _gpu(gpu)
    phases = _mem.training_phases(spec, batch_size=batch_size, seq_len=seq_len, precision=precision,
                                  optimizer_impl=optimizer_impl, device="cuda", gpu=g)
    baseline = max(phases, key=lambda p: p.total)
    act = _act.activation_bytes(spec, batch_size=batch_size, seq_len=seq_len, precision=precision, device="cuda")
    saved = act["layers"] + act["outside"] + act["weight_copies"]
    logits32 = batch_size * seq_len * spec.vocab_size * 4
    offloaded = []
    for p in phases:
        unpacked = logits32 if p.phase.startswith("backward start") else 0
        offloaded.append(dataclasses.replace(p, activations=unpacked,
                                             label=f"{p.label}, save_on_cpu"))
    peak = max(offloaded, key=lambda p: p.total)
    moving = 2 * transfer_seconds(saved, g, efficiency=efficiency)
    host = sum(pinned_block(n) for n in _saved_tensors(spec, batch_size=batch_size, seq_len=seq_len,
                                                         precision=precision))
    return ActivationOffload(gpu_peak=peak, baseline_peak=baseline, host_bytes=host, moved_bytes=saved,
                             transfer_seconds=moving,
                             step_seconds=None if baseline_seconds is None else baseline_seconds + moving)


# ----------------------------------------------------------------------------- model states offload
# torch.optim.AdamW stepping fp32 tensors in host memory, seconds per parameter: calibrated on the
# H100 host's 16 cores with the FSDP2 CPUOffloadPolicy probe (llama-3.2-1b: 1.48 s step = 0.23 s
# on the GPU + 13.8 GB of copies at SAVE_ON_CPU_EFFICIENCY + 0.90 s for 1.24e9 parameters). About
# 70 bytes of host memory traffic per parameter for the for-loop AdamW's kernels, so ~100 GB/s.
# DeepSpeed's CPU-Adam (SIMD, fused) is several times faster: DS_CPU_ADAM_SECONDS_PER_PARAM.
CPU_ADAM_SECONDS_PER_PARAM = 0.73e-9
# ZeRO-Offload's step on the host, seconds per parameter: the gradients' norm, DeepSpeedCPUAdam over
# the flat fp32 partition and the updated parameters' cast to bf16 into the pinned buffer, as DeepSpeed
# 0.19's engine runs them. Calibrated on the H100 host's 16 cores (Xeon) with llama-3.2-1b: the step's
# host part 0.481 s, less the 2.47 GB upload at SAVE_ON_CPU_EFFICIENCY, for 1.24e9 parameters
# (benchmarks/results/offload/gpu/zo_llama_3_2_1b.json); gpt2-medium and pythia-1b are the check
# (tests/test_offload.py). DeepSpeedCPUAdam alone steps a 1e8-parameter tensor at 0.22 ns a
# parameter there, 5.6 times torch's for-loop AdamW (Ren et al. 2021 measure 5.1 to 6.5) and as fast
# as torch's fused CPU AdamW (benchmarks/results/offload/gpu/cpu_adam.json).
DS_CPU_ADAM_SECONDS_PER_PARAM = 0.34e-9
OFFLOAD_SCHEMES = ("zero-offload", "fsdp2-cpu")
# ZeRO-Offload's bytes over PCIe a parameter, per step: (gradients down, parameters up)
ZERO_OFFLOAD_COPIES: dict[str, tuple[int, int]] = {
    # Ren et al. 2021, §4: fp16 gradients down, the updated fp16 parameters up
    "paper": (2, 2),
    # DeepSpeed 0.19, stage_1_and_2.py `async_inplace_copy_grad_to_fp32_buffer_from_gpu`: the 16-bit
    # gradient is cast to fp32 on the GPU (`.float()`) and that copied to the fp32 partition on the
    # host; the updated 16-bit parameters come back up
    "deepspeed": (4, 2),
}
BACKWARD_SHARE = 2 / 3  # of a step's GPU time: the backward's two matmuls a matmul, the forward's one


def _gradient_in_flight(spec: ModelSpec, phase: str) -> int:
    """Elements of the largest gradient ZeRO-Offload holds on the GPU in a phase of the step (DeepSpeed
    0.19, stage_1_and_2.py): a gradient lives from its backward until the hook copies it into the
    reduce bucket, casts it with .float() on the GPU (copies="deepspeed"), copies that down and
    clears it (clear_grad_attribute), one parameter at a time, so the GPU never holds the model's
    gradients. None exist before the backward (the logits' gradient is the largest early peak); the
    untied head's is made in the head's backward, a block's tensors in the blocks' backward, the
    embedding's (a tied head's with it) at the end: the largest such tensor in each phase. Measured
    on an H100 (gpt2-medium, pythia-1b, llama-3.2-1b; benchmarks/results/offload/gpu/): the cast
    never lands on the logits gradient's peak, which the allocator's peak equals."""
    if phase.startswith(("forward", "backward start", "optimizer")):
        return 0
    outside = [(name.split(".")[0] in ("lm_head", "embed_out"), n) for name, n in spec.param_tensors()
               if block_index(name) is None]  # (an untied head's?, elements)
    if phase.startswith("LM head backward"):
        return max((n for head, n in outside if head), default=0)
    blocks = block_tensor_sizes(spec)
    if phase.startswith("embedding backward") or not blocks:
        return max((n for head, n in outside if not head), default=0)
    return max(blocks)


@dataclasses.dataclass(frozen=True)
class ModelOffload:
    scheme: str
    gpu_peak: _mem.MemoryBreakdown
    host_bytes: int  # the model states in host memory (fp32 parameters, Adam's moments, gradients)
    moved_bytes: int  # per step, both ways together
    transfer_seconds: float  # the copies, both ways, end to end
    cpu_seconds: float  # the Adam step on the CPU
    step_seconds: float | None  # see model_offload, when gpu_seconds is given
    exposed_seconds: float = 0.0  # of transfer_seconds, what nothing hides


def model_offload(model: ModelSpec | str, *, scheme: str, batch_size: int, seq_len: int,
                  gpu: GPUSpec | str = "h100-80gb", gpu_seconds: float | None = None,
                  cpu_adam_seconds_per_param: float | None = None,
                  efficiency: float = SAVE_ON_CPU_EFFICIENCY, reduce_bucket: int | None = None,
                  copies: str | None = None, delayed_update: bool = False) -> ModelOffload:
    """One GPU training a 16-bit model (bf16 compute) with AdamW whose states live in host memory.

    - "zero-offload" (DeepSpeed stage 2, `offload_optimizer: cpu`): the GPU keeps the bf16
      parameters and the reduce bucket (`reduce_bucket` elements in bf16, zero.REDUCE_BUCKET by
      default) beside the step's activations; host memory holds fp32 parameters, both moments and
      fp32 gradients (16 bytes a parameter). Copies (`copies`, ZERO_OFFLOAD_COPIES): "deepspeed"
      (the default: DeepSpeed 0.19 casts each gradient to fp32 on the GPU and copies that down, the
      16-bit parameters come up: 6 bytes a parameter; in the backward the GPU holds the gradient in
      flight and its fp32 cast beside the bucket, never the model's gradients: _gradient_in_flight)
      or "paper" (Ren et al. 2021: fp16 both ways, 4).
      Time: the gradients go down while the backward runs (hidden up to BACKWARD_SHARE of the GPU
      step), DeepSpeed steps on the host (DS_CPU_ADAM_SECONDS_PER_PARAM unless given), the parameters
      come up; `delayed_update=True` (the paper's one-step delayed parameter update, §4.3: the step uses
      parameters one update old; DeepSpeed 0.19 has no such option) overlaps the CPU step and the upload
      with the next step's GPU work: the step is the longer of the two. Measured on an H100 with
      DeepSpeed 0.19 (benchmarks/offload_gpu_validation.py): the bytes each way, the GPU peak and the
      host step's time; the overlap of the copies with the backward and the delayed update are not.
    - "fsdp2-cpu" (`fully_shard(..., offload_policy=CPUOffloadPolicy())` with
      `MixedPrecisionPolicy(param_dtype=bf16)`, one rank, each block its own unit): the GPU keeps no
      model state between steps; in the step, the root unit (embeddings, final norm, head) stays
      gathered in bf16 after the forward, the next block's fp32 shard is copied in and cast, and its
      gradient reaches the host before the next; the root's gradient waits on the GPU to the end.
      Copies: every fp32 shard up in the forward, the blocks' again in the backward, the fp32
      gradients down (12 bytes a parameter, less the root's second copy).
      Time: `gpu_seconds` + every copy, not overlapped + torch's AdamW on the CPU
      (CPU_ADAM_SECONDS_PER_PARAM unless given). Checked against the H100's FSDP2 probe
      (tests/test_offload.py).
    Activations, temporaries and gradients in flight are `memory.training_phases` of a pure bf16
    model; `gpu_seconds` is the step on the GPU with no offload; copies run at `efficiency` of the
    link's nominal rate."""
    scheme = _choice("scheme", scheme, OFFLOAD_SCHEMES)
    if gpu_seconds is not None:
        gpu_seconds = _checks.number("gpu_seconds", gpu_seconds)
    delayed_update = _checks.flag("delayed_update", delayed_update)
    if scheme == "zero-offload":
        copies = "deepspeed" if copies is None else _choice("copies", copies, tuple(ZERO_OFFLOAD_COPIES))
    elif copies is not None or delayed_update:
        raise ValueError("copies and delayed_update describe ZeRO-Offload (scheme='zero-offload')")
    if cpu_adam_seconds_per_param is None:
        cpu_adam_seconds_per_param = DS_CPU_ADAM_SECONDS_PER_PARAM if scheme == "zero-offload" else CPU_ADAM_SECONDS_PER_PARAM
    cpu_adam_seconds_per_param = _checks.number("cpu_adam_seconds_per_param", cpu_adam_seconds_per_param)
    efficiency = _checks.fraction("efficiency", efficiency)
    bucket = _checks.whole("reduce_bucket", REDUCE_BUCKET if reduce_bucket is None else reduce_bucket, lo=0, hi=10**12)
    spec = _specs.resolve(model)
    g = _gpu(gpu)
    psi = spec.params
    phases = _mem.training_phases(spec, batch_size=batch_size, seq_len=seq_len, precision="bf16",
                                  optimizer_impl="fused", device="cuda", gpu=g)
    step = [p for p in phases if not p.phase.startswith("optimizer")]
    if scheme == "zero-offload":
        bucket_bytes = min(bucket, psi) * 2

        def held(p) -> tuple[int, int]:  # (the bf16 gradient in flight, its fp32 cast)
            n = _gradient_in_flight(spec, p.phase)
            return 2 * n, (4 * n if copies == "deepspeed" else 0)

        peak = max(step, key=lambda p: p.activations + p.temporaries + sum(held(p)))
        grad, cast = held(peak)
        gpu_peak = dataclasses.replace(peak, optimizer_states=0, gradients=grad,
                                       temporaries=peak.temporaries + bucket_bytes + cast,
                                       label=f"{spec.name}: ZeRO-Offload, {batch_size} x {seq_len}")
        down, up = (k * psi for k in ZERO_OFFLOAD_COPIES[copies])
        moved, host = down + up, 16 * psi
    else:
        block, root = zero_units(spec)
        peak = max((p for p in step if not p.phase.startswith("embedding")),
                   key=lambda p: p.activations + p.temporaries + p.gradients)
        # the root gathered (bf16) and the next block arriving: its fp32 shard and its bf16 copy
        gpu_peak = dataclasses.replace(peak, parameters=2 * root + 6 * block, optimizer_states=0,
                                       label=f"{spec.name}: FSDP2 CPUOffloadPolicy, {batch_size} x {seq_len}")
        moved, host = 4 * psi + 4 * (psi - root) + 4 * psi, 16 * psi
    moving = transfer_seconds(moved, g, efficiency=efficiency)
    cpu = psi * cpu_adam_seconds_per_param
    step = None
    if scheme == "fsdp2-cpu":
        exposed = moving
        step = None if gpu_seconds is None else gpu_seconds + moving + cpu
    else:
        t_down, t_up = transfer_seconds(down, g, efficiency=efficiency), transfer_seconds(up, g, efficiency=efficiency)
        late = t_down if gpu_seconds is None else max(0.0, t_down - BACKWARD_SHARE * gpu_seconds)
        exposed = late + (0.0 if delayed_update else t_up)
        if gpu_seconds is not None:
            step = max(gpu_seconds + late, cpu + t_up) if delayed_update else gpu_seconds + late + cpu + t_up
    return ModelOffload(scheme=scheme, gpu_peak=gpu_peak, host_bytes=host, moved_bytes=moved, transfer_seconds=moving,
                        cpu_seconds=cpu, step_seconds=step, exposed_seconds=exposed)


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


MAX_LAYER_SECONDS = 1e9  # a layer's compute: beyond 30 years is a typo (and keeps every sum finite)
LINK_RANGE_GBps = (1e-6, 1e6)  # a host link from 1 kB/s to 1 PB/s


def _floats(name: str, values, *, lo: float, hi: float, lo_open: bool = False) -> list[float]:
    """`checks.numbers(name, values, ...)` as floats. A list or tuple of plain ints and floats within
    the bounds (what every caller passes: thousands of layers) is taken in one pass; anything else
    goes through checks.numbers, which accepts numpy's scalars and names the offending element."""
    if isinstance(values, (list, tuple)) and values and all(type(v) is float or type(v) is int for v in values) \
            and all((lo < v if lo_open else lo <= v) and v <= hi for v in values):
        return [float(v) for v in values]  # NaN and infinities fail the comparisons
    return [float(v) for v in _checks.numbers(name, values, lo=lo, hi=hi, lo_open=lo_open)]


def _layers(layer_bytes, layer_seconds, link_GBps) -> tuple[list[float], list[float], float]:
    """The layers' bytes (> 0) and compute seconds (>= 0) as floats, as many of each (at most
    MAX_STREAM_LAYERS), and the link's GB/s; or a ValueError naming the argument."""
    sizes = _floats("layer_bytes", layer_bytes, lo=0, lo_open=True, hi=_checks.MAX_BYTES)
    if len(sizes) > MAX_STREAM_LAYERS:
        raise ValueError(f"layer_bytes must list at most {MAX_STREAM_LAYERS:,} layers, got {len(sizes):,}")
    secs = _floats("layer_seconds", layer_seconds, lo=0, hi=MAX_LAYER_SECONDS)
    if len(secs) != len(sizes):
        raise ValueError(f"layer_bytes has {len(sizes)} layers and layer_seconds {len(secs)}")
    lo, hi = LINK_RANGE_GBps
    return sizes, secs, _checks.number("link_GBps", link_GBps, lo=lo, hi=hi)


def _buffers(buffers) -> int:
    return _checks.whole("buffers", buffers, hi=1 << 20)


def spaced(n_layers: int, n_streamed: int) -> tuple[int, ...]:
    """`n_streamed` of `n_layers` layer indices spaced as far apart as possible (BMInf's choice: the
    copies have the most compute between them to hide behind)."""
    n_layers = _checks.whole("n_layers", n_layers, lo=0, hi=MAX_STREAM_LAYERS)
    n_streamed = _checks.whole("n_streamed", n_streamed, lo=0, hi=MAX_STREAM_LAYERS)
    if not n_streamed <= n_layers:
        raise ValueError(f"cannot stream {n_streamed} of {n_layers} layers")
    if n_streamed == 0:
        return ()
    step = n_layers / n_streamed
    return tuple(sorted({int(i * step) for i in range(n_streamed)}))


def _stream(sizes: list[float], secs: list[float], stream: tuple[int, ...], link_GBps: float, buffers: int,
            passes: int = 3) -> Streaming:
    """stream_layers' schedule, its arguments checked (`stream` sorted, without repeats)."""
    n = len(sizes)
    copy_s = {i: sizes[i] / (link_GBps * 1e9) for i in stream}
    made = min(buffers, len(stream))  # the buffers that exist (and that _gpu_bytes counts)
    t = copy_end = 0.0
    computed: list[float] = []  # compute end of each streamed layer, in copy order over all passes
    pass_start, events = 0.0, []
    for _ in range(passes):
        pass_start, events = t, []
        for i in range(n):
            ready = t
            if i in copy_s:
                m = len(computed)  # the m-th copy overall, into buffer m % made
                start = max(copy_end, computed[m - made] if m >= made else 0.0)
                copy_end = start + copy_s[i]
                events.append(("copy", i, start, copy_end))
                ready = max(t, copy_end)
            t = ready + secs[i]
            events.append(("compute", i, ready, t))
            if i in copy_s:
                computed.append(t)
    return Streaming(seconds=t - pass_start, compute_seconds=sum(secs),
                     gpu_bytes=_gpu_bytes(sizes, stream, buffers), host_bytes=int(sum(sizes[i] for i in stream)),
                     streamed=stream,
                     events=tuple(sorted(((kind, i, s - pass_start, e - pass_start) for kind, i, s, e in events),
                                         key=lambda e: (e[2], e[0]))))


def stream_layers(layer_bytes, layer_seconds, *, streamed, link_GBps: float, buffers: int = 2,
                  passes: int = 3) -> Streaming:
    """Run `passes` passes over the layers (each a forward over every layer, as one generated token is):
    layer i computes after layer i-1 and, when i is in `streamed`, after its copy has arrived. The
    streamed layers are copied in order, one at a time on the copy stream, each into one of `buffers`
    GPU buffers (each as large as the largest streamed layer; no more buffers than streamed layers
    are made, as the memory counts them); a buffer is free again once the layer in it has computed.
    The first copy of a pass may start during the previous pass: that is the prefetch. Returns the
    last pass (steady state). At most MAX_STREAM_LAYERS layers and MAX_PASSES passes."""
    sizes, secs, link_GBps = _layers(layer_bytes, layer_seconds, link_GBps)
    n = len(sizes)
    stream = tuple(sorted(set(_checks.wholes("streamed", streamed, lo=0, empty=True))))
    if stream and stream[-1] >= n:
        raise ValueError(f"streamed layers must be indices from 0 to {n - 1}, got {stream[-1]}")
    buffers, passes = _buffers(buffers), _checks.whole("passes", passes, hi=MAX_PASSES)
    return _stream(sizes, secs, stream, link_GBps, buffers, passes)


def _gpu_bytes(sizes, stream, buffers: int) -> int:
    """Resident layers + min(buffers, streamed) buffers, each as large as the largest streamed layer."""
    streamed = [sizes[i] for i in stream]
    return int(sum(sizes) - sum(streamed) + min(buffers, len(streamed)) * max(streamed, default=0))


EXHAUSTIVE_UP_TO = 12  # layers: above this, smallest_resident tries BMInf's spaced choice only


class _Search:
    """The choices of streamed layers `smallest_resident` and `least_memory` try, and which hide.

    A pass copies every streamed layer once on one copy engine, so copies that hide take no longer
    than the pass's compute: no more layers can stream than the smallest ones whose copies fit in it
    (`most`), and a set whose copies exceed it is skipped unsimulated. Every set up to
    EXHAUSTIVE_UP_TO layers, BMInf's spaced choice above.

    `hides(c)` is `stream_layers(..., streamed=c).hidden`, the same simulation without its events,
    after a bound that rejects, without simulating them, sets that cannot hide. The bound is the
    last pass (the third) with fewer constraints: the copies whose buffers the previous pass frees
    (the first b = min(buffers, m)) are taken as already there; streamed layer k >= b is copied into
    the buffer that streamed layer k - b frees when it has computed, the copies running one at a
    time in order. Fewer constraints never make anything later (every time is a max of sums), so
    that pass's delay is at most the simulated one, and when it exceeds what `hidden` allows (1e-9
    of the compute) the set cannot hide. It is checked with a margin (1e-8 of the compute and copy
    time: over a hundred times the rounding of 3 x 20,000 additions) and only rejects; every set it
    lets through is simulated, so the answer is the exhaustive search's. For BMInf's spaced sets two
    terms of it are O(1): copy b alone (its buffer freed by layer s_0 = 0, its layer s_b = int(b x n / m))
    and, for equal layers, copies b to m - 1 back to back from the same moment. So a few thousand
    layers take milliseconds where simulating every count from `most` down took tens of seconds."""

    def __init__(self, sizes: list[float], secs: list[float], link_GBps: float, buffers: int):
        self.sizes, self.secs, self.link, self.buffers = sizes, secs, link_GBps, buffers
        self.n = n = len(sizes)
        self.compute = sum(secs)
        self.budget = self.compute * (1 + 1e-9) * link_GBps * 1e9  # bytes the copy engine moves in one pass
        most, total = 0, 0.0
        for b in sorted(sizes):
            if total + b > self.budget:
                break
            total, most = total + b, most + 1
        self.most = most
        self.copy = [b / (link_GBps * 1e9) for b in sizes]
        self.start = [0.0] * (n + 1)  # start[i]: the compute before layer i
        for i, s in enumerate(secs):
            self.start[i + 1] = self.start[i] + s
        self.tol = 1e-9 * self.compute + 1e-8 * (self.compute + sum(self.copy))
        self.equal = len(set(sizes)) <= 1
        self.uniform = self.equal and len(set(secs)) <= 1 and secs[0] > 0  # every layer the same

    def _within_budget(self, c) -> bool:
        return sum(self.sizes[i] for i in c) <= self.budget

    def choices(self, m: int) -> list[tuple[int, ...]]:
        """The sets of m streamed layers worth simulating, as the exhaustive search listed them."""
        if self.n <= EXHAUSTIVE_UP_TO:
            return [c for c in itertools.combinations(range(self.n), m) if self._within_budget(c)]
        c = spaced(self.n, m)
        return [c] if self._within_budget(c) else []

    def may_hide_spaced(self, m: int) -> bool:
        """Terms of the bound for spaced(n, m), without building the set (see the class): copy b
        alone, and, for equal layers, copies b to b + L - 1 back to back from when layer 0 has
        computed, which must end before layer int((b + L - 1) x n / m) starts. With every layer
        alike (copy d, compute c, g = n / m layers a streamed one) that can fail only while
        L (g - d / c) < 2 - (b - 1) g, as int(x) > x - 1: those few L and L = m - b are checked."""
        made = min(self.buffers, m)
        if m <= made:
            return True
        step, start, tol = self.n / m, self.start, self.tol  # spaced's indices: int(k * step)
        if start[1] + self.copy[int(made * step)] - start[int(made * step)] > tol:
            return False
        if not self.equal:
            return True
        d = self.copy[0]
        chains = [m - made]
        if self.uniform:
            room, gain = 2 - (made - 1) * step, step - d / self.secs[0]
            if room > 0:
                chains += range(1, min(m - made, int(room / gain) + 2 if gain > 0 else m - made))
        return all(start[1] + length * d - start[int((made + length - 1) * step)] <= tol for length in chains)

    def may_hide(self, c) -> bool:
        """False when the bound (see the class) shows the set cannot hide: the last pass with the
        first min(buffers, m) copies already there; `late` is what its compute has waited so far."""
        made, start, copy, secs, tol = min(self.buffers, len(c)), self.start, self.copy, self.secs, self.tol
        late, end, done = 0.0, -math.inf, []
        for k, i in enumerate(c):
            if k >= made:
                free = done[k - made]
                end = (end if end > free else free) + copy[i]
                wait = end - (start[i] + late)
                if wait > 0:
                    late += wait
                    if late > tol:
                        return False
            done.append(start[i] + late + secs[i])
        return True

    def hides(self, c) -> Streaming | None:
        """`stream_layers(..., streamed=c)` when it hides, else None."""
        if not self.may_hide(c):
            return None
        run = _stream(self.sizes, self.secs, c, self.link, self.buffers)
        return run if run.hidden else None


def smallest_resident(layer_bytes, layer_seconds, *, link_GBps: float, buffers: int = 2) -> Streaming:
    """The fewest resident layers whose copies hide behind compute (the pass takes no longer than
    with every layer resident), and which layers to stream; among equally many, the one with the least
    GPU memory. Up to EXHAUSTIVE_UP_TO layers every choice of streamed layers is tried (exact); above,
    only BMInf's choice of layers spaced as far apart as possible (`spaced`), which is exact for equal
    layers but can keep more resident than needed when they differ. Every layer resident always
    hides (nothing is copied). Fewest resident is not least GPU memory when the layers differ: the
    buffers are as large as the largest streamed layer (`least_memory` answers that). The choices are
    tried from the most streamed down, each only when a bound says it may hide (`_Search`): milliseconds
    for thousands of layers; at most MAX_STREAM_LAYERS."""
    sizes, secs, link_GBps = _layers(layer_bytes, layer_seconds, link_GBps)
    search = _Search(sizes, secs, link_GBps, _buffers(buffers))
    for m in range(search.most, -1, -1):
        if search.n > EXHAUSTIVE_UP_TO and not search.may_hide_spaced(m):
            continue
        for c in sorted(search.choices(m), key=lambda c: (_gpu_bytes(sizes, c, search.buffers), c)):
            if run := search.hides(c):
                return run
    raise AssertionError("unreachable: nothing streamed always hides")


def least_memory(layer_bytes, layer_seconds, *, link_GBps: float, buffers: int = 2) -> Streaming:
    """The choice of streamed layers that needs the least GPU memory while its copies hide behind
    compute: what decides whether the model fits. Streaming more is not always less: with layers of
    10, 1, 1 and 1 GB, streaming all four needs two 10 GB buffers (20 GB, more than the 13 GB of all
    resident); streaming the three small ones needs 12 GB. The same choices as `smallest_resident`
    (every one up to EXHAUSTIVE_UP_TO layers, BMInf's spaced ones above), simulated from the least
    memory up until one hides; among equal memory, the fewest resident."""
    sizes, secs, link_GBps = _layers(layer_bytes, layer_seconds, link_GBps)
    buffers = _buffers(buffers)
    search = _Search(sizes, secs, link_GBps, buffers)
    if search.n <= EXHAUSTIVE_UP_TO:
        ranked = sorted((c for m in range(search.most + 1) for c in search.choices(m)),
                        key=lambda c: (_gpu_bytes(sizes, c, buffers), -len(c), c))
        found = next((run for c in ranked if (run := search.hides(c))), None)
    else:  # one spaced set a count: rank the counts by the set's memory without keeping every set
        ranked, n = [], search.n
        if search.equal:  # sum() of m equal sizes, as _gpu_bytes and the budget add them
            x, total, sums = sizes[0], 0, []
            for _ in range(search.most + 1):
                sums.append(total)
                total = total + x
            whole = sum(sizes)
            for m in range(search.most + 1):
                if sums[m] <= search.budget:
                    ranked.append((int(whole - sums[m] + min(buffers, m) * (x if m else 0)), -m))
        else:
            for m in range(search.most + 1):
                c = spaced(n, m)
                if search._within_budget(c):
                    ranked.append((_gpu_bytes(sizes, c, buffers), -m))
        ranked.sort()
        found = None
        for _, m in ranked:
            if search.may_hide_spaced(-m) and (found := search.hides(spaced(n, -m))):
                break
    if found is None:
        raise AssertionError("unreachable: nothing streamed always hides")
    return found


# ----------------------------------------------------------------------------- a model streamed (BMInf)
# Large copies from pinned memory: the share of PCIe's nominal rate assumed for whole layers (an
# assumption: lab 6's bandwidth probe measures it on a GPU; save_on_cpu's many small copies get less)
STREAM_EFFICIENCY = 0.8
STREAM_MFU = 0.4  # the share of the GPU's peak FLOP/s a layer's matmuls reach when compute-bound


@dataclasses.dataclass(frozen=True)
class ModelStreaming:
    model: str
    gpu: str
    layer_bytes: int  # one block's weights
    layer_seconds: float  # one block's compute for `tokens` tokens (roofline: FLOPs or reading the weights)
    other_bytes: int  # kept on the GPU whatever the schedule: embeddings, head, norms
    usable_bytes: int  # the GPU's memory less the CUDA context
    link_GBps: float  # the effective host link
    most_resident: int  # the most blocks that fit beside the buffers (-1: not even the rest fits)
    fitted: Streaming | None  # the schedule with `most_resident` blocks resident
    hiding: Streaming  # the fewest resident blocks whose copies hide (memory permitting or not)


def stream_model(model: ModelSpec | str, gpu: GPUSpec | str, *, tokens: int = 1, weight_bytes: int = 2,
                 buffers: int = 2, efficiency: float = STREAM_EFFICIENCY, mfu: float = STREAM_MFU) -> ModelStreaming:
    """A model's forward (one pass over its blocks, for `tokens` tokens at once: 1 per generated
    token, or a prompt's length) on `gpu` with blocks streamed from host memory as BMInf does.
    Every block holds `weight_bytes` per parameter (2: fp16/bf16; 1: int8, BMInf's choice); a block's
    compute is the larger of its matmuls' FLOPs (2 x params x tokens at `mfu` of the GPU's peak: its
    INT8 rate for int8 weights, which BMInf multiplies in INT8 (Pascal's DP4A, 4x its fp32 rate; tensor
    cores from Turing on), else the faster of its fp32 and 16-bit peaks) and reading its weights from
    GPU memory. The embeddings and head stay
    resident. `most_resident`: the most blocks that fit in the GPU's usable memory beside them and
    `buffers` streaming buffers (activations for a few tokens are small and not counted)."""
    spec = _specs.resolve(model)
    g = _gpu(gpu)
    tokens = _checks.whole("tokens", tokens, hi=_mem.MAX_BATCH)
    weight_bytes = _whole_choice("weight_bytes", weight_bytes, WEIGHT_BYTES)
    buffers = _buffers(buffers)
    efficiency, mfu = _checks.fraction("efficiency", efficiency), _checks.fraction("mfu", mfu)
    n = spec.num_layers + spec.num_decoder_layers
    block_params, rest = zero_units(spec)
    layer_bytes = block_params * weight_bytes
    other = rest * weight_bytes
    int8 = weight_bytes == 1 and g.peak_tops_int8 > 0
    peak = (g.peak_tops_int8 if int8 else max(g.peak_tflops_fp32, g.peak_tflops_16)) * 1e12 * mfu
    layer_s = max(2 * block_params * tokens / peak, layer_bytes / (g.bandwidth_GBps * 1e9))
    link = host_link_GBps(g) * efficiency
    usable = g.usable_bytes - g.context_bytes
    sizes, secs = [layer_bytes] * n, [layer_s] * n
    most, fitted = -1, None
    for k in range(n, -1, -1):
        need = other + k * layer_bytes + min(buffers, n - k) * layer_bytes
        if need <= usable:
            most = k
            fitted = stream_layers(sizes, secs, streamed=spaced(n, n - k), link_GBps=link, buffers=buffers)
            break
    hiding = smallest_resident(sizes, secs, link_GBps=link, buffers=buffers)
    return ModelStreaming(model=spec.name, gpu=g.name, layer_bytes=layer_bytes, layer_seconds=layer_s, other_bytes=other,
                          usable_bytes=usable, link_GBps=link, most_resident=most, fitted=fitted, hiding=hiding)


def ten_b_model() -> ModelSpec:
    """A 10-billion-parameter GPT (48 blocks of width 4096, GPT-2's layout): the size of the
    10 B model BMInf ran on a GTX 1060 (the course's source material), for chapter 6's worked example."""
    from .specs import from_config

    return from_config({"model_type": "gpt2", "n_layer": 48, "n_embd": 4096, "n_head": 32, "vocab_size": 50257,
                        "n_positions": 2048}, name="gpt-10b")


# ----------------------------------------------------------------------------- a pinned DataLoader
@dataclasses.dataclass(frozen=True)
class LoaderMemory:
    batch_bytes: int  # one batch's tensors
    batches_in_flight: int  # made (or being made) ahead of the loop: num_workers x prefetch_factor
    pinned_batches: int  # in pinned memory at once: those in flight and the one the loop holds (0: no pinning)
    pinned_bytes: int  # what the pinned caching host allocator holds for them: each tensor in its power-of-two block
    copy_seconds: float  # one batch host -> GPU over the link (pinned, or pageable when pin_memory is False)
    pageable_copy_seconds: float  # the same batch from pageable memory, for comparison
    step_share: float | None  # copy_seconds / step_seconds, when a step time is given


def loader_memory(batch_tensor_bytes, *, num_workers: int, prefetch_factor: int | None = None,
                  pin_memory: bool = True, gpu: GPUSpec | str = "h100-80gb",
                  step_seconds: float | None = None) -> LoaderMemory:
    """Host memory and copy time of `torch.utils.data.DataLoader(..., num_workers, prefetch_factor,
    pin_memory)` feeding `batch.to("cuda", non_blocking=True)`; `batch_tensor_bytes`: the bytes of each
    tensor in one batch (token ids, labels, mask...).

    How torch (2.x, torch/utils/data/dataloader.py) does it: with workers, the iterator keeps at most
    `prefetch_factor x num_workers` batches outstanding (`_tasks_outstanding`; prefetch_factor defaults
    to 2) and sends one more index each time it hands a batch to the loop. Workers collate into shared
    memory; with `pin_memory=True` a thread in the main process (`_utils/pin_memory.py`) copies every
    tensor of each finished batch into page-locked memory (`tensor.pin_memory()`), so that at most the
    outstanding batches and the one the loop is using are pinned at once. The pinned caching host
    allocator rounds each request up to a power of two (`pinned_block`) and keeps freed blocks for
    reuse: its footprint is that many batches, rounded. With num_workers=0 the loop's own thread
    loads and pins one batch when asked: nothing is in flight.
    The copy: a pinned batch goes at the link's pinned rate and `non_blocking=True` lets the host go
    on; a pageable one is staged by the driver through a pinned bounce buffer (PAGEABLE_FRACTION of
    the rate, and the host waits). Both run on the current stream: the forward waits for the copy
    unless a side stream prefetches the next batch.

    Known limitations: batches still being collated in workers (shared memory, up to num_workers
    of them) and the loop's references to earlier batches are not counted; the rounding is the
    caching allocator's, not the driver's page granularity."""
    sizes = _checks.wholes("batch_tensor_bytes", batch_tensor_bytes, lo=0, hi=_checks.MAX_BYTES)
    num_workers = _checks.whole("num_workers", num_workers, lo=0, hi=1024)
    if num_workers == 0:
        if prefetch_factor is not None:
            raise ValueError("prefetch_factor needs num_workers > 0 (torch refuses it too)")
        in_flight = 0
    else:
        prefetch_factor = _checks.whole("prefetch_factor", 2 if prefetch_factor is None else prefetch_factor, lo=1, hi=1024)
        in_flight = num_workers * prefetch_factor
    pin_memory = _checks.flag("pin_memory", pin_memory)
    if step_seconds is not None:
        step_seconds = _checks.number("step_seconds", step_seconds, lo=0, lo_open=True)
    g = _gpu(gpu)
    batch = sum(sizes)
    pinned = in_flight + 1 if pin_memory else 0
    copy = transfer_seconds(batch, g, pinned=pin_memory, efficiency=STREAM_EFFICIENCY)
    pageable = transfer_seconds(batch, g, pinned=False, efficiency=STREAM_EFFICIENCY)
    return LoaderMemory(batch_bytes=batch, batches_in_flight=in_flight, pinned_batches=pinned,
                        pinned_bytes=pinned * sum(pinned_block(n) for n in sizes), copy_seconds=copy,
                        pageable_copy_seconds=pageable,
                        step_share=None if step_seconds is None else copy / step_seconds)


# ----------------------------------------------------------------------------- ZeRO-Infinity's NVMe tier
TIERS = ("gpu", "cpu", "nvme")
# Placements (where the 16-bit parameters live, where the optimizer states and fp32 gradients live),
# fastest first: what `needed_placement` tries in turn. Offloading the parameters or using NVMe needs
# ZeRO stage 3 in DeepSpeed (offload_config.py: "offload_param ... Valid only with stage 3").
PLACEMENTS: tuple[tuple[str, str], ...] = (("gpu", "gpu"), ("gpu", "cpu"), ("cpu", "cpu"), ("gpu", "nvme"),
                                           ("cpu", "nvme"), ("nvme", "nvme"))
# One NVMe drive's sequential rate, decimal GB/s: an assumption (a PCIe 4.0 x4 data-centre SSD reads
# ~6-7 and writes ~3-4 GB/s; ZeRO-Infinity's DGX-2 striped 16 drives for ~25 GB/s per node).
NVME_GBps = 3.5
# DeepSpeed 0.19's defaults (runtime/zero/offload_config.py, runtime/zero/config.py)
DS_PARAM_BUFFER_COUNT = 5
DS_PARAM_BUFFER_SIZE = 10**8  # elements of each parameter swap buffer (16-bit)
DS_MAX_IN_CPU = 10**9  # 16-bit parameter elements kept in host memory when parameters go to NVMe
DS_OPTIMIZER_BUFFER_COUNT = 4  # fp32 swap buffers, each one sub-group: parameter, gradient, two moments
DS_SUB_GROUP_SIZE = 10**9  # elements of one optimizer sub-group (stage 3's sub_group_size)
INFINITY_MFU = 0.4  # share of the GPU's 16-bit peak a large model's matmuls reach (an assumption)


@dataclasses.dataclass(frozen=True)
class Infinity:
    """One GPU training with ZeRO-Infinity's placement; bytes, and seconds per training step."""

    model: str
    params: str  # where the 16-bit parameters live between uses: gpu, cpu or nvme
    optimizer: str  # where fp32 master weights, Adam's moments and the fp32 gradients live
    gpu_bytes: int  # the GPU's peak: resident states + gathered parameters + activations and temporaries
    host_bytes: int  # host memory: offloaded states + DeepSpeed's pinned swap buffers
    nvme_bytes: int
    pcie_bytes: int  # GPU <-> host per step, both ways
    nvme_read_bytes: int
    nvme_write_bytes: int
    compute_seconds: float
    pcie_seconds: float
    nvme_seconds: float
    cpu_seconds: float  # the Adam step on the CPU (0 when the optimizer is on the GPU)
    step_seconds: float  # ZeRO-Infinity's overlap at best: see `infinity`
    swap_buffer_elements: int  # each parameter swap buffer (at least the largest parameter tensor)
    sub_group_size: int  # elements of one optimizer sub-group (its swap buffers' size)

    @property
    def label(self) -> str:
        return f"params {self.params}, optimizer {self.optimizer}"


@functools.lru_cache(maxsize=64)
def _spec_sizes(spec: ModelSpec) -> tuple[int, int, int]:
    """(the largest block's parameters, the rest's, the largest tensor's elements), cached."""
    block, root = zero_units(spec)
    return block, root, max((n for _, n in spec.param_tensors()), default=0)


@functools.lru_cache(maxsize=64)
def _working_bytes(spec: ModelSpec, g: GPUSpec, batch_size: int, seq_len: int, recompute: bool) -> int:
    """The step's largest activations + temporaries on the GPU (pure bf16, every block recomputed
    when `recompute`), outside the optimizer step: the same for every placement (cached)."""
    plan = _act.recompute_plan("full" if recompute else "none", spec)
    phases = _mem.training_phases(spec, batch_size=batch_size, seq_len=seq_len, precision="bf16",
                                  optimizer_impl="fused", recompute=plan, device="cuda", gpu=g)
    return max(p.activations + p.temporaries for p in phases if not p.phase.startswith("optimizer"))


def infinity(model: ModelSpec | str, *, params: str, optimizer: str, batch_size: int, seq_len: int,
             gpu: GPUSpec | str = "h100-80gb", recompute: bool = True, nvme_GBps: float = NVME_GBps,
             efficiency: float = STREAM_EFFICIENCY, mfu: float = INFINITY_MFU,
             cpu_adam_seconds_per_param: float = DS_CPU_ADAM_SECONDS_PER_PARAM,
             sub_group_size: int = DS_SUB_GROUP_SIZE) -> Infinity:
    """Memory on each tier and traffic on each link of one training step with DeepSpeed's ZeRO-3 on
    one GPU, with `offload_param` (`params`) and `offload_optimizer` (`optimizer`) on "gpu" (not
    offloaded), "cpu" or "nvme" (ZeRO-Infinity, Rajbhandari et al. 2021), bf16 compute, AdamW.

    Ψ parameters; per parameter (the paper's §3): 2 bytes of 16-bit weights, 12 of fp32 master
    weights and moments, gradients (2 bytes on the GPU; 4 in fp32 when the optimizer is offloaded,
    as DeepSpeed copies them, stage3.py `_offload_grad_partition_at_boundary`).
    - GPU: the states left on it, the gathered 16-bit parameters of the live blocks when parameters
      are offloaded (the block in use and the one prefetched, and the root: embeddings, head), the
      step's activations and temporaries (`memory.training_phases`, pure bf16, every block
      recomputed when `recompute`, as the paper trains).
    - host: the offloaded states; with parameters on NVMe, up to DS_MAX_IN_CPU of them stay in host
      memory plus DS_PARAM_BUFFER_COUNT pinned swap buffers of max(DS_PARAM_BUFFER_SIZE, largest
      tensor) 16-bit elements; with the optimizer on NVMe, DS_OPTIMIZER_BUFFER_COUNT pinned fp32
      buffers of one sub-group (min(sub_group_size, Ψ) elements; partitioned_optimizer_swapper.py).
    - traffic: parameters up twice (forward, backward) when not on the GPU; gradients down when the
      optimizer is not on the GPU (4 bytes) and 16-bit parameters back up after the step when they
      live on the GPU (2); from NVMe, parameters read twice and written once after the step
      (2+2 / 2 bytes), optimizer states and gradients read for the step and written back (16 / 16).
    - time: the forward and backward (and recompute) at `mfu` of the GPU's 16-bit peak, PCIe at
      `efficiency` of the link's pinned rate, NVMe at `nvme_GBps` both ways, DeepSpeed's CPU Adam.
      step = max(compute, parameter traffic over PCIe, over NVMe) + max(the optimizer's NVMe
      traffic, the CPU step, the updated parameters' upload): the paper's overlap-centric design
      at its best (a lower bound; DeepSpeed overlaps less unless `pipeline_read/write`).

    Known limitations: one GPU (no data parallelism dividing the states); DeepSpeed's
    `stage3_max_live_parameters`/`max_reuse_distance` can keep more parameters gathered; activation
    checkpoints offloaded to the CPU (the paper's option) are not modelled; FLOPs are 2Ψ a token a
    pass (attention's score FLOPs left out)."""
    params = _choice("params", params, TIERS)
    optimizer = _choice("optimizer", optimizer, TIERS)
    recompute = _checks.flag("recompute", recompute)
    nvme_GBps = _checks.number("nvme_GBps", nvme_GBps, lo=0, lo_open=True, hi=1e6)
    efficiency, mfu = _checks.fraction("efficiency", efficiency), _checks.fraction("mfu", mfu)
    cpu_adam_seconds_per_param = _checks.number("cpu_adam_seconds_per_param", cpu_adam_seconds_per_param)
    sub_group_size = _checks.whole("sub_group_size", sub_group_size, hi=10**13)
    if TIERS.index(params) > TIERS.index(optimizer):
        raise ValueError(f"params on {params} with the optimizer on {optimizer}: DeepSpeed offloads the optimizer "
                         "at least as far as the parameters (an offloaded parameter is updated where its optimizer is)")
    spec = _specs.resolve(model)
    g = _gpu(gpu)
    psi = spec.params
    work = _working_bytes(spec, g, batch_size, seq_len, recompute)
    block, root, largest = _spec_sizes(spec)
    gpu_states = 2 * psi if params == "gpu" else 2 * (2 * block + root)  # 16-bit weights resident or gathered
    gpu_states += 2 * psi + 12 * psi if optimizer == "gpu" else 0  # gradients + fp32 master weights and moments
    if optimizer != "gpu":  # a gradient partition in flight: the largest tensor's, bf16 and its fp32 cast
        gpu_states += 6 * largest
    host = nvme = 0
    buf = max(DS_PARAM_BUFFER_SIZE, largest)
    group = min(sub_group_size, psi)
    if params == "cpu":
        host += 2 * psi
    elif params == "nvme":
        kept = min(DS_MAX_IN_CPU, psi)
        host += 2 * kept + DS_PARAM_BUFFER_COUNT * buf * 2
        nvme += 2 * (psi - kept)
    if optimizer == "cpu":
        host += 16 * psi
    elif optimizer == "nvme":
        host += DS_OPTIMIZER_BUFFER_COUNT * group * 4
        nvme += 16 * psi
    on_nvme_params = 0 if params != "nvme" else psi - min(DS_MAX_IN_CPU, psi)
    pcie = (4 * psi if params != "gpu" else 0) + (4 * psi if optimizer != "gpu" else 0) \
        + (2 * psi if params == "gpu" and optimizer != "gpu" else 0)
    read = 4 * on_nvme_params + (16 * psi if optimizer == "nvme" else 0)
    write = 2 * on_nvme_params + (16 * psi if optimizer == "nvme" else 0)
    tokens = batch_size * seq_len
    passes = 4 if recompute else 3  # forward, backward (two matmuls each), the recompute's forward
    compute = 2 * psi * tokens * passes / (g.peak_tflops_16 * 1e12 * mfu)
    link = host_link_GBps(g) * efficiency * 1e9
    pcie_s, nvme_s = pcie / link, (read + write) / (nvme_GBps * 1e9)
    cpu = psi * cpu_adam_seconds_per_param if optimizer != "gpu" else 0.0
    param_pcie = (4 * psi if params != "gpu" else 0) + (4 * psi if optimizer != "gpu" else 0)
    param_nvme = 6 * on_nvme_params
    opt_nvme = 32 * psi if optimizer == "nvme" else 0
    upload = 2 * psi / link if params == "gpu" and optimizer != "gpu" else 0.0
    total = max(compute, param_pcie / link, param_nvme / (nvme_GBps * 1e9)) \
        + max(opt_nvme / (nvme_GBps * 1e9), cpu, upload)
    return Infinity(model=spec.name, params=params, optimizer=optimizer, gpu_bytes=gpu_states + work, host_bytes=host,
                    nvme_bytes=nvme, pcie_bytes=pcie, nvme_read_bytes=read, nvme_write_bytes=write,
                    compute_seconds=compute, pcie_seconds=pcie_s, nvme_seconds=nvme_s, cpu_seconds=cpu,
                    step_seconds=total, swap_buffer_elements=buf, sub_group_size=group)


def needed_placement(model: ModelSpec | str, *, host_ram_bytes: int, batch_size: int, seq_len: int,
                     gpu: GPUSpec | str = "h100-80gb", **kw) -> Infinity | None:
    """"When a model needs NVMe": the first of PLACEMENTS (fastest first) whose GPU peak fits the
    GPU's usable memory (less its CUDA context) and whose host bytes fit `host_ram_bytes`; None when
    even parameters and optimizer on NVMe do not fit. `kw` goes to `infinity`."""
    host_ram_bytes = _checks.whole("host_ram_bytes", host_ram_bytes, lo=0, hi=_checks.MAX_BYTES)
    g = _gpu(gpu)
    spec = _specs.resolve(model)
    for p, o in PLACEMENTS:
        r = infinity(spec, params=p, optimizer=o, batch_size=batch_size, seq_len=seq_len, gpu=g, **kw)
        if r.gpu_bytes <= g.usable_bytes - g.context_bytes and r.host_bytes <= host_ram_bytes:
            return r
    return None


def deepspeed_config(placement: Infinity, *, nvme_path: str = "/local_nvme", batch_size: int = 1) -> dict:
    """The DeepSpeed config (a dict, as `deepspeed.initialize(config=...)` takes it) for `placement`:
    ZeRO stage 3 (stage 2 when only the optimizer goes to the CPU, ZeRO-Offload), `offload_param`
    and `offload_optimizer` with the swap buffers `infinity` counted, bf16."""
    if not isinstance(placement, Infinity):
        raise ValueError(f"placement must be an offload.Infinity (from infinity or needed_placement), got {_checks.show(placement)}")
    if not isinstance(nvme_path, str) or not nvme_path.startswith("/"):
        raise ValueError(f"nvme_path must be an absolute path, got {_checks.show(nvme_path)}")
    batch_size = _checks.whole("batch_size", batch_size, hi=_mem.MAX_BATCH)
    p, o = placement.params, placement.optimizer
    stage = 2 if p == "gpu" and o in ("gpu", "cpu") else 3
    zero: dict = {"stage": stage}
    if o != "gpu":
        zero["offload_optimizer"] = {"device": o, "pin_memory": True}
        if o == "nvme":
            zero["offload_optimizer"].update(nvme_path=nvme_path, buffer_count=DS_OPTIMIZER_BUFFER_COUNT)
            zero["sub_group_size"] = placement.sub_group_size
    if p != "gpu":
        zero["offload_param"] = {"device": p, "pin_memory": True}
        if p == "nvme":
            zero["offload_param"].update(nvme_path=nvme_path, buffer_count=DS_PARAM_BUFFER_COUNT,
                                         buffer_size=placement.swap_buffer_elements, max_in_cpu=DS_MAX_IN_CPU)
    cfg = {"train_micro_batch_size_per_gpu": batch_size, "bf16": {"enabled": True}, "zero_optimization": zero}
    if "nvme" in (p, o):  # DeepSpeed's async I/O (runtime/swap_tensor/aio_config.py defaults)
        cfg["aio"] = {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                      "overlap_events": True}
    return cfg


# ----------------------------------------------------------------------------- out of core, streamed from disk
@dataclasses.dataclass(frozen=True)
class DiskStreaming:
    """A stack of layers kept on disk, read into `buffers` host buffers one layer at a time through a
    forward and a backward (what `vramlab.measure.offload.stream_from_disk` runs)."""

    resident_bytes: int  # the buffers: layer weights in memory at once
    activation_bytes: int  # each layer's saved input, kept for the backward
    gradient_bytes: int  # one layer's weight gradient before it is written out
    peak_bytes: int  # the three together
    read_bytes: int  # per step: every layer read in the forward and again in the backward
    write_bytes: int  # per step: every layer's gradient written
    read_seconds: float | None  # read_bytes at `disk_GBps`, when given


def disk_streaming(layer_bytes, *, activation_bytes: int, buffers: int = 2,
                   disk_GBps: float | None = None) -> DiskStreaming:
    """Host bytes and disk traffic of one forward+backward over layers stored on disk (ZeRO-Infinity's
    "whole model on NVMe, a few layers in CPU buffers" on a CPU): weights of at most `buffers`
    layers in memory (each buffer as large as the largest layer), the saved input of every layer
    (`activation_bytes`, one layer's), one layer's gradient in flight; every layer read twice and
    its gradient written once."""
    sizes = _checks.wholes("layer_bytes", layer_bytes, lo=0, hi=_checks.MAX_BYTES)
    activation_bytes = _checks.whole("activation_bytes", activation_bytes, lo=0, hi=_checks.MAX_BYTES)
    buffers = _buffers(buffers)
    if disk_GBps is not None:
        disk_GBps = _checks.number("disk_GBps", disk_GBps, lo=0, lo_open=True, hi=1e6)
    big = max(sizes)
    resident = min(buffers, len(sizes)) * big
    acts = activation_bytes * len(sizes)
    read, write = 2 * sum(sizes), sum(sizes)
    return DiskStreaming(resident_bytes=resident, activation_bytes=acts, gradient_bytes=big,
                         peak_bytes=resident + acts + big, read_bytes=read, write_bytes=write,
                         read_seconds=None if disk_GBps is None else read / (disk_GBps * 1e9))
