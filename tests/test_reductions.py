"""memcalc.impls.reductions: what CUDA's reduction kernel allocates inside itself.

The expected sizes are an H200's (132 SMs, 2,048 threads per SM, torch 2.11), read from
the caching allocator's own history (``validation/history.py``, the ``reductions`` of the
first live run); beside each, the arithmetic of ``setReduceConfig`` that gives it.
"""

from __future__ import annotations

import pytest

from memcalc.engine.program import Dims, Tensor
from memcalc.engine.symbolic import Sym, evaluate_sym
from memcalc.impls.device import Gpu
from memcalc.impls.reductions import (Launch, Scratch, contiguous_strides, reduced,
                                      reduction_iter, reduction_scratch)

H200 = Gpu(132, (9, 0))


def scratch(shape, itemsize, dims=None, out_itemsize=None, gpu=H200) -> Scratch:
    dims = tuple(range(len(shape))) if dims is None else tuple(d % len(shape) for d in dims)
    return reduction_scratch(shape, contiguous_strides(shape), dims, itemsize,
                             out_itemsize or itemsize, 4, 0, gpu)


MEASURED = [
    # full sums: one output, blocks of 512 lanes; target grid 132 SMs x (2048 / 512) = 528;
    # ctas = max(min(528, ceil(vpt / 16)), ceil(vpt / 256)), vpt = numel / 512; 4 B each
    ((8, 8, 2047, 64), 2, None, 528 * 4, 4),  # vpt 16,376: min(528, 1,024) = 528
    ((1, 8, 2047, 128), 2, None, 256 * 4, 4),  # vpt 4,094: min(528, 256) = 256
    ((1 << 20,), 4, None, 128 * 4, 4),  # vpt 2,048: min(528, 128) = 128
    ((1 << 24,), 4, None, 528 * 4, 4),  # vpt 32,768: 528
    # k.sum(-2) of (2, 4, N, 16): 128 outputs, 4-wide, blocks 32 x 4, target 132 x 16 = 2,112;
    # vpt = ceil(N / 4); buffer = 4 B x 128 outputs x ctas x 32 lanes x 4-wide
    ((2, 4, 1050, 16), 2, (-2,), 4 * 128 * 17 * 32 * 4, 4),  # vpt 263: ceil(263 / 16) = 17
    ((2, 4, 1050, 16), 4, (-2,), 4 * 128 * 17 * 32 * 4, 4),  # float32 alike
    ((2, 4, 3001, 16), 2, (-2,), 4 * 128 * 47 * 32 * 4, 4),  # vpt 751: ceil(751 / 16) = 47
    # (4, 8, 16384, 64) over -2: 2,048 outputs, grid.x = 512 / 32 = 16 (64 B of semaphores);
    # ctas = min(ceil(2,112 / 16), ceil(4,096 / 16)) = 132
    ((4, 8, 16384, 64), 2, (-2,), 4 * 2048 * 132 * 32 * 4, 4 * 16),
    # a Linear's bias grad over 2,048 rows: 768 outputs, grid.x 6, vpt 512: ctas 32
    ((2, 1024, 768), 4, (0, 1), 4 * 768 * 32 * 32 * 4, 4 * 6),
    ((2048, 768), 4, (0,), 4 * 768 * 32 * 32 * 4, 4 * 6),
    ((2, 1024, 768), 2, (0, 1), 4 * 768 * 32 * 32 * 4, 4 * 6),  # bf16: a float buffer
    ((2, 4096, 768), 4, (0, 1), 4 * 768 * 128 * 32 * 4, 4 * 6),  # vpt 2,048: ctas 128
    ((2, 1024, 256), 4, (0, 1), 4 * 256 * 32 * 32 * 4, 4 * 2),  # grid.x 2
    # a 1,000 x 1,000 matrix by rows or columns: 1,000 outputs, no split
    ((1000, 1000), 4, (1,), 0, 0),
    ((1000, 1000), 4, (0,), 0, 0),
]


