"""The ledger: a dispatch-level record of every storage a rank creates, from creation to free (`Ledger`,
`LEDGER` the rank's own, `ledger_step` one measured step), the in-place resizes FSDP2 makes seen by it
(`track_resizes`), and lab 3's pipeline accounting of live bytes (`LiveBytes`, also lab 4's). What the
parallelism experiments (`vramlab.measure.parallel` and its siblings) report as `memory`. Imports torch
inside its functions.
"""

from __future__ import annotations

import contextlib
from typing import Any


_FORWARD_PHASES = ("forward", "loss")
STATE_CATEGORIES = ("parameters", "gradients", "optimizer_states")


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


class Ledger(_ModeContext):
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
        self.lab_excluded = {k for cat in STATE_CATEGORIES + ("inputs",) for k in map(_storage_key, groups.get(cat, []))
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


# the rank's ledger while an experiment runs (`ranks.run_rank` sets it): read it as `ledger.LEDGER` when it is
# needed, never imported by name (that would keep the None it is before a rank starts)
LEDGER: Ledger | None = None


def _groups(modules, opt, inputs) -> dict[str, list]:
    params = [p for m in modules for p in m.parameters()]
    return {"parameters": params, "gradients": [p.grad for p in params if p.grad is not None],
            "optimizer_states": [v for s in opt.state.values() for v in s.values() if hasattr(v, "untyped_storage")],
            "inputs": list(inputs), "buffers": [b for m in modules for b in m.buffers()]}


def ledger_step(step, modules, opt, inputs) -> dict[str, Any]:
    """One step measured by the process's ledger."""
    led = LEDGER
    groups = _groups(modules, opt, inputs)
    led.begin(groups)
    try:
        step(led)
    finally:
        led.set_phase("after step")
    return led.end(_groups(modules, opt, inputs))


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


@contextlib.contextmanager
def track_resizes(led: Ledger):
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
