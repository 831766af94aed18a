"""A model of PyTorch's CUDA caching allocator, enough to reproduce its byte counters.

Rules read from ``c10/cuda/CUDACachingAllocator.cpp`` (torch 2.13, default config: no
``max_split_size_mb``, no garbage-collection threshold; expandable segments as
``PYTORCH_ALLOC_CONF=expandable_segments:True``, formerly ``PYTORCH_CUDA_ALLOC_CONF``,
sets them, below):

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

With expandable segments (``Settings``), no segment is reserved per request: each pool of
each stream has one segment, a virtual range as large as the device, whose pages are mapped
as it grows (``ExpandableSegment``): 2 MiB pages for the small pool, 20 MiB for the large
one (``find_expandable_block``: kSmallBuffer, kLargeBuffer). A request no free block fits
takes the lowest unmapped range that, with the free block just before it, holds it, and maps
the pages it lacks, merged with that free block (``try_allocate_expandable_block``,
``map_block``): reserved grows by those pages alone. Every block is split when at least 512 B
remain, in both pools (``should_split``). Releasing the cache unmaps every whole page of
every free block (``release_blocks``, ``unmap_block``), leaving unmapped holes that later
requests map again. Blocks never merge across mapped and unmapped ranges.

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
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Settings:
    """What ``PYTORCH_ALLOC_CONF`` sets that the model follows: ``expandable_segments``
    (``c10/cuda/CUDAAllocatorConfig.cpp``). The default is the allocator's own."""

    expandable_segments: bool = False

    def text(self) -> str:
        """The setting as ``PYTORCH_ALLOC_CONF`` spells it, ``""`` for the default."""
        return "expandable_segments:True" if self.expandable_segments else ""


DEFAULT_SETTINGS = Settings()
# PYTORCH_ALLOC_CONF's keys (c10/cuda/CUDAAllocatorConfig.cpp, torch 2.15) that change
# nothing the device's counters read in a step: the host's pinned memory, a lock, CUDA graphs
NO_EFFECT = ("release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
             "pinned_num_register_threads", "pinned_use_background_threads",
             "pinned_reserve_segment_size_mb", "graph_capture_record_stream_reuse")
NOT_MODELLED = ("max_split_size_mb", "max_non_split_rounding_mb",
                "garbage_collection_threshold", "roundup_power2_divisions", "backend",
                "per_process_memory_fraction")


def settings_of(text: str | None) -> Settings:
    """``PYTORCH_ALLOC_CONF`` (``key:value`` pairs, comma-separated) as ``Settings``;
    a ValueError for a key torch does not take, a value it refuses, or a setting the model
    does not follow (the caller names the option)."""
    expandable = False
    for pair in (text or "").split(","):
        if not pair.strip():
            continue
        key, sep, value = (part.strip() for part in pair.partition(":"))
        if key == "expandable_segments" and sep and value in ("True", "False"):
            expandable = value == "True"
        elif key == "expandable_segments":
            raise ValueError(f"expandable_segments takes True or False, as torch spells "
                             f"them, not {value!r}")
        elif key in NOT_MODELLED:
            raise ValueError(f"{key} is not modelled: memcalc follows expandable_segments, "
                             f"and takes {', '.join(NO_EFFECT[:2])}, ... as changing "
                             f"nothing on the device")
        elif key not in NO_EFFECT:
            from memcalc.errors import did_you_mean

            known = ["expandable_segments", *NO_EFFECT, *NOT_MODELLED]
            raise ValueError(f"{key!r} is not an option of PyTorch's caching allocator"
                             f"{did_you_mean(key, known)}; give key:value pairs such as "
                             f"expandable_segments:True")
    return Settings(expandable)
