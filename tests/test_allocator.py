"""vramlab.allocator: the caching allocator's rules, each checked against a number worked out by
hand from c10/cuda/CUDACachingAllocator.cpp (never against the model's own output). The replay of
real training steps against the H100 is in tests/measure/test_allocator.py and
benchmarks/allocator_validation.py."""

from __future__ import annotations

import pytest

from vramlab.allocator import (Alloc, AllocatorConfig, CachingAllocator, EmptyCache, Free, OutOfMemory, ResetPeak,
                               replay, round_size, segment_size)

KiB, MiB = 1 << 10, 1 << 20


def test_round_size_is_a_multiple_of_512_at_least_512():
    assert [round_size(n) for n in (0, 1, 511, 512, 513, 1024, 1025)] == [512, 512, 512, 512, 1024, 1024, 1536]


def test_segment_size_follows_get_allocation_size():
    assert segment_size(1) == 2 * MiB  # small pool: 2 MiB buffers
    assert segment_size(MiB) == 2 * MiB  # 1 MiB is still small
    assert segment_size(MiB + 1) == 20 * MiB  # (1, 10) MiB: a 20 MiB block to split
    assert segment_size(10 * MiB - 512) == 20 * MiB
    assert segment_size(10 * MiB - 1) == 10 * MiB  # rounded to 512 B first: 10 MiB exactly
    assert segment_size(10 * MiB) == 10 * MiB  # from 10 MiB: the size rounded up to 2 MiB
    assert segment_size(10 * MiB + 1) == 12 * MiB


def test_small_requests_share_2_mib_segments():
    r = replay([("alloc", i, 512 * KiB) for i in range(5)])
    assert r.peak_allocated == 5 * 512 * KiB
    assert r.peak_reserved == 4 * MiB  # four fill the first 2 MiB segment, the fifth opens another
    assert r.stats.segments == 2


def test_a_large_segment_is_split_when_more_than_1_mib_is_left():
    r = replay([("alloc", "a", 3 * MiB), ("alloc", "b", 5 * MiB), ("alloc", "c", 11 * MiB)])
    # a: a 20 MiB segment, split (17 MiB left); b: from the 17 MiB (12 left); c: 11 of the 12
    # (1 MiB left: not more than kSmallSize, so c takes the whole 12 MiB block, unsplit)
    assert r.peak_reserved == 20 * MiB
    assert r.stats.allocated == 20 * MiB and r.stats.requested == 19 * MiB


def test_best_fit_takes_the_smallest_block_that_fits():
    events = [("alloc", "x", 30 * MiB), ("alloc", "y", 50 * MiB), ("free", "x"), ("free", "y"),
              ("alloc", "z", 25 * MiB), ("alloc", "w", 45 * MiB)]
    r = replay(events)
    assert r.peak_reserved == 80 * MiB  # z in the 30 MiB block, w in the 50 MiB one: no new segment
    # had z taken the 50 MiB block, w would have needed a new segment
    segs = sorted(size for size, _ in r.segments)
    assert segs == [30 * MiB, 50 * MiB]


def test_fragmentation_reserves_more_than_is_allocated():
    # 40 MiB freed, then 20 MiB carved from it: the 20 MiB left cannot serve 30 MiB
    r = replay([("alloc", 1, 40 * MiB), ("free", 1), ("alloc", 2, 20 * MiB), ("alloc", 3, 30 * MiB)])
    assert r.stats.allocated == 50 * MiB and r.peak_reserved == 70 * MiB
    assert r.stats.inactive_split == 20 * MiB  # the free half of a split segment: "non-releasable"


def test_expandable_segments_extend_the_segment_instead():
    events = [("alloc", 1, 40 * MiB), ("free", 1), ("alloc", 2, 20 * MiB), ("alloc", 3, 30 * MiB)]
    r = replay(events, AllocatorConfig(expandable_segments=True))
    # 40 MiB = two 20 MiB pages; 3 uses the free 20 MiB at the end plus one more page mapped after it
    assert r.stats.allocated == 50 * MiB and r.peak_reserved == 60 * MiB
    small = replay([("alloc", 1, 100)], AllocatorConfig(expandable_segments=True))
    assert small.peak_reserved == 2 * MiB  # the small pool maps 2 MiB pages


def test_free_merges_neighbours_and_empty_cache_releases_only_whole_segments():
    a = CachingAllocator()
    h1, h2 = a.malloc(3 * MiB), a.malloc(3 * MiB)  # one 20 MiB segment, split three ways
    big = a.malloc(30 * MiB)  # a segment of its own
    a.free(big)
    a.free(h1)
    a.empty_cache()
    assert a.reserved == 20 * MiB  # the 30 MiB segment went back; the split one holds h2
    a.free(h2)  # merges with both free neighbours: the segment is whole again
    assert a.stats().inactive_split == 0
    a.empty_cache()
    assert a.reserved == 0 and a.stats().segments == 0


def _step(tag: str, sizes=(12, 14, 16, 18)) -> list[tuple]:
    """A toy training step: activations kept, a big temporary, everything freed at the end (MiB)."""
    acts = [("alloc", f"{tag}a{i}", s * MiB) for i, s in enumerate(sizes)]
    return [*acts, ("alloc", f"{tag}t", 64 * MiB), ("free", f"{tag}t"),
            *[("free", f"{tag}a{i}") for i in reversed(range(len(sizes)))]]


