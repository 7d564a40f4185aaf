"""Lab 6's measurements: layer streaming (BMInf's schedule, run for real) and, on a GPU, the
host link, `save_on_cpu` and ZeRO-Offload, each set beside `vramlab.offload`'s prediction.

Streaming runs in the caller's process (the lab's notebook passes the function its students wrote):
the stack's weights live in host memory, `k` layers are moved to the device for good and the rest
are copied in before their turn through a few device buffers by a copy engine:
- on a GPU, `CudaLink`: pinned host tensors, a side CUDA stream, events;
- on a CPU, `CpuLink`: one thread makes the copies (real copies, one after another), paced to a
  link of `CPU_LINK_GBps` so that a copy takes longer than its layer's compute, as PCIe does for
  BMInf's GPU. A CPU has no second memory: what this shows is the schedule and its overlap, not
  what PCIe costs or what GPU memory it saves.
The memory each configuration puts on the device is counted from its tensors (on a GPU, the
allocator's peak is recorded beside it, and a leak check runs after each configuration).

The GPU probes run one per process (`python -m vramlab.measure.offload --probe NAME --out F`):
`bandwidth` (pinned and pageable host<->device copies), `baseline` and `save-on-cpu` (one GPT-2
training step, allocator peak, step time and host RSS), `zero-offload` (DeepSpeed stage 2 with
`offload_optimizer: cpu`, if DeepSpeed is installed), and `loader-pinned` (a pin_memory=True
DataLoader: the pinned caching host allocator's peak; run by benchmarks/gpu_campaign.py's `pinned` step).
Any machine (`--probe disk|out-of-core|loader`, files under `--folder`): the disk's O_DIRECT rates (the
stand-in for NVMe), a stack streamed from disk through a forward and backward (`stream_from_disk`),
and a real DataLoader's batches in flight (`loader_in_flight`), each beside `vramlab.offload`'s estimate.
"""

from __future__ import annotations

import dataclasses
import json
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch

from .. import checks
from .. import offload as off
from ..parallel import check_count

CPU_LINK_GBps = 2.0  # the CPU mode's stand-in for PCIe: slower than the layers' compute, as in BMInf
# the stack: layer i is an MLP x + relu(x W_up^T) W_down^T of width WIDTHS[i] (uneven on purpose)
WIDTHS = (1024, 2048, 4096, 1024, 3072, 2048, 1024, 4096)
SHAPES = {"cpu": dict(d=1024, rows=32, dtype=torch.float32), "cuda": dict(d=4096, rows=8192, dtype=torch.bfloat16)}
PROBES = ("bandwidth", "baseline", "save-on-cpu", "zero-offload")
GPU_ONLY_PROBES = ("loader-pinned",)  # run by benchmarks/gpu_campaign.py's "pinned" step, not by gpu_probes
CPU_PROBES = ("disk", "out-of-core", "loader")  # any machine: this CPU's disk and DataLoader
LOADER_CASE = dict(images=128, num_workers=2, prefetch_factor=2, batches=12)  # 3 x 224 x 224 fp32 images
SAVE_CASE = dict(model="gpt2", batch_size=8, seq_len=1024)


# ----------------------------------------------------------------------------- copy engines
def _same_size(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.numel() != src.numel():
        raise ValueError(f"copy: the buffer holds {dst.numel()} values, the layer {src.numel()}")


class CpuLink:
    """A copy engine for a CPU: one worker thread copies in the order asked, chunk by chunk, each
    chunk finished no sooner than a link of `GBps` would finish it. `copy` returns at once."""

    def __init__(self, GBps: float = CPU_LINK_GBps, chunk_bytes: int = 1 << 20):
        self.GBps, self.chunk = GBps, chunk_bytes
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="copy-engine")
        self.log: list[tuple[int, float, float]] = []  # (numel, start, end) of each copy, perf_counter
        self.device = "cpu"

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        t0 = time.perf_counter()
        step = max(self.chunk // src.element_size(), 1)
        for lo in range(0, src.numel(), step):
            hi = min(lo + step, src.numel())
            dst[lo:hi].copy_(src[lo:hi])
            due = t0 + hi * src.element_size() / (self.GBps * 1e9)
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
        self.log.append((src.numel(), t0, time.perf_counter()))

    def copy(self, dst: torch.Tensor, src: torch.Tensor):
        _same_size(dst, src)
        return self._pool.submit(self._copy, dst, src)

    def wait(self, ticket) -> None:
        ticket.result()

    def clock(self) -> float:
        """Seconds, as the compute sees them: a copy it has not waited for may still be running."""
        return time.perf_counter()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class CudaLink:
    """A copy engine for a GPU: copies on a side stream from pinned host memory; `wait` makes the
    compute stream wait for one copy's event. A copy starts only after all compute queued before it
    (the buffer it overwrites is free once the layer that used it has run)."""

    def __init__(self):
        self.stream = torch.cuda.Stream()
        self.log: list[tuple[int, Any, Any]] = []  # (numel, start event, end event)
        self.device = "cuda"

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device="cuda")

    def copy(self, dst: torch.Tensor, src: torch.Tensor):
        _same_size(dst, src)
        self.stream.wait_stream(torch.cuda.current_stream())
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            dst.copy_(src, non_blocking=True)
            end.record(self.stream)
        self.log.append((src.numel(), start, end))
        return end

    def wait(self, ticket) -> None:
        torch.cuda.current_stream().wait_event(ticket)

    def clock(self) -> float:
        """Seconds, once the compute stream's work has finished (a copy it has not waited for, on the
        copy stream, may still be running)."""
        torch.cuda.current_stream().synchronize()
        return time.perf_counter()

    def close(self) -> None:
        torch.cuda.synchronize()


