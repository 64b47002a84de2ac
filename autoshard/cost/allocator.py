"""PyTorch's CUDA caching allocator, replayed: how many bytes it reserves from the device for a
sequence of tensor allocations and frees, against the bytes those tensors hold.

A training step's live tensors (what :mod:`autoshard.cost.liveness` counts) are not what a GPU
runs out of: the allocator keeps freed memory cached in segments, a cached block serves only the
stream that allocated it, and a free block too small for the next request stays reserved beside
a new one. Its peak *reserved* bytes (``torch.cuda.memory_stats()["reserved_bytes.all.peak"]``,
what torchtitan logs as memory) is the peak of live bytes plus that fragmentation. This module
plays an event sequence (``("alloc", id, bytes, stream)``, ``("free", id)``, ``("step",)``)
through a model of the allocator's documented default rules (PyTorch's "CUDA memory
management" notes and the constants of c10/cuda/CUDACachingAllocator.cpp, as of torch 2.5-2.6):

- requests round up to multiples of 512 B (``kMinBlockSize``); those of at most 1 MiB
  (``kSmallSize``) come from the small pool, the rest from the large pool; each pool's cached
  blocks are kept per stream and serve only requests of that stream;
- a request takes the smallest free cached block of its pool and stream that fits (best fit),
  splitting it (the request at the lower address) when the remainder is at least 512 B (small
  pool) or more than 1 MiB (large pool); a freed block merges with free neighbours;
- with no block to take, default segments (``expandable_segments:False``) are fresh
  ``cudaMalloc`` s of 2 MiB (small pool, ``kSmallBuffer``), 20 MiB (requests under 10 MiB,
  ``kLargeBuffer`` / ``kMinLargeAlloc``) or the request rounded up to 2 MiB (``kRoundLarge``);
  they are never returned, except that when a new one would pass ``capacity`` the allocator
  first frees every cached segment that is wholly free, and retries;
- with ``expandable_segments:True`` each stream and pool has one segment of virtual address
  space whose pages are mapped on demand: 2 MiB pages for the small pool, 20 MiB for the large
  (``segment_size = pool->is_small ? kSmallBuffer : kLargeBuffer``). A request with no free
  mapped block to take grows the segment at its end, starting at a free block there if there is
  one; any remainder of at least 512 B is split off; best fit takes a free block at the mapped
  end only when no other fits. Past ``capacity``, the free pages at a segment's end are
  unmapped first, then the request retried (PyTorch also unmaps free pages inside a segment, to
  be mapped again for a later request that fits there: not modelled).

Not modelled: ``max_split_size_mb``, ``roundup_power2_divisions`` and the other
``PYTORCH_CUDA_ALLOC_CONF`` knobs (off by default), ``record_stream`` (events delaying reuse),
CUDA graphs' private pools, the CUDA context and library workspaces (cuBLAS, NCCL), and
``garbage_collection_threshold``. A request that still does not fit under ``capacity`` after
the release raises :class:`~autoshard.runtime.errors.OverBudgetError`.
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import Iterable, Union

from autoshard.runtime.errors import OverBudgetError

MIN_BLOCK = 512  # kMinBlockSize: every request rounds up to a multiple of it
SMALL_SIZE = 1 << 20  # kSmallSize: the largest small-pool request
SMALL_BUFFER = 2 << 20  # kSmallBuffer: a small-pool segment (expandable: the small pool's page)
LARGE_BUFFER = 20 << 20  # kLargeBuffer: a segment for requests under MIN_LARGE_ALLOC (expandable: the large pool's page)
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge: larger segments are the request rounded up to it

Event = Union[tuple[str, object, int, str], tuple[str, object], tuple[str]]


def round_size(nbytes: int) -> int:
    """A request's size as the allocator serves it: at least 512 B, a multiple of 512 B."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def _up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def _peak(value: int, peak: int, per_step: list[int]) -> int:
    """The new overall peak; the current step's (the last of ``per_step``) raised in place."""
    if per_step:
        per_step[-1] = max(per_step[-1], value)
    return max(peak, value)


