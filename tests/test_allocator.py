"""The caching-allocator model against the rules of c10/cuda/CUDACachingAllocator.cpp."""

import random
import re

import pytest

from memcalc.engine.allocator import (INTEGERS, MiB, CachingAllocator, FreeBlocks, OutOfMemory, Settings,
                                      round_size, segment_size, settings_of)


@pytest.mark.parametrize("request_bytes, block", [
    (0, 0),  # 0-byte tensors allocate nothing
    (1, 512),  # kMinBlockSize
    (512, 512),
    (513, 1024),  # ceil(513 / 512) * 512
    (8_000_000, 8_000_000),  # 15625 * 512, already a multiple
    (12_000, 12_288),  # ceil(12000 / 512) = 24 -> 24 * 512
])
def test_round_size(request_bytes, block):
    assert round_size(request_bytes) == block


@pytest.mark.parametrize("request_bytes, answer", [
    (0, None),  # allocates nothing
    (1, (512, True)),  # kMinBlockSize, small pool
    (MiB, (MiB, True)),  # kSmallSize is still small
    (MiB + 1, (MiB + 512, False)),  # ceil((MiB + 1) / 512) * 512 > kSmallSize: large pool
])
def test_request_gives_block_and_pool(request_bytes, answer):
    assert INTEGERS.request(request_bytes) == answer
    assert INTEGERS.request(request_bytes) == answer  # the kept answer, asked again


@pytest.mark.parametrize("block, segment", [
    (512, 2 * MiB),  # small pool: kSmallBuffer
    (MiB, 2 * MiB),  # 1 MiB is still small
    (MiB + 512, 20 * MiB),  # below kMinLargeAlloc (10 MiB): kLargeBuffer
    (10 * MiB, 10 * MiB),  # from 10 MiB: rounded up to 2 MiB
    (11 * MiB + 512 * 1024, 12 * MiB),  # 11.5 MiB -> 12 MiB
])
def test_segment_size(block, segment):
    assert segment_size(block) == segment


def test_unsplit_remainder_counts_as_allocated():
    # 11.5 MiB takes a fresh 12 MiB segment; the 0.5 MiB rest is not > 1 MiB, so the
    # whole 12 MiB block is allocated (DESIGN.md section 2).
    a = CachingAllocator()
    a.malloc(11 * MiB + 512 * 1024)
    assert a.allocated == 12 * MiB
    assert a.reserved == 12 * MiB


def test_large_split_and_reuse():
    a = CachingAllocator()
    first = a.malloc(8_000_000)  # 20 MiB segment, rest 20 MiB - 8,000,000 = 12,971,520 > 1 MiB: split
    assert first.size == 8_000_000
    second = a.malloc(12_000_000)  # fits the 12,971,520 remainder; rest 971,520 <= 1 MiB: no split
    assert second.size == 12_971_520
    assert a.allocated == 20 * MiB and a.reserved == 20 * MiB  # 8,000,000 + 12,971,520


def test_small_pool_splits_down_to_512():
    a = CachingAllocator()
    a.malloc(1000)  # block 1024 of a 2 MiB small segment
    a.malloc(MiB)  # from the 2 MiB - 1024 rest; what is left, 1 MiB - 1024 >= 512: split
    a.malloc(MiB - 1536)  # from the 1 MiB - 1024 rest; 512 left >= 512: split again
    assert a.allocated == 2 * MiB - 512  # 1024 + 1 MiB + (1 MiB - 1536)
    assert len(a.segments) == 1


def test_best_fit_prefers_smallest_block():
    a = CachingAllocator()
    big, small = a.malloc(30 * MiB), a.malloc(12 * MiB)
    a.free(big), a.free(small)
    assert a.malloc(12 * MiB).size == 12 * MiB  # the 12 MiB segment, not a split of 30
    assert a.reserved == 42 * MiB  # 30 + 12, nothing new


def test_free_merges_neighbours():
    a = CachingAllocator()
    x, y = a.malloc(4 * MiB), a.malloc(4 * MiB)  # both in one 20 MiB segment
    a.free(x), a.free(y)
    assert [b.size for b in a.segments[0].blocks] == [20 * MiB]


def test_peaks_and_reset():
    a = CachingAllocator()
    x = a.malloc(30 * MiB)
    a.free(x)
    assert (a.allocated, a.peak_allocated) == (0, 30 * MiB)
    a.reset_peaks()
    assert (a.peak_allocated, a.peak_reserved) == (0, 30 * MiB)  # reserved stays cached


def test_oom_releases_cache_then_raises():
    a = CachingAllocator(capacity=40 * MiB)
    a.free(a.malloc(30 * MiB))
    a.malloc(32 * MiB)  # no cached block fits; 30 + 32 > 40: the free 30 MiB segment goes first
    assert a.reserved == 32 * MiB
    with pytest.raises(OutOfMemory):
        a.malloc(10 * MiB)  # 32 + 10 > 40 and nothing left to release


