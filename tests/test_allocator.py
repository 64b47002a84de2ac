"""autoshard/cost/allocator.py: PyTorch's caching allocator replayed on hand-made event
sequences, each expected figure worked out by hand in the test's docstring."""
from __future__ import annotations

import pytest

from autoshard.cost.allocator import replay, round_size, segment_size
from autoshard.runtime.errors import OverBudgetError

MiB = 1 << 20


def alloc(key, nbytes, stream="compute"):
    return ("alloc", key, nbytes, stream)


def free(key):
    return ("free", key)


def test_rounding_and_segment_sizes():
    """512-byte multiples (at least 512); small requests (<= 1 MiB) in 2 MiB segments, large ones
    under 10 MiB in 20 MiB, larger ones rounded up to 2 MiB. 11 MiB: a 12 MiB segment (its
    0.5 MiB remainder not split); 3 MiB: a 20 MiB one; 1 byte: a 2 MiB one. Then 11 MiB more
    fits the 17 MiB left of the 20 (split off after the 3): still 34 reserved."""
    assert [round_size(n) for n in (1, 512, 513, 1000)] == [512, 512, 1024, 1024]
    assert segment_size(MiB) == 2 * MiB and segment_size(MiB + 512) == 20 * MiB
    assert segment_size(10 * MiB - 512) == 20 * MiB and segment_size(10 * MiB) == 10 * MiB
    assert segment_size(11 * MiB) == 12 * MiB
    stats = replay([alloc(2, 11 * MiB), alloc(1, 3 * MiB), alloc(0, 1), alloc(3, 11 * MiB)])
    assert stats.peak_allocated == 12 * MiB + 3 * MiB + 512 + 11 * MiB
    assert stats.peak_reserved == 12 * MiB + 20 * MiB + 2 * MiB


def test_same_stream_reuses_and_other_streams_do_not():
    """A freed 12 MiB segment serves the next 12 MiB request of its stream (reserved stays 12);
    another stream's request gets a segment of its own (24)."""
    same = replay([alloc(0, 12 * MiB), free(0), alloc(1, 12 * MiB)])
    assert same.peak_reserved == 12 * MiB
    other = replay([alloc(0, 12 * MiB), free(0), alloc(1, 12 * MiB, stream="all_gather")])
    assert other.peak_reserved == 24 * MiB and other.peak_allocated == 12 * MiB


def test_fragmentation_reserves_more_than_is_allocated():
    """A 100 MiB segment; 60 MiB carved from it (split: remainder 40 > 1 MiB) and kept, the rest
    freed; a new 100 MiB request fits no free block (40) and gets a second segment: 200 reserved,
    at most 160 allocated."""
    stats = replay([alloc(0, 100 * MiB), free(0), alloc(1, 60 * MiB), alloc(2, 100 * MiB)])
    assert stats.peak_allocated == 160 * MiB
    assert stats.peak_reserved == 200 * MiB


def test_best_fit_and_coalescing():
    """Segments of 30 and 50 MiB, both freed. A 25 MiB request takes the 30 (the smallest that
    fits), leaving 5 free beside it. Freeing it merges the two back into 30, so a 30 MiB request
    fits again: reserved stays 80. Without coalescing it would need a third segment."""
    stats = replay([alloc(0, 30 * MiB), alloc(1, 50 * MiB), free(0), free(1),
                    alloc(2, 25 * MiB), alloc(3, 45 * MiB), free(2), alloc(4, 30 * MiB)])
    assert stats.peak_reserved == 80 * MiB and stats.peak_allocated == 80 * MiB


