"""What a ZeRO or FSDP2 rank holds during a training step, and when (`vramlab.measure.zero`'s instruments).

- `resident`: every live storage (a scan of the objects Python holds, `storages`), sorted by
  `owned_storages` into parameters, gradients, optimizer states and other;
- `PeakTracker` run by `TrackMode`: everything live through one step, by owner and phase, with what was
  live at each phase's peak;
- `AllocatorLog`: PyTorch's CPU allocator's own record (the profiler's memory events), the tracker's check;
- `CommCounter`: the collectives a step calls and the bytes they move;
- `Marks`: the step's phases, told to the tracker and to the profiler.
Imports torch (inside the functions that need it).
"""

from __future__ import annotations

import collections
import contextlib
import gc
from typing import Any

from .. import collectives as C


def storages() -> dict[int, tuple[int, str, tuple]]:
    """Every live CPU/GPU storage Python can reach: data_ptr -> (bytes, dtype, a shape that views it)."""
    from .memory import live_tensors

    out: dict[int, tuple[int, str, tuple]] = {}
    for o in live_tensors():
        try:
            if o.device.type != "meta":
                st = o.untyped_storage()
                if st.nbytes():
                    out.setdefault(st.data_ptr(), (st.nbytes(), str(o.dtype).replace("torch.", ""), tuple(o.shape)))
        except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
            continue
    return out


def _ptr(t) -> int | None:
    try:
        return t.untyped_storage().data_ptr() if t is not None and t.untyped_storage().nbytes() else None
    except (RuntimeError, NotImplementedError):
        return None


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def owned_storages(model, optimizer) -> dict[str, set[int]]:
    """Storage pointers of each category, from the objects that own them."""
    inner = getattr(optimizer, "optimizer", optimizer)
    params, grads, states = set(), set(), set()
    for p in model.parameters():
        for t in (_local(p), getattr(p, "ds_tensor", None)):
            params.add(_ptr(t))
        grads.add(_ptr(_local(p.grad) if p.grad is not None else None))
    module_ptrs = set(params)
    for group in inner.param_groups:
        for p in group["params"]:
            ptr = _ptr(_local(p))
            if ptr not in module_ptrs:
                states.add(ptr)  # DeepSpeed's fp32 master partition: the paper counts it in K
            grads.add(_ptr(_local(p.grad) if p.grad is not None else None))
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):  # ZeRO-1/2's, ZeRO-3's masters
        for t in getattr(optimizer, name, None) or []:
            states.add(_ptr(t))
    for st in inner.state.values():
        for v in st.values():
            if hasattr(v, "untyped_storage") and v.numel() > 1:
                states.add(_ptr(_local(v)))
    for name in ("grad_partitions_flat_buffer", "averaged_gradients"):  # ZeRO-3's and ZeRO-1/2's gradient shards
        buf = getattr(optimizer, name, None)
        for t in (buf.values() if isinstance(buf, dict) else [buf]):
            for x in (t if isinstance(t, list) else [t]):
                grads.add(_ptr(x))
    return {"parameters": params - {None}, "gradients": grads - {None} - params, "optimizer_states": states - {None}}


def resident(model, optimizer) -> dict[str, Any]:
    gc.collect()
    live = storages()
    known = owned_storages(model, optimizer)
    out: dict[str, Any] = {k: sum(live[p][0] for p in ptrs if p in live) for k, ptrs in known.items()}
    claimed = set().union(*known.values())
    rest = sorted((v for p, v in live.items() if p not in claimed), key=lambda v: -v[0])
    out["other"] = sum(v[0] for v in rest)
    out["other_largest"] = [{"bytes": n, "dtype": d, "shape": list(s)} for n, d, s in rest[:4]]
    out["total"] = sum(v[0] for v in live.values())
    out["storages"] = set(live)
    return out


PHASES = ("forward", "backward", "step")  # step: the optimizer's step and zero_grad (DeepSpeed's engine.step)
TOP_TRANSIENTS = 10
SLACK = 4096  # bytes: a few scalars (the loss) may outlive a step's marks


def _storage_of(t):
    """The storage a tensor's bytes live in (a DTensor's: its local shard's), or None."""
    import torch

    if not isinstance(t, torch.Tensor):
        return None
    t = getattr(t, "_local_tensor", t)
    if t.device.type == "meta":
        return None
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a wrapper subclass without storage
        return None
    return st if st.nbytes() else None


