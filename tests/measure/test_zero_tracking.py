"""vramlab.measure.zero_tracking: the heap walk that finds every live storage, and the per-step tracker
(frees, `resize_`, phases) that zerolab's peaks are made of."""

from __future__ import annotations

import pytest


def test_the_heap_walk_after_freezing_the_imports_finds_every_storage(monkeypatch):
    """After `memory.settle_imports` froze the heap, `zero_tracking.storages` still finds every storage that a plain walk of the
    heap with isinstance found before the freeze (frozen tensors through their weak references), and new
    ones made after it; a frozen tensor that dies is not reported."""
    import gc
    import weakref

    torch = pytest.importorskip("torch")
    from vramlab.measure import memory as M
    from vramlab.measure import zero_tracking as ZT

    monkeypatch.setattr(M, "_FROZEN", [])
    old = torch.zeros(1000)
    while gc.collect():  # one pass can leave garbage its finalizers freed (seen after a few hundred tests)
        pass
    expected = set()
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.device.type != "meta" and o.untyped_storage().nbytes():
            expected.add(o.untyped_storage().data_ptr())
    try:
        M.settle_imports()
        assert ZT.storages().keys() == expected and old.untyped_storage().data_ptr() in expected
        new = torch.ones(2000)
        assert ZT.storages().keys() == expected | {new.untyped_storage().data_ptr()}
        gone = weakref.ref(old)
        del old
        assert gone() is None and not any(t is None for t in M.live_tensors())
        assert sum(1 for _ in M.live_tensors()) == sum(1 for r in M._FROZEN if r() is not None) + sum(
            1 for o in gc.get_objects() if isinstance(o, torch.Tensor))
    finally:
        gc.unfreeze()


def test_tracker_follows_frees_resizes_and_phases():
    """The tracker counts what a step starts with, every new storage until it dies, a storage resized to
    0 (FSDP2's way of freeing a gathered parameter) as freed and resized back as allocated, and keeps
    each phase's high with what was live then."""
    torch = pytest.importorskip("torch")
    from vramlab.measure.zero_tracking import PeakTracker, TrackMode

    lin = torch.nn.Linear(256, 256, bias=False)
    gathered = torch.empty(1024)  # 4 KiB, resized away below, like an FSDP2 unsharded parameter
    tracker = PeakTracker(lin, torch.optim.SGD(lin.parameters()), {"parameters": {lin.weight.untyped_storage().data_ptr()}})
    start = tracker.now
    with TrackMode(tracker):
        tracker.set_phase("forward")
        gathered.untyped_storage().resize_(0)
        a = torch.ones(1000)          # 4,000 B
        b = a * 2                     # 4,000 B
        del a
        tracker.set_phase("backward")
        gathered.untyped_storage().resize_(4096)  # reallocated: 4,096 B
        c = torch.zeros(2000)         # 8,000 B
        del b, c
        tracker.set_phase("step")
        gathered.untyped_storage().resize_(0)
    out = tracker.close()
    assert out["start"] == start and out["end"] == start - 4096
    ph = out["phases"]
    assert ph["forward"]["peak"] - start == 8000 - 4096
    assert ph["backward"]["peak"] - start == 4000 + 8000  # b, the regathered 4,096 B and c, less the 4,096 freed before
    assert ph["forward"]["by_category"]["parameters"] == 256 * 256 * 4
    top = ph["backward"]["top_transients"]
    assert top[0]["bytes"] == 8000 and top[0]["op"].startswith("aten::zeros") and top[0]["phase"] == "backward"
    assert out["resize_allocated_bytes"] == 4096
