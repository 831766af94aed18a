"""A model of PyTorch's CUDA caching allocator, enough to reproduce its byte counters.

Rules read from ``c10/cuda/CUDACachingAllocator.cpp`` (torch 2.13, default config: no
``max_split_size_mb``, no expandable segments, no garbage-collection threshold):

* a request of ``n > 0`` bytes is rounded to a block of ``max(512, ceil(n/512)*512)``
  (``round_size``); 0-byte requests allocate nothing;
* blocks of <= 1 MiB come from the small pool, larger ones from the large pool;
* a request takes the best-fitting free block of its pool, the smallest one that is big
  enough, ties broken by address (``BlockComparatorSize``); each pool keeps its free blocks
  ordered by (size, address) and finds that block by bisection (``get_free_block``'s
  ``lower_bound``); for the small pool's integer sizes, a list of addresses per size and
  a bisection over the sizes that have a free block (``SmallFreeBlocks``);
* with no fitting block a new segment is reserved (``get_allocation_size``): 2 MiB for
  small requests, 20 MiB below 10 MiB, else the size rounded up to 2 MiB;
* the chosen block is split when the rest is >= 512 B (small pool) or > 1 MiB (large
  pool); otherwise the whole block counts as allocated (``should_split``);
* a freed block merges with its free neighbours (``try_merge_blocks``; blocks are linked to
  their neighbours in the segment, ``Block::prev``/``next``);
* when a new segment would exceed the device, every wholly free segment is released and
  the reservation retried once (``release_cached_blocks``), then OutOfMemory is raised;
* a block serves only requests made on the CUDA stream its segment was reserved on: the
  pools order blocks by (stream, size, address) and ``get_free_block`` gives up at a block
  of another stream (``BlockComparatorSize``); a segment is reserved on the requesting
  stream. Streams are numbered here, 0 the default one; FSDP's all-gather and
  reduce-scatter buffers are made on streams of their own (``memcalc.tracing.fsdp``).

New segments get increasing virtual addresses; real ``cudaMalloc`` addresses are not
known in advance, so ties between equal free blocks in different segments are broken as
if segments were handed out in order.

The allocator is generic over its size arithmetic (``Sizes``): plain integers for a
replay, or the linear forms of ``memcalc.analysis.vectorized`` that record every decision as a
guard, so that one set of rules serves a single configuration and a whole grid.

The measured step of the protocol makes the warm-up's small-pool decisions again; the
allocator checks that it will (``mirror_small_pool``) and then only counts its small
blocks: a chunked loop's measured step is a million small requests.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from functools import lru_cache

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
    return -(-nbytes // MIN_BLOCK) * MIN_BLOCK  # at least MIN_BLOCK: nbytes >= 1


def round_segment(block: int) -> int:
    """``block`` rounded up to 2 MiB: the segment of a request of 10 MiB or more."""
    return -(-block // ROUND_LARGE) * ROUND_LARGE


def segment_size(block: int) -> int:
    """Size of the segment ``cudaMalloc`` reserves when no cached block fits."""
    if block <= SMALL_SIZE:
        return SMALL_BUFFER
    if block < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return round_segment(block)


def is_small(block: int) -> bool:
    """Whether a rounded request is served by the small pool."""
    return block <= SMALL_SIZE


class Sizes:
    """The arithmetic the allocator decides with: plain integers. A subclass may give
    sizes another type with ``+``, ``-`` and integer constants (``memcalc.analysis.vectorized``'s
    forms), and must then answer the three questions below for it."""

    # the rounded block of a request of ``nbytes``
    block = staticmethod(round_size)

    def large_segment(self, nbytes, block):
        """The segment of a request of 10 MiB or more: ``block`` rounded up to 2 MiB."""
        return round_segment(block)

    def ge0(self, x) -> bool:
        """``x >= 0``: every decision of the allocator is one of these."""
        return x >= 0

    def request(self, nbytes) -> tuple | None:
        """A request's block and whether the small pool serves it; None for 0 bytes."""
        size = self.block(nbytes)
        if not self.ge0(size - 1):
            return None
        return size, self.ge0(SMALL_SIZE - size)

    def key(self, size, addr):
        """What orders free blocks: by size, then address (``BlockComparatorSize``)."""
        return size, addr

    # keys are plain values: comparing them decides nothing that must be recorded, so a
    # free block can be found by its key
    plain_keys = True

    # the measured step may repeat the warm-up's small-pool decisions without making them
    # again (``CachingAllocator.mirror_small_pool``); a subclass that records every
    # decision must make them all
    may_mirror = True

    def top(self, peak, value):
        """The new peak after ``value`` (the grid path takes its peaks elsewhere)."""
        return value if value > peak else peak


