"""PyTorch's CUDA caching allocator, modelled from its source: why `torch.cuda.memory_reserved()`
exceeds `memory_allocated()`, what `empty_cache()` gives back (and why it never lowers the next step's
peak), and what `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` changes.

Replay a program's allocations and frees (`replay(events)`, or `CachingAllocator` one call at a time)
and read allocated and reserved bytes over time and at the peak. Pure Python: a training step's
~10,000 events replay in well under a second.

Source: c10/cuda/CUDACachingAllocator.cpp (PyTorch 2.x, `DeviceCachingAllocator`); the rules, with the
function each comes from:
- every request is rounded up to a multiple of 512 B (`kMinBlockSize`, `round_size`);
- requests of at most 1 MiB (`kSmallSize`) use the small pool, larger ones the large pool
  (`get_pool`); a new segment (one cudaMalloc) is 2 MiB for a small request (`kSmallBuffer`), 20 MiB
  for one under 10 MiB (`kLargeBuffer`, `kMinLargeAlloc`), else the request rounded up to 2 MiB
  (`kRoundLarge`; `get_allocation_size`);
- a request first takes the smallest cached free block of its pool that is large enough (best fit,
  `get_free_block`); with `max_split_size` set, a block at least that large serves only a request
  at least that large and less than 20 MiB smaller than it;
- the block is split when the rest is worth keeping: >= 512 B in the small pool or with expandable
  segments, > 1 MiB in the large pool (and never for a request >= max_split_size; `should_split`);
- a freed block merges with free neighbours of its segment (`free_block`, `try_merge_blocks`) and
  stays cached: reserved bytes go down only when a segment is wholly free and either
  `empty_cache()` runs (`release_cached_blocks`) or a cudaMalloc fails (then, with max_split_size
  set, oversize blocks are released first, `release_available_cached_blocks`; then every wholly free
  segment; then the cudaMalloc is retried once, and a second failure is the out-of-memory error);
- expandable segments: one segment per pool that grows by mapping pages (2 MiB in the small pool,
  20 MiB in the large; `ExpandableSegment`, `try_allocate_expandable_block`): a request that no free
  block fits extends the segment at its lowest free address, so the free space at a segment's end
  is never stranded; `empty_cache()` unmaps every wholly free page (`unmap_block`).

Known limitations: one device and one stream (no cross-stream `record_stream` events, no CUDA
graphs' private pools), no `garbage_collection_threshold` or `roundup_power2_divisions`; cudaMalloc
addresses are modelled as increasing, which only decides ties between equal-size free blocks.
`capacity` stands for the bytes the driver would hand out (the GPU's memory less the CUDA context
and anything outside this allocator).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Iterable, Union

from . import checks as _checks

MIN_BLOCK_SIZE = 512  # kMinBlockSize: all sizes are rounded to at least 512 bytes
SMALL_SIZE = 1 << 20  # kSmallSize: largest "small" allocation is 1 MiB
SMALL_BUFFER = 2 << 20  # kSmallBuffer: "small" allocations are packed in 2 MiB blocks
LARGE_BUFFER = 20 << 20  # kLargeBuffer: "large" allocations may be packed in 20 MiB blocks
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: allocations between 1 and 10 MiB may use kLargeBuffer
ROUND_LARGE = 2 << 20  # kRoundLarge: round up large allocations to 2 MiB
_NO_LIMIT = 1 << 62  # max_split_size's default (SIZE_MAX in the source): no limit


def round_size(nbytes: int) -> int:
    """The block size a request of `nbytes` gets: a multiple of 512 B, at least 512 (`round_size`)."""
    n = _checks.whole("nbytes", nbytes, lo=0, hi=_checks.MAX_BYTES)
    return MIN_BLOCK_SIZE * max(1, -(-n // MIN_BLOCK_SIZE))


def segment_size(nbytes: int) -> int:
    """The cudaMalloc a request of `nbytes` makes when no cached block fits it
    (`get_allocation_size` of the rounded size): 2 MiB for <= 1 MiB, 20 MiB under 10 MiB, else the
    size rounded up to 2 MiB."""
    size = round_size(nbytes)
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * -(-size // ROUND_LARGE)


@dataclass(frozen=True, kw_only=True)
class AllocatorConfig:
    """The allocator's settings (`PYTORCH_CUDA_ALLOC_CONF`) and the memory it may take."""

    expandable_segments: bool = False  # expandable_segments:True
    max_split_size: int | None = None  # bytes (max_split_size_mb x 2**20); None: no limit (the default)
    capacity: int | None = None  # bytes the driver can hand out; None: unlimited (never out of memory)

    def __post_init__(self):
        _checks.flag("expandable_segments", self.expandable_segments)
        if self.max_split_size is not None:
            _checks.whole("max_split_size", self.max_split_size, lo=LARGE_BUFFER + 1, hi=_checks.MAX_BYTES)
        if self.capacity is not None:
            _checks.whole("capacity", self.capacity, lo=0, hi=_checks.MAX_BYTES)


