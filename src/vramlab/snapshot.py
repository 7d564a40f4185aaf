"""Explain an out-of-memory error from a PyTorch memory snapshot: where every allocated byte went, by the
estimator's categories, what the allocator held beyond that, and whether the run would fit with
`expandable_segments` or a smaller batch. Pure Python (stdlib `pickle` only): runs in the browser.

The input is the pickle `torch.cuda.memory._dump_snapshot()` writes (the dict `torch.cuda.memory._snapshot()`
returns; what pytorch.org/memory_viz reads). Its format, from `torch/cuda/memory.py` (`_snapshot`'s
docstring) and `torch/csrc/cuda/Module.cpp` (`_memory_snapshot`):

    {"segments": [{"address", "total_size", "allocated_size", "active_size", "requested_size", "stream",
                   "segment_type": "small" | "large", "segment_pool_id", "is_expandable", "frames",
                   "blocks": [{"address", "size", "requested_size", "frames": [{"filename", "line", "name"}],
                               "state": "active_allocated" | "active_pending_free" | "inactive"}]}],
     "device_traces": [[{"action": "alloc" | "free_requested" | "free_completed" | "segment_alloc" |
                         "segment_free" | "segment_map" | "segment_unmap" | "snapshot" | "oom",
                         "addr" (or "device_free" for "oom"), "size", "stream", "time_us", "frames"}]],
     "allocator_settings": {...}}

A segment is one cudaMalloc (or one expandable segment); its blocks tile it. `memory_reserved()` is the
sum of the segments' `total_size`; `memory_allocated()` the sum of the sizes of the `active_allocated`
blocks (each request rounded up to 512 B: `size` >= `requested_size`). Older snapshots (a bare list of
segments; blocks with a `history` list instead of `frames`) are read as `torch/cuda/_memory_viz.py` reads
them (`_read`, `_block_extra_legacy`).

Where the bytes go (`explain`): every `active_allocated` block is put in exactly one category by the
explicit rules in `RULES`, matched against its stack frames (`classify`), so the categories sum to
`memory_allocated()` exactly. Reserved - allocated is split into blocks freed but awaiting other streams
(`active_pending_free`), free blocks inside segments that still hold tensors (fragmentation: what
`expandable_segments:True` gives back) and wholly free segments (what `empty_cache()` or the OOM path's
`release_cached_blocks` returns to the driver). The CUDA context and libraries outside the allocator are
`device_total - reserved - device_free`, read from the trace's `oom` entry when there is one.

In the browser (Pyodide) the page calls `explain_bytes(file_bytes, device_total=..., batch_size=...,
estimate=...)`: a JSON-ready dict with the report's lines; a ValueError's message is the one line to show.

Safety: `load_snapshot` unpickles with `SafeUnpickler`, which resolves no global except a few builtin
container types, so a file from the internet cannot run code (an ordinary `pickle.load` can).

Known limitations:
- Attribution follows the stack recorded at allocation (`_record_memory_history()` before the run; the
  default `stacks="all"` adds the C++ frames the gradient rules read). A block allocated before recording
  began has no frames: it is "unattributed", never guessed.
- A parameter's gradient is often allocated by the backward op that computed it and then stolen by
  `AccumulateGrad` (torch/csrc/autograd/functions/accumulate_grad.h), so its frames say "backward", not
  "gradient". Backward blocks are paired one-to-one with parameter blocks of the same size (`_pair_gradients`):
  paired ones are gradients, the rest backward transients (activation gradients). An activation gradient
  exactly the size of a parameter that has no gradient yet is miscounted as a gradient.
- Flat-buffer frameworks (DeepSpeed, FSDP) allocate parameters, gradients and states in their own code:
  their frames match the "optimizer" and "parameters" rules only where the names say so; the rest is
  "unknown", named as such.
- Tensors the training script itself makes (the input batch, the labels) are "unknown": no frame tells them
  from anything else a script allocates. On a GPU the backward ops run on the autograd engine's device
  thread; with `stacks="python"` their blocks may carry no frames ("unattributed"): record with the default
  `stacks="all"` (benchmarks/snapshot_probe.py records both, to see).
- The verdicts speak of the moment the snapshot was taken (the OOM): a later, larger peak of the same
  step is not in the snapshot. The batch answer assumes the blocks of the forward, checkpointing, KV-cache
  and backward rules scale linearly with the batch and everything else does not, and holds the
  fragmentation at its bytes (without expandable segments).
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Iterable

from . import checks as _checks
from .units import fmt_bytes

MAX_SNAPSHOT_BYTES = 1 << 32  # 4 GiB of pickle: beyond any snapshot a browser or a test should read
# expandable segments map pages: 20 MiB in the large pool, 2 MiB in the small one (CUDACachingAllocator.cpp,
# `ExpandableSegment`); what is mapped but unused is at most the last page of each (fitting._PAGE)
EXPANDABLE_SLACK = (20 + 2) << 20
UNEXPECTED_SHARE = 0.05  # a category "not expected" exceeds the estimate's bytes by more than this share
UNEXPECTED_FLOOR = 1 << 20  # ... and by at least this many bytes (a cuBLAS workspace is not news)
OUTSIDE_NOTE = 256 << 20  # memory outside the allocator beyond the context worth a note

CATEGORIES: tuple[str, ...] = ("parameters", "gradients", "optimizer_states", "activations", "temporaries",
                               "kv_cache", "inputs", "other", "unknown", "unattributed")
ESTIMATE_CATEGORIES = CATEGORIES[:8]  # memory.CATEGORIES: what an estimate has
UNATTRIBUTED = ("unattributed (record history with torch.cuda.memory._record_memory_history to attribute it)")
# what a category over its estimate usually means: one line each, shown beside the finding
HINTS = {"gradients": "gradients alive outside backward: optimizer.zero_grad(set_to_none=True) frees them "
                      "(or gradient accumulation keeps them on purpose)",
         "optimizer_states": "more state than the optimizer estimated: another optimizer, or states kept in fp32",
         "activations": "more saved for backward than estimated: eager attention, no checkpointing, or a larger "
                        "batch or sequence than estimated",
         "temporaries": "backward transients or optimizer-step copies: a fused/for-loop optimizer takes less",
         "kv_cache": "a KV cache in training: transformers builds one unless use_cache=False",
         "unknown": "tensors the script itself allocated (the batch, labels, metrics kept on the GPU)",
         "other": "library workspaces (cuBLAS, cuDNN) beyond one per stream"}
STATES = ("active_allocated", "active_pending_free", "active_awaiting_free", "inactive")


# ----------------------------------------------------------------------------- reading the pickle safely

class RefusedGlobal(pickle.UnpicklingError):
    """A pickle that names a global a snapshot never needs."""


class SafeUnpickler(pickle.Unpickler):
    """Unpickles plain data only: a snapshot is dicts, lists, tuples, ints, floats, strings, bools and
    None, none of which needs a global. Any global other than these builtin containers is refused, so a
    pickle that names `os.system` (or any class) fails before anything runs."""

    ALLOWED = frozenset({("builtins", "set"), ("builtins", "frozenset"), ("builtins", "bytearray"),
                         ("builtins", "complex"), ("__builtin__", "set"), ("__builtin__", "frozenset")})

    def find_class(self, module: str, name: str):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise RefusedGlobal(f"it references {module}.{name}, and a memory snapshot is plain data "
                                     "(refused: unpickling it could run code)")

    def persistent_load(self, pid):
        raise RefusedGlobal("it uses persistent ids, and a memory snapshot is plain data")


def safe_loads(data: bytes):
    """`pickle.loads` that resolves no global beyond builtin containers (`SafeUnpickler`)."""
    return SafeUnpickler(io.BytesIO(data)).load()


# ----------------------------------------------------------------------------- the snapshot, checked

@dataclass(frozen=True)
class Frame:
    filename: str
    line: int
    name: str


@dataclass(frozen=True)
class Block:
    """One block of a segment: `size` bytes (a multiple of 512), `requested` of them asked for."""

    segment: int  # index of its segment
    address: int
    size: int
    requested: int
    state: str  # active_allocated | active_pending_free | inactive
    frames: tuple[Frame, ...]  # innermost first, as PyTorch records them


@dataclass(frozen=True)
class Segment:
    address: int
    total_size: int
    allocated_size: int  # as the file says (cross-checked with the blocks)
    stream: int
    segment_type: str
    is_expandable: bool


@dataclass(frozen=True)
class OOM:
    """The trace's `oom` entry: the request that failed and what the driver still had free."""

    size: int  # bytes requested
    device_free: int  # cudaMemGetInfo's free at the failure
    frames: tuple[Frame, ...]