@pytest.mark.parametrize("shape, itemsize, dims, buffer, semaphores", MEASURED)
def test_the_buffers_an_h200_allocated(shape, itemsize, dims, buffer, semaphores):
    assert scratch(shape, itemsize, dims) == Scratch(0, (Launch(buffer, semaphores),))


def test_the_iterator_puts_the_reduced_dimension_first_and_merges_the_rest():
    # (2, 4, 1050, 16) fp16 over dim 2: the reduced 1,050 (stride 16 x 2 B), then the 16
    # features (stride 2 B), then batch and heads merged (8, stride 1,050 x 16 x 2 B)
    it = reduction_iter((2, 4, 1050, 16), contiguous_strides((2, 4, 1050, 16)), (2,), 2, 2)
    assert (it.shape, it.in_strides, it.num_reduce_dims) == ((1050, 16, 8), (32, 2, 33600), 1)


def test_fewer_sms_split_less():
    # an A100 (108 SMs): target 108 x 4 = 432 blocks for the full sum of 8 x 8 x 2047 x 64
    assert scratch((8, 8, 2047, 64), 2, gpu=Gpu(108, (8, 0))).launches == (Launch(432 * 4, 4),)


def test_a_reduction_past_32_bit_offsets_is_split_and_a_half_result_gets_a_float_buffer():
    # 2^32 half values summed into a half: two halves of 2^31 (each over the int32 range in
    # bytes: halved again), four launches of vpt 2^30 / 512 = 2^21 -> ctas 2^21 / 256 = 8,192
    # x 4 B, alike, so one is kept (each finds the blocks the one before freed); and a
    # float32 accumulation buffer of the one output, 4 B
    result = scratch((1, 32, 1 << 20, 128), 2)
    assert result == Scratch(4, (Launch(8192 * 4, 4),))


def test_no_kernel_for_an_empty_tensor():
    assert scratch((0, 16), 4) == Scratch(0, ())


def dims(**sizes) -> Dims:
    base = dict(B=1, H=8, N=3001, M=3001, D=64, dtype="bfloat16", causal=False, loss="sum",
                Hk=8, chunk=64, sm_count=132, compute_capability=(9, 0))
    return Dims(**{**base, **sizes})


def test_reduced_adds_the_buffer_and_semaphores_after_the_result_and_frees_them():
    # the loss of a bf16 (1, 8, 3001, 64) output: vpt = 1,536,512 / 512 = 3,001,
    # ctas = min(528, ceil(3,001 / 16) = 188) = 188: 752 B and 4 B
    events = reduced("loss", (), "bfloat16", None, dims(), (1, 8, 3001, 64), (0, 1, 2, 3))
    made = [(e.name, e.shape) for e in events if isinstance(e, Tensor)]
    assert made == [("loss", ()), ("loss: split-reduction buffer", (188 * 4,)),
                    ("loss: semaphores", (4,))]
    assert events[-1].names == ("loss: split-reduction buffer", "loss: semaphores")


def test_over_symbolic_sizes_the_scratch_is_evaluated_per_configuration():
    n = Sym.leaf("N")
    events = reduced("k_sum", (2, 4, 16), "float16", None, dims(N=n), (2, 4, n, 16), (2,))
    buffer = next(e for e in events if isinstance(e, Tensor) and "split-reduction" in e.name)
    import numpy as np

    # N = 1,050 and 3,001 as measured; N = 64: 16 values a thread, no split
    values = evaluate_sym(buffer.shape[0], {"N": np.array([1050, 3001, 64])})
    assert values.tolist() == [4 * 128 * 17 * 32 * 4, 4 * 128 * 47 * 32 * 4, 0]


@pytest.mark.parametrize("shape, itemsize", [((8, 1, 10_000, 10_000), 4),  # halved once
                                             ((8, 1, 20_000, 20_000), 4),
                                             ((8, 1, 16_000_001, 16_000_001), 4),
                                             ((1, 3, 70_001, 70_001), 2),
                                             # the floor halves fit a level before the
                                             # ceiling ones
                                             ((3, 1, 2_421_787, 2_421_787), 2)])