# ----------------------------------------------------------------------------- events

@dataclass(frozen=True)
class Alloc:
    """`torch.empty(...)` of `nbytes` on the device, known afterwards as `id`."""

    id: int | str
    nbytes: int


@dataclass(frozen=True)
class Free:
    """The last reference to allocation `id` is gone."""

    id: int | str


@dataclass(frozen=True)
class EmptyCache:
    """`torch.cuda.empty_cache()`."""


@dataclass(frozen=True)
class ResetPeak:
    """`torch.cuda.reset_peak_memory_stats()`: the peaks restart from the current values."""


Event = Union[Alloc, Free, EmptyCache, ResetPeak]


def as_event(e) -> Event:
    """An event, or its tuple form: ("alloc", id, nbytes), ("free", id), ("empty_cache",), ("reset_peak",)."""
    if isinstance(e, (Alloc, Free, EmptyCache, ResetPeak)):
        return e
    if isinstance(e, (tuple, list)) and e:
        kind, rest = e[0], tuple(e[1:])
        if kind == "alloc" and len(rest) == 2:
            return Alloc(rest[0], _checks.whole("nbytes", rest[1], lo=0, hi=_checks.MAX_BYTES))
        if kind == "free" and len(rest) == 1:
            return Free(rest[0])
        if kind == "empty_cache" and not rest:
            return EmptyCache()
        if kind == "reset_peak" and not rest:
            return ResetPeak()
    raise ValueError(f"an event must be ('alloc', id, nbytes), ('free', id), ('empty_cache',) or "
                     f"('reset_peak',), got {_checks.show(e)}")


# ----------------------------------------------------------------------------- the allocator

class OutOfMemory(Exception):
    """The allocator's out-of-memory error: `requested` is the cudaMalloc it could not make."""

    def __init__(self, *, requested: int, allocated: int, reserved: int):
        self.requested, self.allocated, self.reserved = requested, allocated, reserved
        g = 1 << 30
        super().__init__(f"out of memory: tried to allocate {requested / g:.2f} GiB; {allocated / g:.2f} GiB is "
                         f"allocated and {(reserved - allocated) / g:.2f} GiB is reserved but unallocated")


