"""What CUDA's reduction kernel allocates inside itself: the staging buffer and semaphores of
a reduction split across thread blocks.

``gpu_reduce_kernel`` (``aten/src/ATen/native/cuda/Reduce.cuh``) chooses a launch
configuration (``setReduceConfig``) from the ``TensorIterator`` of the reduction and the
device. When each output's inputs are many and the outputs few, it splits every output
over ``ctas_per_output`` thread blocks, which meet in global memory: it takes a staging
``buffer`` and int32 ``semaphores`` from the caching allocator, launches, and frees both
as it returns (``config.global_memory_size()``, ``config.semaphore_size()``). The meta
device allocates neither; a GPU's counters see both, after the result.

Measured on an H200 with torch 2.11 (``validation/results/``, ``validation/history.py``):
the sum of a Linear's bias gradient over 2,048 rows of 768 features takes a 12 MiB buffer
(768 outputs x 32 blocks x 32 lanes x 4-wide x 4 B); the full sum of 8.4 M half values
2,112 B (528 blocks x 4 B). Sizes are ``int`` or ``memcalc.engine.symbolic.Sym``: the
decisions compare sizes, so a symbolic one raises ``SizeDependent`` and the grid path
holds it fixed.
"""

from __future__ import annotations

from functools import lru_cache, partial
from math import prod
from typing import NamedTuple

from memcalc.engine.elementwise import div_up, every, maximum, minimum, negate, where
from memcalc.engine.program import ITEMSIZE, Dims, Role, free, new
from memcalc.impls.device import Gpu, gpu_of, max_threads_per_sm

WARP = 32  # at::cuda::warp_size() on NVIDIA GPUs
MAX_NUM_THREADS = 512  # mnt_wrapper<T>::MAX_NUM_THREADS (256 for complex double only)
MIN_VALUES_PER_THREAD = 16  # setReduceConfig, not ROCm
MAX_VALUES_PER_THREAD = 256
INT32_MAX = 2**31 - 1


class Iter(NamedTuple):
    """A reduction's ``TensorIterator`` after ``reorder_dimensions`` and
    ``coalesce_dimensions``: sizes fastest first, reduced dimensions first; byte strides
    of the output (0 where reduced) and of the input."""

    shape: tuple
    out_strides: tuple
    in_strides: tuple
    num_reduce_dims: int


class Launch(NamedTuple):
    """One kernel's global-memory scratch, in bytes as requested from the allocator."""

    buffer: int
    semaphores: int


def reduction_iter(sizes: tuple, strides: tuple, dims: tuple, in_itemsize: int,
                   out_itemsize: int) -> Iter:
    """The iterator of reducing a tensor of ``sizes`` and element ``strides`` over ``dims``
    into a new contiguous result (``make_reduction``, ``ReduceOpsUtils.h``): the result's
    strides are 0 along reduced dimensions."""
    ndim = len(sizes)
    run = _run(dims, ndim)
    if run and strides == contiguous_strides(sizes) and prod(sizes) > 1:
        start, stop = run
        return run_iter(prod(sizes[:start]), prod(sizes[start:stop]), prod(sizes[stop:]),
                        in_itemsize, out_itemsize)
    return general_iter(sizes, strides, dims, in_itemsize, out_itemsize)


def general_iter(sizes: tuple, strides: tuple, dims: tuple, in_itemsize: int,
                 out_itemsize: int) -> Iter:
    """``reduction_iter`` of any input, as ``TensorIterator`` builds it: strides reordered,
    then neighbours coalesced."""
    ndim = len(sizes)
    kept = [i for i in range(ndim) if i not in dims]
    out = [0] * ndim
    for i, stride in zip(kept, contiguous_strides(tuple(sizes[i] for i in kept))):
        out[i] = stride * out_itemsize
    ins = [s * in_itemsize for s in strides]
    perm = _reorder(list(sizes), [out, ins])
    return _coalesce([sizes[p] for p in perm], [[out[p] for p in perm], [ins[p] for p in perm]])


def _run(dims: tuple, ndim: int) -> tuple[int, int] | None:
    """``(start, stop)`` when ``dims`` are one run of neighbouring dimensions, else None."""
    if not dims:
        return None
    start, stop = min(dims) % ndim, max(dims) % ndim + 1
    return (start, stop) if sorted(d % ndim for d in dims) == list(range(start, stop)) else None


