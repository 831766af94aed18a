"""FSDP2's copies as CUDA runs them, in a trace: the packed metadata its fused
``split_with_sizes_copy`` (the all-gather copy-out) and ``chunk_cat`` (the reduce-scatter
copy-in; ``chunk_cat_mixed_dtype`` from torch 2.15) make and free inside themselves (``memcalc.impls.packed_copies``), which the
tracer adds after each ``fsdp::`` op (``memcalc.tracing.tracer``)."""

from __future__ import annotations

from math import prod

import torch


def split_copy(tracer, source, split_sizes, dim=0, *, out) -> None:
    """``fsdp::split_with_sizes_copy`` (the all-gather copy-out) as CUDA runs it: on its
    fast path (contiguous operands of one dtype), the packed metadata, made and freed."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false as dense

    from memcalc.impls.packed_copies import SplitCopy

    if not all(dense(t) and t.dtype == source.dtype for t in (source, *out)):
        return
    stride, size = source.stride(dim), source.element_size()
    chunks = source.numel() // prod(source.shape[dim:])
    tracer.scratch(SplitCopy(tuple(s * stride * size for s in split_sizes), chunks),
                   "all-gather copy-out")


def chunk_cat(tracer, tensors, dim, num_chunks, *, out) -> None:
    """``fsdp::chunk_cat`` (the reduce-scatter copy-in) as CUDA runs it: on its fast path
    (contiguous, one dtype or bf16 into float32), the packed metadata, made and freed."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false as dense

    from memcalc.impls.packed_copies import ChunkCat

    same = all(t.dtype == out.dtype for t in tensors)
    widened = all(t.dtype == torch.bfloat16 for t in tensors) and out.dtype == torch.float32
    if not (all(dense(t) for t in tensors) and (same or widened)):
        return
    padded = tuple(-(-t.shape[dim] // num_chunks) * prod(t.shape[dim + 1:])
                   * out.element_size() for t in tensors)
    tracer.scratch(ChunkCat(padded), "reduce-scatter copy-in")


def chunk_cat_mixed(tracer, tensors, dim, num_chunks, *, out) -> None:
    """``fsdp::chunk_cat_mixed_dtype``, the reduce-scatter copy-in from torch 2.15
    (``foreach_reduce_scatter_copy_in``, ``_fsdp_collectives.py``): a group of one dtype runs
    ``_chunk_cat``'s kernel as ``chunk_cat`` does; a bf16 and float32 group runs it once per
    dtype (its packed metadata each time, made and freed in turn). Other mixes, which cast
    each gradient first, are not modelled here."""
    dtypes = list(dict.fromkeys(t.dtype for t in tensors))
    if len(dtypes) == 1:
        return chunk_cat(tracer, tensors, dim, num_chunks, out=out)
    if set(dtypes) == {torch.bfloat16, torch.float32} and out.dtype == torch.float32:
        for dtype in dtypes:
            chunk_cat(tracer, [t for t in tensors if t.dtype == dtype], dim, num_chunks, out=out)


# the fsdp:: ops whose CUDA implementations allocate inside themselves, by name
COPIES = {"split_with_sizes_copy": split_copy, "chunk_cat": chunk_cat,
          "chunk_cat_mixed_dtype": chunk_cat_mixed}
