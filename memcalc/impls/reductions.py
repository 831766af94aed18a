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
    if dims == tuple(range(ndim - len(dims), ndim)) and strides == contiguous_strides(sizes) \
            and prod(sizes) > 1:
        return _trailing(sizes, len(dims), in_itemsize, out_itemsize)
    kept = [i for i in range(ndim) if i not in dims]
    out = [0] * ndim
    for i, stride in zip(kept, contiguous_strides(tuple(sizes[i] for i in kept))):
        out[i] = stride * out_itemsize
    ins = [s * in_itemsize for s in strides]
    perm = _reorder(list(sizes), [out, ins])
    return _coalesce([sizes[p] for p in perm], [[out[p] for p in perm], [ins[p] for p in perm]])


def _trailing(sizes: tuple, reduced: int, in_itemsize: int, out_itemsize: int) -> Iter:
    """What reordering and coalescing give for a contiguous tensor reduced over its last
    ``reduced`` dimensions (a row sum, a whole sum): one reduced run, then one run of
    outputs; dimensions of size 1 vanish."""
    inputs = prod(sizes[len(sizes) - reduced:])
    outputs = prod(sizes[:len(sizes) - reduced])
    if outputs == 1 or inputs == 1:
        return Iter((inputs * outputs,), (0 if outputs == 1 else out_itemsize,),
                    (in_itemsize,), 1 if outputs == 1 else 0)
    return Iter((inputs, outputs), (0, out_itemsize), (in_itemsize, inputs * in_itemsize), 1)


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