@dataclass(frozen=True)
class Snapshot:
    segments: tuple[Segment, ...]
    blocks: tuple[Block, ...]
    oom: OOM | None = None  # the last oom entry of the traces, if any
    trace_entries: int = 0  # entries in all device traces (0: history not recorded, or none kept)
    expandable_segments: bool | None = None  # allocator_settings, where the file says
    history_recorded: bool = False  # some block, segment or trace entry carries frames

    @property
    def reserved(self) -> int:
        """`torch.cuda.memory_reserved()`: the segments' bytes."""
        return sum(s.total_size for s in self.segments)

    @property
    def allocated(self) -> int:
        """`torch.cuda.memory_allocated()`: the active_allocated blocks' bytes (rounded sizes)."""
        return sum(b.size for b in self.blocks if b.state == "active_allocated")

    @property
    def requested(self) -> int:
        """What the program asked for: the active_allocated blocks' requested sizes (`_memory_viz.segsum`'s
        total_allocated)."""
        return sum(b.requested for b in self.blocks if b.state == "active_allocated")


def _need(d, key: str, where: str, kind=int):
    if not isinstance(d, dict) or key not in d:
        raise ValueError(f"not a memory snapshot: {where} has no {key!r}")
    v = d[key]
    if kind is int:
        if _checks.index(v) is None or v < 0:
            raise ValueError(f"not a memory snapshot: {where}[{key!r}] must be a whole number of bytes, "
                             f"got {_checks.show(v)}")
        return int(v)
    if not isinstance(v, kind):
        raise ValueError(f"not a memory snapshot: {where}[{key!r}] must be a {kind.__name__}, got {_checks.show(v)}")
    return v


def _frames(raw, where: str) -> tuple[Frame, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, (list, tuple)):
        raise ValueError(f"not a memory snapshot: {where} frames must be a list, got {_checks.show(raw)}")
    out = []
    for f in raw:
        if not isinstance(f, dict):
            raise ValueError(f"not a memory snapshot: {where} has a frame that is not a dict: {_checks.show(f)}")
        line = f.get("line", 0)
        out.append(Frame(filename=str(f.get("filename", "")), line=line if isinstance(line, int) else 0,
                         name=str(f.get("name", ""))))
    return tuple(out)