class IntegerSizes(Sizes):
    """Plain integers, each request's answer kept: a long loop makes a million requests of
    a few dozen sizes."""

    @lru_cache(maxsize=4096)
    def request(self, nbytes) -> tuple | None:
        return super().request(nbytes)


INTEGERS = IntegerSizes()


class OutOfMemory(Exception):
    """Raised when a reservation does not fit in the device capacity, even after
    releasing every cached free segment."""

    def __init__(self, requested: int, reserved: int, capacity: int):
        self.requested, self.reserved, self.capacity = requested, reserved, capacity
        super().__init__(
            f"out of memory: a {requested} B segment on top of {reserved} B reserved "
            f"exceeds {capacity} B"
        )


class MirrorBroken(Exception):
    """A capped measured step had to release cached segments while its small pool was
    mirrored: the mirror's premise (no release since the warm-up) no longer holds, so the
    step must be replayed with every small-pool decision made (``may_mirror = False``)."""


class Segment:
    """One ``cudaMalloc`` reservation; its blocks form a linked list from ``head``."""

    __slots__ = ("addr", "size", "small", "head", "stream")

    def __init__(self, addr, size, small: bool, stream: int = 0):
        self.addr, self.size, self.small, self.stream = addr, size, small, stream
        self.head = Block(addr, size, self)

    @property
    def blocks(self) -> list["Block"]:
        """The blocks in address order."""
        out, b = [], self.head
        while b is not None:
            out.append(b)
            b = b.next
        return out

    def is_free(self) -> bool:
        return self.head.free and self.head.next is None


class Block:
    """A contiguous range of one segment, either free or handed out."""

    __slots__ = ("addr", "size", "segment", "free", "prev", "next")

    def __init__(self, addr, size, segment: Segment, free: bool = True):
        self.addr, self.size, self.segment, self.free = addr, size, segment, free
        self.prev: Block | None = None
        self.next: Block | None = None