def segment_size(size: int) -> int:
    """The bytes a default (non-expandable) segment for a rounded request of ``size`` reserves."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    return LARGE_BUFFER if size < MIN_LARGE_ALLOC else _up(size, ROUND_LARGE)


@dataclass(eq=False)
class _Block:
    start: int
    size: int
    segment: _Segment
    allocated: bool = False
    mapped: bool = True
    prev: _Block | None = None
    next: _Block | None = None

    def key(self) -> tuple[int, int, int]:
        return (self.size, self.segment.index, self.start)


@dataclass(eq=False)
class _Segment:
    index: int
    stream: str
    small: bool
    page: int  # expandable: the granularity its pages are mapped in


@dataclass
class AllocatorStats:
    """What a replay reserved and allocated: peaks overall and from each ``("step",)`` event to
    the next (``*_per_step``: steady state when they stop growing); ``retries`` counts releases
    forced by ``capacity``."""

    peak_reserved: int = 0
    peak_allocated: int = 0
    reserved: int = 0
    allocated: int = 0
    retries: int = 0
    reserved_peak_per_step: list[int] = field(default_factory=list)
    allocated_peak_per_step: list[int] = field(default_factory=list)


class CachingAllocator:
    """The caching allocator's state: segments, their blocks, and each (stream, pool)'s free
    blocks by size. ``malloc``/``free`` as :func:`replay` drives them."""

    def __init__(self, *, expandable_segments: bool = False, capacity: int | None = None) -> None:
        self.expandable = expandable_segments
        self.capacity = capacity
        self.stats = AllocatorStats()
        self._free: dict[tuple[str, bool], list[tuple[tuple[int, int, int], _Block]]] = {}
        self._grow: dict[tuple[str, bool], _Block] = {}  # expandable: the unmapped block at each segment's end
        self._ids = itertools.count()

    def _insert(self, b: _Block) -> None:
        bisect.insort(self._free.setdefault((b.segment.stream, b.segment.small), []), (b.key(), b), key=lambda e: e[0])

    def _remove(self, b: _Block) -> None:
        blocks = self._free[(b.segment.stream, b.segment.small)]
        i = bisect.bisect_left(blocks, b.key(), key=lambda e: e[0])
        assert blocks[i][1] is b
        del blocks[i]

    def _best_fit(self, stream: str, small: bool, size: int) -> _Block | None:
        blocks = self._free.get((stream, small), [])
        i = bisect.bisect_left(blocks, (size, -1, -1), key=lambda e: e[0])
        # Expandable: a free block at the mapped end counts as the size it could grow to, so it
        # is taken only when no other block fits.
        at_end = None
        for _, b in itertools.islice(blocks, i, None):
            if b.next is None or b.next.mapped:
                return b
            at_end = at_end or b
        return at_end

    def malloc(self, nbytes: int, stream: str) -> _Block:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._best_fit(stream, small, size)
        if block is None:
            block = self._new_space(stream, small, size)
        else:
            self._remove(block)
        rest = block.size - size
        if rest >= MIN_BLOCK and (small or self.expandable or rest > SMALL_SIZE):
            tail = _Block(block.start + size, rest, block.segment, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            self._insert(tail)
        block.allocated = True
        self.stats.allocated += block.size
        self.stats.peak_allocated = _peak(self.stats.allocated, self.stats.peak_allocated, self.stats.allocated_peak_per_step)
        return block

    def free(self, block: _Block) -> None:
        block.allocated = False
        self.stats.allocated -= block.size
        for other in (block.prev, block.next):
            if other is not None and not other.allocated and other.mapped:
                self._remove(other)
                self._merge(block, other)
        self._insert(block)

    @staticmethod
    def _merge(block: _Block, other: _Block) -> None:
        """Absorb the neighbouring ``other`` into ``block``."""
        if other is block.prev:
            block.start, block.prev = other.start, other.prev
            if other.prev is not None:
                other.prev.next = block
        else:
            block.next = other.next
            if other.next is not None:
                other.next.prev = block
        block.size += other.size

    def _new_space(self, stream: str, small: bool, size: int) -> _Block:
        """A free block of at least ``size`` from new device memory, releasing cached memory
        first if ``capacity`` requires it."""
        grow = self._growth(stream, small, size)
        if self.capacity is not None and self.stats.reserved + grow > self.capacity:
            self.stats.retries += 1
            self._release()
            grow = self._growth(stream, small, size)
            if self.stats.reserved + grow > self.capacity:
                raise OverBudgetError(
                    f"autoshard.cost.allocator: a {size} B request on stream {stream!r} does not fit: {self.stats.reserved} B stay "
                    f"reserved of the {self.capacity} B capacity after releasing the cached memory; raise the capacity, or "
                    "lower what the step holds (a memory budget, more ranks, activation checkpointing).")
        self.stats.reserved += grow
        self.stats.peak_reserved = _peak(self.stats.reserved, self.stats.peak_reserved, self.stats.reserved_peak_per_step)
        if not self.expandable:
            return _Block(0, grow, _Segment(next(self._ids), stream, small, grow))
        end = self._grow[(stream, small)]
        start = end.prev.start if end.prev is not None and not end.prev.allocated else end.start
        block = _Block(end.start, grow, end.segment, prev=end.prev, next=end)
        if end.prev is not None:
            end.prev.next = block
        end.prev, end.start = block, end.start + grow
        if block.prev is not None and not block.prev.allocated:
            self._remove(block.prev)
            self._merge(block, block.prev)
        assert block.start == start
        return block

    def _growth(self, stream: str, small: bool, size: int) -> int:
        """Bytes to reserve for a request of ``size`` that no free block meets."""
        if not self.expandable:
            return segment_size(size)
        key = (stream, small)
        if key not in self._grow:
            page = SMALL_BUFFER if small else LARGE_BUFFER
            segment = _Segment(next(self._ids), stream, small, page)
            self._grow[key] = _Block(0, 1 << 62, segment, mapped=False)
        end = self._grow[key]
        tail = end.prev if end.prev is not None and not end.prev.allocated else None
        start = tail.start if tail is not None else end.start
        return _up(start + size, end.segment.page) - end.start

    def _release(self) -> None:
        """Free cached memory: whole free segments (default); the free pages at each expandable
        segment's mapped end (PyTorch also unmaps free pages inside a segment, to be mapped
        again where a later request fits: not modelled)."""
        if not self.expandable:  # a free block with no neighbours is a whole segment
            for key, blocks in self._free.items():
                self.stats.reserved -= sum(b.size for _, b in blocks if b.prev is None and b.next is None)
                self._free[key] = [(k, b) for k, b in blocks if b.prev is not None or b.next is not None]
            return
        for end in self._grow.values():
            tail = end.prev
            if tail is None or tail.allocated:
                continue
            keep = _up(tail.start, end.segment.page)  # the page holding the tail's start stays mapped
            drop = end.start - keep
            if drop <= 0:
                continue
            self._remove(tail)
            tail.size -= drop
            end.start = keep
            self.stats.reserved -= drop
            if tail.size:
                self._insert(tail)
            else:  # the whole block was in released pages
                end.prev = tail.prev
                if tail.prev is not None:
                    tail.prev.next = end


def replay(events: Iterable[Event], *, expandable_segments: bool = False, capacity: int | None = None) -> AllocatorStats:
    """Play ``events`` through a fresh :class:`CachingAllocator` and return its
    :class:`AllocatorStats`. ``("alloc", id, nbytes, stream)`` allocates, ``("free", id)``
    frees it, ``("step",)`` starts a step (for the per-step peaks)."""
    allocator = CachingAllocator(expandable_segments=expandable_segments, capacity=capacity)
    held: dict[object, _Block] = {}
    for event in events:
        if event[0] == "alloc":
            _, key, nbytes, stream = event
            held[key] = allocator.malloc(nbytes, stream)
        elif event[0] == "free":
            allocator.free(held.pop(event[1]))
        else:
            allocator.stats.reserved_peak_per_step.append(allocator.stats.reserved)
            allocator.stats.allocated_peak_per_step.append(allocator.stats.allocated)
    return allocator.stats