def _block(b, i: int, where: str, address: int) -> Block:
    size = _need(b, "size", where)
    state = _need(b, "state", where, str)
    if state not in STATES:
        raise ValueError(f"not a memory snapshot: {where}['state'] must be one of {', '.join(STATES[:3])}, "
                         f"got {_checks.show(state)}")
    if "frames" in b or "history" not in b:  # _memory_viz._block_extra
        frames, requested = _frames(b.get("frames"), where), b.get("requested_size", size)
    else:  # the older format: the first history entry (_memory_viz._block_extra_legacy)
        hist = b["history"] if isinstance(b["history"], list) else []
        first = hist[0] if hist and isinstance(hist[0], dict) else {}
        frames, requested = _frames(first.get("frames"), where), first.get("real_size", size)
    if _checks.index(requested) is None or not 0 <= requested <= size:
        requested = size
    addr = b.get("address", address)
    return Block(segment=i, address=addr if isinstance(addr, int) else address, size=size, requested=int(requested),
                 state="active_pending_free" if state == "active_awaiting_free" else state, frames=frames)


def _devices(raw_segments: list) -> list[int]:
    return sorted({s["device"] for s in raw_segments if isinstance(s, dict) and _checks.index(s.get("device")) is not None})


def parse_snapshot(data, *, device: int | None = None) -> Snapshot:
    """A `Snapshot` from the unpickled object (a dict as `_snapshot()` returns, or a bare list of segments
    as older `memory_snapshot()` files hold); a ValueError in one line when it is not one. `_snapshot()` holds
    every device's segments: with more than one, `device` chooses (its segments and its trace)."""
    if isinstance(data, list):  # segments only (torch/cuda/_memory_viz.py, `_read`)
        data = {"segments": data, "device_traces": []}
    if not isinstance(data, dict) or "segments" not in data:
        kind = type(data).__name__
        keys = f" with keys {sorted(map(str, data))[:5]}" if isinstance(data, dict) else ""
        raise ValueError(f"not a memory snapshot: expected the dict torch.cuda.memory._snapshot() returns "
                         f"(with 'segments'), got a {kind}{keys}")
    raw_segments = data["segments"]
    if not isinstance(raw_segments, list):
        raise ValueError(f"not a memory snapshot: 'segments' must be a list, got {_checks.show(raw_segments)}")
    devices = _devices(raw_segments)
    if device is None and len(devices) > 1:
        raise ValueError(f"the snapshot holds devices {', '.join(map(str, devices))}: choose one (device=, --device)")
    if device is not None:
        device = _checks.whole("device", device, lo=0, hi=1 << 16)
        if devices and device not in devices:
            raise ValueError(f"device {device} has no segments in this snapshot (it holds {', '.join(map(str, devices))})")
        raw_segments = [s for s in raw_segments if not isinstance(s, dict) or s.get("device", device) == device]
    segments, blocks, recorded = [], [], False
    for i, s in enumerate(raw_segments):
        where = f"segments[{i}]"
        seg = Segment(address=_need(s, "address", where), total_size=_need(s, "total_size", where),
                      allocated_size=int(s.get("allocated_size", 0)) if _checks.index(s.get("allocated_size", 0)) is not None else 0,
                      stream=int(s.get("stream", 0)) if _checks.index(s.get("stream", 0)) is not None else 0,
                      segment_type=str(s.get("segment_type", "large")), is_expandable=bool(s.get("is_expandable", False)))
        raw_blocks = _need(s, "blocks", where, list)
        addr = seg.address
        for j, b in enumerate(raw_blocks):
            blk = _block(b, i, f"{where}['blocks'][{j}]", addr)
            addr += blk.size
            recorded = recorded or bool(blk.frames)
            blocks.append(blk)
        segments.append(seg)
        recorded = recorded or bool(s.get("frames"))
    traces = data.get("device_traces") or []
    if not isinstance(traces, list):
        raise ValueError(f"not a memory snapshot: 'device_traces' must be a list, got {_checks.show(traces)}")
    oom, entries = None, 0
    if len(traces) > 1:  # one trace per device, by index
        chosen = device if device is not None else (devices[0] if devices else 0)
        traces = traces[chosen:chosen + 1]
    for trace in traces:
        if not isinstance(trace, list):
            raise ValueError("not a memory snapshot: each of 'device_traces' must be a list of entries")
        for e in trace:
            entries += 1
            if isinstance(e, dict):
                recorded = recorded or bool(e.get("frames"))
                if e.get("action") == "oom":
                    oom = OOM(size=_need(e, "size", "an oom entry"), device_free=_need(e, "device_free", "an oom entry"),
                              frames=_frames(e.get("frames"), "an oom entry"))
    settings = data.get("allocator_settings")
    expandable = settings.get("expandable_segments") if isinstance(settings, dict) else None
    if expandable is None and any(s.is_expandable for s in segments):
        expandable = True
    return Snapshot(segments=tuple(segments), blocks=tuple(blocks), oom=oom, trace_entries=entries,
                    expandable_segments=None if expandable is None else bool(expandable),
                    history_recorded=recorded or entries > 0)