class PeakTracker:
    """Everything live during one step, by owner, with the step's phase.

    It starts from every storage a scan of Python's objects finds (each sorted by `owned_storages` into
    parameters, gradients, optimizer states or other) and adds every storage an operation creates or
    first touches (a TorchDispatchMode sees every operation's outputs and inputs; DTensors by their
    local shard) and every allocation by `UntypedStorage.resize_` (FSDP2 frees and reallocates its
    gathered parameters that way), each until it is freed (a finalizer on the storage, or a resize to
    0). `now` is the bytes live; each phase's peak and what was live at it are kept: the peak's
    snapshot is taken lazily, at the first free (or phase change) after a new high, so its cost is
    paid once per rising edge, not once per allocation.

    It cannot see memory a kernel allocates and frees inside one operation (its scratch space), nor
    storages that C++ alone creates and Python never reaches. Storages a collective makes for itself
    (gloo copies the gathered output and the reduce-scatter input; NCCL does not) are first seen, if at
    all, while a Work is waited on: they are kept apart (`collective_internal_peak`), not in `now`. The
    CPU allocator's own record (`AllocatorLog`) checks the rest: with collectives' blocks left out,
    its peak equals this tracker's wherever no free escaped the profiler."""

    def __init__(self, model, optimizer, known: dict[str, set[int]]):
        import itertools

        from .memory import live_tensors

        self.model, self.entries, self.by_ptr = model, {}, {}
        self.serial = itertools.count()
        self.now, self.cat_now = 0, {"parameters": 0, "gradients": 0, "optimizer_states": 0, "other": 0, "transient": 0}
        self.phase, self.phase_peak, self.snaps, self.dirty, self.last_op = "other", {}, {}, False, None
        self.late, self.resized_bytes, self.closed = 0, 0, False
        self.pending: collections.deque = collections.deque()
        # storages a collective makes for itself (gloo's copy of a reduce-scatter's input, first seen
        # while a Work is waited on): kept apart, not in `now` (NCCL makes none; see AllocatorLog)
        self.in_collective, self.internal_now, self.internal_peak = 0, 0, 0
        cat_of = {ptr: cat for cat, ptrs in known.items() for ptr in ptrs}
        self._params = self._param_objects(model)
        gc.collect()
        for o in live_tensors():
            st = _storage_of(o)
            if st is not None:
                self._add(st, cat_of.get(st.data_ptr(), "other"), None)
        self.start = self.now

    @staticmethod
    def _param_objects(model) -> list:
        """(name, tensor) of every parameter object the module can hold: its own, and FSDP2's unsharded
        parameters (which replace the sharded ones on the modules between all-gather and reshard)."""
        out = list(model.named_parameters())
        names = {id(p): n for n, p in out}
        for m in model.modules():
            state = getattr(m, "_get_fsdp_state", None)
            group = getattr(state(), "_fsdp_param_group", None) if state is not None else None
            for fp in getattr(group, "fsdp_params", None) or []:
                u = getattr(fp, "_unsharded_param", None)
                if u is not None:
                    out.append((names.get(id(fp.sharded_param), getattr(fp, "_param_fqn", "?")), u))
        return out

    # -- accounting
    def _add(self, st, cat: str, info: dict | None) -> None:
        import weakref

        n, ptr = st.nbytes(), st.data_ptr()
        if self.pending:
            self._drain()
        if not n or ptr in self.by_ptr:
            return
        key = next(self.serial)
        fin = weakref.finalize(st, self._free, key)
        fin.atexit = False
        self.entries[key] = [n, cat, info, ptr, fin]
        self.by_ptr[ptr] = key
        if cat == "collective_internal":
            self.internal_now += n
            self.internal_peak = max(self.internal_peak, self.internal_now)
            return
        self.now += n
        self.cat_now[cat] += n
        if self.now > self.phase_peak.get(self.phase, -1):
            self.phase_peak[self.phase] = self.now
            self.dirty = True

    def _free(self, key: int) -> None:
        """A storage's finalizer: queued, applied by the next `_drain` (finalizers run in whatever thread
        drops a storage's last reference, a gloo worker's too, and in the middle of anything)."""
        if not self.closed:
            self.pending.append(key)

    def _drain(self) -> None:
        while self.pending:
            e = self.entries.pop(self.pending.popleft(), None)
            if e is None:
                continue
            if self.dirty:  # what was live at the high, before this free
                self._snapshot()
            n, cat, _, ptr, fin = e
            if self.entries.get(self.by_ptr.get(ptr)) is None:
                self.by_ptr.pop(ptr, None)
            fin.detach()
            if cat == "collective_internal":
                self.internal_now -= n
                continue
            self.now -= n
            self.cat_now[cat] -= n

    def register(self, t, op: str, origin: str) -> None:
        if self.pending:
            self._drain()
        st = _storage_of(t)
        if st is None or st.data_ptr() in self.by_ptr:
            return
        tt = getattr(t, "_local_tensor", t)
        if self.in_collective:
            self._add(st, "collective_internal", {"op": op})
            return
        if origin == "input":
            self.late += st.nbytes()
        self._add(st, "transient", {"dtype": str(tt.dtype).replace("torch.", ""), "shape": list(tt.shape), "op": op,
                                    "phase": self.phase, "origin": origin})
        if self.dirty:
            self.last_op = op

    def resized(self, st, old_ptr: int, old_n: int, op: str) -> None:
        """A storage's bytes were reallocated in place (`resize_`): free the old block, add the new."""
        self._drain()
        key = self.by_ptr.get(old_ptr) if old_n else None
        cat = "transient"
        info = {"dtype": None, "shape": [st.nbytes()], "op": op, "phase": self.phase, "origin": "resize"}
        if key is not None:
            cat = self.entries[key][1]
            info = self.entries[key][2] or info
            self.pending.append(key)
            self._drain()
        if st.nbytes():
            self.resized_bytes += st.nbytes()
            self._add(st, cat, info)
            if self.dirty:
                self.last_op = op

    def set_phase(self, phase: str) -> None:
        self._drain()
        if self.dirty:
            self._snapshot()
        self.phase = phase
        if self.now > self.phase_peak.get(phase, -1):  # what a phase starts with is part of its peak
            self.phase_peak[phase] = self.now
            self.dirty = True

    def _snapshot(self) -> None:
        """What is live now, at a new high of the current phase."""
        self.dirty = False
        roles: dict[int, tuple] = {}
        for name, p in self._params:
            for role, t in (("parameter", p), ("gradient", getattr(p, "grad", None))):
                st = _storage_of(t)
                if st is not None:
                    had = roles.get(st.data_ptr())
                    if had is None:
                        tt = getattr(t, "_local_tensor", t)
                        roles[st.data_ptr()] = (role, name, str(tt.dtype).replace("torch.", ""), list(tt.shape), 1)
                    elif had[0] == role and had[1] != name:
                        roles[st.data_ptr()] = had[:4] + (had[4] + 1,)
        trans = [(e[0], e[2], roles.get(e[3])) for e in self.entries.values() if e[1] == "transient"]
        self.snaps[self.phase] = {"live": self.now, "by_category": dict(self.cat_now), "transients": trans,
                                  "op": self.last_op}

    def close(self) -> dict[str, Any]:
        self._drain()
        if self.dirty:
            self._snapshot()
        self.closed = True
        for e in self.entries.values():
            e[4].detach()
        phases = {}
        for phase, snap in self.snaps.items():
            by_role = {"gathered_parameters": 0, "gradients": 0, "activations_and_other": 0}
            rows = []
            for n, info, role in snap["transients"]:
                kind = {"parameter": "gathered_parameters", "gradient": "gradients"}.get(role[0] if role else "",
                                                                                     "activations_and_other")
                by_role[kind] += n
                rows.append((n, info, role))
            rows.sort(key=lambda r: -r[0])
            top = []
            for n, info, role in rows[:TOP_TRANSIENTS]:
                row = {"bytes": n, **(info or {}), "role": role[0] if role else "other"}
                if role:
                    row["name"] = role[1] + (f" (and {role[4] - 1} more sharing this storage)" if role[4] > 1 else "")
                    if row.get("dtype") is None:  # a storage resize_ allocated: its parameter says what it holds
                        row["dtype"], row["shape"] = role[2], role[3]
                top.append(row)
            cats = dict(snap["by_category"])
            cats["activations/transients"] = cats.pop("transient")
            phases[phase] = {"peak": snap["live"], "by_category": cats, "transient_by_role": by_role,
                             "last_allocating_op": snap["op"], "live_transients": len(rows), "top_transients": top}
        self.entries.clear()
        return {"start": self.start, "end": self.now, "phases": phases,
                "first_seen_as_input_bytes": self.late, "resize_allocated_bytes": self.resized_bytes,
                "collective_internal_peak": self.internal_peak}


