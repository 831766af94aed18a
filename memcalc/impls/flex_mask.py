"""``create_block_mask`` run eagerly inside the step (``flex --block-mask dense``): what it
allocates to build a BlockMask, as torch 2.13 runs it (``torch/nn/attention/
flex_attention.py``, ``FA`` below), for memcalc's mask kinds written as people write them:

* causal: ``q >= kv``; sliding:W: ``(q >= kv) & (q - kv <= W)``; document:L:
  ``doc[b, q] == doc[b, kv]``, with ``doc`` a (B, max(N, M)) int64 tensor of document ids
  (``arange // L``) made before the step (an input).

``create_mask`` evaluates the mask_mod over every (q, kv) pair: an N x M bool mask (and the
mod's own N x M temporaries: sliding's ``q - kv`` is int64, 8 bytes an element), alive until
``create_block_mask`` returns. ``_convert_mask_to_block_mask`` pads it to whole 128-blocks (a
copy), and sums each block: ``sum`` of a bool tensor into int64 first converts the whole
padded mask to int64 (``make_reduction_from_out_ty``, ATen's ReduceOpsUtils.h): the
``--block-mask dense`` peak is 1 + 1 + 8 bytes an element of an N x M grid. Then the block
counts become the eight int32 index tensors (``_dense_to_ordered``, ``_transpose_ordered``):
small, and each step of them allocated as it is here.

The sequence was read from the source and checked, event by event, against ``memcalc
trace`` of code calling ``create_block_mask`` (``tests/test_impls_flex_mask.py``), which runs
torch's own functions on the meta device with CUDA's reduction buffers.
"""

from __future__ import annotations

from memcalc.engine.program import Dims, Role, Tensor, free, new
from memcalc.impls.device import gpu_of
from memcalc.impls.reductions import contiguous_strides, reduction_scratch, scratch_events

T, S, I = Role.temporary, Role.saved, Role.input
BLOCK = 128  # FA _DEFAULT_SPARSE_BLOCK_SIZE
MADE = "create_block_mask"
I64, I32, BOOL, I8 = "int64", "int32", "bool", "int8"
# the BlockMask's tensors, as ``create_block_mask`` returns them (``flex.block_mask``)
OUTPUTS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
           "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def made(name: str, shape: tuple, dtype: str, role: Role, op: str):
    """``new``, the op named as create_block_mask's (every table says where it came from)."""
    return new(name, shape, dtype, role, f"{MADE}: {op}")


def mask_of(d: Dims) -> str:
    """The mask: ``--mask``, else ``causal`` under ``--causal``."""
    return d.mask if d.mask != "none" else ("causal" if d.causal else "none")


def kind_of(d: Dims) -> str:
    """The mask's kind: ``none``, ``causal``, ``sliding`` or ``document``."""
    return mask_of(d).split(":")[0]


def batch_of(d: Dims) -> int:
    """``B`` of ``create_block_mask``: the batch for a document mask, else None (1)."""
    return d.B if kind_of(d) == "document" else 1


def inputs(d: Dims) -> list:
    """What the mask_mod reads, made before the step: a document mask's ``doc``
    (B, max(N, M)) int64 ids."""
    if kind_of(d) != "document":
        return []
    return [Tensor("doc", (d.B, max(d.N, d.M)), I64, I, "document ids")]