def load_snapshot(source: "bytes | bytearray | memoryview | str | object", *, device: int | None = None) -> Snapshot:
    """Read a snapshot from the pickle's bytes, a file path, or an already unpickled dict. Unpickles with
    `SafeUnpickler` (no code runs); a truncated or foreign file gives a ValueError in one line. `device`:
    which GPU's segments, when the file holds several."""
    if isinstance(source, (dict, list)):
        return parse_snapshot(source, device=device)
    if isinstance(source, str) or hasattr(source, "__fspath__"):
        try:
            with open(source, "rb") as f:
                source = f.read(MAX_SNAPSHOT_BYTES + 1)
        except OSError as e:
            raise ValueError(f"cannot read snapshot {str(source)!r}: {e.strerror or e}") from None
    if not isinstance(source, (bytes, bytearray, memoryview)):
        raise ValueError(f"snapshot must be a pickle's bytes, a path or the dict _snapshot() returns, "
                         f"got {_checks.show(source)}")
    data = bytes(source)
    if not data:
        raise ValueError("not a memory snapshot: the file is empty")
    if len(data) > MAX_SNAPSHOT_BYTES:
        raise ValueError(f"snapshot is larger than {fmt_bytes(MAX_SNAPSHOT_BYTES)}: not read")
    try:
        obj = safe_loads(data)
    except RefusedGlobal as e:
        raise ValueError(f"not a memory snapshot: {e}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError, MemoryError,
            OverflowError, UnicodeDecodeError, RecursionError) as e:
        truncated = isinstance(e, EOFError) or "truncated" in str(e)
        what = "it ends early (truncated?)" if truncated else f"it is not a readable pickle ({' '.join(str(e).split())[:80]})"
        raise ValueError(f"not a memory snapshot: {what}") from None
    return parse_snapshot(obj, device=device)


# ----------------------------------------------------------------------------- the rules: frames -> category

@dataclass(frozen=True)
class Rule:
    """A frame rule: matches a block when any of its frames has a function name in `names` (or containing
    one of `name_parts`; any function when both are empty) in a file whose path contains one of `files`
    (any file when `files` is empty)."""

    key: str  # the rule's name, as reported
    category: str
    why: str
    names: frozenset = frozenset()
    name_parts: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    scales_with_batch: bool = False

    def matches(self, frames: Iterable[Frame]) -> bool:
        for f in frames:
            path = f.filename.replace("\\", "/")
            if self.files and not any(p in path for p in self.files):
                continue
            if (not self.names and not self.name_parts) or f.name in self.names or \
                    any(p in f.name for p in self.name_parts):
                return True
        return False


# First match wins: a library workspace is one whatever called it; a state created inside optimizer.step()
# is a state, not a step temporary; a tensor recomputed by checkpointing inside backward is an activation;
# a tensor the KV cache allocates inside forward is the cache. Sources: torch/optim/adam.py (`_init_group`
# creates exp_avg, exp_avg_sq, step), torch/nn/modules/module.py (`_apply` moves parameters and buffers),
# torch/csrc/autograd/functions/accumulate_grad.h (`AccumulateGrad` sets .grad, stealing the incoming
# gradient when it can), torch/csrc/autograd/engine.cpp (backward runs in `Engine::thread_main` /
# `evaluate_function`, each op's `*Backward0::apply`), transformers/cache_utils.py (`update`).
# Checked on the real Python stacks of a real training step (tests/test_snapshot.py).
RULES: tuple[Rule, ...] = (
    Rule("cuBLAS/cuDNN workspace", "other", "a library workspace taken from the caching allocator (one per "
         "stream and thread: the backward thread has its own)",
         name_parts=("cublas", "Cublas", "CUDABlas", "BlasLtWorkspace", "cudnn", "Cudnn")),
    Rule("optimizer state init", "optimizer_states", "created by the optimizer's state initialisation",
         names=frozenset({"_init_group", "_init_state", "init_state", "_lazy_init_state", "initialize_state"}),
         files=("optim",)),
    Rule("optimizer step", "temporaries", "allocated inside optimizer.step() (foreach/fused intermediates)",
         names=frozenset({"step", "_step", "_single_tensor_adam", "_multi_tensor_adam", "_fused_adam",
                          "_single_tensor_adamw", "_multi_tensor_adamw", "_fused_adamw", "_multi_tensor_sgd",
                          "_single_tensor_sgd"}), files=("/optim/",)),
    Rule("gradient clipping", "temporaries", "norms computed by clip_grad_norm_",
         names=frozenset({"clip_grad_norm_", "_get_total_norm", "_clip_grads_with_norm_"}), files=("clip_grad",)),
    Rule("recomputed activation", "activations", "recomputed by activation checkpointing during backward",
         files=("torch/utils/checkpoint.py",), scales_with_batch=True),
    Rule("gradient (AccumulateGrad)", "gradients", "allocated by AccumulateGrad: a parameter's .grad",
         name_parts=("AccumulateGrad", "accumulate_grad", "accumulateGrad")),
    Rule("backward", "temporaries", "allocated by the autograd engine during backward",
         names=frozenset({"backward", "_engine_run_backward", "run_backward", "grad"}),
         name_parts=("torch::autograd::Engine", "evaluate_function", "Backward0::apply", "Backward1::apply",
                     "Backward::apply", "call_function(", "validate_outputs"),
         scales_with_batch=True),
    Rule("KV cache", "kv_cache", "written by the model's KV cache (transformers' cache_utils; in training too, where "
         "use_cache defaults to True: pass use_cache=False)",
         files=("transformers/cache_utils.py",), scales_with_batch=True),
    Rule("model built or moved", "parameters", "a module's parameters and buffers: built on the device, moved "
         "by .to()/.cuda() (Module._apply) or loaded",
         names=frozenset({"_apply", "to", "cuda", "to_empty", "convert", "reset_parameters", "load_state_dict",
                          "_load_from_state_dict", "from_pretrained", "_load_pretrained_model", "from_config",
                          "_from_config", "_init_weights", "init_weights", "post_init", "fully_shard",
                          "__new__"}),
         files=("torch/nn/modules/module.py", "torch/nn/parameter.py", "transformers/modeling_utils.py",
                "torch/distributed/fsdp", "torch/nn/modules/")),
    Rule("module constructor", "parameters", "a module's __init__ allocating its parameters on the device",
         names=frozenset({"__init__"}), files=("torch/nn/modules/", "transformers/models/")),
    Rule("forward", "activations", "allocated inside a module's forward (kept for backward, or live outputs)",
         names=frozenset({"forward", "_call_impl", "_wrapped_call_impl", "_forward_unimplemented"}),
         scales_with_batch=True),
    Rule("functional outside a module", "activations", "a torch.nn.functional op outside any forward (the loss)",
         files=("torch/nn/functional.py", "transformers/loss/"), scales_with_batch=True),
)
BACKWARD = "backward"
PAIRED_GRADIENT = "gradient (backward, paired with a parameter)"
NO_RULE = "no rule matched"
NO_FRAMES = "no frames"
_BY_KEY = {r.key: r for r in RULES}