class TrackMode:
    """Runs a `PeakTracker` through a step: a TorchDispatchMode that registers every operation's output
    and input storages (and handles in-place resizes), and a patched `UntypedStorage.resize_`."""

    RESIZE_OPS = ("aten::resize_", "aten::resize_as_")

    def __init__(self, tracker: PeakTracker):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        self.tracker = tracker
        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = func.name()
                before = None
                if name in outer.RESIZE_OPS and args and isinstance(args[0], torch.Tensor):
                    st = args[0].untyped_storage()
                    before = (st.data_ptr(), st.nbytes())
                out = func(*args, **kwargs)
                if before is not None:
                    tracker.resized(args[0].untyped_storage(), *before, name)
                for t in tree_flatten(out)[0]:
                    tracker.register(t, name, "output")
                for t in tree_flatten((args, kwargs))[0]:
                    tracker.register(t, name, "input")
                return out

        self.mode = Mode()
        self._orig = torch.UntypedStorage.resize_

    def __enter__(self):
        import torch

        orig, tracker = self._orig, self.tracker

        def resize_(st, size):
            before = (st.data_ptr(), st.nbytes())
            out = orig(st, size)
            tracker.resized(st, *before, "UntypedStorage.resize_")
            return out

        torch.UntypedStorage.resize_ = resize_
        self._wait = None
        if torch.distributed.is_available():
            work, self._wait = torch.distributed.Work, torch.distributed.Work.wait

            def wait(w, *a, _orig=self._wait, **kw):
                tracker.in_collective += 1
                try:
                    return _orig(w, *a, **kw)
                finally:
                    tracker.in_collective -= 1

            work.wait = wait
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        import torch

        try:
            return self.mode.__exit__(*exc)
        finally:
            torch.UntypedStorage.resize_ = self._orig
            if self._wait is not None:
                torch.distributed.Work.wait = self._wait


