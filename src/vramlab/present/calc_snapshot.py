"""Chapter 1's snapshot calculator (`explain`): an out-of-memory error's snapshot, byte by byte, beside the
estimate; and `example_snapshot`, the built-in example it reads when the reader gives no file."""

from __future__ import annotations

import pickle

from .. import memory, specs
from .. import precision as P
from .. import snapshot as SNAP
from ..units import GiB, fmt_bytes
from .calc_base import COLORS, GPU_CHOICES, SEQ_CHOICES, Calculator, Input, Result, both, refused
from .svg import stacked_bars

_TORCH = "/usr/lib/python3/site-packages/torch"  # where the example's frames say torch lives (any path works)
_TRAIN_FRAME = {"filename": "/home/me/train.py", "line": 41, "name": "main"}
_EXAMPLE_FRAMES = {  # innermost first, as torch/csrc/profiler/combined_traceback.cpp writes them
    "parameters": [{"filename": f"{_TORCH}/nn/modules/module.py", "line": 1341, "name": "convert"},
                   {"filename": f"{_TORCH}/nn/modules/module.py", "line": 900, "name": "_apply"}, _TRAIN_FRAME],
    "gradients": [{"filename": "??", "line": 0, "name": "torch::autograd::AccumulateGrad::apply(...)"},
                  {"filename": "??", "line": 0, "name": "torch::autograd::Engine::thread_main(...)"}],
    "optimizer_states": [{"filename": f"{_TORCH}/optim/adam.py", "line": 150, "name": "_init_group"},
                         {"filename": f"{_TORCH}/optim/adam.py", "line": 220, "name": "step"}, _TRAIN_FRAME],
    "activations": [{"filename": f"{_TORCH}/nn/modules/linear.py", "line": 125, "name": "forward"},
                    {"filename": f"{_TORCH}/nn/modules/module.py", "line": 1750, "name": "_call_impl"}, _TRAIN_FRAME],
    "kv_cache": [{"filename": "/usr/lib/python3/site-packages/transformers/cache_utils.py", "line": 700,
                  "name": "update"}, _TRAIN_FRAME],
    "other": [{"filename": "??", "line": 0, "name": "at::cuda::getCUDABlasLtWorkspace()"}, _TRAIN_FRAME],
    "inputs": [_TRAIN_FRAME],  # torch.randint(..., device="cuda") in the script: no rule knows it
}
EXAMPLE = {"model": "gpt2", "batch_size": 8, "seq_len": 1024, "precision": "fp32", "gpu": "t4"}