def classify(frames: tuple[Frame, ...]) -> Rule | None:
    """The first rule of `RULES` whose frames match, or None (the category "unknown")."""
    for rule in RULES:
        if rule.matches(frames):
            return rule
    return None


# where the failed request was made (its rule's key) -> the part of a training step it came in
STEP_PART_OF_RULE = {"forward": "forward", "functional outside a module": "forward", "KV cache": "forward",
                     "backward": "backward", "gradient (AccumulateGrad)": "backward",
                     "recomputed activation": "backward", "optimizer state init": "optimizer",
                     "optimizer step": "optimizer", "gradient clipping": "optimizer"}


def phase_to_compare(snapshot: "Snapshot", phases: list):
    """(phase, part): the phase of `phases` (`memory.training_phases`' order: forward end first,
    optimizer.step() last) to set beside `snapshot`, and the part of the step its failed request came in
    ("forward", "backward", "optimizer"; None without an OOM or its frames): the forward's end, the largest
    backward phase, optimizer.step(), else the step's peak. `vramlab explain` and the page's calculator both
    ask this."""
    rule = classify(snapshot.oom.frames) if snapshot.oom is not None and snapshot.oom.frames else None
    part = STEP_PART_OF_RULE.get(rule.key) if rule else None
    if part == "forward":
        return phases[0], part
    if part == "optimizer":
        return phases[-1], part
    inside = phases[1:-1] if part == "backward" and len(phases) > 2 else phases
    return max(inside, key=lambda b: b.total), part


def _pair_gradients(blocks: list[tuple[Block, str]]) -> list[tuple[Block, str]]:
    """AccumulateGrad steals the gradient the backward op allocated: a backward block the size of a parameter
    block is that parameter's gradient. Pairs one-to-one by size (largest first); the rest stay backward."""
    free = {}
    for b, key in blocks:
        if _BY_KEY.get(key) and _BY_KEY[key].category == "parameters":
            free[b.size] = free.get(b.size, 0) + 1
    for b, key in blocks:  # parameters that already have an AccumulateGrad-allocated gradient
        if key == "gradient (AccumulateGrad)" and free.get(b.size):
            free[b.size] -= 1
    out = []
    for b, key in sorted(blocks, key=lambda t: -t[0].size):
        if key == BACKWARD and free.get(b.size):
            free[b.size] -= 1
            key = PAIRED_GRADIENT
        out.append((b, key))
    return out


def _category(key: str) -> str:
    if key == PAIRED_GRADIENT:
        return "gradients"
    if key == NO_RULE:
        return "unknown"
    if key == NO_FRAMES:
        return "unattributed"
    return _BY_KEY[key].category


def _scales(key: str) -> bool:
    return key in _BY_KEY and _BY_KEY[key].scales_with_batch


# ----------------------------------------------------------------------------- the explanation