class AllocatorLog:
    """PyTorch's CPU allocator's own record (the profiler's memory events): every allocation and free
    through c10's CPU allocator while the profiler runs, in the threads it profiles, with the bytes
    allocated after each. Started before the model is built, so that a block freed in a measured step
    was allocated under it; each step's phases are marked with record_function ranges. Gives each
    measured step's peak above what the step started with (and each phase's), to set beside the
    tracker's. CPU only (on CUDA the allocator's peak is recorded instead)."""

    def __init__(self):
        import torch

        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)

    def __enter__(self):
        self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        return self.prof.__exit__(*exc)

    def steps(self, measured: list[int]) -> list[dict[str, Any]]:
        """Per measured step: bytes allocated at its start (since the profiler started), the most above
        that in the step and in each phase, and what is left at its end (above 0: a free in a thread the
        profiler does not follow, which then inflates everything after it). The same with the blocks
        allocated inside collective operations (`c10d::*`, `gloo:*`: gloo's own copies of the gathered output
        and of the reduce-scatter input, which NCCL does not make) left out: those are invisible to the
        tracker, which sees a collective's inputs and outputs only, so this series should equal its."""
        import bisect

        from torch._C._profiler import _EventType

        events, marks = [], {}
        stack = [(ev, False, ()) for ev in self.prof.profiler.kineto_results.experimental_event_tree()]
        while stack:
            ev, in_c10d, ops = stack.pop()
            if ev.tag == _EventType.Allocation:
                f = ev.extra_fields
                if f.device.type == "cpu":
                    events.append((ev.start_time_ns, f.alloc_size, f.ptr, in_c10d, ops))
                continue
            if ev.name.startswith("zerolab:"):  # once per micro-batch: from the first start to the last end
                a, b = marks.get(ev.name, (ev.start_time_ns, ev.end_time_ns))
                marks[ev.name] = (min(a, ev.start_time_ns), max(b, ev.end_time_ns))
            inner = in_c10d or ev.name.startswith(("c10d::", "gloo:"))  # a collective, or gloo running one
            stack.extend((c, inner, (ops + (ev.name,))[-3:]) for c in ev.children)
        events.sort(key=lambda e: e[0])
        times, total, excl = [], [], []
        t_all = t_ex = 0
        internal: dict[int, int] = {}  # ptr -> bytes of blocks a collective allocated, until freed
        for t, n, ptr, in_c10d, _ in events:
            t_all += n
            if n > 0:
                internal.pop(ptr, None)  # a block here before was freed (perhaps where the profiler missed it)
                if in_c10d:
                    internal[ptr] = n
                else:
                    t_ex += n
            elif internal.pop(ptr, None) is None:
                t_ex += n
            times.append(t)
            total.append(t_all)
            excl.append(t_ex)

        def level(series, i):
            return series[i - 1] if i else 0

        out = []
        for k in measured:
            spans = {ph: marks.get(f"zerolab:{k}:{ph}") for ph in PHASES}
            if not all(spans.values()):
                out.append({"step": k, "error": "phase marks missing"})
                continue
            t0, t1 = spans[PHASES[0]][0], spans[PHASES[-1]][1]
            i0, i1 = bisect.bisect_left(times, t0), bisect.bisect_right(times, t1)
            row: dict[str, Any] = {"step": k, "events": i1 - i0}
            for key, series in (("", total), ("_excluding_collective_internals", excl)):
                base = level(series, i0)
                phases = {}
                for ph, (a, b) in spans.items():
                    lo, hi = bisect.bisect_left(times, a), bisect.bisect_right(times, b)
                    phases[ph] = max(series[lo:hi] + [level(series, lo)]) - base
                row["phase_peaks_above_start" + key] = phases
                row["peak_above_start" + key] = max(phases.values())
                row["end_above_start" + key] = level(series, i1) - base
            # the largest blocks live at the peak (collectives' own left out) that this step allocated,
            # with the operations they were allocated in (outermost first)
            at = max(range(i0, i1), key=lambda i: excl[i], default=None)
            if at is not None:
                live: dict[int, tuple] = {}
                for t, n, ptr, in_c10d, ops in events[i0:at + 1]:
                    if n > 0 and not in_c10d:
                        live[ptr] = (n, ops)
                    elif n < 0:
                        live.pop(ptr, None)
                top = sorted(live.values(), key=lambda v: -v[0])[:TOP_TRANSIENTS]
                row["top_blocks_at_peak_excluding_collective_internals"] = [
                    {"bytes": n, "allocated_in": list(ops)} for n, ops in top]
            out.append(row)
        return out