class _Segment:
    """An expandable segment: a range of addresses with pages mapped on demand."""

    def __init__(self, base: int, size: int, page: int):
        self.base, self.size, self.page = base, size, page

    def map(self, ptr: int, size: int, room: int) -> int:
        """Bytes mapped to cover [ptr, ptr + size) (ptr is page-aligned), 0 if `room` is too small."""
        begin = (ptr - self.base) // self.page
        end = -(-(ptr + size - self.base) // self.page)
        n = (end - begin) * self.page
        return n if n <= room else 0

    def unmappable(self, ptr: int, size: int) -> tuple[int, int]:
        """The whole pages inside [ptr, ptr + size): (start, bytes)."""
        begin = -(-(ptr - self.base) // self.page)
        end = (ptr + size - self.base) // self.page
        return self.base + begin * self.page, max(0, end - begin) * self.page


class _Block:
    __slots__ = ("ptr", "size", "small", "seg", "mapped", "allocated", "requested", "prev", "next")

    def __init__(self, ptr: int, size: int, small: bool, seg: _Segment | None = None, mapped: bool = True):
        self.ptr, self.size, self.small, self.seg, self.mapped = ptr, size, small, seg, mapped
        self.allocated, self.requested = False, 0
        self.prev: _Block | None = None
        self.next: _Block | None = None

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def splice(self, before: "_Block | None", after: "_Block | None") -> None:
        if before is not None:
            before.next = self
        self.prev = before
        if after is not None:
            after.prev = self
        self.next = after


class _Pool:
    """Cached free blocks sorted by (size, address), as `BlockPool.blocks`; unmapped ranges by address."""

    def __init__(self, small: bool):
        self.small = small
        self.keys: list[tuple[int, int]] = []
        self.blocks: dict[tuple[int, int], _Block] = {}
        self.unmapped: list[_Block] = []

    def insert(self, b: _Block) -> None:
        key = (b.size, b.ptr)
        bisect.insort(self.keys, key)
        self.blocks[key] = b

    def remove(self, b: _Block) -> None:
        key = (b.size, b.ptr)
        i = bisect.bisect_left(self.keys, key)
        assert self.keys[i] == key and self.blocks[key] is b
        del self.keys[i]
        del self.blocks[key]

    def cached(self) -> int:
        return sum(k[0] for k in self.keys)


@dataclass(frozen=True, kw_only=True)
class AllocatorStats:
    """The counters `torch.cuda.memory_stats()` reports (aggregate over both pools), in bytes."""

    allocated: int  # allocated_bytes.all.current: live blocks, rounded sizes
    reserved: int  # reserved_bytes.all.current: segments held from the driver
    requested: int  # requested_bytes.all.current: what the program asked for, unrounded
    peak_allocated: int  # max_memory_allocated() since the last reset
    peak_reserved: int  # max_memory_reserved() since the last reset
    inactive_split: int  # inactive_split_bytes: free blocks of split segments (cannot be released)
    segments: int  # segment.all.current: cudaMallocs held (expandable: segments)
    allocations: int  # allocation.all.current: live blocks
    num_alloc_retries: int  # cudaMallocs retried after freeing the cache
    num_ooms: int
    num_device_alloc: int  # cudaMalloc (or page-mapping) calls
    num_device_free: int  # cudaFree (or unmapping) calls

    @property
    def cached(self) -> int:
        """Reserved but unallocated: what `empty_cache()` could at most give back."""
        return self.reserved - self.allocated


class CachingAllocator:
    """The caching allocator's state, one call at a time: `malloc(nbytes)` returns a handle,
    `free(handle)`, `empty_cache()`, `reset_peak()`, `stats()`."""

    def __init__(self, config: AllocatorConfig | None = None):
        self.config = config or AllocatorConfig()
        self._max_split = self.config.max_split_size or _NO_LIMIT
        self._pools = {True: _Pool(True), False: _Pool(False)}
        self._live: dict[int, _Block] = {}
        self._handles = 0
        self._address = 1 << 40  # where the next cudaMalloc lands (increasing; only breaks ties)
        self._segments: list[_Segment] = []
        self.allocated = self.reserved = self.requested = 0
        self.peak_allocated = self.peak_reserved = 0
        self._n_segments = 0
        self.num_alloc_retries = self.num_ooms = self.num_device_alloc = self.num_device_free = 0

    # --- public calls
    def malloc(self, nbytes: int) -> int:
        """Allocate `nbytes`; returns a handle for `free`. Raises OutOfMemory past `capacity`."""
        n = _checks.whole("nbytes", nbytes, lo=0, hi=_checks.MAX_BYTES)
        size = round_size(n)
        pool = self._pools[size <= SMALL_SIZE]
        block = self._get_free_block(pool, size)
        if block is None:
            alloc_size = segment_size(size)
            block = (self._alloc_block(pool, size, alloc_size)
                     or (self._release_available_cached_blocks(pool, size)
                         and self._alloc_block(pool, size, alloc_size))
                     or (self._release_cached_blocks() and self._alloc_block(pool, size, alloc_size, retry=True)))
            if not block:
                self.num_ooms += 1
                raise OutOfMemory(requested=alloc_size, allocated=self.allocated, reserved=self.reserved)
        if self._should_split(block, size):
            rest = block
            block = _Block(rest.ptr, size, rest.small, rest.seg)
            block.splice(rest.prev, rest)
            rest.ptr += size
            rest.size -= size
            pool.insert(rest)
        block.allocated, block.requested = True, n
        self.allocated += block.size
        self.requested += n
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self._handles += 1
        self._live[self._handles] = block
        return self._handles

    def free(self, handle: int) -> None:
        """Free the allocation `handle`: its block is cached, merged with free neighbours."""
        block = self._live.pop(handle, None)
        if block is None:
            raise ValueError(f"free: no live allocation {_checks.show(handle)}")
        block.allocated = False
        self.allocated -= block.size
        self.requested -= block.requested
        pool = self._pools[block.small]
        for neighbour in (block.prev, block.next):
            self._try_merge(block, neighbour, pool)
        pool.insert(block)

    def empty_cache(self) -> None:
        """`torch.cuda.empty_cache()`: give every wholly free segment (expandable: every wholly free
        page) back to the driver. Split segments with a live block stay."""
        self._release_cached_blocks()

    def reset_peak(self) -> None:
        """`torch.cuda.reset_peak_memory_stats()`."""
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def stats(self) -> AllocatorStats:
        inactive = 0
        if not self.config.expandable_segments:
            inactive = sum(b.size for p in self._pools.values() for b in p.blocks.values() if b.is_split())
        return AllocatorStats(allocated=self.allocated, reserved=self.reserved, requested=self.requested,
                              peak_allocated=self.peak_allocated, peak_reserved=self.peak_reserved,
                              inactive_split=inactive, segments=self._n_segments, allocations=len(self._live),
                              num_alloc_retries=self.num_alloc_retries, num_ooms=self.num_ooms,
                              num_device_alloc=self.num_device_alloc, num_device_free=self.num_device_free)

    def segments(self) -> list[tuple[int, list[tuple[int, bool]]]]:
        """Each segment's mapped blocks in address order: (segment bytes, [(block bytes, allocated)])
        (as `torch.cuda.memory_snapshot()` lists them)."""
        heads: dict[int, _Block] = {}
        for b in [*self._live.values(), *(b for p in self._pools.values() for b in p.blocks.values())]:
            while b.prev is not None:
                b = b.prev
            heads[id(b)] = b
        out = []
        for head in sorted(heads.values(), key=lambda b: b.ptr):
            blocks, b = [], head
            while b is not None:
                if b.mapped:
                    blocks.append((b.size, b.allocated))
                b = b.next
            out.append((sum(s for s, _ in blocks), blocks))
        return out

    # --- the source's private functions
    def _room(self) -> int:
        cap = self.config.capacity
        return _NO_LIMIT if cap is None else cap - self.reserved

    def _grow(self, n: int) -> None:
        self.reserved += n
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.num_device_alloc += 1

    def _new_address(self, size: int) -> int:
        ptr = self._address
        self._address += -(-size // ROUND_LARGE) * ROUND_LARGE + ROUND_LARGE
        return ptr

    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        i = bisect.bisect_left(pool.keys, (size, -1))
        if i == len(pool.keys):
            return None
        b = pool.blocks[pool.keys[i]]
        if b.seg is not None:  # best fit counts the unmapped room after a block as its own
            def room(x: _Block) -> int:
                return x.size + (x.next.size if x.next is not None and not x.next.mapped else 0)
            for key in pool.keys[i + 1:]:
                nb = pool.blocks[key]
                if not (b.seg is not None and room(nb) < room(b)):
                    break
                b = nb
        if size < self._max_split <= b.size:
            return None  # do not return an oversized block for a smaller request
        if size >= self._max_split and b.size >= size + LARGE_BUFFER:
            return None  # an oversized block may be rounded up only within 20 MiB
        pool.remove(b)
        return b

    def _should_split(self, b: _Block, size: int) -> bool:
        remaining = b.size - size
        if b.small or self.config.expandable_segments:
            return remaining >= MIN_BLOCK_SIZE
        return size < self._max_split and remaining > SMALL_SIZE

    def _alloc_block(self, pool: _Pool, size: int, alloc_size: int, retry: bool = False) -> _Block | None:
        if retry:
            self.num_alloc_retries += 1
        if self.config.expandable_segments:
            return self._try_allocate_expandable(pool, size)
        if alloc_size > self._room():
            return None
        self._grow(alloc_size)
        self._n_segments += 1
        return _Block(self._new_address(alloc_size), alloc_size, pool.small)

    def _try_merge(self, dst: _Block, src: _Block | None, pool: _Pool) -> int:
        if src is None or src.allocated or dst.mapped != src.mapped:
            return 0
        if src.mapped:
            pool.remove(src)
        else:
            pool.unmapped.remove(src)
        if dst.prev is src:
            dst.ptr = src.ptr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    def _release_block(self, b: _Block, pool: _Pool) -> None:
        pool.remove(b)
        self.reserved -= b.size
        self._n_segments -= 1
        self.num_device_free += 1

    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        """With max_split_size set: free one oversize cached block that fits, or the largest ones."""
        if self._max_split == _NO_LIMIT:
            return False
        want = max(size, self._max_split)
        i = bisect.bisect_left(pool.keys, (want, -1))
        if i < len(pool.keys):
            self._release_block(pool.blocks[pool.keys[i]], pool)
            return True
        released = 0
        for key in reversed(list(pool.keys)):
            b = pool.blocks[key]
            if released >= want or b.size < self._max_split:
                break
            released += b.size
            self._release_block(b, pool)
        return released >= want

    def _release_cached_blocks(self) -> bool:
        for pool in self._pools.values():
            to_unmap = []
            for key in list(pool.keys):
                b = pool.blocks[key]
                if b.seg is not None:
                    to_unmap.append(b)
                elif not b.is_split():
                    self._release_block(b, pool)
            for b in to_unmap:
                self._unmap_block(b, pool)
                if not b.is_split() and not b.mapped:  # the whole segment is free: release it
                    pool.unmapped.remove(b)
                    self._segments.remove(b.seg)
                    self._n_segments -= 1
        return True

    # --- expandable segments
    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        def has_room(b: _Block | None) -> bool:
            n = 0
            while n < size and b is not None and not b.allocated:
                n += b.size
                b = b.next
            return n >= size
        for c in sorted(pool.unmapped, key=lambda b: b.ptr):
            if c.prev is not None and not c.prev.allocated:
                c = c.prev
            if has_room(c):
                return c
        cap = self.config.capacity
        space = -(-((cap if cap is not None else 1 << 48) * 9 // 8) // LARGE_BUFFER) * LARGE_BUFFER
        seg = _Segment(self._new_address(space), space, SMALL_BUFFER if pool.small else LARGE_BUFFER)
        self._segments.append(seg)
        self._n_segments += 1
        c = _Block(seg.base, space, pool.small, seg, mapped=False)
        pool.unmapped.append(c)
        return c

    def _map_block(self, b: _Block, size: int, pool: _Pool) -> bool:
        n = b.seg.map(b.ptr, size, self._room())
        if n == 0:
            return False
        pool.unmapped.remove(b)
        b.mapped = True
        if n < b.size:
            rest = _Block(b.ptr + n, b.size - n, b.small, b.seg, mapped=False)
            rest.splice(b, b.next)
            pool.unmapped.append(rest)
            b.size = n
        self._try_merge(b, b.prev, pool)
        self._try_merge(b, b.next, pool)
        pool.insert(b)
        self._grow(n)
        return True

    def _try_allocate_expandable(self, pool: _Pool, size: int) -> _Block | None:
        c = self._find_expandable_block(pool, size)
        if not c.mapped and not self._map_block(c, min(c.size, size), pool):
            return None
        while c.size < size:
            nxt = c.next
            if not self._map_block(nxt, min(size - c.size, nxt.size), pool):
                return None
            c = nxt  # the newly mapped block absorbed c
        pool.remove(c)
        return c

    def _unmap_block(self, b: _Block, pool: _Pool) -> None:
        start, n = b.seg.unmappable(b.ptr, b.size)
        if n == 0:
            return
        pool.remove(b)
        before = start - b.ptr
        if before > 0:
            head = _Block(b.ptr, before, b.small, b.seg)
            head.splice(b.prev, b)
            pool.insert(head)
        after = b.size - before - n
        if after > 0:
            tail = _Block(start + n, after, b.small, b.seg)
            tail.splice(b, b.next)
            pool.insert(tail)
        b.ptr, b.size, b.mapped = start, n, False
        self._try_merge(b, b.prev, pool)
        self._try_merge(b, b.next, pool)
        pool.unmapped.append(b)
        self.reserved -= n
        self.num_device_free += 1


# ----------------------------------------------------------------------------- replay

@dataclass(frozen=True, kw_only=True)
class Replay:
    """A program's allocations replayed through the allocator. `allocated` and `reserved` are the
    bytes after each event; the peaks are since the last `ResetPeak` (as `max_memory_allocated()` and
    `max_memory_reserved()` after `reset_peak_memory_stats()`)."""

    config: AllocatorConfig
    allocated: tuple[int, ...]
    reserved: tuple[int, ...]
    peak_allocated: int
    peak_reserved: int
    stats: AllocatorStats  # at the end (or at the out-of-memory error)
    oom: OutOfMemory | None = None  # the error that stopped the replay, if one did
    oom_event: int | None = None  # its index in the events
    segments: tuple[tuple[int, tuple[tuple[int, bool], ...]], ...] = field(default=(), repr=False)

    @property
    def overhead(self) -> int:
        """Reserved minus allocated at their peaks: the allocator's rounding and fragmentation."""
        return self.peak_reserved - self.peak_allocated


def replay(events: Iterable, config: AllocatorConfig | None = None, *, stop_at_oom: bool = True) -> Replay:
    """Replay `events` (`Alloc`, `Free`, `EmptyCache`, `ResetPeak`, or their tuple forms, see
    `as_event`) through a fresh allocator. A zero-byte allocation takes no memory (as on CUDA).
    At an out-of-memory error the replay stops and reports it (`stop_at_oom=False` raises it)."""
    a = CachingAllocator(config)
    handles: dict = {}
    allocated: list[int] = []
    reserved: list[int] = []
    oom = oom_event = None
    for i, raw in enumerate(events):
        e = as_event(raw)
        if isinstance(e, Alloc):
            if e.id in handles:
                raise ValueError(f"event {i}: allocation {_checks.show(e.id)} is already live")
            n = _checks.whole("nbytes", e.nbytes, lo=0, hi=_checks.MAX_BYTES)
            try:
                handles[e.id] = a.malloc(n) if n else None
            except OutOfMemory as err:
                if not stop_at_oom:
                    raise
                oom, oom_event = err, i
                break
        elif isinstance(e, Free):
            if e.id not in handles:
                raise ValueError(f"event {i}: free of {_checks.show(e.id)}, which is not a live allocation")
            h = handles.pop(e.id)
            if h is not None:
                a.free(h)
        elif isinstance(e, EmptyCache):
            a.empty_cache()
        else:
            a.reset_peak()
        allocated.append(a.allocated)
        reserved.append(a.reserved)
    segs = tuple((size, tuple(blocks)) for size, blocks in a.segments())
    return Replay(config=a.config, allocated=tuple(allocated), reserved=tuple(reserved),
                  peak_allocated=a.peak_allocated, peak_reserved=a.peak_reserved, stats=a.stats(), oom=oom,
                  oom_event=oom_event, segments=segs)