@dataclass(frozen=True, kw_only=True)
class Explanation:
    """Where a snapshot's bytes are. All byte counts are integers; `by_category` sums to `allocated`
    exactly and `pending_free + fragmentation + free_segments + uncovered` to `reserved - allocated`."""

    allocated: int  # torch.cuda.memory_allocated() at the snapshot
    reserved: int  # torch.cuda.memory_reserved()
    requested: int  # what the program asked for (allocated less the 512 B rounding)
    by_category: dict  # CATEGORIES -> bytes (zeros left out), sums to `allocated`
    by_rule: dict  # the rule that matched -> bytes (finer than by_category), sums to `allocated`
    pending_free: int  # freed, awaiting another stream's use (record_stream)
    fragmentation: int  # free blocks inside segments that still hold tensors
    free_segments: int  # wholly free segments (empty_cache would return them)
    uncovered: int  # segment bytes no block covers (0 in every well-formed snapshot)
    largest_free_block: int  # the largest free block: no request larger than it is served without cudaMalloc
    scaling: int  # bytes assumed proportional to the batch (activations, KV cache, inputs, backward transients)
    history_recorded: bool
    oom: OOM | None = None
    oom_rule: str = ""  # the rule the failed request's frames match
    outside: int | None = None  # device_total - reserved - device_free: the CUDA context and non-PyTorch memory
    capacity: int | None = None  # what PyTorch could hold: reserved + device_free (at an OOM), or device_total - outside
    estimate: dict | None = None  # the estimate's bytes by category, where given
    unexpected: tuple = ()  # (category, snapshot bytes, estimate bytes), largest excess first
    fits_as_is: bool | None = None
    fits_with_expandable_segments: bool | None = None
    batch_size: int | None = None
    largest_batch_that_fits: int | None = None  # at the snapshot's allocator setting
    largest_batch_with_expandable_segments: int | None = None
    notes: tuple = ()

    @property
    def cached_free(self) -> int:
        """reserved - allocated: what the allocator holds beyond the tensors."""
        return self.reserved - self.allocated

    def to_dict(self) -> dict:
        """JSON-ready (the page's worker and `vramlab explain --json`)."""
        d = {k: getattr(self, k) for k in ("allocated", "reserved", "requested", "pending_free", "fragmentation",
                                           "free_segments", "uncovered", "largest_free_block", "scaling",
                                           "history_recorded", "oom_rule", "outside", "capacity", "estimate",
                                           "fits_as_is", "fits_with_expandable_segments", "batch_size",
                                           "largest_batch_that_fits", "largest_batch_with_expandable_segments")}
        d.update(by_category=dict(self.by_category), by_rule=dict(self.by_rule), cached_free=self.cached_free,
                 oom=None if self.oom is None else {"size": self.oom.size, "device_free": self.oom.device_free},
                 unexpected=[{"category": c, "snapshot": s, "estimate": e} for c, s, e in self.unexpected],
                 notes=list(self.notes))
        return d

    def rows(self) -> list[tuple[str, int, int | None]]:
        """(category, snapshot bytes, estimate bytes or None), the estimator's order, then unknown/unattributed."""
        est = self.estimate or {}
        cats = [c for c in CATEGORIES if self.by_category.get(c) or est.get(c)]
        return [(c, self.by_category.get(c, 0), est.get(c) if self.estimate is not None else None) for c in cats]

    def verdicts(self) -> list[str]:
        out = []
        if self.oom is not None:
            out.append(f"the failed request: {fmt_bytes(self.oom.size)} ({self.oom_rule or 'no frames'}) with "
                       f"{fmt_bytes(self.oom.device_free)} free on the device and the largest cached free block "
                       f"{fmt_bytes(self.largest_free_block)}")
        if self.unexpected:
            out.append("not expected by the estimate:")
            out += [f"  {c.replace('_', ' ')} {fmt_bytes(s)} vs {fmt_bytes(e)} estimated (+{fmt_bytes(s - e)})"
                    + (f": {HINTS[c]}" if c in HINTS else "") for c, s, e in self.unexpected]
        elif self.estimate is not None:
            out.append("every category is within the estimate (+5 %)")
        if self.fits_with_expandable_segments is not None:
            frag = self.fragmentation + self.free_segments
            out.append(f"with expandable_segments:True: {'fits' if self.fits_with_expandable_segments else 'does NOT fit'} "
                       f"({fmt_bytes(frag)} of cached free space becomes usable, less a page of each pool)")
        if self.largest_batch_that_fits is not None:
            b = self.largest_batch_that_fits
            out.append(f"batch size {self.batch_size}: the largest that fits here is {b}" if b else
                       f"batch size {self.batch_size}: not even batch size 1 fits (the model states alone are too large)")
            if self.largest_batch_with_expandable_segments is not None:
                out[-1] += f" ({self.largest_batch_with_expandable_segments} with expandable_segments)"
        return out

    def table_lines(self) -> list[str]:
        """The categories as aligned text: category, snapshot bytes (and estimate, difference)."""
        est = self.estimate is not None
        head = f"{'category':<18}{'snapshot':>12}" + (f"{'estimate':>12}{'difference':>12}" if est else "")
        out = [head, "-" * len(head)]
        for c, s, e in self.rows():
            row = f"{c.replace('_', ' '):<18}{fmt_bytes(s):>12}"
            if est:
                row += f"{fmt_bytes(e or 0):>12}{fmt_bytes(s - (e or 0)):>12}"
            out.append(row)
        total = sum(self.estimate.values()) if est else 0
        out.append(f"{'allocated':<18}{fmt_bytes(self.allocated):>12}"
                   + (f"{fmt_bytes(total):>12}{fmt_bytes(self.allocated - total):>12}" if est else ""))
        return out

    def allocator_lines(self) -> list[str]:
        """reserved - allocated, named part by part; what sits outside the allocator."""
        out = [f"reserved {fmt_bytes(self.reserved)} - allocated {fmt_bytes(self.allocated)} = "
               f"{fmt_bytes(self.cached_free)} held by the caching allocator:",
               f"  fragmentation (free blocks in segments holding tensors)  {fmt_bytes(self.fragmentation)}",
               f"  wholly free segments (empty_cache returns them)          {fmt_bytes(self.free_segments)}"]
        if self.pending_free:
            out.append(f"  freed, awaiting another stream (record_stream)           {fmt_bytes(self.pending_free)}")
        if self.uncovered:
            out.append(f"  not covered by any block                                 {fmt_bytes(self.uncovered)}")
        if self.allocated != self.requested:
            out.append(f"(allocated includes {fmt_bytes(self.allocated - self.requested)} of rounding to 512 B blocks)")
        if self.outside is not None:
            out.append(f"outside the allocator (CUDA context, libraries): {fmt_bytes(self.outside)}")
        if self.by_category.get("unattributed"):
            out.append("unattributed: record history with torch.cuda.memory._record_memory_history() to attribute it")
        return out

    def lines(self) -> list[str]:
        """The plain-text report: the categories, the allocator's share, the verdicts, the notes."""
        return self.table_lines() + self.allocator_lines() + self.verdicts() + list(self.notes)

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _estimate_dict(estimate) -> dict[str, int]:
    """An estimate as category -> bytes: a MemoryBreakdown (anything with `to_dict`), `vramlab estimate
    --json`'s object (its "breakdown"), or a plain dict of categories."""
    if hasattr(estimate, "to_dict") and callable(estimate.to_dict):
        estimate = estimate.to_dict()
    if isinstance(estimate, dict) and isinstance(estimate.get("breakdown"), dict):
        estimate = estimate["breakdown"]
    if not isinstance(estimate, dict) or not estimate:
        raise ValueError(f"estimate must be a MemoryBreakdown, `vramlab estimate --json`'s object or a dict of "
                         f"categories to bytes, got {_checks.show(estimate)}")
    unknown = sorted(set(map(str, estimate)) - set(ESTIMATE_CATEGORIES))
    if unknown:
        raise ValueError(f"estimate has unknown categories {', '.join(unknown)}; allowed: {', '.join(ESTIMATE_CATEGORIES)}")
    return {c: _checks.whole(f"estimate[{c!r}]", v, lo=0, hi=_checks.MAX_BYTES) for c, v in estimate.items()}