def make_link(mode: str, GBps: float = CPU_LINK_GBps):
    return CudaLink() if mode == "cuda" else CpuLink(GBps)


# ----------------------------------------------------------------------------- the stack
class Stack:
    """Layers of uneven width with their flat weights in host memory (pinned on a GPU machine)."""

    def __init__(self, mode: str, widths=WIDTHS, *, d: int | None = None, rows: int | None = None, seed: int = 0):
        shape = SHAPES["cuda" if mode == "cuda" else "cpu"]
        self.mode, self.widths = mode, tuple(widths)
        self.d, self.rows, self.dtype = d or shape["d"], rows or shape["rows"], shape["dtype"]
        g = torch.Generator().manual_seed(seed)
        pin = mode == "cuda"
        self.host = []
        for m in self.widths:
            w = (torch.randn(2 * m * self.d, generator=g) * self.d ** -0.5).to(self.dtype)
            self.host.append(w.pin_memory() if pin else w)
        self.x0 = torch.randn(self.rows, self.d, generator=g).to(self.dtype)
        self.device = "cuda" if mode == "cuda" else "cpu"

    @property
    def layer_bytes(self) -> list[int]:
        return [w.numel() * w.element_size() for w in self.host]

    def run_layer(self, i: int, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        m, d = self.widths[i], self.d
        up, down = w[: m * d].view(m, d), w[m * d: 2 * m * d].view(d, m)
        return x + torch.relu(x @ up.T) @ down.T

    def weights(self, resident) -> list[torch.Tensor]:
        """Resident layers' weights on the device, the others the host tensors."""
        keep = set(resident)
        return [w.to(self.device) if i in keep else w for i, w in enumerate(self.host)]


class _Clock:
    """Timestamps in seconds from the first mark: perf_counter on a CPU, CUDA events on a GPU."""

    def __init__(self, mode: str):
        self.cuda = mode == "cuda"
        self.marks: list[tuple[str, int, Any]] = []

    def mark(self, what: str, i: int) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append((what, i, e))
        else:
            self.marks.append((what, i, time.perf_counter()))

    def seconds(self, origin) -> list[tuple[str, int, float]]:
        if self.cuda:
            torch.cuda.synchronize()
            return [(w, i, origin.elapsed_time(e) / 1e3) for w, i, e in self.marks]
        return [(w, i, t - origin) for w, i, t in self.marks]


def _origin(mode: str):
    if mode == "cuda":
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e
    return time.perf_counter()


def _timed(stack: Stack, fn: Callable, streamed, link, *, buffers: int, passes: int):
    """Run fn (the students' stream_forward) with a run_layer that records each layer's start and
    end; returns (output, compute events [(layer, start, end)] of every pass, copy events)."""
    clock = _Clock(stack.mode)
    origin = _origin(stack.mode)
    n = len(stack.widths)

    def run_layer(i, x, w):
        clock.mark("start", i)
        y = stack.run_layer(i, x, w)
        clock.mark("end", i)
        return y

    link.log.clear()
    weights = stack.weights([i for i in range(n) if i not in set(streamed)])
    out = fn(stack.x0.to(stack.device), weights, list(streamed), link, run_layer=run_layer, buffers=buffers,
             passes=passes)
    if stack.mode == "cuda":
        torch.cuda.synchronize()
        copies = [(numel, origin.elapsed_time(s) / 1e3, origin.elapsed_time(e) / 1e3) for numel, s, e in link.log]
    else:
        copies = [(numel, s - origin, e - origin) for numel, s, e in link.log]
    marks = clock.seconds(origin)
    starts = [t for w, _, t in marks if w == "start"]
    ends = [t for w, _, t in marks if w == "end"]
    if len(starts) != passes * n:
        raise RuntimeError(f"stream_forward ran {len(starts)} layers; {passes} passes over {n} layers are {passes * n}")
    order = [i for what, i, _ in marks if what == "start"]
    if order != list(range(n)) * passes:
        raise RuntimeError("stream_forward must run the layers in order, 0 to n-1, once per pass")
    compute = [(i % n, s, e) for i, (s, e) in enumerate(zip(starts, ends))]
    return out, compute, copies


def reference_forward(stack: Stack, passes: int = 1) -> torch.Tensor:
    x = stack.x0.to(stack.device)
    w = stack.weights(range(len(stack.widths)))
    for _ in range(passes):
        for i in range(len(w)):
            x = stack.run_layer(i, x, w[i])
    return x


def measure_streaming(fn: Callable, *, mode: str = "auto", widths=WIDTHS, buffers: int = 2, passes: int = 4,
                      cpu_link_GBps: float = CPU_LINK_GBps, configs=None, progress=print) -> dict[str, Any]:
    """Measure the layers' compute and copy times, then run `fn` (stream_forward) with each choice of
    streamed layers and set the measured pass time (the last of `passes`, at least 2) beside
    `offload.stream_layers`' prediction from the measured per-layer times. `configs`: lists of
    streamed layers (default: none, BMInf's spaced choices for 1, 2, 4 streamed, every layer, and
    the smallest resident set `offload.smallest_resident` finds from the measured times)."""
    if mode not in ("auto", "cpu", "cuda"):
        raise ValueError(f"mode must be auto, cpu or cuda, got {mode!r}")
    check_count("buffers", buffers), check_count("passes", passes, lo=2, hi=1000)
    if isinstance(cpu_link_GBps, bool) or not isinstance(cpu_link_GBps, (int, float)) or not cpu_link_GBps > 0:
        raise ValueError(f"cpu_link_GBps must be a positive number, got {cpu_link_GBps!r}")
    mode = ("cuda" if torch.cuda.is_available() else "cpu") if mode == "auto" else mode
    if mode == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("mode cuda: no CUDA GPU here")
    if mode == "cpu":
        torch.set_num_threads(1)  # the compute gets one core; the copy engine's thread the other
    stack = Stack(mode, widths)
    n = len(stack.widths)
    link = make_link(mode, cpu_link_GBps)
    try:
        # every layer resident: its compute time inside a pass (median over passes 2..)
        _, compute, _ = _timed(stack, _resident_forward, [], link, buffers=buffers, passes=passes)
        # the leak check's baseline after the first matmuls: cuBLAS keeps its workspace (32 MiB on a
        # Hopper GPU) in the caching allocator for the life of the process, which is no leak
        before = torch.cuda.memory_allocated() if mode == "cuda" else 0
        layer_s = [statistics.median(e - s for j, s, e in compute[n:] if j == i) for i in range(n)]
        # each layer's copy alone, through the engine
        bufs = link.buffer(max(w.numel() for w in stack.host), stack.dtype)
        copy_s = []
        for i, w in enumerate(stack.host):
            times = []
            for _ in range(3):
                link.log.clear()
                link.wait(link.copy(bufs[: w.numel()], w))
                if mode == "cuda":
                    torch.cuda.synchronize()
                    times.append(link.log[0][1].elapsed_time(link.log[0][2]) / 1e3)
                else:
                    times.append(link.log[0][2] - link.log[0][1])
            copy_s.append(statistics.median(times[1:]))
        del bufs
        link_GBps = sum(stack.layer_bytes) / sum(copy_s) / 1e9
        progress(f"compute per layer (ms): {', '.join(f'{1e3 * t:.2f}' for t in layer_s)}")
        progress(f"copy per layer (ms):    {', '.join(f'{1e3 * t:.2f}' for t in copy_s)}  ({link_GBps:.1f} GB/s)")
        best = off.smallest_resident(stack.layer_bytes, layer_s, link_GBps=link_GBps, buffers=buffers)
        if configs is None:
            configs = [(), off.spaced(n, 1), off.spaced(n, 2), off.spaced(n, 4), tuple(range(n)), best.streamed]
        seen, rows = set(), []
        for streamed in configs:
            streamed = tuple(sorted(set(streamed)))
            if streamed in seen:
                continue
            seen.add(streamed)
            if mode == "cuda":
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            out, compute, copies = _timed(stack, fn, streamed, link, buffers=buffers, passes=passes)
            exact = torch.equal(out, reference_forward(stack, passes))
            peak = torch.cuda.max_memory_allocated() - base if mode == "cuda" else None
            del out
            ends = [e for i, _, e in compute if i == n - 1]
            measured = ends[-1] - ends[-2]  # the last pass: from the end of the one before
            pred = off.stream_layers(stack.layer_bytes, layer_s, streamed=streamed, link_GBps=link_GBps,
                                     buffers=buffers, passes=passes)
            last0 = ends[-2]
            rows.append({"streamed": list(streamed), "resident": n - len(streamed), "measured_seconds": measured,
                         "predicted_seconds": pred.seconds, "compute_seconds": pred.compute_seconds,
                         "error_pct": 100 * (pred.seconds - measured) / measured, "hidden_predicted": pred.hidden,
                         "gpu_bytes": pred.gpu_bytes, "host_bytes": pred.host_bytes, "allocator_peak_bytes": peak,
                         "matches_all_resident": bool(exact),
                         "measured_events": [("compute", i, s - last0, e - last0) for i, s, e in compute
                                             if e > last0 + 1e-12] +
                                            [("copy", -1, s - last0, e - last0) for _, s, e in copies if e > last0],
                         "predicted_events": [list(e) for e in pred.events]})
            r = rows[-1]
            progress(f"streamed {str(list(streamed)):>26}: pass {1e3 * measured:7.2f} ms measured, "
                     f"{1e3 * pred.seconds:7.2f} ms predicted ({r['error_pct']:+.1f} %), device {r['gpu_bytes'] / 2**20:.0f} MiB"
                     + ("" if r["matches_all_resident"] else "  OUTPUT DIFFERS from the resident run"))
        if mode == "cuda":
            torch.cuda.synchronize()
            leaked = torch.cuda.memory_allocated() - before
            if leaked > 0:
                raise RuntimeError(f"streaming leaked {leaked} bytes of device memory")
    finally:
        link.close()
    return {"mode": mode, "widths": list(stack.widths), "d": stack.d, "rows": stack.rows, "dtype": str(stack.dtype),
            "buffers": buffers, "passes": passes, "layer_bytes": stack.layer_bytes, "layer_seconds": layer_s,
            "copy_seconds": copy_s, "link_GBps": link_GBps,
            "link": ("CUDA side stream from pinned host memory" if mode == "cuda" else
                     f"a thread copying at {cpu_link_GBps:g} GB/s (stands in for PCIe; not a GPU)"),
            "smallest_resident": {"resident": n - len(best.streamed), "streamed": list(best.streamed)},
            "configs": rows}


def _resident_forward(x, weights, streamed, link, *, run_layer, buffers, passes):
    """stream_forward with nothing streamed: every layer runs from its weights, in order."""
    for _ in range(passes):
        for i, w in enumerate(weights):
            x = run_layer(i, x, w)
    return x


# ----------------------------------------------------------------------------- pinned memory and the DataLoader
def pinned_memory_available() -> tuple[bool, str]:
    """Whether this machine can page-lock host memory through torch (it needs an accelerator
    backend: on a CPU-only build `torch.empty(..., pin_memory=True)` raises), and why not."""
    try:
        t = torch.empty(16, pin_memory=True)
        return bool(t.is_pinned()), "pinned"
    except RuntimeError as e:
        return False, str(e).splitlines()[0]


class _CountingBatches(torch.utils.data.Dataset):
    """Each index is one whole batch (the DataLoader runs with batch_size=None); a counter shared
    with the workers counts the batches made."""

    def __init__(self, n: int, elements: int, made):
        self.n, self.elements, self.made = n, elements, made

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        x = torch.full((self.elements,), float(i))
        with self.made.get_lock():
            self.made.value += 1
        return x


def loader_in_flight(*, num_workers: int, prefetch_factor: int | None = None, batches: int = 24,
                     elements: int = 1024, consumer_seconds: float = 0.03) -> dict[str, Any]:
    """Batches a real `torch.utils.data.DataLoader` has made ahead of the loop: a slow loop
    (`consumer_seconds` a batch) reads, after each batch it receives, how many batches the workers
    have made (a counter they share); made - received is the number in flight. The largest over
    the loop, once the workers have started, is what `offload.loader_memory`'s
    `batches_in_flight` predicts. (Pinning needs an accelerator: on a CPU-only machine the
    DataLoader ignores pin_memory=True, so the pin thread's copies are measured on a GPU only.)"""
    import multiprocessing as mp

    made = mp.get_context("fork").Value("i", 0)
    kw = {} if num_workers == 0 else {"prefetch_factor": prefetch_factor or 2, "multiprocessing_context": "fork"}
    loader = torch.utils.data.DataLoader(_CountingBatches(batches, elements, made), batch_size=None,
                                         num_workers=num_workers, **kw)
    seen = []
    for i, batch in enumerate(loader):
        if int(batch[0]) != i:
            raise RuntimeError(f"batch {i} arrived out of order")
        time.sleep(consumer_seconds)  # the training step: the workers run ahead meanwhile
        seen.append(made.value - (i + 1))
    steady = seen[: max(1, batches - (num_workers * (prefetch_factor or 2)) - 1)]  # before the dataset runs out
    return {"num_workers": num_workers, "prefetch_factor": None if num_workers == 0 else prefetch_factor or 2,
            "batches": batches, "in_flight_each_batch": seen, "in_flight_max": max(steady)}


# ----------------------------------------------------------------------------- out of core: layers on disk
_ALIGN = 4096  # O_DIRECT wants offsets, sizes and buffers aligned to the device's block (4 KiB is safe)


def _aligned(nbytes: int):
    """A page-aligned anonymous buffer (mmap) of `nbytes` rounded up to _ALIGN: what O_DIRECT needs."""
    import mmap

    return mmap.mmap(-1, -(-nbytes // _ALIGN) * _ALIGN)


def _direct_fd(path, write: bool = False) -> tuple[int, bool]:
    """A file descriptor with O_DIRECT (no page cache: the bytes really come from the disk, as
    DeepSpeed's aio reads them) where the filesystem allows it; else a plain one (direct=False)."""
    import os

    flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
    try:
        return os.open(path, flags | os.O_DIRECT, 0o644), True
    except OSError:
        return os.open(path, flags, 0o644), False


def _read_into(path, buf, nbytes: int) -> bool:
    import os

    fd, direct = _direct_fd(path)
    try:
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        view = memoryview(buf)[: -(-nbytes // _ALIGN) * _ALIGN if direct else nbytes]
        got = os.preadv(fd, [view], 0)
        if got < nbytes:
            raise RuntimeError(f"{path}: read {got} of {nbytes} bytes")
        return direct
    finally:
        os.close(fd)


def _write_from(path, buf, nbytes: int) -> None:
    import os

    fd, direct = _direct_fd(path, write=True)
    try:
        os.pwritev(fd, [memoryview(buf)[: -(-nbytes // _ALIGN) * _ALIGN if direct else nbytes]], 0)
        if not direct:
            os.fsync(fd)
    finally:
        os.close(fd)


def _io_counters() -> dict[str, int]:
    """The kernel's count of this process's bytes read from and written to storage (/proc/self/io)."""
    out = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        k, v = line.split(":")
        out[k] = int(v)
    # major page faults: pages of this process's mapped files (its libraries' code and data) read back from storage,
    # which read_bytes counts too when memory is short and the kernel had dropped them
    majflt = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[9])
    return {"read": out["read_bytes"], "write": out["write_bytes"], "major_faults": majflt}


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def disk_bandwidth(folder, nbytes: int = 256 << 20, chunk: int = 16 << 20) -> dict[str, Any]:
    """Sequential read and write rates of the disk under `folder` (decimal GB/s), through O_DIRECT
    where the filesystem allows it (no page cache: the stand-in on this machine for an NVMe drive
    ZeRO-Infinity would read with DeepSpeed's aio, which is also O_DIRECT)."""
    import os

    path = Path(folder) / "vramlab_disk_probe.bin"
    buf = _aligned(chunk)
    buf.write(os.urandom(1 << 20) * (chunk >> 20))
    fd, direct = _direct_fd(path, write=True)
    try:
        t0 = time.perf_counter()
        for pos in range(0, nbytes, chunk):
            os.pwritev(fd, [buf], pos)
        os.fsync(fd)
        wrote = time.perf_counter() - t0
    finally:
        os.close(fd)
    fd, _ = _direct_fd(path)
    try:
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        for pos in range(0, nbytes, chunk):
            os.preadv(fd, [buf], pos)
        read = time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink()
    return {"bytes": nbytes, "o_direct": direct, "read_GBps": nbytes / read / 1e9, "write_GBps": nbytes / wrote / 1e9}


def _stream_step(paths, grad_paths, d: int, x: torch.Tensor, buffers: int, pool, grad_buf, counts: dict) -> torch.Tensor:
    """One forward and backward of y = relu(x W_i^T) over the layers in `paths` (d x d fp32 each),
    each read from disk into one of `buffers` host buffers just before its turn (the next read runs
    on a thread while this layer computes: at most `buffers` layers in memory), every layer's input
    and output kept for the backward, each gradient of W written to `grad_paths[i]` from one buffer.
    Returns the gradient of sum(y) with respect to x (the check against autograd)."""
    from concurrent.futures import ThreadPoolExecutor

    nbytes = d * d * 4
    n = len(paths)
    free = list(range(buffers))
    weight = lambda k: torch.frombuffer(pool[k], dtype=torch.float32, count=d * d).view(d, d)  # noqa: E731
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    with ThreadPoolExecutor(1) as io:
        def fetch(order):  # reads ahead into free buffers, in the order the layers run
            pending = []
            for i in order:
                while not free:  # every buffer holds a layer that has not run yet
                    k, fut = pending.pop(0)
                    fut.result()
                    yield i_of[k], k
                k = free.pop(0)
                i_of[k] = i
                pending.append((k, io.submit(_read_into, paths[i], pool[k], nbytes)))
                counts["read"] += nbytes
            for k, fut in pending:
                fut.result()
                yield i_of[k], k

        i_of: dict[int, int] = {}
        for i, k in fetch(range(n)):
            y = (x @ weight(k).T).relu_()  # in place: one new tensor a layer
            saved.append((x, y))
            counts["live_max"] = max(counts["live_max"], buffers - len(free))
            counts["rss_max"] = max(counts["rss_max"], _status_bytes("VmRSS"))
            free.append(k)
            x = y
        g = torch.ones_like(x)
        gw = torch.frombuffer(grad_buf, dtype=torch.float32, count=d * d).view(d, d)
        for i, k in fetch(range(n - 1, -1, -1)):
            xi, yi = saved.pop()
            gz = g * (yi > 0)
            torch.mm(gz.T, xi, out=gw)  # dL/dW_i, (d, d)
            g = gz @ weight(k)
            counts["rss_max"] = max(counts["rss_max"], _status_bytes("VmRSS"))
            free.append(k)
            _write_from(grad_paths[i], grad_buf, nbytes)
            counts["written"] += nbytes
    return g


def _glibc():
    """glibc, for mallopt and malloc_trim (None elsewhere: musl, macOS)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def stream_from_disk(folder, *, layers: int = 8, d: int = 1024, rows: int = 64, buffers: int = 2,
                     steps: int = 2, seed: int = 0) -> dict[str, Any]:
    """Out-of-core training's memory and traffic, measured on this CPU: `layers` fp32 layers of
    d x d stored in files under `folder` (the "NVMe": on this machine its disk, through O_DIRECT),
    streamed through `buffers` host buffers by `_stream_step` for `steps` forward+backward steps.
    Reports, beside `offload.disk_streaming`'s estimate: the process's peak resident memory above
    what it held before the step (VmHWM after resetting it, /proc/self/clear_refs, and VmRSS after
    each layer; glibc is told to map every allocation of 64 KiB or more on its own and to give free
    heap pages back first, so that a tensor's pages are counted when made and gone when freed,
    rather than hidden in memory the process already held), the bytes the
    kernel read from and wrote to storage (/proc/self/io: independent of this code's own count),
    the time spent and the model's size on disk. The first step's gradient of the input is checked
    against torch.autograd on the same weights held in memory (on small stacks only)."""
    import gc

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    libc = _glibc()
    if libc is not None:  # every tensor of 64 KiB or more its own mapping, unmapped when freed: RSS follows them
        libc.mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD (fixed: no longer raised by frees)
    gen = torch.Generator().manual_seed(seed)
    nbytes = d * d * 4
    paths = [folder / f"layer{i}.bin" for i in range(layers)]
    grad_paths = [folder / f"grad{i}.bin" for i in range(layers)]
    tmp = _aligned(nbytes)
    for p in paths:  # write the model out, one layer at a time through one buffer
        torch.frombuffer(tmp, dtype=torch.float32, count=d * d).copy_(torch.randn(d * d, generator=gen) / d ** 0.5)
        _write_from(p, tmp, nbytes)
    tmp.close()
    x0 = torch.randn(rows, d, generator=gen)
    small = layers * nbytes <= 64 << 20
    ref = None
    if small:  # the reference holds the whole model in memory: small stacks only
        ws = [torch.from_file(str(p), size=d * d, dtype=torch.float32).view(d, d).clone() for p in paths]
        xr = x0.clone().requires_grad_(True)
        y = xr
        for w in ws:
            y = torch.relu(y @ w.T)
        y.sum().backward()
        ref = xr.grad
        del ws, y, xr
    fd, direct = _direct_fd(paths[0])
    import os

    os.close(fd)
    gc.collect()
    if libc is not None:
        libc.malloc_trim(0)  # free heap pages back to the system: the step cannot reuse them unseen
    # a warm-up of one layer's forward and backward on a throwaway weight: the BLAS library's packing
    # buffers (kept per thread, as cuBLAS keeps its workspaces on a GPU) are made before the step
    w = torch.randn(d, d, generator=gen)
    y = (x0 @ w.T).relu_()
    gz = torch.ones_like(y) * (y > 0)
    _ = torch.mm(gz.T, x0), gz @ w
    del w, y, gz, _
    gc.collect()
    if libc is not None:
        libc.malloc_trim(0)
    counts = {"read": 0, "written": 0, "live_max": 0, "rss_max": 0}
    Path("/proc/self/clear_refs").write_text("5")  # the peak RSS starts again from here
    base = _status_bytes("VmRSS")
    io0 = _io_counters()
    t0 = time.perf_counter()
    pool = [_aligned(nbytes) for _ in range(buffers)]  # the host buffers: allocated inside what is measured
    grad_buf = _aligned(nbytes)
    matches = None
    for s in range(steps):
        g = _stream_step(paths, grad_paths, d, x0, buffers, pool, grad_buf, counts)
        if s == 0 and ref is not None:
            matches = bool(torch.allclose(g, ref, rtol=1e-4, atol=1e-5))
    took = time.perf_counter() - t0
    io1 = _io_counters()
    # the kernel's high-water mark, and VmRSS sampled after every layer's compute (VmHWM alone can
    # miss a peak: the kernel folds the current RSS into it only at some points, e.g. unmaps)
    peak = max(_status_bytes("VmHWM"), counts["rss_max"])
    est = off.disk_streaming([nbytes] * layers, activation_bytes=rows * d * 4, buffers=buffers)
    for p in paths + grad_paths:
        p.unlink(missing_ok=True)
    return {"layers": layers, "d": d, "rows": rows, "buffers": buffers, "steps": steps, "o_direct": direct,
            "model_bytes": layers * nbytes, "estimate": dataclasses.asdict(est),
            "peak_rss_above_start_bytes": peak - base,
            "kernel_read_bytes": io1["read"] - io0["read"], "kernel_written_bytes": io1["write"] - io0["write"],
            "major_faults": io1["major_faults"] - io0["major_faults"],
            "counted_read_bytes": counts["read"], "counted_written_bytes": counts["written"],
            "most_layers_resident": counts["live_max"], "seconds": took, "gradient_matches_autograd": matches}


def run_isolated(fn: str, **kw) -> dict[str, Any]:
    """`fn` (a function of this module) with `kw` in a fresh Python process: its peak memory sees
    nothing of this one's. Returns its JSON result."""
    code = ("import json, sys, torch; torch.set_num_threads(1); from vramlab.measure import offload as m; "
            f"print(json.dumps(m.{fn}(**json.loads(sys.argv[1]))))")
    r = subprocess.run([sys.executable, "-c", code, json.dumps(kw, default=str)], capture_output=True, text=True,
                       timeout=600)
    if r.returncode:
        raise RuntimeError(f"{fn} failed: {(r.stderr.strip().splitlines() or ['exit %d' % r.returncode])[-1]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- GPU probes (one per process)
def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def probe_bandwidth(size_bytes: int = 1 << 30) -> dict[str, Any]:
    """Host-to-device and device-to-host copies of `size_bytes`, pinned and pageable: GB/s (median of 5)."""
    n = size_bytes // 2
    dev = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    out = {}
    for pinned in (True, False):
        host = torch.empty(n, dtype=torch.bfloat16, pin_memory=pinned)
        host.fill_(1)
        for direction in ("h2d", "d2h"):
            times = []
            for _ in range(6):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                (dev.copy_(host, non_blocking=pinned) if direction == "h2d" else host.copy_(dev, non_blocking=pinned))
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            out[f"{direction}_{'pinned' if pinned else 'pageable'}_GBps"] = size_bytes / statistics.median(times[1:]) / 1e9
        del host
    return {"probe": "bandwidth", "bytes": size_bytes, **out}


def _train_step_probe(offload_activations: bool, steps: int = 4) -> dict[str, Any]:
    from .models import build_model, make_batch
    from ..specs import preset

    spec = preset(SAVE_CASE["model"])
    model = build_model(spec, device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    batch = make_batch(spec, batch_size=SAVE_CASE["batch_size"], seq_len=SAVE_CASE["seq_len"], device="cuda")
    rss0 = _rss_bytes()
    times = []
    for step in range(steps):
        if step == 2:  # two warm steps: states made, allocator and pinned host cache warm
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if offload_activations:
                with torch.autograd.graph.save_on_cpu(pin_memory=True):
                    loss = model(**batch).loss
            else:
                loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step >= 2:
            times.append(time.perf_counter() - t0)
    return {"probe": "save-on-cpu" if offload_activations else "baseline", **SAVE_CASE, "precision": "bf16-mixed",
            "peak_allocated": torch.cuda.max_memory_allocated(), "peak_reserved": torch.cuda.max_memory_reserved(),
            "step_seconds": times, "host_rss_growth_bytes": _rss_bytes() - rss0}


def probe_zero_offload(steps: int = 4) -> dict[str, Any]:
    """DeepSpeed ZeRO stage 2 with the optimizer offloaded to the CPU (torch's AdamW stepping there,
    so no C++ op has to build), one rank, bf16; the GPT-2 case of SAVE_CASE."""
    import os

    import deepspeed

    from .models import build_model, make_batch
    from ..specs import preset

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    deepspeed.init_distributed(dist_backend="nccl", verbose=False)
    spec = preset(SAVE_CASE["model"])
    model = build_model(spec, device="cuda")
    cfg = {"train_micro_batch_size_per_gpu": SAVE_CASE["batch_size"], "bf16": {"enabled": True},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
           "zero_force_ds_cpu_optimizer": False, "zero_allow_untested_optimizer": True}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    batch = make_batch(spec, batch_size=SAVE_CASE["batch_size"], seq_len=SAVE_CASE["seq_len"], device="cuda")
    times = []
    for step in range(steps):
        if step == 2:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize()
        if step >= 2:
            times.append(time.perf_counter() - t0)
    return {"probe": "zero-offload", **SAVE_CASE, "precision": "bf16", "peak_allocated": torch.cuda.max_memory_allocated(),
            "step_seconds": times, "reduce_bucket": int(engine.zero_reduce_bucket_size())}


def _image_batches(n: int, images: int):
    class Images(torch.utils.data.Dataset):  # each index one batch: images and int64 labels
        def __len__(self):
            return n

        def __getitem__(self, i):
            return torch.full((images, 3, 224, 224), float(i)), torch.full((images,), i, dtype=torch.int64)

    return Images()


def probe_loader_pinned(images: int = LOADER_CASE["images"], num_workers: int = LOADER_CASE["num_workers"],
                        prefetch_factor: int = LOADER_CASE["prefetch_factor"], batches: int = LOADER_CASE["batches"],
                        step_seconds: float = 0.2) -> dict[str, Any]:
    """A DataLoader of image batches with pin_memory=True feeding a slow loop (`step_seconds` a
    batch, so the workers and the pin thread run ahead): the pinned caching host allocator's peak
    (`torch.cuda.host_memory_stats`) against `offload.loader_memory`, and one batch's copy to the
    GPU from pinned and from pageable memory (non_blocking, CUDA events, median)."""
    torch.cuda.init()
    if not hasattr(torch.cuda, "host_memory_stats"):
        raise RuntimeError(f"torch {torch.__version__} has no torch.cuda.host_memory_stats (the pinned allocator's counters)")
    base = torch.cuda.host_memory_stats()
    loader = torch.utils.data.DataLoader(_image_batches(batches, images), batch_size=None, num_workers=num_workers,
                                         prefetch_factor=prefetch_factor, pin_memory=True)
    pinned_seen = []
    for x, y in loader:
        pinned_seen.append(bool(x.is_pinned()))
        x.to("cuda", non_blocking=True), y.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        time.sleep(step_seconds)
    stats = torch.cuda.host_memory_stats()
    times: dict[str, list[float]] = {"pinned": [], "pageable": []}
    x = torch.full((images, 3, 224, 224), 1.0)
    xp = x.pin_memory()
    for _ in range(6):
        for kind, src in (("pinned", xp), ("pageable", x)):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            src.to("cuda", non_blocking=True)
            b.record()
            torch.cuda.synchronize()
            times[kind].append(a.elapsed_time(b) / 1e3)
    sizes = [images * 3 * 224 * 224 * 4, images * 8]
    pred = off.loader_memory(sizes, num_workers=num_workers, prefetch_factor=prefetch_factor)
    return {"probe": "loader-pinned", **LOADER_CASE, "images": images, "num_workers": num_workers,
            "prefetch_factor": prefetch_factor, "batch_tensor_bytes": sizes, "all_pinned": all(pinned_seen),
            "host_allocated_bytes_peak": stats.get("allocated_bytes.peak", 0) - base.get("allocated_bytes.current", 0),
            "host_active_bytes_peak": stats.get("active_bytes.peak", 0),
            "host_stats": {k: v for k, v in stats.items() if k.startswith(("allocated_bytes", "active_bytes", "allocations"))},
            "predicted_pinned_bytes": pred.pinned_bytes, "predicted_pinned_batches": pred.pinned_batches,
            "copy_seconds": {k: statistics.median(v[1:]) for k, v in times.items()},
            "predicted_copy_seconds": {"pinned": pred.copy_seconds, "pageable": pred.pageable_copy_seconds}}


def run_cpu_probe(name: str, folder) -> dict[str, Any]:
    """The measurements any machine can make (no GPU): `disk` (O_DIRECT rates of the disk under
    `folder`, the stand-in for an NVMe drive), `out-of-core` (a stack streamed from files in `folder`
    through a forward and backward, in a fresh process, beside `offload.disk_streaming`), `loader`
    (a DataLoader's batches in flight for a few worker settings, beside `offload.loader_memory`)."""
    import warnings

    if name == "disk":
        return {"probe": "disk", **disk_bandwidth(folder)}
    if name == "out-of-core":
        disk = disk_bandwidth(folder, nbytes=128 << 20)
        runs = [run_isolated("stream_from_disk", folder=str(folder), layers=layers, d=d, buffers=b, steps=2)
                for layers, d, b in ((16, 1024, 2), (32, 1024, 2), (16, 1536, 3), (16, 1536, 1))]
        return {"probe": "out-of-core", "disk": disk, "runs": runs}
    if name == "loader":
        rows = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for nw, pf in ((0, None), (1, 2), (2, 2), (2, 4)):
                got = loader_in_flight(num_workers=nw, prefetch_factor=pf, batches=16, consumer_seconds=0.04)
                pred = off.loader_memory([4096], num_workers=nw, prefetch_factor=pf)
                rows.append({"num_workers": nw, "prefetch_factor": got["prefetch_factor"],
                             "measured_in_flight": got["in_flight_max"], "predicted_in_flight": pred.batches_in_flight})
        ok, why = pinned_memory_available()
        return {"probe": "loader", "pinned_memory_available": ok, "pinned_memory_note": why, "rows": rows}
    raise ValueError(f"probe must be one of {', '.join(CPU_PROBES)}, got {name!r}")


def run_probe(name: str) -> dict[str, Any]:
    if name in GPU_ONLY_PROBES and torch.cuda.is_available():
        return probe_loader_pinned()
    if name not in PROBES:
        raise ValueError(f"probe must be one of {', '.join(PROBES + GPU_ONLY_PROBES)}, got {name!r}")
    if not torch.cuda.is_available():
        raise RuntimeError(f"probe {name} needs a CUDA GPU")
    if name == "bandwidth":
        return probe_bandwidth()
    if name == "zero-offload":
        return probe_zero_offload()
    return _train_step_probe(name == "save-on-cpu")


def gpu_probes(progress=print, timeout: int = 600) -> dict[str, Any]:
    """Every probe in its own process; a probe that fails is reported in one line, not raised."""
    import os
    import tempfile

    out: dict[str, Any] = {}
    for name in PROBES:
        with tempfile.TemporaryDirectory() as tmp:
            f = Path(tmp) / "probe.json"
            r = subprocess.run([sys.executable, "-m", "vramlab.measure.offload", "--probe", name, "--out", str(f)],
                               capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONWARNINGS": "ignore"})
            if r.returncode == 0:
                out[name] = json.loads(f.read_text())
                progress(f"probe {name}: done")
            else:
                why = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
                out[name] = {"probe": name, "error": why}
                progress(f"probe {name}: not measured ({why})")
    return out


PROG = "python -m vramlab.measure.offload"


def main(argv: list[str] | None = None) -> int:
    import importlib.util


    ap = checks.Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--probe", required=True, choices=PROBES + GPU_ONLY_PROBES + CPU_PROBES,
                    help=f"GPU: {', '.join(PROBES + GPU_ONLY_PROBES)}; any machine: {', '.join(CPU_PROBES)}")
    ap.add_argument("--out", type=Path, required=True, help="the probe's JSON (its folder must exist)")
    ap.add_argument("--folder", type=Path, default=None,
                    help="disk and out-of-core: where the files go (default: the --out file's folder)")
    a = ap.parse_args(argv)
    checks.output_path(PROG, a.out)
    if a.probe in CPU_PROBES:
        folder = a.folder or a.out.resolve().parent
        if not folder.is_dir():
            checks.fail(PROG, f"--folder {folder}: no such folder")
        from .record import provenance

        import os

        res = {**run_cpu_probe(a.probe, folder), "device": "cpu (no GPU: the disk stands in for NVMe)",
               "cpus": os.cpu_count(), "provenance": provenance("cpu"), "command": f"{PROG} --probe {a.probe}"}
        a.out.write_text(json.dumps(res, indent=1) + "\n")
        return 0
    if not torch.cuda.is_available():  # before the probe starts, as every other refusal
        checks.fail(PROG, f"--probe {a.probe} needs a CUDA GPU and this machine has none")
    if a.probe == "zero-offload" and importlib.util.find_spec("deepspeed") is None:
        checks.fail(PROG, "--probe zero-offload needs DeepSpeed (pip install deepspeed)")
    try:
        res = run_probe(a.probe)
    except (ValueError, RuntimeError, ImportError) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