def build(d: Dims) -> list:
    """The whole of ``create_block_mask(mask_mod, B, None, N, M)``, eager: the dense mask,
    its block sums, the eight index tensors (``OUTPUTS``, saved by the attention call that
    follows), and every temporary on the way, freed where Python drops them (a batch of
    frees in the order the tensors were made, as the tracer takes them)."""
    b, rows, cols = batch_of(d), -(-d.N // BLOCK), -(-d.M // BLOCK)
    grid, transposed = (b, 1, rows, cols), (b, 1, cols, rows)
    return [*mask_mod(d), *block_sums(d, grid),
            *dense_to_ordered(d, "kv", grid, "partial: int32"),
            free(*dropped("kv", "partial: int32")),
            *dense_to_ordered(d, "full_kv", grid, "full: int32"),
            free(*dropped("full_kv", "full: int32")),
            *ordered_to_dense("q", grid),
            *dense_to_ordered(d, "q", transposed, "q: dense"),
            free(*dropped("q", "q: dense")),
            *ordered_to_dense("full_q", grid),
            *dense_to_ordered(d, "full_q", transposed, "full_q: dense"),
            # create_block_mask returns: the dense mask, the int8 block kinds and what the
            # last step held die together
            free("mask", "partial", "full", *dropped("full_q", "full_q: dense"))]


def mask_mod(d: Dims) -> list:
    """``create_mask``: ``arange`` of b, h, q, kv, then the vmapped mask_mod over them."""
    b, kind = batch_of(d), kind_of(d)
    index = [made("b", (b,), I64, T, "arange"), made("h", (1,), I64, T, "arange"),  # (B,), (1,)
             made("q_idx", (d.N,), I64, T, "arange"), made("kv_idx", (d.M,), I64, T, "arange")]
    grid = (d.N, d.M)
    if kind == "causal":
        return [*index, made("mask", grid, BOOL, T, "ge"),  # (N, M) q >= kv
                free("b", "h", "q_idx", "kv_idx")]
    if kind == "sliding":
        return [*index, made("ge", grid, BOOL, T, "ge"),  # (N, M) q >= kv
                made("distance", grid, I64, T, "sub"),  # (N, M) q - kv, int64
                made("within", grid, BOOL, T, "le"),  # (N, M) q - kv <= W
                free("distance"),
                made("mask", grid, BOOL, T, "bitwise_and"),  # (N, M)
                free("ge", "within", "b", "h", "q_idx", "kv_idx")]
    return [*index, made("doc_q", (d.B, d.N), I64, T, "index"),  # (B, N) doc[b, q]
            made("doc_kv", (d.B, d.M), I64, T, "index"),  # (B, M) doc[b, kv]
            made("mask", (d.B, d.N, d.M), BOOL, T, "eq"),  # (B, N, M)
            free("doc_q", "doc_kv", "b", "h", "q_idx", "kv_idx")]


def block_sums(d: Dims, grid: tuple) -> list:
    """``_convert_mask_to_block_mask``: the mask padded to whole blocks, each block's count
    (int64, of the padded mask converted to int64 as a whole, viewed block by block), which
    blocks are partly and which wholly set (int8)."""
    b, h, rows, cols = grid
    padded = (b, h, rows * BLOCK, cols * BLOCK)
    # the (B, 1, rows, cols, 128, 128) view of the padded mask, and its int64 copy's strides
    blocks = (*grid, BLOCK, BLOCK)
    p = contiguous_strides(padded)
    strides = (p[0], p[1], BLOCK * p[2], BLOCK, p[2], 1)
    return [made("padded", padded, BOOL, T, "constant_pad_nd"),  # (B, 1, rows*128, cols*128)
            *summed("block sums", grid, blocks, strides, (4, 5), d),  # (B, 1, rows, cols)
            made("full: bool", grid, BOOL, T, "eq"),  # (B, 1, rows, cols) sum == 128 x 128
            made("some", grid, BOOL, T, "gt"), made("not all", grid, BOOL, T, "lt"),
            made("partial: bool", grid, BOOL, T, "bitwise_and"),  # (B, 1, rows, cols)
            free("some", "not all"),
            made("partial", grid, I8, T, "to"),  # (B, 1, rows, cols) int8
            free("partial: bool"),
            made("full", grid, I8, T, "to"),  # (B, 1, rows, cols) int8
            free("padded", "block sums", "full: bool")]


def summed(name: str, shape: tuple, source: tuple, strides: tuple, dims: tuple,
           d: Dims) -> list:
    """``sum`` into int64 of an int32 or bool tensor: the result, then the source converted
    to int64 (a copy with the source's strides, ``self.to(out_dtype)``), reduced, freed as
    the kernel returns (the tracer's ``_reduction`` does the same)."""
    scratch = reduction_scratch(source, strides, dims, 8, 8, 8, 0, gpu_of(d))
    return [made(name, shape, I64, T, "sum"),
            made(f"{name}: int64 copy", source, I64, T, "to"),
            *scratch_events(name, scratch, "sum"),
            free(f"{name}: int64 copy")]


def dense_to_ordered(d: Dims, prefix: str, grid: tuple, dense: str) -> list:
    """``_dense_to_ordered``: ``dense`` as int32 (a copy of the int8 block kinds; none of the
    transposed dense masks, int32 already), its row counts, an argsort of each row, then
    the ``num_blocks`` and ``indices`` pair as contiguous int32 copies (saved: the BlockMask).
    ``grid``: (B, 1, rows, cols) of the mask read; a transposed one is a view of a
    contiguous (B, 1, cols, rows) tensor."""
    rows = grid[:-1]
    if dense.endswith(": dense"):  # the transpose of _ordered_to_dense's result
        c = contiguous_strides((*grid[:2], grid[3], grid[2]))
        strides, as_int32 = (c[0], c[1], 1, c[2]), []
    else:
        strides = contiguous_strides(grid)
        as_int32 = [made(dense, grid, I32, T, "to")]  # (B, 1, rows, cols)
    return [*as_int32,
            *summed(f"{prefix}: row sums", rows, grid, strides, (3,), d),  # (B, 1, rows)
            made(f"{prefix}: sorted", grid, I32, T, "sort"),  # argsort's values, dropped
            made(f"{prefix}: order", grid, I64, T, "sort"),  # and its indices
            free(f"{prefix}: sorted"),
            made(f"{prefix}_num_blocks", rows, I32, S, "to"),  # (B, 1, rows)
            made(f"{prefix}_indices", grid, I32, S, "to")]  # (B, 1, rows, cols)


def dropped(prefix: str, dense: str) -> tuple[str, ...]:
    """What ``_dense_to_ordered`` held, dropped as it returns."""
    return dense, f"{prefix}: row sums", f"{prefix}: order"


def ordered_to_dense(prefix: str, grid: tuple) -> list:
    """``_ordered_to_dense`` of a (num_blocks, indices) pair (vmapped over (B, 1)), for
    ``_transpose_ordered`` to make ``prefix``'s pair: a zeroed dense mask
    one column wider, the index ranges, which entries are in use, the valid column of each,
    the one written at them (``index_put``, with vmap's batch indices), then the dense mask
    without the extra column (a copy)."""
    b, h, rows, cols = grid
    name = f"{prefix}: "
    return [made(name + "zeros", (b, h, rows, cols + 1), I32, T, "new_zeros"),
            made(name + "rows", (rows,), I32, T, "arange"),  # (rows,)
            made(name + "cols", (cols,), I32, T, "arange"),  # (cols,)
            made(name + "in use", grid, BOOL, T, "lt"),  # (B, 1, rows, cols)
            made(name + "fill", (), I32, T, "scalar_tensor"),  # () num_cols
            made(name + "valid", grid, I32, T, "where"),  # (B, 1, rows, cols)
            free(name + "fill"),
            made(name + "one", (b, h), I32, T, "new_ones"),  # (B, 1) vmapped ones(())
            made(name + "h index", (h,), I64, T, "arange"),  # vmap's batch indices
            made(name + "b index", (b,), I64, T, "arange"),
            free(name + "one", name + "h index", name + "b index"),
            made(name + "dense", grid, I32, T, "clone"),  # (B, 1, rows, cols)
            free(name + "zeros", name + "rows", name + "cols", name + "in use", name + "valid")]