def example_snapshot(*, batch_size: int = 8, gpu: str = "t4", oom: bool = True) -> bytes:
    """An example snapshot built to the format of `torch.cuda.memory._snapshot()` (not recorded on a GPU):
    GPT-2 small (124 M parameters, 12 layers, d=768) trained in fp32 with Adam at `batch_size` x 1024 tokens
    with eager attention and transformers' KV cache left on, in the forward of its second step; gradients
    of the first step are still alive (zero_grad() is called before backward). Each layer's forward makes
    one segment (six d-wide tensors, two 4d-wide, the attention scores and their softmax, each batch x 1024
    x width x 4 B; a 2 MiB block freed in it), its KV cache another; layers are added until the next tensor
    does not fit `gpu`'s memory less its CUDA context: that request is the trace's "oom" entry (with
    `oom`), else the forward ends and no OOM is recorded. Bytes: integers, multiples of 512.
    Known limitations: a real step's tensors are many more, smaller blocks; the sizes are the layer's
    tensor shapes, not what a given PyTorch version allocates."""
    b, s, d, a, v, layers = _checks_example(batch_size), 1024, 768, 12, 50257, 12
    g = specs.gpu(gpu)
    capacity = g.usable_bytes - g.context_bytes
    hidden, wide, scores = b * s * d * 4, b * s * 4 * d * 4, b * a * s * s * 4
    per_layer = 12 * d * d + 13 * d  # GPT-2's block: attention 4d^2 + 4d, MLP 8d^2 + 5d, two norms 4d
    params = [v * d * 4, 1024 * d * 4] + [per_layer * 4] * layers + [2 * d * 4]
    segments, trace, state = [], [], {"addr": 0x7F0000000000, "reserved": 0}

    def segment(blocks: list[tuple[int, str, str]]) -> None:  # (size, state, category of the frames)
        out, addr = [], state["addr"]
        for size, st, cat in blocks:
            out.append({"address": addr, "size": size, "requested_size": size, "state": st,
                        "frames": _EXAMPLE_FRAMES[cat] if st != "inactive" else []})
            if st == "active_allocated":
                trace.append({"action": "alloc", "addr": addr, "size": size, "stream": 0, "time_us": len(trace),
                              "frames": out[-1]["frames"]})
            addr += size
        total = addr - state["addr"]
        alloc = sum(x["size"] for x in out if x["state"] == "active_allocated")
        segments.append({"device": 0, "address": state["addr"], "total_size": total, "allocated_size": alloc,
                         "active_size": alloc, "requested_size": alloc, "stream": 0,
                         "segment_type": "large" if total > 1 << 20 else "small", "segment_pool_id": (0, 0),
                         "is_expandable": False, "frames": out[0]["frames"], "blocks": out})
        state["addr"], state["reserved"] = addr + (2 << 20), state["reserved"] + total

    def rounded(n: int) -> int:  # the allocator's 2 MiB granularity for large segments
        return -(-n // (2 << 20)) * (2 << 20)

    for cat, sizes in (("parameters", params), ("gradients", params), ("optimizer_states", params + params)):
        used = sum(sizes)
        segment([(n, "active_allocated", cat) for n in sizes] + [(rounded(used) - used, "inactive", "")])
    segment([(8 << 20, "active_allocated", "other"), (b * s * 8, "active_allocated", "inputs"),
             (2 << 20, "inactive", "")])
    layer = [hidden] * 6 + [wide] * 2 + [scores] * 2
    failed = None
    for _ in range(layers):
        kv = [(hidden, "active_allocated", "kv_cache")] * 2
        need = sum(layer) + (2 << 20) + 2 * hidden
        if oom and state["reserved"] + need > capacity:  # this layer does not fit: as far as it gets
            room, done = capacity - state["reserved"], []
            for n in layer:
                if sum(done) + n > room:
                    failed = n
                    break
                done.append(n)
            if done:
                segment([(n, "active_allocated", "activations") for n in done])
            break
        segment([(n, "active_allocated", "activations") for n in layer] + [(2 << 20, "inactive", "")])
        segment(kv)
    if failed is not None:
        trace.append({"action": "oom", "device_free": capacity - state["reserved"], "size": failed, "stream": 0,
                      "time_us": len(trace), "frames": _EXAMPLE_FRAMES["activations"]})
    data = {"segments": segments, "device_traces": [trace],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "expandable_segments": False}}
    return pickle.dumps(data, protocol=4)


def _checks_example(batch_size: int) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= 64:
        raise ValueError(f"batch_size must be a whole number from 1 to 64, got {batch_size!r}")
    return batch_size


_EXAMPLE_BYTES: list[bytes] = []


def _example() -> bytes:
    if not _EXAMPLE_BYTES:
        _EXAMPLE_BYTES.append(example_snapshot(batch_size=EXAMPLE["batch_size"], gpu=EXAMPLE["gpu"]))
    return _EXAMPLE_BYTES[0]


NO_MODEL = "none (no estimate)"
NO_GPU = "not given"
_SNAP_COLORS = {**COLORS, "unknown": "#CCB974", "unattributed": "#BBBBBB", "cached free": "#E5E5E5"}


