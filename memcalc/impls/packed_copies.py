"""What CUDA's fused copies for FSDP2 allocate inside themselves: a packed metadata tensor.

FSDP2 copies its all-gather buffer out into the unsharded parameters with
``split_with_sizes_copy.out`` and its gradients into the reduce-scatter input with
``_chunk_cat.out`` (``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``). On
contiguous operands (of one dtype; ``_chunk_cat`` also bf16 into float32) both take a fast
path in ``aten/src/ATen/native/cuda/TensorShape.cu`` whose kernel reads its addresses and
block map from one int64 tensor on the device: ``detail::pack_vecs`` fills pinned host
memory and copies it with ``.to(device, non_blocking=true)``, a caching-allocator block of
8 bytes an entry, freed as the function returns. The meta device has none of it.

The entries, from the same file:

* ``split_with_sizes_copy_out_cuda_contiguous_no_cast``: the destination and source
  addresses and each split's chunk size (one each per split), ``block_idx_to_split_idx``
  (the blocks of every split's chunk) and ``blocks_cumsums`` (splits + 1); the blocks of a
  chunk are ``ceil(chunk / (TILE x iters_per_chunk))``, ``iters_per_chunk`` spreading the
  work over at most ``2 x SMs x maxThreadsPerMultiProcessor / 128`` blocks;
* ``get_chunk_cat_metadata``: the sources, the block map (``ceil(padded chunk / TILE)``
  blocks a tensor), two prefix sums (tensors + 1 each) and three sizes per tensor.
"""

from __future__ import annotations

from math import isqrt
from typing import NamedTuple

from memcalc.engine.program import Role, free, new
from memcalc.impls.device import max_threads_per_sm

BLOCK_SIZE = 128  # detail::BLOCK_SIZE
TILE = 16 * BLOCK_SIZE  # detail::BYTES_PER_THREAD x BLOCK_SIZE: bytes a block copies a pass


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _ceil_sqrt(x: int) -> int:
    """``std::ceil(std::sqrt(x))`` for a whole ``x`` (a double's square root is correctly
    rounded, so it is whole exactly when ``x`` is a square)."""
    r = isqrt(x)
    return r if r * r == x else r + 1


def _packed(name: str, entries: int) -> list:
    """The packed tensor's block, made and freed within the op."""
    label = f"{name}: packed metadata"
    return [new(label, (entries,), "int64", Role.temporary, "pack_vecs"), free(label)]


class SplitCopy(NamedTuple):
    """``split_with_sizes_copy.out`` on its fast path: the splits' chunk sizes in bytes
    (split size x stride x element size) and the number of chunks."""

    chunk_bytes: tuple[int, ...]
    num_chunks: int

    def events(self, name: str, gpu) -> list:
        """The packed metadata: 3 entries a split, its blocks, and one more."""
        blocks = sum(_div_up(c, TILE) for c in self.chunk_bytes)
        max_blocks = gpu.sm_count * max_threads_per_sm(gpu) // BLOCK_SIZE * 2
        iter_factor = _div_up(blocks * self.num_chunks, max_blocks)
        chunks_per_block = min(_ceil_sqrt(iter_factor), self.num_chunks)
        iters = _div_up(iter_factor, chunks_per_block)
        launched = sum(_div_up(c, TILE * iters) for c in self.chunk_bytes)
        return _packed(name, 3 * len(self.chunk_bytes) + 1 + launched)


class ChunkCat(NamedTuple):
    """``_chunk_cat.out`` on its fast path: each tensor's padded chunk in bytes of the
    output's dtype (``ceil(dim size / chunks) x chunks x trailing x size / chunks``)."""

    padded_chunk_bytes: tuple[int, ...]

    def events(self, name: str, gpu=None) -> list:
        """The packed metadata: 5 entries a tensor, its blocks, and two more."""
        blocks = sum(_div_up(c, TILE) for c in self.padded_chunk_bytes)
        return _packed(name, 5 * len(self.padded_chunk_bytes) + 2 + blocks)