@dataclass(frozen=True)
class _CacheSplit:
    """reserved - allocated, by where the free bytes sit (CUDACachingAllocator.cpp's block states)."""

    pending: int  # active_pending_free: freed, awaiting another stream's use
    fragmentation: int  # inactive blocks of segments that still hold a live block
    free_segments: int  # segments whose blocks are all inactive
    uncovered: int  # segment bytes no block covers
    largest_free: int  # the largest inactive block


def _cache_split(snap: Snapshot) -> _CacheSplit:
    per_segment: dict[int, list[Block]] = {}
    for b in snap.blocks:
        per_segment.setdefault(b.segment, []).append(b)
    frag = free_segs = uncovered = 0
    for i, seg in enumerate(snap.segments):
        mine = per_segment.get(i, [])
        inactive = sum(b.size for b in mine if b.state == "inactive")
        uncovered += max(0, seg.total_size - sum(b.size for b in mine))
        if all(b.state == "inactive" for b in mine):
            free_segs += inactive
        else:
            frag += inactive
    return _CacheSplit(pending=sum(b.size for b in snap.blocks if b.state == "active_pending_free"),
                       fragmentation=frag, free_segments=free_segs, uncovered=uncovered,
                       largest_free=max([0] + [b.size for b in snap.blocks if b.state == "inactive"]))


def _attribute(snap: Snapshot) -> tuple[dict[str, int], dict[str, int], int]:
    """(bytes by category, bytes by rule, bytes that scale with the batch) of the active_allocated blocks."""
    keyed = []
    for b in snap.blocks:
        if b.state == "active_allocated":
            rule = classify(b.frames) if b.frames else None
            keyed.append((b, rule.key if rule else (NO_RULE if b.frames else NO_FRAMES)))
    by_category: dict[str, int] = {}
    by_rule: dict[str, int] = {}
    scaling = 0
    for b, key in _pair_gradients(keyed):
        c = _category(key)
        by_category[c] = by_category.get(c, 0) + b.size
        by_rule[key] = by_rule.get(key, 0) + b.size
        scaling += b.size if _scales(key) else 0
    return ({c: by_category[c] for c in CATEGORIES if by_category.get(c)},
            dict(sorted(by_rule.items(), key=lambda kv: -kv[1])), scaling)


def _consistency_notes(snap: Snapshot) -> list[str]:
    notes = []
    covered = sum(b.size for b in snap.blocks)
    if covered > snap.reserved:
        notes.append(f"note: the blocks cover {fmt_bytes(covered - snap.reserved)} more than the segments' total_size")
    live = {}
    for b in snap.blocks:
        if b.state == "active_allocated":
            live[b.segment] = live.get(b.segment, 0) + b.size
    mismatch = [i for i, seg in enumerate(snap.segments) if seg.allocated_size and seg.allocated_size != live.get(i, 0)]
    if mismatch:
        notes.append(f"note: {len(mismatch)} segment(s) state an allocated_size their blocks do not sum to; "
                     "the blocks are used")
    if not snap.history_recorded and snap.blocks:
        notes.append("no stack frames in this snapshot: call torch.cuda.memory._record_memory_history() before "
                     "the run to attribute the bytes")
    return notes


def _capacity(snap: Snapshot, device_total, context_bytes, notes: list) -> tuple[int | None, int | None]:
    """(what lies outside the allocator, what PyTorch could hold): from the OOM entry (reserved + device_free;
    device_total - that is outside), else device_total - context_bytes; (None, None) when not known."""
    if snap.oom is not None:
        capacity = snap.reserved + snap.oom.device_free
        if device_total is None:
            return None, capacity
        outside = device_total - capacity
        if outside < 0:
            notes.append("note: device_total is smaller than reserved + the OOM's device_free; ignored")
            return None, capacity
        if context_bytes is not None and outside - context_bytes > OUTSIDE_NOTE:
            notes.append(f"note: {fmt_bytes(outside - context_bytes)} outside the allocator beyond the CUDA context "
                         f"({fmt_bytes(context_bytes)}): another process, NCCL or a library allocating with cudaMalloc")
        return outside, capacity
    if device_total is not None and context_bytes is not None:
        return context_bytes, max(0, device_total - context_bytes)
    if device_total is not None:
        notes.append("note: no OOM entry in the trace and no context_bytes: the CUDA context is not known, so "
                     "the verdicts are not computed")
    return None, None