PAGE = {True: SMALL_BUFFER, False: LARGE_BUFFER}  # an expandable segment's page, by pool
VIRTUAL_PAGES = 1 << 30  # an expandable segment's virtual range, in pages: past any device


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
        self.rank: int | None = None  # under several ranks, the one that ran out (its caller's)
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

    __slots__ = ("addr", "size", "small", "head", "stream", "unmapped")

    def __init__(self, addr, size, small: bool, stream: int = 0):
        self.addr, self.size, self.small, self.stream = addr, size, small, stream
        self.head = Block(addr, size, self)
        # an expandable segment's unmapped blocks, by address (None: an ordinary segment)
        self.unmapped: list[Block] | None = None

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
    """A contiguous range of one segment, either free or handed out; in an expandable
    segment, a free range may be unmapped (no memory behind it, in no pool)."""

    __slots__ = ("addr", "size", "segment", "free", "prev", "next", "mapped")

    def __init__(self, addr, size, segment: Segment, free: bool = True, mapped: bool = True):
        self.addr, self.size, self.segment, self.free = addr, size, segment, free
        self.mapped = mapped
        self.prev: Block | None = None
        self.next: Block | None = None

    @property
    def joinable(self) -> bool:
        """Free and mapped: a neighbour a freed or newly mapped block merges with
        (``try_merge_blocks`` refuses an allocated or differently mapped one)."""
        return self.free and self.mapped


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

    def __init__(self, capacity: int | None = None, sizes: Sizes = INTEGERS,
                 settings: Settings = DEFAULT_SETTINGS):
        if settings.expandable_segments and not isinstance(sizes, IntegerSizes):
            raise ValueError("alloc_conf: expandable_segments is modelled for one "
                             "configuration at a time, not over a grid of sizes")
        self.capacity, self.sizes, self.settings = capacity, sizes, settings
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
        if (not self.sizes.may_mirror or not self.may_mirror or self.settings.expandable_segments
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
        block = pool.take_best_fit(size) or (
            self._expand(size, small, stream) if self.settings.expandable_segments
            else self._new_segment(nbytes, size, small, stream))
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
        pool.add(self._merged(block, pool))

    def _merged(self, block: Block, pool) -> Block:
        """``block`` merged with its free, mapped neighbours, which leave ``pool``."""
        after, before = block.next, block.prev
        if after is not None and after.joinable:
            pool.remove(after)
            block = self._merge(block, after)
        if before is not None and before.joinable:
            pool.remove(before)
            block = self._merge(block, before)
        return block

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
        for segment in [s for s in self.segments if s.unmapped is not None]:
            self._unmap_free(segment)
        for segment in [s for s in self.segments if s.is_free() and s.unmapped is None]:
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
        fine = segment.small or segment.unmapped is not None  # should_split's 512-B rule
        if not self.sizes.ge0(rest - MIN_BLOCK if fine else rest - SMALL_SIZE - 1):
            return
        remainder = Block(block.addr + size, rest, segment)
        remainder.prev, remainder.next = block, after
        if after is not None:
            after.prev = remainder
        block.next, block.size = remainder, size
        pool.add(remainder)

    # --- expandable segments (``Settings.expandable_segments``) ------------------------------

    def _expandable(self, small: bool, stream: int) -> Segment:
        """The pool's expandable segment on ``stream``, made wholly unmapped at first use
        (``find_expandable_block``: one per pool and stream, as large as the device)."""
        for segment in self.segments:
            if segment.unmapped is not None and segment.small == small \
                    and segment.stream == stream:
                return segment
        size = VIRTUAL_PAGES * PAGE[small]
        segment = Segment(self._next_addr, size, small, stream)
        self._next_addr = self._next_addr + size
        segment.head.mapped = False
        segment.unmapped = [segment.head]
        self.segments.append(segment)
        return segment

    def _expand(self, size: int, small: bool, stream: int) -> Block:
        """The block ``try_allocate_expandable_block`` makes for ``size`` bytes: the pages
        it lacks mapped (after releasing the cache and once more, if the device is full),
        merged into one free block, taken out of its pool."""
        segment = self._expandable(small, stream)
        start, plan = self._mapping(segment, size)
        needed = sum(pages for _, pages in plan)
        if self.capacity is not None and self.reserved + needed > self.capacity:
            self.empty_cache()
            start, plan = self._mapping(segment, size)
            needed = sum(pages for _, pages in plan)
            if self.reserved + needed > self.capacity:
                raise OutOfMemory(needed, self.reserved, self.capacity)
        pool = self.pool(small, stream)
        block = start
        while not block.mapped or block.size < size:
            target = block if not block.mapped else block.next
            block = self._map(target, min(size - (block.size if block.mapped else 0),
                                          target.size), pool)
        pool.remove(block)
        return block

    def _mapping(self, segment: Segment, size: int) -> tuple[Block, list]:
        """Where ``size`` bytes go (``find_expandable_block``): the lowest unmapped block
        that, from the free mapped block just before it if any, has room for them through
        the free and unmapped blocks that follow; and the pages each unmapped block on the
        way maps, as ``(block, bytes)``."""
        page = PAGE[segment.small]
        for unmapped in segment.unmapped:
            start = unmapped.prev if unmapped.prev is not None and unmapped.prev.joinable \
                else unmapped
            plan, have, block = [], 0, start
            while have < size and block is not None and block.free:
                if block.mapped:
                    have += block.size
                else:
                    pages = min(-(-(size - have) // page) * page, block.size)
                    plan.append((block, pages))
                    have += pages
                block = block.next
            if have >= size:
                return start, plan
        raise AssertionError("an expandable segment's last unmapped block spans the device")

    def _map(self, unmapped: Block, nbytes: int, pool) -> Block:
        """``map_block``: the pages holding ``nbytes`` at the front of ``unmapped`` mapped
        (reserved grows by them), merged with free mapped neighbours; the merged block is
        in ``pool``, returned."""
        segment, page = unmapped.segment, PAGE[unmapped.segment.small]
        mapped = -(-nbytes // page) * page
        index = segment.unmapped.index(unmapped)
        if mapped < unmapped.size:
            rest = Block(unmapped.addr + mapped, unmapped.size - mapped, segment, mapped=False)
            self._link_after(unmapped, rest)
            segment.unmapped[index] = rest
        else:
            del segment.unmapped[index]
        unmapped.size, unmapped.mapped = mapped, True
        self.reserved = self.reserved + mapped
        self.peak_reserved = self.sizes.top(self.peak_reserved, self.reserved)
        block = self._merged(unmapped, pool)
        pool.add(block)
        return block

    def _unmap_free(self, segment: Segment) -> None:
        """``release_blocks`` for an expandable segment: every whole page of each free
        mapped block unmapped (``unmap_block``), the block's ends left mapped, the unmapped
        range merged with unmapped neighbours."""
        page, pool = PAGE[segment.small], self.pool(segment.small, segment.stream)
        for block in [b for b in segment.blocks if b.joinable]:
            offset = block.addr - segment.addr
            begin = segment.addr + -(-offset // page) * page
            end = segment.addr + (offset + block.size) // page * page
            if begin >= end:
                continue
            pool.remove(block)
            if begin > block.addr:  # the head stays mapped
                head = Block(block.addr, begin - block.addr, segment)
                self._link_before(block, head)
                pool.add(head)
            if end < block.addr + block.size:  # so does the tail
                tail = Block(end, block.addr + block.size - end, segment)
                self._link_after(block, tail)
                pool.add(tail)
            block.addr, block.size, block.mapped = begin, end - begin, False
            self.reserved = self.reserved - block.size
            self._join_unmapped(segment, block)

    def _join_unmapped(self, segment: Segment, block: Block) -> None:
        """An unmapped ``block`` merged with unmapped neighbours, kept by address."""
        for neighbour in (block.next, block.prev):
            if neighbour is not None and neighbour.free and not neighbour.mapped:
                segment.unmapped.remove(neighbour)
                block = self._merge(block, neighbour)
        insort(segment.unmapped, block, key=lambda b: b.addr)

    @staticmethod
    def _link_after(block: Block, new: Block) -> None:
        new.prev, new.next = block, block.next
        if block.next is not None:
            block.next.prev = new
        block.next = new

    def _link_before(self, block: Block, new: Block) -> None:
        new.prev, new.next = block.prev, block
        if block.prev is not None:
            block.prev.next = new
        else:
            block.segment.head = new
        block.prev = new