def run_iter(outer, reduced, inner, in_itemsize: int, out_itemsize: int) -> Iter:
    """What reordering and coalescing give for a contiguous tensor reduced over one run of
    dimensions (a row sum, a whole sum, ``k.sum(-2)``), from the products of its sizes
    before, in and after the run: dimensions of size 1 vanish, the reduced run goes first,
    then the outputs inside it (the input's smaller stride), then those outside; those two
    cannot merge past the reduced run. The products may be numpy arrays over configurations
    that agree on which of them are 1 (the grid groups them so)."""
    if every(reduced == 1):  # nothing reduced: one run of outputs
        return Iter((inner * outer,), (out_itemsize,), (in_itemsize,), 0)
    runs = [(reduced, 0, in_itemsize * inner)]  # (size, output stride, input stride), bytes
    if not every(inner == 1):
        runs.append((inner, out_itemsize, in_itemsize))
    if not every(outer == 1):
        runs.append((outer, out_itemsize * inner, in_itemsize * reduced * inner))
    shape, out, ins = zip(*runs)
    return Iter(shape, out, ins, 1)


def _reorder(shape: list, strides: list) -> list:
    """``TensorIteratorBase::reorder_dimensions`` for a reduction (``TensorIterator.cpp``):
    an insertion sort of the dimensions, last first, that moves the output's reduced
    dimensions to the front and otherwise orders by stride, operand by operand."""
    def should_swap(d0: int, d1: int) -> int:
        for arg, stride in enumerate(strides):
            s0, s1 = stride[d0], stride[d1]
            if arg == 0 and (s0 == 0) != (s1 == 0):  # the output: reduced dims to the front
                return 1 if s1 == 0 else -1
            if s0 == 0 or s1 == 0:
                continue
            if s0 != s1:
                return -1 if s0 < s1 else 1
            if shape[d0] > shape[d1]:
                return 1
        return 0

    perm = list(reversed(range(len(shape))))
    for i in range(1, len(shape)):
        dim1 = i
        for dim0 in range(i - 1, -1, -1):
            comparison = should_swap(perm[dim0], perm[dim1])
            if comparison > 0:
                perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
                dim1 = dim0
            elif comparison < 0:
                break
    return perm


def _coalesce(shape: list, strides: list) -> Iter:
    """``coalesce_dimensions``: merge neighbours where every operand steps evenly across
    both (or one has size 1)."""
    shape, strides = list(shape), [list(s) for s in strides]
    prev = 0
    for dim in range(1, len(shape)):
        if shape[prev] == 1 or shape[dim] == 1 or all(
                shape[prev] * s[prev] == s[dim] for s in strides):
            if shape[prev] == 1:
                for s in strides:
                    s[prev] = s[dim]
            shape[prev] *= shape[dim]
        else:
            prev += 1
            if prev != dim:
                for s in strides:
                    s[prev] = s[dim]
                shape[prev] = shape[dim]
    n = min(prev + 1, len(shape))
    out, ins = (tuple(s[:n]) for s in strides)
    return Iter(tuple(shape[:n]), out, ins, sum(1 for s in out if s == 0))


def _last_pow2(n):
    """``last_pow2`` (``Reduce.cuh``): the largest power of two not above ``n`` (at least
    1). Over an array, exact below ``MAX_NUM_THREADS``, the only values it is asked for
    (``_block`` caps the rest)."""
    if getattr(n, "ndim", 0) == 0:
        return 1 << (max(int(n), 1).bit_length() - 1)
    power = 1
    for k in range(1, MAX_NUM_THREADS.bit_length()):
        power = where(n >= 1 << k, 1 << k, power)
    return power