def _unexpected(by_category: dict, est: dict | None) -> tuple:
    """(category, snapshot bytes, estimate bytes) over the estimate by > UNEXPECTED_SHARE and UNEXPECTED_FLOOR,
    the largest excess first; "unattributed" is not a finding (it says nothing)."""
    if est is None:
        return ()
    rows = [(c, by_category.get(c, 0), est.get(c, 0)) for c in CATEGORIES if c != "unattributed"]
    over = [(c, s, e) for c, s, e in rows if s - e > max(UNEXPECTED_SHARE * e, UNEXPECTED_FLOOR)]
    return tuple(sorted(over, key=lambda t: -(t[1] - t[2])))


def _largest_batch(fixed: int, scaling: int, batch: int, extra: int, capacity: int, limit: int = 1 << 16) -> int:
    """The largest b <= limit with fixed + scaling * b / batch + extra <= capacity (0 if none)."""
    room = capacity - fixed - extra
    if room < 0:
        return 0
    if scaling == 0:
        return limit
    return min(limit, room * batch // scaling)


def explain(snapshot, *, estimate=None, device_total: int | None = None, context_bytes: int | None = None,
            batch_size: int | None = None, device: int | None = None) -> Explanation:
    """Attribute a snapshot's allocated bytes to categories by frames (`RULES`), name the allocator's share,
    compare with `estimate` (a MemoryBreakdown, `vramlab estimate --json`'s object, or a dict), and say
    whether the state would fit with expandable segments or at a smaller batch.

    snapshot: a `Snapshot`, or anything `load_snapshot` reads (bytes, a path, the dict); `device` chooses the
      GPU when it holds several.
    device_total: the GPU's bytes as cudaMemGetInfo reports total; with the trace's `oom` entry it gives the
      memory outside the allocator (total - reserved - device_free). Without an `oom` entry, `context_bytes`
      (the CUDA context and libraries) is taken off it; not given, the context is not known and the capacity is
      not guessed.
    batch_size: the run's batch (sequences a step); `estimate`'s own "batch_size" when it is `vramlab estimate
      --json`'s object.
    The verdicts: with expandable segments, allocated + awaiting-free + the failed request + a page of each
    pool (EXPANDABLE_SLACK) must fit the capacity; at batch b', the blocks of batch-scaling rules (and the
    failed request, if its rule scales) times b'/batch, plus the rest, plus the fragmentation as it is (or
    the slack, with expandable segments).
    Source of the categories: `memory.CATEGORIES`; of the allocator's terms: CUDACachingAllocator.cpp."""
    if isinstance(estimate, dict) and batch_size is None and _checks.index(estimate.get("batch_size")) is not None:
        batch_size = estimate["batch_size"]
    snap = snapshot if isinstance(snapshot, Snapshot) else load_snapshot(snapshot, device=device)
    est = None if estimate is None else _estimate_dict(estimate)
    if device_total is not None:
        device_total = _checks.whole("device_total", device_total, lo=1, hi=_checks.MAX_BYTES)
    if context_bytes is not None:
        context_bytes = _checks.whole("context_bytes", context_bytes, lo=0, hi=_checks.MAX_BYTES)
    if batch_size is not None:
        batch_size = _checks.whole("batch_size", batch_size)

    by_category, by_rule, scaling = _attribute(snap)
    cache = _cache_split(snap)
    notes = _consistency_notes(snap)
    outside, capacity = _capacity(snap, device_total, context_bytes, notes)
    request = snap.oom.size if snap.oom is not None else 0
    oom_rule = ""
    if snap.oom is not None and snap.oom.frames:
        rule = classify(snap.oom.frames)
        oom_rule = rule.key if rule else NO_RULE

    fits_as_is = fits_exp = largest = largest_exp = None
    if capacity is not None:
        # as is: an OOM snapshot did not fit (that is why it exists); any other needs its segments again
        fits_as_is = False if snap.oom is not None else snap.reserved <= capacity
        # expandable segments: the free space between tensors is usable, less the last page of each pool
        fits_exp = snap.allocated + cache.pending + request + EXPANDABLE_SLACK <= capacity
        if snap.expandable_segments:
            fits_exp = fits_as_is
            notes.append("note: expandable segments were already on in this run")
        if batch_size is not None:
            req_scales = request if _scales(oom_rule) else 0
            fixed = snap.allocated - scaling + cache.pending + (request - req_scales)
            largest = _largest_batch(fixed, scaling + req_scales, batch_size, cache.fragmentation, capacity)
            largest_exp = _largest_batch(fixed, scaling + req_scales, batch_size, EXPANDABLE_SLACK, capacity)
    elif batch_size is not None:
        notes.append("note: the capacity is not known (no OOM entry, or no device_total): no batch answer")

    return Explanation(allocated=snap.allocated, reserved=snap.reserved, requested=snap.requested,
                       by_category=by_category, by_rule=by_rule, pending_free=cache.pending,
                       fragmentation=cache.fragmentation, free_segments=cache.free_segments, uncovered=cache.uncovered,
                       largest_free_block=cache.largest_free, scaling=scaling, history_recorded=snap.history_recorded,
                       oom=snap.oom, oom_rule=oom_rule, outside=outside, capacity=capacity, estimate=est,
                       unexpected=_unexpected(by_category, est), fits_as_is=fits_as_is,
                       fits_with_expandable_segments=fits_exp, batch_size=batch_size, largest_batch_that_fits=largest,
                       largest_batch_with_expandable_segments=largest_exp, notes=tuple(notes))


def explain_bytes(data: bytes, **options) -> dict:
    """For the page's worker: the dropped file's bytes -> `explain(...).to_dict()` plus the report's lines.
    Options as `explain` (estimate, device_total, context_bytes, batch_size). A ValueError's message is the
    one line to show."""
    e = explain(load_snapshot(data), **options)
    return {**e.to_dict(), "lines": e.lines()}