class FreeBlocks:
    """One pool's free blocks, ordered by (size, address) like ``BlockPool::blocks`` and
    searched by bisection (``Sizes.key`` orders them).

    Kept as a list of sorted runs (``keys[j]`` are ``blocks[j]``'s keys, ``last[j]`` the
    largest of them; a run past ``2 * RUN`` blocks is halved), so that adding or taking a
    block moves at most one run: a flat list made a long chunked loop quadratic (its pools hold thousands of
    free blocks). A pool that fits in one run is searched exactly as a flat list."""

    RUN = 256

    def __init__(self, sizes: Sizes):
        self.sizes = sizes
        self.keys: list[list] = []
        self.blocks: list[list[Block]] = []
        self.last: list = []

    def __len__(self) -> int:
        return sum(len(run) for run in self.blocks)

    def __iter__(self):
        return (block for run in self.blocks for block in run)

    def add(self, block: Block) -> None:
        key = self.sizes.key(block.size, block.addr)
        if not self.last:
            self.keys.append([key]), self.blocks.append([block]), self.last.append(key)
            return
        j = min(self._run(key), len(self.last) - 1)  # past every run: the last one
        keys = self.keys[j]
        i = bisect_left(keys, key)
        keys.insert(i, key)
        self.blocks[j].insert(i, block)
        if i == len(keys) - 1:
            self.last[j] = key
        if len(keys) > 2 * self.RUN:
            self._halve(j)

    def remove(self, block: Block) -> None:
        """Take ``block`` out. Found by its key where keys are plain values; by identity
        otherwise (comparing forms would record a decision the program did not make)."""
        if self.sizes.plain_keys:
            key = self.sizes.key(block.size, block.addr)
            j = self._run(key)
            self._pop(j, bisect_left(self.keys[j], key))
            return
        for j, run in enumerate(self.blocks):
            if any(b is block for b in run):
                self._pop(j, run.index(block))
                return
        raise ValueError("block is not in this pool")

    def take_best_fit(self, size) -> Block | None:
        """Take out the smallest free block of at least ``size`` (lowest address among
        equals): ``lower_bound`` of ``(size, lowest address)``, as ``get_free_block``
        searches; None when no block is large enough."""
        probe = self.sizes.key(size, -1)
        j = self._run(probe)
        if j == len(self.keys):  # larger than every run's largest, or no block at all
            return None
        i = bisect_left(self.keys[j], probe)
        if i == len(self.keys[j]):  # only in a single run: the probe was not compared
            return None
        return self._pop(j, i)

    def _run(self, key) -> int:
        """The run that holds ``key``'s place: the first whose largest key is not less.
        With one run, that run (its blocks are then searched as a flat list)."""
        return bisect_left(self.last, key) if len(self.last) > 1 else 0

    def _pop(self, j: int, i: int) -> Block:
        keys, blocks = self.keys[j], self.blocks[j]
        del keys[i]
        block = blocks.pop(i)
        if not keys:
            del self.keys[j], self.blocks[j], self.last[j]
        elif i == len(keys):
            self.last[j] = keys[-1]
        return block

    def _halve(self, j: int) -> None:
        """Split run ``j`` in two."""
        keys, blocks, half = self.keys[j], self.blocks[j], self.RUN
        self.keys[j:j + 1] = [keys[:half], keys[half:]]
        self.blocks[j:j + 1] = [blocks[:half], blocks[half:]]
        self.last[j:j + 1] = [keys[half - 1], keys[-1]]


class SmallFreeBlocks:
    """The small pool's free blocks when sizes are integers: one address-sorted list per
    size and the ascending list of sizes that have a free block (a multiple of 512 B up to
    2 MiB: at most 4,096, in practice a few dozen). The best fit is the first size at or
    above the request's, then that size's lowest address: the order of ``FreeBlocks``,
    found without comparing keys. A long chunked loop leaves thousands of free small
    blocks of a few sizes."""

    def __init__(self):
        self.addrs: dict[int, list[int]] = {}  # by size
        self.blocks: dict[int, Block] = {}  # by address
        self.sizes: list[int] = []  # the sizes that have a free block, ascending

    def __len__(self) -> int:
        return len(self.blocks)

    def __iter__(self):
        return (self.blocks[a] for size in self.sizes for a in self.addrs[size])

    def add(self, block: Block) -> None:
        size, addr = block.size, block.addr
        self.blocks[addr] = block
        addrs = self.addrs.get(size)
        if addrs is None:
            self.addrs[size] = [addr]
            insort(self.sizes, size)
        else:
            insort(addrs, addr)

    def remove(self, block: Block) -> None:
        size, addrs = block.size, self.addrs[block.size]
        del addrs[bisect_left(addrs, block.addr)], self.blocks[block.addr]
        if not addrs:
            del self.addrs[size], self.sizes[bisect_left(self.sizes, size)]

    def take_best_fit(self, size: int) -> Block | None:
        """Take out the smallest free block of at least ``size``, lowest address first."""
        sizes = self.sizes
        j = bisect_left(sizes, size)
        if j == len(sizes):
            return None
        fit = sizes[j]
        addrs = self.addrs[fit]
        block = self.blocks.pop(addrs.pop(0))
        if not addrs:
            del self.addrs[fit], sizes[j]
        return block