def test_empty_cache_between_steps_does_not_lower_the_next_peak():
    weights = [("alloc", "w", 100 * MiB)]
    kept = replay([*weights, *_step("1"), ("reset_peak",), *_step("2")])
    emptied = replay([*weights, *_step("1"), ("empty_cache",), ("reset_peak",), *_step("2")])
    assert emptied.reserved[len(weights) + len(_step("1"))] == 100 * MiB  # the cache went back to the driver...
    # ...and the next step took it all again: a steady step reuses its own blocks, so the cache it finds
    # is exactly what it needs (100 + 12 + 14 + 16 + 18 + 64 MiB)
    assert emptied.peak_reserved == kept.peak_reserved == 224 * MiB
    assert emptied.peak_allocated == kept.peak_allocated
    assert emptied.stats.num_device_alloc == 2 * kept.stats.num_device_alloc - 1  # paying every cudaMalloc again


def test_empty_cache_gives_back_only_what_the_next_step_would_not_reuse():
    # sizes under 10 MiB share 20 MiB segments: the second step finds them split differently than a fresh
    # start would, and reserves more; empty_cache() removes that extra, never the step's own peak
    weights = [("alloc", "w", 100 * MiB)]
    small = (8, 9, 10, 11)
    kept = replay([*weights, *_step("1", small), ("reset_peak",), *_step("2", small)])
    emptied = replay([*weights, *_step("1", small), ("empty_cache",), ("reset_peak",), *_step("2", small)])
    # from an empty cache, 11 MiB gets a 12 MiB segment whole (1 MiB left is not split off): 203 MiB
    assert emptied.peak_allocated == (100 + 8 + 9 + 10 + 12 + 64) * MiB
    assert kept.peak_allocated >= (100 + 8 + 9 + 10 + 11 + 64) * MiB
    assert kept.peak_reserved > emptied.peak_reserved >= emptied.peak_allocated


def test_a_failed_cudamalloc_frees_the_cache_and_retries():
    cap = AllocatorConfig(capacity=100 * MiB)
    r = replay([("alloc", 1, 60 * MiB), ("free", 1), ("alloc", 2, 70 * MiB)], cap)
    assert r.oom is None and r.stats.num_alloc_retries == 1 and r.stats.reserved == 70 * MiB
    r = replay([("alloc", 1, 60 * MiB), ("alloc", 2, 50 * MiB), ("alloc", 3, 1)], cap)
    assert isinstance(r.oom, OutOfMemory) and r.oom_event == 1 and r.oom.requested == 50 * MiB
    assert len(r.allocated) == 1  # the replay stopped there
    with pytest.raises(OutOfMemory, match="tried to allocate 0.05 GiB"):
        replay([("alloc", 1, 60 * MiB), ("alloc", 2, 50 * MiB)], cap, stop_at_oom=False)


def test_max_split_size_keeps_oversize_blocks_for_large_requests():
    cfg = AllocatorConfig(max_split_size=100 * MiB)
    base = [("alloc", "o", 200 * MiB), ("free", "o")]
    assert replay([*base, ("alloc", 1, 50 * MiB)], cfg).peak_reserved == 250 * MiB  # not carved from 200
    assert replay([*base, ("alloc", 1, 190 * MiB)], cfg).peak_reserved == 200 * MiB  # within 20 MiB: reused
    assert replay([*base, ("alloc", 1, 150 * MiB)], cfg).peak_reserved == 350 * MiB  # 50 MiB too big a waste
    assert replay([*base, ("alloc", 1, 150 * MiB)]).peak_reserved == 200 * MiB  # default: split and reused


def test_empty_cache_unmaps_free_pages_of_expandable_segments():
    cfg = AllocatorConfig(expandable_segments=True)
    r = replay([("alloc", 1, 50 * MiB), ("alloc", 2, 50 * MiB), ("free", 2), EmptyCache()], cfg)
    # 100 MiB mapped as five 20 MiB pages; 1 ends inside page 3, so pages 4 and 5 are unmapped
    assert r.reserved[1] == 100 * MiB and r.reserved[-1] == 60 * MiB
    r = replay([Alloc(1, 50 * MiB), Free(1), EmptyCache()], cfg)
    assert r.reserved[-1] == 0 and r.stats.segments == 0


def test_reset_peak_and_dataclass_events():
    r = replay([Alloc("a", 40 * MiB), Free("a"), ResetPeak(), Alloc("b", 4 * MiB)])
    assert r.peak_allocated == 4 * MiB and r.peak_reserved == 40 * MiB  # the cache stays reserved
    assert replay([("alloc", 1, 0), ("free", 1)]).peak_reserved == 0  # zero bytes take no memory


@pytest.mark.parametrize("events, message", [
    ([("alloc", 1, -1)], "nbytes"),
    ([("alloc", 1, 1.5)], "nbytes"),
    ([("free", 7)], "not a live allocation"),
    ([("alloc", 1, 8), ("alloc", 1, 8)], "already live"),
    ([("malloc", 1, 8)], "an event must be"),
    ([("alloc", 1)], "an event must be"),
])
def test_bad_events_are_one_clear_error(events, message):
    with pytest.raises(ValueError, match=message):
        replay(events)


def test_bad_config():
    with pytest.raises(ValueError, match="max_split_size"):
        AllocatorConfig(max_split_size=MiB)
    with pytest.raises(ValueError, match="capacity"):
        AllocatorConfig(capacity=-1)
    with pytest.raises(ValueError, match="expandable_segments"):
        AllocatorConfig(expandable_segments="yes")
    with pytest.raises(ValueError, match="no live allocation"):
        CachingAllocator().free(3)