def test_a_row_reductions_split_in_integers_is_the_general_split(shape, itemsize):
    """Rows past 32-bit offsets are halved until each part fits: the integer shortcut
    (``_row_parts``, what makes a sweep to 16M rows affordable) gives the parts the general
    ``TensorIterator`` split gives."""
    from memcalc.impls.reductions import _row_parts, _split

    it = reduction_iter(shape, contiguous_strides(shape), (3,), itemsize, itemsize)
    parts = _split(it, 0)
    assert _row_parts(it) == parts
    assert all(part.shape[1] < it.shape[1] for part, _ in parts)  # it was split


@pytest.mark.parametrize("shape, itemsize", [((1, 32, 1 << 20, 128), 2),  # 2^32 values
                                             ((3, 5, 70_001, 4_099), 4)])
def test_a_whole_sums_split_in_integers_is_the_general_split(shape, itemsize):
    """A whole sum past 32-bit offsets is one row of every value: halved as rows are."""
    from memcalc.impls.reductions import _row_parts, _split

    it = reduction_iter(shape, contiguous_strides(shape), tuple(range(len(shape))), itemsize,
                        itemsize)
    assert len(it.shape) == 1 and _row_parts(it) == _split(it, 0)


def test_the_iterator_of_a_run_of_dimensions_is_the_general_one():
    """``run_iter`` (a contiguous input reduced over neighbouring dimensions, the grid's
    closed form) gives what reordering and coalescing give, for every layout of sizes 1,
    2 and 3 in up to four dimensions and every run."""
    from itertools import product

    from memcalc.impls.reductions import general_iter

    for ndim in range(1, 5):
        for shape in product((1, 2, 3), repeat=ndim):
            runs = [tuple(range(a, b)) for a in range(ndim) for b in range(a + 1, ndim + 1)]
            for dims in runs if max(shape) > 1 else ():
                strides = contiguous_strides(shape)
                assert reduction_iter(shape, strides, dims, 2, 4) == \
                    general_iter(shape, strides, dims, 2, 4), (shape, dims)


GRID_LENGTHS = sorted({1, 2, 3, 127, 128, 4095, 10_000, 46_341, 1 << 20, 2_421_787, 11_863_283,
                       16_000_001, 1 << 24} | set(range(1, 16 << 20, 411_029)))
"""Lengths across every layout and split: one row, no split, split warps, rows past
32-bit offsets halved once (10,000), into two and into three sizes, up to 16M."""


@pytest.mark.parametrize("gpu", [H200, Gpu(108, (8, 0))])
@pytest.mark.parametrize("dims, shape, itemsize", [
    ((3,), lambda n: (8, 1, n, n), 4),  # naive's row sums of the scores
    ((3,), lambda n: (1, 3, n, n), 2),  # half: an accumulation buffer once split
    ((0, 1, 2, 3), lambda n: (8, 1, n, 16), 4),  # the loss
    ((0, 1, 2, 3), lambda n: (2, 8, n, 128), 2),
    ((2,), lambda n: (2, 4, n, 16), 2),  # k.sum(-2): outputs on both sides of the run
    ((2,), lambda n: (1, 1, n, 64), 4),
])
def test_a_grids_scratch_is_each_configurations(gpu, dims, shape, itemsize):
    """The grid's closed form (one ``largest_launch`` per layout, over arrays) gives, for
    every length, the figures ``Part`` gives one configuration at a time."""
    import numpy as np

    from memcalc.impls.reductions import Part, _grid_figures, forget

    kernel = (dims, itemsize, itemsize, 4, gpu)
    lengths = np.array(GRID_LENGTHS, dtype=np.int64)
    grid = _grid_figures(kernel, shape(lengths))
    forget()
    one_by_one = [[Part(kernel, which)(*shape(int(n))) for n in lengths] for which in range(3)]
    assert grid.tolist() == one_by_one
    assert grid[1].any()  # some split across blocks