def _explain(*, snapshot: bytes | None, model: str, batch_size: int, seq_len: int, precision: str, gpu: str) -> Result:
    data = _example() if snapshot is None else snapshot
    estimate, phase = None, ""
    if model != NO_MODEL:
        spec = specs.preset(model)
        phases = memory.training_phases(spec, batch_size=batch_size, seq_len=seq_len, precision=precision)
        try:
            snap = SNAP.load_snapshot(data)
        except ValueError as e:
            return refused(f"snapshot file: {e.args[0]}", "snapshot")
        estimate, _ = SNAP.phase_to_compare(snap, phases)  # the phase the OOM came in, as `vramlab explain`
        phase = f"estimate: {spec.name}, {batch_size} x {seq_len}, {precision}, Adam, at '{estimate.phase}'"
        data = snap
    opts = {}
    if gpu != NO_GPU:
        g = specs.gpu(gpu)
        opts = {"device_total": g.usable_bytes, "context_bytes": g.context_bytes}
    try:
        e = SNAP.explain(data, estimate=estimate, batch_size=batch_size, **opts)
    except ValueError as err:
        return refused(f"snapshot file: {err.args[0]}", "snapshot")
    rows = e.rows()
    cached = e.reserved - e.allocated
    snap_bar = [(c.replace("_", " "), s / GiB, _SNAP_COLORS[c]) for c, s, _ in rows] + \
               [("cached free", cached / GiB, _SNAP_COLORS["cached free"])]
    bars = [("snapshot", snap_bar)]
    if estimate is not None:
        bars.append(("estimate", [(c.replace("_", " "), (est or 0) / GiB, _SNAP_COLORS[c]) for c, _, est in rows]))
    line = (e.capacity / GiB, "PyTorch's capacity") if e.capacity else None
    svg, narrow = both(stacked_bars, bars, title="the snapshot's bytes by category" +
                        (" beside the estimate" if estimate is not None else ""), line=line)
    source = ("the built-in example (GPT-2, fp32, Adam, batch 8 on a T4; built to PyTorch's snapshot format, "
              "not recorded on a GPU)" if snapshot is None else f"your file ({len(snapshot):,} B, read in this page)")
    lines = [f"snapshot: {source}"] + ([phase] if phase else []) + [""] + e.lines()
    numbers = {"allocated": (e.allocated, fmt_bytes(e.allocated)), "reserved": (e.reserved, fmt_bytes(e.reserved)),
               "cached_free": (cached, fmt_bytes(cached))}
    if e.fits_with_expandable_segments is not None:
        yes = e.fits_with_expandable_segments
        numbers["expandable"] = (int(yes), "fits" if yes else "does not fit")
    if e.largest_batch_that_fits is not None:
        numbers["largest_batch"] = (e.largest_batch_that_fits, f"{e.largest_batch_that_fits:,}")
    return Result(text="\n".join(lines), numbers=numbers, svg=svg, svg_narrow=narrow)


EXPLAIN = Calculator(
    name="explain", title="Explain an out-of-memory error: a memory snapshot, byte by byte", compute=_explain,
    number_labels={"allocated": "allocated", "reserved": "reserved", "cached_free": "held by the allocator",
                   "expandable": "with expandable_segments", "largest_batch": "largest batch that fits"},
    inputs=(Input(name="snapshot", label="snapshot file", kind="file", default=None, choices=(".pickle", ".pkl")),
            Input(name="model", label="estimate for model", kind="choice", default=EXAMPLE["model"],
                  choices=(NO_MODEL,) + specs.preset_names()),
            Input(name="batch_size", label="batch size of the run", kind="int", default=EXAMPLE["batch_size"],
                  min=1, max=4096),
            Input(name="seq_len", label="sequence length", kind="choice", default=EXAMPLE["seq_len"], choices=SEQ_CHOICES),
            Input(name="precision", label="precision", kind="choice", default=EXAMPLE["precision"], choices=P.PRECISIONS),
            Input(name="gpu", label="GPU (its total memory)", kind="choice", default=EXAMPLE["gpu"],
                  choices=(NO_GPU,) + GPU_CHOICES)))