def test_large_remainders_of_a_mebibyte_or_less_are_not_split():
    """A 20 MiB segment for a 2 MiB request; the remainder (18 MiB) is split off and serves a
    second 2 MiB request. A freed 12 MiB segment asked for 11.5 MiB is handed out whole (its
    0.5 MiB remainder is not more than 1 MiB), so the allocated bytes count all 12; a later
    2 MiB request gets a 20 MiB segment (32 reserved)."""
    stats = replay([alloc(0, 2 * MiB), alloc(1, 2 * MiB)])
    assert stats.peak_reserved == 20 * MiB
    whole = replay([alloc(0, 12 * MiB), free(0), alloc(1, 11 * MiB + MiB // 2), alloc(2, 2 * MiB)])
    # 12 reserved, then 2 MiB needs a new 20 MiB segment: the 0.5 MiB tail stayed with block 1.
    assert whole.peak_reserved == 32 * MiB and whole.peak_allocated == 12 * MiB + 2 * MiB


def test_small_pool_splits_down_to_512_bytes():
    """Small requests share one 2 MiB segment: 4096 requests of 512 B fill it exactly."""
    stats = replay([alloc(i, 512) for i in range(4096)] + [alloc(-1, 512)])
    assert stats.peak_reserved == 2 * MiB + 2 * MiB


def test_capacity_releases_free_segments_before_failing():
    """Capacity 64 MiB: 40 MiB allocated and freed, then 50 MiB: 90 would pass it, so the
    free 40 MiB segment is released (one retry) and 50 reserved; 70 more cannot fit."""
    stats = replay([alloc(0, 40 * MiB), free(0), alloc(1, 50 * MiB)], capacity=64 * MiB)
    assert stats.retries == 1 and stats.reserved == 50 * MiB and stats.peak_reserved == 50 * MiB
    with pytest.raises(OverBudgetError, match="does not fit"):
        replay([alloc(0, 40 * MiB), alloc(1, 30 * MiB)], capacity=64 * MiB)


def test_expandable_segments_grow_at_the_end_in_20_mib_pages():
    """Expandable: 30 MiB maps two 20 MiB pages (40); 5 MiB fits the 10 left at the end (split
    down to 512 B); a 12 MiB request needs 5 more at the end beyond the free 5: one more page (60).
    The default allocator: 30, then a 20 MiB segment for the 5 whose 15 left serve the 12: 50."""
    events = [alloc(0, 30 * MiB), alloc(1, 5 * MiB), alloc(2, 12 * MiB)]
    assert replay(events, expandable_segments=True).peak_reserved == 60 * MiB
    assert replay(events).peak_reserved == 50 * MiB


def test_expandable_segments_fragment_too():
    """Expandable: 100 MiB maps 100; freed, 60 MiB taken from its start and kept; a 100 MiB
    request fits no free block inside (the free 40 is at the end, so it grows from there:
    60 + 100 = 160, rounded up to 20 MiB pages: 160). The default allocator: 200."""
    events = [alloc(0, 100 * MiB), free(0), alloc(1, 60 * MiB), alloc(2, 100 * MiB)]
    assert replay(events, expandable_segments=True).peak_reserved == 160 * MiB
    assert replay(events).peak_reserved == 200 * MiB
    # A hole in the middle stays reserved: 60 kept after 40 freed in front of it.
    hole = [alloc(0, 40 * MiB), alloc(1, 60 * MiB), free(0), alloc(2, 50 * MiB)]
    assert replay(hole, expandable_segments=True).peak_reserved == 160 * MiB


def test_expandable_small_pool_uses_2_mib_pages_per_stream():
    """Small requests map 2 MiB pages; each stream has its own segment."""
    stats = replay([alloc(0, 1000), alloc(1, 1000, stream="reduce_scatter")], expandable_segments=True)
    assert stats.peak_reserved == 4 * MiB


def test_per_step_peaks():
    """("step",) starts a step: peaks per step, and reserved carried over from the last."""
    step = [("step",), alloc(0, 30 * MiB), free(0)]
    stats = replay(step + [("step",), alloc(1, 10 * MiB), free(1)])
    assert stats.reserved_peak_per_step == [30 * MiB, 30 * MiB]
    assert stats.allocated_peak_per_step == [30 * MiB, 10 * MiB]


def test_release_frees_only_wholly_free_segments():
    """Capacity 100 MiB. Segment A (40 MiB) holds a 20 MiB block and 20 free after it; both
    freed, they merge back into one free 40 MiB segment. Segment B (30 MiB) keeps a 12 MiB block.
    A 50 MiB request (120 > 100) releases A only (B is split and in use): 30 + 50 = 80."""
    events = [alloc(0, 40 * MiB), free(0), alloc(1, 20 * MiB), alloc(2, 20 * MiB), alloc(3, 30 * MiB),
              free(3), alloc(4, 12 * MiB), free(2), free(1), alloc(5, 50 * MiB)]
    stats = replay(events, capacity=100 * MiB)
    assert stats.retries == 1 and stats.reserved == 80 * MiB and stats.peak_reserved == 80 * MiB


def test_expandable_release_unmaps_the_free_pages_at_the_end():
    """Expandable, capacity 100 MiB, one stream: 30 MiB (pages to 40) then 50 (grows to 80);
    both freed, they are one free block over 80 mapped MiB. A 30 MiB request on another stream
    (its own segment: 40 more, 120 > 100) unmaps the free pages: all of the first segment's 80
    (the free block starts at 0). Reserved 40."""
    events = [alloc(0, 30 * MiB), alloc(1, 50 * MiB), free(0), free(1), alloc(2, 30 * MiB, stream="all_gather")]
    stats = replay(events, expandable_segments=True, capacity=100 * MiB)
    assert stats.retries == 1 and stats.reserved == 40 * MiB and stats.peak_reserved == 80 * MiB
