"""A model of PyTorch's CUDA caching allocator, enough to reproduce its byte counters.

Rules read from ``c10/cuda/CUDACachingAllocator.cpp`` (torch 2.13, default config: no
``max_split_size_mb``, no expandable segments, no garbage-collection threshold):

* a request of ``n > 0`` bytes is rounded to a block of ``max(512, ceil(n/512)*512)``
  (``round_size``); 0-byte requests allocate nothing;
* blocks of <= 1 MiB come from the small pool, larger ones from the large pool;
* a request takes the best-fitting free block of its pool, the smallest one that is big
  enough, ties broken by address (``BlockComparatorSize``);
* with no fitting block a new segment is reserved (``get_allocation_size``): 2 MiB for
  small requests, 20 MiB below 10 MiB, else the size rounded up to 2 MiB;
* the chosen block is split when the rest is >= 512 B (small pool) or > 1 MiB (large
  pool); otherwise the whole block counts as allocated (``should_split``);
* a freed block merges with free neighbours of its segment (``try_merge_blocks``);
* when a new segment would exceed the device, every wholly free segment is released and
  the reservation retried once (``release_cached_blocks``), then OutOfMemory is raised.

New segments get increasing virtual addresses; real ``cudaMalloc`` addresses are not
known in advance, so ties between equal free blocks in different segments are broken as
if segments were handed out in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

KiB = 1024
MiB = 1024 * KiB
MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 * MiB  # kSmallSize: largest request served by the small pool
SMALL_BUFFER = 2 * MiB  # kSmallBuffer: segment size of the small pool
LARGE_BUFFER = 20 * MiB  # kLargeBuffer: segment size for requests below MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc
ROUND_LARGE = 2 * MiB  # kRoundLarge


def round_size(nbytes: int) -> int:
    """Block size the allocator hands out for a request of ``nbytes`` (0 for none)."""
    if nbytes <= 0:
        return 0
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(block: int) -> int:
    """Size of the segment ``cudaMalloc`` reserves when no cached block fits."""
    if block <= SMALL_SIZE:
        return SMALL_BUFFER
    if block < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-block // ROUND_LARGE) * ROUND_LARGE


def is_small(block: int) -> bool:
    """Whether a rounded request is served by the small pool."""
    return block <= SMALL_SIZE


class OutOfMemory(Exception):
    """Raised when a reservation does not fit in the device capacity, even after
    releasing every cached free segment."""

    def __init__(self, requested: int, reserved: int, capacity: int):
        self.requested, self.reserved, self.capacity = requested, reserved, capacity
        super().__init__(
            f"out of memory: a {requested} B segment on top of {reserved} B reserved "
            f"exceeds {capacity} B"
        )


@dataclass(eq=False)
class Block:
    """A contiguous range of one segment, either free or handed out."""

    addr: int
    size: int
    segment: "Segment"
    free: bool = True


@dataclass(eq=False)
class Segment:
    """One ``cudaMalloc`` reservation, split into address-ordered blocks."""

    addr: int
    size: int
    small: bool
    blocks: list[Block] = field(default_factory=list)

    def is_free(self) -> bool:
        return len(self.blocks) == 1 and self.blocks[0].free


class CachingAllocator:
    """Replays allocations and frees; tracks allocated and reserved bytes and their peaks
    exactly as ``torch.cuda.memory_stats`` does."""

    def __init__(self, capacity: int | None = None):
        self.capacity = capacity
        self.segments: list[Segment] = []
        self._next_addr = 0
        self.allocated = 0
        self.peak_allocated = 0
        self.peak_reserved = 0

    @property
    def reserved(self) -> int:
        """Bytes held in segments, what ``memory_reserved()`` reports."""
        return sum(s.size for s in self.segments)

    def reset_peaks(self) -> None:
        """``reset_peak_memory_stats()``: peaks restart from the current values."""
        self.peak_allocated = self.allocated
        self.peak_reserved = self.reserved

    def malloc(self, nbytes: int) -> Block | None:
        """Allocate a block for ``nbytes``; None for a 0-byte request."""
        size = round_size(nbytes)
        if size == 0:
            return None
        block = self._best_fit(size) or self._new_segment(size)
        self._split(block, size)
        block.free = False
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block: Block | None) -> None:
        """Return a block to its pool, merging it with free neighbours."""
        if block is None:
            return
        block.free = True
        self.allocated -= block.size
        blocks = block.segment.blocks
        i = blocks.index(block)
        if i + 1 < len(blocks) and blocks[i + 1].free:
            block.size += blocks.pop(i + 1).size
        if i > 0 and blocks[i - 1].free:
            blocks[i - 1].size += blocks.pop(i).size

    def empty_cache(self) -> None:
        """Release every wholly free segment (``torch.cuda.empty_cache``)."""
        self.segments = [s for s in self.segments if not s.is_free()]

    def _best_fit(self, size: int) -> Block | None:
        small = is_small(size)
        fits = [
            b
            for s in self.segments
            if s.small == small
            for b in s.blocks
            if b.free and b.size >= size
        ]
        return min(fits, key=lambda b: (b.size, b.addr), default=None)

    def _new_segment(self, size: int) -> Block:
        seg_size = segment_size(size)
        if self.capacity is not None and self.reserved + seg_size > self.capacity:
            self.empty_cache()
            if self.reserved + seg_size > self.capacity:
                raise OutOfMemory(seg_size, self.reserved, self.capacity)
        segment = Segment(self._next_addr, seg_size, is_small(size))
        self._next_addr += seg_size
        segment.blocks.append(Block(segment.addr, seg_size, segment))
        self.segments.append(segment)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return segment.blocks[0]

    def _split(self, block: Block, size: int) -> None:
        rest = block.size - size
        threshold_met = rest >= MIN_BLOCK if block.segment.small else rest > SMALL_SIZE
        if not threshold_met:
            return
        blocks = block.segment.blocks
        remainder = Block(block.addr + size, rest, block.segment)
        blocks.insert(blocks.index(block) + 1, remainder)
        block.size = size