@pytest.mark.parametrize("run", [None, 1, 2, 3, 256])
def test_free_blocks_give_the_best_fit(monkeypatch, run):
    """The small pool's index (per size, ``run=None``) and the sorted runs (here of ``run``
    blocks, which serve the large pool and symbolic sizes) choose exactly what one sorted
    list would: the smallest free block of at least the request, lowest address first.
    The oracle is a scan of every free block of the small pool."""
    allocator, live = CachingAllocator(), []
    if run is not None:
        monkeypatch.setattr(FreeBlocks, "RUN", run)
        allocator.pools[True, 0] = FreeBlocks(INTEGERS)
    rng = random.Random(7)
    for step in range(3000):
        if live and rng.random() < 0.45:
            allocator.free(live.pop(rng.randrange(len(live))))
            continue
        size = round_size(rng.choice([512, 1536, 4096, 32768, 131072, 700000]))
        pool = allocator.pool(True)
        fits = [b for b in pool if b.size >= size]
        expected = min(fits, key=lambda b: (b.size, b.addr)) if fits else None
        block = allocator.malloc(size)
        if expected is not None:
            assert block.addr == expected.addr
        live.append(block)
    pool = allocator.pool(True)
    keys = [(b.size, b.addr) for b in pool]
    assert keys == sorted(keys) and len(pool) == len(keys)


def _step(allocator, rng_seed):
    """A step of small and large requests and frees, all freed at its end; returns the
    allocated peak and the sizes of the blocks it got, in order."""
    rng, live, blocks = random.Random(rng_seed), [], []
    for _ in range(400):
        if live and rng.random() < 0.4:
            allocator.free(live.pop(rng.randrange(len(live))))
            continue
        live.append(allocator.malloc(rng.choice([700, 4096, 131072, 600_000, 3 * MiB])))
        blocks.append(live[-1].size)
    for block in live:
        allocator.free(block)
    return blocks


@pytest.mark.parametrize("seed", [3, 5, 11, 17])
def test_measured_step_mirrors_the_warm_ups_small_pool(seed):
    """After a warm-up that freed all it allocated, a second step makes the same small-pool
    decisions: mirrored, it reserves nothing and counts the blocks a full replay counts."""
    runs = []
    for mirror in (False, True):
        allocator = CachingAllocator()
        held = allocator.malloc(1000)  # an input: stays in the small pool throughout
        allocator.mark_warm_up()
        _step(allocator, seed)
        reserved = allocator.reserved
        if mirror:  # else the full replay, for comparison
            assert allocator.mirror_small_pool() is True
        allocator.reset_peaks()
        runs.append((_step(allocator, seed), allocator.peak_allocated, allocator.peak_reserved))
        assert allocator.reserved == reserved and held.size == 1024
    assert runs[0] == runs[1]


def test_no_mirror_unless_the_small_pool_is_as_the_warm_up_found_it():
    """Not mirrored: a small block the warm-up allocated is still held; nothing was marked;
    mirroring is off (a replay again after ``MirrorBroken``); the warm-up released
    segments (``empty_cache``: the warm-up's may be gone)."""
    kept = CachingAllocator()
    kept.mark_warm_up()
    kept.malloc(4096)
    unmarked = CachingAllocator()
    off = CachingAllocator(capacity=1 << 40)
    off.mark_warm_up()
    off.may_mirror = False
    released = CachingAllocator(capacity=1 << 40)
    released.mark_warm_up()
    released.empty_cache()
    assert [a.mirror_small_pool() for a in (kept, unmarked, off, released)] == [False] * 4


def test_a_capped_allocator_mirrors_and_refuses_to_release_while_mirrored():
    """With a capacity the measured step mirrors too; a release it would need then raises
    ``MirrorBroken`` (the mirrored small pool's segments are not tracked), not a wrong
    count: 2 MiB of small segment cached, a capacity of 22 MiB, a 20 MiB segment asked."""
    from memcalc.engine.allocator import MirrorBroken

    a = CachingAllocator(capacity=22 * MiB)
    a.mark_warm_up()
    a.free(a.malloc(4096))  # the warm-up: one small segment, wholly free after
    assert a.mirror_small_pool() and a.reserved == 2 * MiB
    with pytest.raises(MirrorBroken):
        a.malloc(20 * MiB + 1)  # a 22 MiB segment on top of 2 MiB: release needed