def _output_vec_size(it: Iter, in_itemsize: int, storage_offset: int) -> int:
    """``get_output_vec_size``: 4, halved until it divides the input's address (in elements:
    the allocator aligns storages, so the storage offset decides), the size of the first
    output dimension and every other input stride."""
    vec = 4
    values = [storage_offset, it.shape[it.num_reduce_dims]] + [
        s // in_itemsize for i, s in enumerate(it.in_strides) if i != it.num_reduce_dims]
    for n in values:  # halving 4 until it divides n: the largest of 4, 2, 1 that does
        vec = minimum(vec, where(n % 4 == 0, 4, where(n % 2 == 0, 2, 1)))
    return vec


def _on_fastest(it: Iter):
    """Whether the reduced dimension is the input's fastest moving (``setReduceConfig``)."""
    r = it.num_reduce_dims
    return r == len(it.shape) or it.in_strides[0] < it.in_strides[r]


def launch(it: Iter, in_itemsize: int, acc_itemsize: int, storage_offset: int, sm_count: int,
           max_threads_per_sm: int) -> Launch:
    """``setReduceConfig`` (``Reduce.cuh``) for one 32-bit-indexable iterator, and the
    global memory it then takes (0 and 0 when the blocks do not split an output). The
    sizes may be arrays over configurations whose iterators share ``it``'s layout: each
    decision is then made element by element (``memcalc.engine.elementwise``)."""
    if not it.shape:  # a 0-d input: one value, one thread
        return Launch(0, 0)
    num_outputs = prod(n for n, stride in zip(it.shape, it.out_strides)
                       if not (isinstance(stride, int) and stride == 0))
    inputs_per_output = prod(it.shape) // num_outputs
    r = it.num_reduce_dims
    on_fastest = _on_fastest(it)
    dim0 = where(on_fastest, inputs_per_output, num_outputs)
    dim1 = where(on_fastest, num_outputs, inputs_per_output)
    fastest_stride = it.in_strides[0] if r == len(it.shape) else where(
        on_fastest, it.in_strides[0], it.in_strides[r])
    contiguous = fastest_stride == in_itemsize
    # "vectorize along input" divides dim0 by input_vec_size (4, or 8 for 16-bit types from
    # the releases that widened it); never enough to change the split: a split needs 256
    # values per thread, which the block width these dims give never leaves
    along_input = contiguous & on_fastest & (dim0 >= 128) & (r == 1)
    vec = 1 if r == len(it.shape) else where(
        contiguous & negate(on_fastest), _output_vec_size(it, in_itemsize, storage_offset), 1)
    dim0 = where(along_input, dim0 // 4, dim0 // vec)
    width, height = _block(dim0, dim1, MAX_NUM_THREADS // vec)
    step_input, step_output = where(on_fastest, width, 1), where(on_fastest, 1, width)
    split_warps = div_up(inputs_per_output, step_input) >= minimum(height * 16,
                                                                   MAX_VALUES_PER_THREAD)
    step_input = where(split_warps, step_input * height, step_input)
    step_output = where(split_warps, step_output, step_output * height)
    return _global(num_outputs, inputs_per_output, vec, width, height, step_input,
                   step_output, split_warps, on_fastest, acc_itemsize, sm_count,
                   max_threads_per_sm)


def _block(dim0, dim1, max_threads):
    """``ReduceConfig::set_block_dimension``: block width and height."""
    dim0_pow2 = where(dim0 < max_threads, _last_pow2(dim0), max_threads)
    dim1_pow2 = where(dim1 < max_threads, _last_pow2(dim1), max_threads)
    width = minimum(dim0_pow2, WARP)
    height = minimum(dim1_pow2, max_threads // width)
    width = minimum(dim0_pow2, max_threads // height)
    return width, height


def _global(num_outputs, inputs, vec, width, height, step_input, step_output, split_warps,
            on_fastest, acc_itemsize: int, sm_count: int, max_threads_per_sm: int) -> Launch:
    """The last step of ``setReduceConfig``: split the input across blocks when each thread
    has at least 256 values and the grid is small; then ``global_memory_size()`` (times the
    block's lanes when they do not reduce among themselves) and ``semaphore_size()``."""
    values = div_up(inputs, step_input)
    grid_x = div_up(num_outputs // vec, step_output)
    target = sm_count * (max_threads_per_sm // (width * height))
    ctas = maximum(minimum(div_up(target, grid_x), div_up(values, MIN_VALUES_PER_THREAD)),
                   div_up(values, MAX_VALUES_PER_THREAD))
    split = split_warps & (values >= MAX_VALUES_PER_THREAD) & (grid_x <= target) & (ctas > 1)
    size = acc_itemsize * num_outputs * ctas * where(on_fastest, 1, width * vec)
    return Launch(where(split, size, 0), where(split, 4 * grid_x, 0))


class Scratch(NamedTuple):
    """Everything one reduction takes inside itself, in order: an accumulation buffer for
    the whole op (0 if none), then each kernel's ``Launch``."""

    accumulation: int
    launches: tuple


def _fits_32bit(it: Iter, numel):
    """``TensorIteratorBase::can_use_32bit_indexing``: every offset, in bytes, fits int32
    (element by element over arrays of configurations)."""
    fits = numel <= INT32_MAX
    for strides in (it.out_strides, it.in_strides):
        fits = fits & (1 + sum((n - 1) * s for n, s in zip(it.shape, strides)) <= INT32_MAX)
    return fits


class Rows(NamedTuple):
    """A row reduction's iterator read as rows (each a reduced run of ``inputs`` values,
    ``size`` bytes apart, into one output ``out_size`` bytes after the last): a whole sum
    is one row of every value, or rows of one value each."""

    it: Iter
    inputs: object
    rows: object
    size: int
    out_size: int

    @staticmethod
    def of(it: Iter) -> "Rows | None":
        """The rows of ``it`` when it is one contiguous reduced run (then rows of it), else
        None."""
        if it.num_reduce_dims != 1 or len(it.shape) not in (1, 2):
            return None
        size = it.in_strides[0]
        if len(it.shape) == 1:
            return Rows(it, 1, it.shape[0], size, it.out_strides[0])
        inputs, rows = it.shape
        if not every(it.in_strides[1] == inputs * size):
            return None
        return Rows(it, inputs, rows, size, it.out_strides[1])

    def part(self, rows) -> Iter:
        """The iterator of ``rows`` of them."""
        return self.it._replace(shape=(rows,) if len(self.it.shape) == 1 else (self.inputs, rows))

    def fits(self, rows):
        """Whether ``rows`` of them fit 32-bit offsets (``_fits_32bit`` of ``part(rows)``)."""
        return (rows * self.inputs <= INT32_MAX) \
            & (rows * self.inputs * self.size - self.size + 1 <= INT32_MAX) \
            & (1 + (rows - 1) * self.out_size <= INT32_MAX)

    def halved(self) -> tuple:
        """``_split`` of the rows in integers: they are halved (first halves ``rows // 2``
        first) until each part fits, so at the first depth ``k`` where the ceiling half
        ``ceil(rows / 2^k)`` fits, every part is ``floor`` or ``ceil`` of ``rows / 2^k``,
        but for the floor parts one level up, which are leaves already when they fit.
        Returns the three row counts that may occur, in the order they first do (some
        equal), and whether a single row fits (where not, the reduced run is split too,
        which ``_split`` does)."""
        rows = self.rows
        whole = self.fits(rows)
        depth, k, found = 0, 0, whole
        while not every(found):
            depth += 1
            ceiling = div_up(rows, 1 << depth)
            newly = self.fits(ceiling) & negate(found)
            k, found = where(newly, depth, k), found | newly
            if every(ceiling == 1):
                break
        up = 2 ** (maximum(k, 1) - 1)  # where no halving is needed, or none is enough: any
        up_floor, up_ceil = rows // up, div_up(rows, up)
        three = self.fits(up_floor)  # the floor parts one level up stop there
        counts = (where(three, up_floor, rows // (2 * up)),
                  where(three, up_ceil // 2, div_up(rows, 2 * up)),
                  where(three, up_ceil - up_ceil // 2, div_up(rows, 2 * up)))
        # rows that fit whole, or that no halving fits, keep their count (then unused)
        counts = tuple(where(found & negate(whole), c, rows) for c in counts)
        return counts, found


def _row_parts(it: Iter) -> tuple | None:
    """``_split`` of a row reduction (``Rows``) in integers: the parts of the halved rows,
    in order, with input offset 0; None where a single row does not fit, or ``it`` is no
    row reduction."""
    rows = Rows.of(it)
    if rows is None:
        return None
    counts, found = rows.halved()
    return tuple((rows.part(r), 0) for r in dict.fromkeys(counts)) if found else None


@lru_cache(maxsize=1 << 12)
def _split(it: Iter, offset: int) -> tuple:
    """``SplitUntil32Bit``: halve the dimension of largest extent until each part fits,
    first halves first (``TensorIteratorBase::split``): the distinct parts, in order, as
    ``(Iter, input byte offset mod 16)`` (all the vectorization reads of an offset)."""
    if _on_fastest(it):
        offset = 0  # read only to vectorize along outputs, which this reduction does not
    if _fits_32bit(it, prod(it.shape)):
        return ((it, offset),)
    dim = max(reversed(range(len(it.shape))), key=lambda d: max(
        (it.shape[d] - 1) * abs(s[d]) for s in (it.out_strides, it.in_strides)))
    half = it.shape[dim] // 2
    first = it._replace(shape=it.shape[:dim] + (half,) + it.shape[dim + 1:])
    rest = it._replace(shape=it.shape[:dim] + (it.shape[dim] - half,) + it.shape[dim + 1:])
    parts = _split(first, offset) + _split(rest, (offset + half * it.in_strides[dim]) % 16)
    return tuple(dict.fromkeys(parts))


def reduction_scratch(sizes: tuple, strides: tuple, dims: tuple, in_itemsize: int,
                      out_itemsize: int, acc_itemsize: int, storage_offset: int,
                      gpu: Gpu) -> Scratch:
    """What ``gpu_reduce_kernel`` allocates to reduce a tensor (``sizes``, element
    ``strides``, ``storage_offset``) over ``dims`` with accumulator ``acc_itemsize`` bytes
    wide: an iterator too large for 32-bit offsets is split, each part its own kernel, and
    a half or bfloat16 result (which cannot accumulate in itself) gets a float buffer the
    size of the result for all of them (``AccumulationBuffer``)."""
    it = reduction_iter(sizes, strides, dims, in_itemsize, out_itemsize)
    threads = max_threads_per_sm(gpu)
    numel = 1
    for n in it.shape:
        numel *= n
    if numel == 0:
        return Scratch(0, ())
    fits = _fits_32bit(it, numel)
    parts = ((it, storage_offset * in_itemsize % 16),) if fits else (
        _row_parts(it) or _split(it, storage_offset * in_itemsize % 16))
    accumulation = _accumulation(it, fits, out_itemsize, acc_itemsize)
    launches = (launch(p, in_itemsize, acc_itemsize, at // in_itemsize % 4, gpu.sm_count,
                       threads) for p, at in parts)
    # each launch frees what it took before the next: a launch like an earlier one finds
    # the blocks that one took free again, so each distinct launch is kept once, in order
    # (millions of kernels reduce 10^16 elements; their buffers take a few sizes)
    return Scratch(accumulation, tuple(dict.fromkeys(launches)))


def _accumulation(it: Iter, fits, out_itemsize: int, acc_itemsize: int):
    """A half or bfloat16 result (which cannot accumulate in itself) of an iterator split
    for 32-bit offsets gets a float buffer the size of the result (``AccumulationBuffer``)."""
    if out_itemsize != 2:
        return 0
    extent = out_itemsize
    for n, stride in zip(it.shape, it.out_strides):
        extent = maximum(extent, n * stride)
    return where(fits, 0, extent // out_itemsize * acc_itemsize)


def largest_launch(it: Iter, in_itemsize: int, out_itemsize: int, acc_itemsize: int,
                   gpu: Gpu) -> tuple:
    """``(accumulation, buffer, semaphores, exact)`` of reducing with iterator ``it`` (a
    contiguous input: offset 0), for arrays of configurations at once (the grid path): the
    launch that takes the largest buffer, the first of those where several do, whose
    blocks the others reuse. ``exact`` is False where a split iterator is no row
    reduction (``Rows``); those configurations are left to ``reduction_scratch``."""
    fits = _fits_32bit(it, prod(it.shape))
    threads = max_threads_per_sm(gpu)
    whole = launch(it, in_itemsize, acc_itemsize, 0, gpu.sm_count, threads)
    accumulation = _accumulation(it, fits, out_itemsize, acc_itemsize)
    rows = Rows.of(it)
    if rows is None:
        return accumulation, whole.buffer, whole.semaphores, fits
    counts, found = rows.halved()
    best = whole
    for i, count in enumerate(counts):
        part = launch(rows.part(count), in_itemsize, acc_itemsize, 0, gpu.sm_count, threads)
        better = negate(fits) & ((i == 0) | (part.buffer > best.buffer))
        best = Launch(where(better, part.buffer, best.buffer),
                      where(better, part.semaphores, best.semaphores))
    return accumulation, best.buffer, best.semaphores, fits | found


class Reduction(NamedTuple):
    """One ``sum``/``mean`` kernel call as the reduction kernel sees it: the reduced tensor's
    sizes, element strides and storage offset, the reduced dimensions, and the element
    widths of input, result and accumulator. A traced program keeps these (polynomials in
    N) and recomputes the scratch at each length."""

    sizes: tuple
    strides: tuple
    dims: tuple
    in_itemsize: int
    out_itemsize: int
    acc_itemsize: int
    storage_offset: int

    def scratch(self, gpu: Gpu) -> Scratch:
        return reduction_scratch(self.sizes, self.strides, self.dims, self.in_itemsize,
                                 self.out_itemsize, self.acc_itemsize, self.storage_offset,
                                 gpu)

    def events(self, name: str, gpu: Gpu) -> list:
        """The kernel's scratch as program events named ``name: ...`` (a traced call's,
        recomputed at each length: ``memcalc.tracing.fitted``)."""
        return scratch_events(name, self.scratch(gpu), "sum")


def accumulator_bytes(out_dtype: str) -> int:
    """``sizeof(arg_t)`` of a sum or mean into ``out_dtype`` (a torch dtype's name): float
    for half, bfloat16 and float (``opmath_type``), double for double, int64 for integers
    and bool, the complex counterparts for complex."""
    if out_dtype.startswith("complex"):
        return ITEMSIZE[out_dtype]
    return {"float64": 8}.get(out_dtype, 4 if out_dtype.startswith(("float", "bfloat")) else 8)


def contiguous_strides(shape: tuple) -> tuple:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step = step * n
    return tuple(reversed(strides))


def reduced(name: str, shape: tuple, dtype: str, role: Role, d: Dims, source: tuple,
            dims: tuple, source_dtype: str | None = None, op: str = "sum") -> list:
    """``new(name, shape, dtype, role, op)``, a sum (or mean) of a contiguous tensor of shape
    ``source`` over ``dims``, then what CUDA's kernel takes inside itself to compute it
    (``reduction_scratch``, on ``d``'s device), each freed as the kernel returns; the
    tracer adds the same (``memcalc.tracing.tracer._reduction``).

    Over symbolic sizes (the grid path) the scratch is three placeholders evaluated per
    configuration (``memcalc.engine.symbolic.apply``): the accumulation buffer and one
    launch, the largest, whose blocks every other launch of a split reduction reuses."""
    dims = tuple(i % len(source) for i in dims)
    kernel = (dims, ITEMSIZE[source_dtype or dtype], ITEMSIZE[dtype], accumulator_bytes(dtype),
              gpu_of(d))
    if not all(isinstance(n, int) for n in source):  # the grid path's placeholders
        from memcalc.engine.symbolic import apply  # numpy: not on the CLI's path

        bound = _bound_of(ITEMSIZE[source_dtype or dtype])
        sizes = [apply(Part(kernel, i), source, bound) for i in range(3)]
        scratch = Scratch(sizes[0], (Launch(sizes[1], sizes[2]),))
    else:
        scratch = _scratch(kernel, tuple(source))
    return [new(name, shape, dtype, role, op), *scratch_events(name, scratch, op)]


@lru_cache(maxsize=1 << 12)
def _scratch(kernel: tuple, source: tuple) -> Scratch:
    dims, in_size, out_size, acc_size, gpu = kernel
    return reduction_scratch(source, contiguous_strides(source), dims, in_size, out_size,
                             acc_size, 0, gpu)


def forget() -> None:
    """Let go of what a grid left behind: its last arrays and the per-size cache."""
    _scratch.cache_clear()
    _LAST_GRID[:] = [None, None]


class Part(NamedTuple):
    """One figure of a reduction's scratch as a function of its input's sizes: the
    accumulation buffer (``which`` 0), or the largest launch's buffer (1) or semaphores (2).
    A placeholder's identity (``memcalc.engine.symbolic.apply``): equal reductions (naive's
    three row sums) are one expression, evaluated once per grid."""

    kernel: tuple
    which: int

    def __call__(self, *source: int) -> int:
        scratch = _scratch(self.kernel, source)
        if self.which == 0:
            return scratch.accumulation
        largest = max(scratch.launches, key=lambda part: part.buffer, default=Launch(0, 0))
        return largest.buffer if self.which == 1 else largest.semaphores

    def over_arrays(self, *source):
        """The figure for every configuration of a grid (``source``: ints or int64 arrays of
        one length), in closed form (``largest_launch``) where it can be."""
        return _grid_scratch(self.kernel, source)[self.which]


_LAST_GRID: list = [None, None]  # (kernel, sources) and their figures: the three parts


def _grid_scratch(kernel: tuple, sources: tuple) -> tuple:
    """``Part``'s three figures over a grid, computed once for the three placeholders that
    read them (they are evaluated one after another, on the same arrays)."""
    key = (kernel, tuple(map(id, sources)))
    if _LAST_GRID[0] is None or _LAST_GRID[0][0] != key:
        _LAST_GRID[:] = [(key, sources), _grid_figures(kernel, sources)]
    return _LAST_GRID[1]


def _grid_figures(kernel: tuple, sources: tuple):
    """(3, n) int64: each configuration's accumulation, buffer and semaphores. The inputs
    are grouped by which of the products before, in and after the reduced run are 1 (the
    iterator's layout, ``run_iter``); each group is one call of ``largest_launch`` on its
    arrays. Configurations that call for the general split, and inputs of 2^55 elements or
    more, are computed one by one."""
    import numpy as np

    dims, in_size, out_size, acc_size, gpu = kernel
    n = max(np.size(x) for x in sources)
    arrays = [np.broadcast_to(np.asarray(x), (n,)) for x in sources]
    out = np.zeros((3, n), dtype=np.int64)
    run = _run(dims, len(sources))
    bound = prod(int(a.max()) for a in arrays)
    one_by_one = np.ones(n, dtype=bool)
    if run is not None and bound < 1 << 55:
        arrays = [a.astype(np.int64) for a in arrays]
        start, stop = run
        ones = np.ones(n, dtype=np.int64)
        outer, reduced, inner = (prod(arrays[i:j], start=ones)
                                 for i, j in ((0, start), (start, stop), (stop, len(arrays))))
        layout = (reduced > 1) * 4 + (inner > 1) * 2 + (outer > 1)
        for code in np.unique(layout):
            at = np.flatnonzero(layout == code)
            it = run_iter(outer[at], reduced[at], inner[at], in_size, out_size)
            *figures, exact = largest_launch(it, in_size, out_size, acc_size, gpu)
            out[:, at] = np.broadcast_arrays(*figures, at)[:3]
            one_by_one[at] = ~np.broadcast_to(exact, at.shape)
    for i in np.flatnonzero(one_by_one):
        out[:, i] = [Part(kernel, w)(*(int(a[i]) for a in arrays)) for w in range(3)]
    return out


@lru_cache(maxsize=None)
def _bound_of(itemsize: int):
    return partial(_bound, itemsize)


def _bound(itemsize: int, *bounds: int) -> int:
    """An upper bound of any of them: at most 4 B per output and block (of at most one per
    input) and 128 lanes of 16 B, or 8 B per output."""
    return 2048 * prod(bounds) * max(itemsize, 1)


def scratch_events(name: str, scratch: Scratch, op: str) -> list:
    """A ``Scratch`` as program events: the accumulation buffer around every launch's
    buffer and semaphores, each launch's freed before the next."""
    events, T = [], Role.temporary
    if not isinstance(scratch.accumulation, int) or scratch.accumulation:
        events.append(new(f"{name}: accumulation buffer", (scratch.accumulation,), "uint8", T,
                          op))
    for i, part in enumerate(scratch.launches):
        nth = f" {i + 1}" if len(scratch.launches) > 1 else ""  # of a split iterator's launches
        buffer, semaphores = f"{name}: split-reduction buffer{nth}", f"{name}: semaphores{nth}"
        if not isinstance(part.buffer, int) or part.buffer:
            events += [new(buffer, (part.buffer,), "uint8", T, op),  # (bytes,) staging
                       new(semaphores, (part.semaphores,), "uint8", T, op),  # (4 x grid.x,)
                       free(buffer, semaphores)]
    if not isinstance(scratch.accumulation, int) or scratch.accumulation:
        events.append(free(f"{name}: accumulation buffer"))
    return events