# The dispatcher's collective operations (where torch.distributed's functions, DeepSpeed's and FSDP2's
# calls all end) and the collective each is
C10D_OPS = {"allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "broadcast_": "broadcast",
            "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_coalesced_": "all_gather",
            "allgather_into_tensor_coalesced_": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
            "reduce_scatter_": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter"}


def _nbytes(x) -> int:
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return x.numel() * x.element_size() if hasattr(x, "element_size") else 0


class CommCounter:
    """Counts every collective while active, at the dispatcher (`c10d::` operations): calls and payload
    bytes by collective, the payload being the whole tensor (all-reduce, broadcast), the gathered
    output or the scattered input."""

    def __init__(self, world: int):
        from torch.utils._python_dispatch import TorchDispatchMode

        self.world, self.calls, self.payload = world, {}, {}
        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.name()
                if name.startswith("c10d::"):
                    outer._count(name.split("::", 1)[1].split(".")[0], args)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def _count(self, name: str, args) -> None:
        op = C10D_OPS.get(name)
        if op is None:
            return
        size = _nbytes(args[0]) if op in ("all_reduce", "broadcast") else max(_nbytes(args[0]), _nbytes(args[1]))
        self.calls[op] = self.calls.get(op, 0) + 1
        self.payload[op] = self.payload.get(op, 0) + size

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)

    def report(self) -> dict[str, Any]:
        sent = {op: C.bytes_sent_per_rank(op, self.world, size / self.calls[op]) * self.calls[op]
                for op, size in self.payload.items()}
        return {"calls": self.calls, "payload": self.payload, "sent_per_rank": sent,
                "sent_per_rank_total": sum(sent.values())}


class Marks:
    """The step's phase, told to the tracker of the measured step (if any) and to the profiler (a
    record_function range `zerolab:<step>:<phase>`) as each of forward, backward and step begins."""

    def __init__(self):
        self.step, self.tracker, self.profiling = 0, None, False

    @contextlib.contextmanager
    def __call__(self, phase: str):
        if self.tracker is not None:
            self.tracker.set_phase(phase)
        if self.profiling:
            import torch

            with torch.profiler.record_function(f"zerolab:{self.step}:{phase}"):
                yield
        else:
            yield