def test_a_block_serves_its_own_stream_only():
    """``get_free_block`` stops at a block of another stream (``BlockComparatorSize`` orders
    the pools by stream first): FSDP's buffers, made on its own streams, are not reused
    by the compute stream, nor the other way round."""
    a = CachingAllocator()
    block = a.malloc(4 * MiB, stream=1)  # a 20 MiB segment on stream 1
    a.free(block)
    assert a.reserved == 20 * MiB
    again = a.malloc(4 * MiB, stream=0)  # stream 0 cannot take it: a segment of its own
    assert a.reserved == 40 * MiB and again.segment.stream == 0
    a.free(again)
    assert a.malloc(4 * MiB, stream=1).segment is block.segment  # stream 1's, reused
    a.empty_cache()  # releases the wholly free segments of every stream
    assert a.reserved == 20 * MiB  # 40 MiB - stream 0's free 20 MiB segment


# --- expandable segments (PYTORCH_ALLOC_CONF=expandable_segments:True) ---------------------
# c10/cuda/CUDACachingAllocator.cpp: find_expandable_block, try_allocate_expandable_block,
# map_block, unmap_block, release_blocks, should_split; pages of kSmallBuffer (2 MiB) and
# kLargeBuffer (20 MiB)

def expandable(capacity=None) -> CachingAllocator:
    return CachingAllocator(capacity, settings=Settings(expandable_segments=True))


def test_expandable_segments_map_pages_of_2_and_20_mib():
    """No segment per request: the pool's one segment maps a 20 MiB page (large pool) or a
    2 MiB page (small pool) at a time."""
    a = expandable()
    a.malloc(3 * MiB)
    assert a.reserved == 20 * MiB  # one large page (default: a 20 MiB segment too)
    a.malloc(1000)
    assert a.reserved == 22 * MiB  # and one small page


def test_a_request_maps_only_the_pages_it_lacks_after_the_free_block_before_them():
    """3 MiB then 30 MiB: the 17 MiB left free at the end of the first page and one more
    page (ceil((30 - 17) / 20) = 1) hold it: 40 MiB reserved, where the default reserves a
    20 MiB segment and a 30 MiB one (50 MiB)."""
    a, default = expandable(), CachingAllocator()
    for allocator in (a, default):
        allocator.malloc(3 * MiB)
        allocator.malloc(30 * MiB)
    assert (a.reserved, default.reserved) == (40 * MiB, 50 * MiB)
    assert a.allocated == default.allocated == 33 * MiB


def test_a_large_block_is_split_down_to_512_bytes():
    """should_split: with expandable segments every pool splits a block when 512 B or more
    remain; by default the large pool keeps a remainder of 1 MiB or less in the block. 11.5
    MiB from 12 MiB: the default counts 12 MiB allocated, expandable segments 11.5."""
    request = 11 * MiB + MiB // 2
    a, default = expandable(), CachingAllocator()
    a.malloc(request), default.malloc(request)
    assert (a.allocated, default.allocated) == (request, 12 * MiB)


def test_releasing_unmaps_whole_free_pages_and_the_holes_are_mapped_again():
    """release_blocks unmaps every whole page inside a free block (unmap_block): 25 MiB then
    2 MiB map two pages; with the 25 MiB freed and the cache released, the first page is
    unmapped (its block's last 5 MiB, in the second page, stay mapped): 20 MiB reserved. A
    22 MiB request then maps that hole again, the lowest unmapped range that, with the free
    5 MiB after it, holds it: 40 MiB reserved."""
    a = expandable()
    x = a.malloc(25 * MiB)
    a.malloc(2 * MiB)
    assert a.reserved == 40 * MiB
    a.free(x)
    a.empty_cache()
    assert a.reserved == 20 * MiB
    block = a.malloc(22 * MiB)
    assert (a.reserved, block.addr) == (40 * MiB, x.addr)


def test_out_of_memory_unmaps_the_cache_first():
    """On a full device the allocator releases (unmaps) its free pages and maps again before
    it fails: capacity 40 MiB, 25 MiB and 2 MiB mapped (40 MiB); the 25 MiB freed, 30 MiB
    fits once the first page is unmapped and mapped again (40 MiB); 50 MiB more does not."""
    a = expandable(capacity=40 * MiB)
    x = a.malloc(25 * MiB)
    a.malloc(2 * MiB)
    a.free(x)
    a.malloc(30 * MiB)
    assert a.reserved == 40 * MiB
    with pytest.raises(OutOfMemory):
        a.malloc(50 * MiB)


@pytest.mark.parametrize("text, expandable_segments", [
    (None, False), ("", False), ("expandable_segments:True", True),
    ("expandable_segments:False", False),
    ("release_lock_on_cudamalloc:True,expandable_segments:True", True),
])
def test_the_settings_are_read_as_torch_reads_them(text, expandable_segments):
    assert settings_of(text) == Settings(expandable_segments)


@pytest.mark.parametrize("text, message", [
    ("expandable_segments:true", "expandable_segments takes True or False"),
    ("max_split_size_mb:512", "max_split_size_mb is not modelled"),
    ("expandible_segments:True", "(did you mean 'expandable_segments'?)"),
])
def test_settings_the_model_cannot_follow_are_refused(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        settings_of(text)