# stands for the small pool while the measured step mirrors the warm-up's decisions
_MIRRORED = Segment(-1, 0, small=True)


class CachingAllocator:
    """Replays allocations and frees; tracks allocated and reserved bytes and their peaks
    exactly as ``torch.cuda.memory_stats`` does."""

    def __init__(self, capacity: int | None = None, sizes: Sizes = INTEGERS):
        self.capacity, self.sizes = capacity, sizes
        # each pool's free blocks by (small, stream): a block serves its own stream only
        self.pools: dict[tuple[bool, int], FreeBlocks | SmallFreeBlocks] = {}
        self.segments: list[Segment] = []
        self._next_addr = 0
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0
        self._marked: tuple | None = None  # the small pool's layout when the warm-up began
        self._mirrored: dict | None = None  # while mirroring: a block per small request
        self.may_mirror = True  # False: a replay again after ``MirrorBroken``

    def mark_warm_up(self) -> None:
        """The warm-up step starts: note the small pool's layout, for ``mirror_small_pool``."""
        self._marked = self._small_layout()

    def mirror_small_pool(self) -> bool:
        """The measured step starts. If it will make the warm-up's small-pool decisions,
        stop making them: a small request then only counts its block. Returns whether it
        does.

        It does when the small pool is as the warm-up found it plus the segments the warm-up
        reserved, all wholly free now, and nothing was released since, nor is during the
        measured step (under a capacity a release there raises ``MirrorBroken``, and the
        step is replayed without mirroring). Then, by induction over the same requests and
        frees, the measured step's pool is the warm-up's at the same point plus wholly free
        segments at higher addresses than any the warm-up had reserved by then: a request
        the warm-up served from a cached block finds that same block best (a spare 2 MiB
        segment is no smaller, and loses a tie by address); one for which it reserved a
        segment takes the spare at the lowest address, which is that segment. So no small
        segment is reserved, and a small block is always exactly its rounded request: the
        rest of a split, a multiple of 512 B, is either 0 or kept (``should_split``). The
        chunked implementations' measured step makes a million small requests; this halves
        them."""
        if (not self.sizes.may_mirror or not self.may_mirror
                or self._marked is None or self._small_layout() != self._marked):
            return False
        self._mirrored = {}
        return True

    def _small_layout(self) -> tuple:
        """The small pool's segments that hold an allocated block, as (address, size, free)
        of each block."""
        return tuple(tuple((b.addr, b.size, b.free) for b in s.blocks)
                     for s in self.segments if s.small and not s.is_free())

    def reset_peaks(self) -> None:
        """``reset_peak_memory_stats()``: peaks restart from the current values."""
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def pool(self, small: bool, stream: int = 0) -> FreeBlocks | SmallFreeBlocks:
        """The free blocks of the small or the large pool that serve ``stream``."""
        pool = self.pools.get((small, stream))
        if pool is None:
            plain = small and self.sizes.plain_keys
            pool = self.pools[small, stream] = SmallFreeBlocks() if plain else FreeBlocks(self.sizes)
        return pool

    def malloc(self, nbytes, stream: int = 0) -> Block | None:
        """Allocate a block for ``nbytes`` on ``stream`` (0: the default stream); None for
        a 0-byte request."""
        mirrored = self._mirrored
        block = mirrored.get(nbytes) if mirrored is not None and not stream else None
        if block is None:
            block = self._take(nbytes, stream)
            if block is None:
                return None
        self.allocated = allocated = self.allocated + block.size
        self.peak_allocated = self.sizes.top(self.peak_allocated, allocated)
        return block

    def _take(self, nbytes, stream: int = 0) -> Block | None:
        """The block a request on ``stream`` gets: the best-fitting free one of its pool or
        a new segment's, split (or, mirrored, a small request's block); None for 0 bytes."""
        request = self.sizes.request(nbytes)
        if request is None:
            return None
        size, small = request
        if small and self._mirrored is not None and not stream:
            # the mirror is the default stream's small pool; other streams' pools, which
            # never serve it, decide as ever
            return self._mirror_block(nbytes, size)
        pool = self.pool(small, stream)
        block = pool.take_best_fit(size) or self._new_segment(nbytes, size, small, stream)
        self._split(block, size, pool)
        block.free = False
        return block

    def free(self, block: Block | None) -> None:
        """Return a block to its pool, merging it with free neighbours."""
        if block is None:
            return
        self.allocated = self.allocated - block.size
        if block.segment is _MIRRORED:
            return
        block.free = True
        pool = self.pool(block.segment.small, block.segment.stream)
        after, before = block.next, block.prev
        if after is not None and after.free:
            pool.remove(after)
            block = self._merge(block, after)
        if before is not None and before.free:
            pool.remove(before)
            block = self._merge(block, before)
        pool.add(block)

    def _mirror_block(self, nbytes, size) -> Block:
        """The block a mirrored small request of ``nbytes`` counts, ``size`` bytes: one per
        request size, shared (never split, merged or freed into a pool)."""
        block = self._mirrored[nbytes] = Block(-1, size, _MIRRORED, free=False)
        return block

    def empty_cache(self) -> None:
        """Release every wholly free segment (``torch.cuda.empty_cache``). Not while the
        small pool is mirrored (its segments are not tracked then): ``MirrorBroken``, and
        the caller replays again without mirroring."""
        if self._mirrored is not None:
            raise MirrorBroken
        self._marked = None  # the warm-up's segments may be gone
        for segment in [s for s in self.segments if s.is_free()]:
            self.pool(segment.small, segment.stream).remove(segment.head)
            self.segments.remove(segment)
            self.reserved = self.reserved - segment.size

    @staticmethod
    def _merge(block: Block, neighbour: Block) -> Block:
        """Join two adjacent blocks; the lower one survives."""
        low, high = (block, neighbour) if neighbour is block.next else (neighbour, block)
        low.size = low.size + high.size
        low.next = high.next
        if high.next is not None:
            high.next.prev = low
        return low

    def _segment_size(self, nbytes, size, small: bool):
        if small:
            return SMALL_BUFFER
        if self.sizes.ge0(MIN_LARGE_ALLOC - 1 - size):
            return LARGE_BUFFER
        return self.sizes.large_segment(nbytes, size)

    def _new_segment(self, nbytes, size, small: bool, stream: int = 0) -> Block:
        seg_size = self._segment_size(nbytes, size, small)
        if self.capacity is not None and self.reserved + seg_size > self.capacity:
            self.empty_cache()
            if self.reserved + seg_size > self.capacity:
                raise OutOfMemory(seg_size, self.reserved, self.capacity)
        segment = Segment(self._next_addr, seg_size, small, stream)
        self._next_addr = self._next_addr + seg_size
        self.segments.append(segment)
        self.reserved = self.reserved + seg_size
        self.peak_reserved = self.sizes.top(self.peak_reserved, self.reserved)
        return segment.head

    def _split(self, block: Block, size, pool) -> None:
        """Cut ``size`` off a block taken from ``pool``; the rest goes back to the pool."""
        rest, segment, after = block.size - size, block.segment, block.next
        if not self.sizes.ge0(rest - MIN_BLOCK if segment.small else rest - SMALL_SIZE - 1):
            return
        remainder = Block(block.addr + size, rest, segment)
        remainder.prev, remainder.next = block, after
        if after is not None:
            after.prev = remainder
        block.next, block.size = remainder, size
        pool.add(remainder)