def _last_pow2(n: int) -> int:
    """``last_pow2`` (``Reduce.cuh``): the largest power of two not above ``n`` (at least 1)."""
    return 1 << (max(n, 1).bit_length() - 1)


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _output_vec_size(it: Iter, in_itemsize: int, storage_offset: int) -> int:
    """``get_output_vec_size``: 4, halved until it divides the input's address (in elements:
    the allocator aligns storages, so the storage offset decides), the size of the first
    output dimension and every other input stride."""
    vec = 4
    values = [storage_offset, it.shape[it.num_reduce_dims]] + [
        s // in_itemsize for i, s in enumerate(it.in_strides) if i != it.num_reduce_dims]
    for n in values:
        while n % vec != 0:
            vec //= 2
    return vec


@lru_cache(maxsize=1 << 12)
def _on_fastest(it: Iter) -> bool:
    """Whether the reduced dimension is the input's fastest moving (``setReduceConfig``)."""
    r = it.num_reduce_dims
    return r == len(it.shape) or it.in_strides[0] < it.in_strides[r]


def launch(it: Iter, in_itemsize: int, acc_itemsize: int, storage_offset: int, sm_count: int,
           max_threads_per_sm: int) -> Launch:
    """``setReduceConfig`` (``Reduce.cuh``) for one 32-bit-indexable iterator, and the
    global memory it then takes (0 and 0 when the blocks do not split an output)."""
    if not it.shape:  # a 0-d input: one value, one thread
        return Launch(0, 0)
    num_outputs = 1
    for size, stride in zip(it.shape, it.out_strides):
        num_outputs *= size if stride else 1
    numel = 1
    for size in it.shape:
        numel *= size
    inputs_per_output = numel // num_outputs
    r = it.num_reduce_dims
    on_fastest = _on_fastest(it)
    dim0, dim1 = (inputs_per_output, num_outputs) if on_fastest else (num_outputs,
                                                                      inputs_per_output)
    fastest_stride = it.in_strides[0] if on_fastest else it.in_strides[r]
    vec = 1
    # "vectorize along input" divides dim0 by input_vec_size (4, or 8 for 16-bit types from
    # the releases that widened it); never enough to change the split: a split needs 256
    # values per thread, which the block width these dims give never leaves
    if fastest_stride == in_itemsize:
        if on_fastest and dim0 >= 128 and r == 1:
            dim0 //= 4
        elif not on_fastest:
            vec = _output_vec_size(it, in_itemsize, storage_offset)
            dim0 //= vec
    width, height = _block(dim0, dim1, MAX_NUM_THREADS // vec)
    step_input = step_output = 1
    if on_fastest:
        step_input *= width
    else:
        step_output *= width
    values = _div_up(inputs_per_output, step_input)
    split_warps = values >= min(height * 16, MAX_VALUES_PER_THREAD)
    if split_warps:
        step_input *= height
    else:
        step_output *= height
    return _global(num_outputs, inputs_per_output, vec, width, height, step_input,
                   step_output, split_warps, on_fastest, acc_itemsize, sm_count,
                   max_threads_per_sm)


def _block(dim0: int, dim1: int, max_threads: int) -> tuple[int, int]:
    """``ReduceConfig::set_block_dimension``: block width and height."""
    dim0_pow2 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    dim1_pow2 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    width = min(dim0_pow2, WARP)
    height = min(dim1_pow2, max_threads // width)
    width = min(dim0_pow2, max_threads // height)
    return width, height


def _global(num_outputs: int, inputs: int, vec: int, width: int, height: int,
            step_input: int, step_output: int, split_warps: bool, on_fastest: bool,
            acc_itemsize: int, sm_count: int, max_threads_per_sm: int) -> Launch:
    """The last step of ``setReduceConfig``: split the input across blocks when each thread
    has at least 256 values and the grid is small; then ``global_memory_size()`` (times the
    block's lanes when they do not reduce among themselves) and ``semaphore_size()``."""
    values = _div_up(inputs, step_input)
    grid_x = _div_up(num_outputs // vec, step_output)
    target = sm_count * (max_threads_per_sm // (width * height))
    if not (split_warps and values >= MAX_VALUES_PER_THREAD and grid_x <= target):
        return Launch(0, 0)
    ctas = max(min(_div_up(target, grid_x), _div_up(values, MIN_VALUES_PER_THREAD)),
               _div_up(values, MAX_VALUES_PER_THREAD))
    if ctas <= 1:
        return Launch(0, 0)
    size = acc_itemsize * num_outputs * ctas * (1 if on_fastest else width * vec)
    return Launch(size, 4 * grid_x)


class Scratch(NamedTuple):
    """Everything one reduction takes inside itself, in order: an accumulation buffer for
    the whole op (0 if none), then each kernel's ``Launch``."""

    accumulation: int
    launches: tuple


def _fits_32bit(it: Iter, numel: int) -> bool:
    """``TensorIteratorBase::can_use_32bit_indexing``: every offset, in bytes, fits int32."""
    if numel > INT32_MAX:
        return False
    return all(1 + sum((n - 1) * s for n, s in zip(it.shape, strides)) <= INT32_MAX
               for strides in (it.out_strides, it.in_strides))


def _row_parts(it: Iter) -> tuple | None:
    """``_split`` of a row reduction (reduced run first, then rows of it, contiguous) in
    integers: the rows are halved until a part fits, so the parts are the distinct row
    counts of that halving, in order; None where a single row does not fit (then the
    reduced run is split too, which ``_split`` does)."""
    if len(it.shape) != 2 or it.num_reduce_dims != 1:
        return None
    inputs, rows = it.shape
    size = it.in_strides[0]
    if it.in_strides != (size, inputs * size):
        return None
    counts = _halved_rows(rows, inputs, size, it.out_strides[1])
    return None if counts is None else tuple(
        (it._replace(shape=(inputs, r)), 0) for r in counts)


def _halved_rows(rows: int, inputs: int, size: int, out_size: int) -> tuple | None:
    """The distinct row counts of halving ``rows`` (first halves ``rows // 2`` first) until
    each part fits, in the order they first occur: at the first depth ``k`` where the
    ceiling half ``ceil(rows / 2^k)`` fits, every part is ``floor`` or ``ceil`` of
    ``rows / 2^k``, but for the floor parts one level up, which are leaves already when
    they fit. None when a single row does not fit."""
    def fits(r: int) -> bool:
        return r * inputs <= INT32_MAX and r * inputs * size - size + 1 <= INT32_MAX \
            and 1 + (r - 1) * out_size <= INT32_MAX

    if fits(rows):
        return (rows,)
    k = 1
    while not fits(-(-rows // (1 << k))):
        if -(-rows // (1 << k)) == 1:
            return None
        k += 1
    up_floor, up_ceil = rows // (1 << (k - 1)), -(-rows // (1 << (k - 1)))
    if fits(up_floor):  # the floor parts one level up stop there; the ceiling ones halve
        return tuple(dict.fromkeys((up_floor, up_ceil // 2, up_ceil - up_ceil // 2)))
    return tuple(dict.fromkeys((rows // (1 << k), -(-rows // (1 << k)))))


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
    accumulation = 0
    if not fits and out_itemsize == 2:  # a half or bfloat16 result
        extent = max([out_itemsize] + [n * s for n, s in zip(it.shape, it.out_strides)])
        accumulation = extent // out_itemsize * acc_itemsize
    launches = (launch(p, in_itemsize, acc_itemsize, at // in_itemsize % 4, gpu.sm_count,
                       threads) for p, at in parts)
    # each launch frees what it took before the next: a launch like an earlier one finds
    # the blocks that one took free again, so each distinct launch is kept once, in order
    # (millions of kernels reduce 10^16 elements; their buffers take a few sizes)
    return Scratch(accumulation, tuple(dict.fromkeys(launches)))


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
        sizes = [apply(_part_of(kernel, i), source, bound) for i in range(3)]
        scratch = Scratch(sizes[0], (Launch(sizes[1], sizes[2]),))
    else:
        scratch = _scratch(kernel, tuple(source))
    return [new(name, shape, dtype, role, op), *scratch_events(name, scratch, op)]


@lru_cache(maxsize=1 << 17)  # a grid's configurations, read once per part (``_part``);
def _scratch(kernel: tuple, source: tuple) -> Scratch:  # emptied after it (``forget``)
    dims, in_size, out_size, acc_size, gpu = kernel
    return reduction_scratch(source, contiguous_strides(source), dims, in_size, out_size,
                             acc_size, 0, gpu)


def forget() -> None:
    """Empty the per-configuration cache a grid filled: a hundred thousand entries kept
    make every later garbage collection of the process slow."""
    _scratch.cache_clear()


def _part(kernel: tuple, which: int, *source: int) -> int:
    """The accumulation buffer (0), or the largest launch's buffer (1) or semaphores (2)."""
    scratch = _scratch(kernel, source)
    if which == 0:
        return scratch.accumulation
    largest = max(scratch.launches, key=lambda part: part.buffer, default=Launch(0, 0))
    return largest.buffer if which == 1 else largest.semaphores


@lru_cache(maxsize=None)
def _part_of(kernel: tuple, which: int):
    """One function object per kernel and part: placeholders of equal reductions (naive's
    three row sums) are then one expression, evaluated once per configuration."""
    return partial(_part, kernel, which)


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
