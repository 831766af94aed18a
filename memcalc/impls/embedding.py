"""What CUDA's embedding backward allocates inside itself, which the meta device does not.

``embedding_dense_backward_cuda`` (``aten/src/ATen/native/cuda/Embedding.cu``) takes one of
two paths. With at most 3,072 indices and no ``scale_grad_by_freq`` one kernel adds each row
of the grad into ``grad_weight`` with atomics: nothing but the result. Past that (every
language model's token embedding at a real batch), it sorts the indices and sums each
index's rows in segments (``embedding_backward_cuda_kernel``,
``aten/src/ATen/native/cuda/EmbeddingBackwardKernel.cu``), with these buffers, all freed as
it returns but ``grad_weight``:

- (either path) ``indices_.contiguous()`` and ``grad_.contiguous()``, copies of inputs that
  are not contiguous (BERT's token types, a buffer expanded over the batch);
- ``sorted_indices``, ``orig_indices`` (``empty_like(indices)``) and ``range`` (``arange``
  of the indices, freed once the pairs are sorted into the two); ``count`` with
  ``scale_grad_by_freq``;
- ``segment_offsets`` (one index a row), ``num_of_segments`` (a 0-d int64); the keys that
  ``cuda::cub::unique_by_key`` writes into a buffer of its own and drops
  (``aten/src/ATen/cuda/cub.cuh``);
- ``partials_per_segment`` and ``partials_per_segment_offset`` (one index per segment, at
  most ``min(indices, num_weights)``), ``num_of_partial_segments`` (a 0-d int64),
  ``partial_segment_offset`` (``indices / 10 + segments``: ``NROWS_PER_THREAD`` rows a
  partial segment) and ``grad_weight_per_segment``, that many rows of the embedding's
  width in the grad's accumulate type (float32 for half and bfloat16).

Not modelled: the temporary storage CUB sizes for itself at run time (the radix sort of the
pairs, ``unique_by_key``, ``exclusive_sum``), and the fused path a later release takes for
few segments of many rows (``partial_to_segment_idx``): ``memcalc trace`` names the call.
``grad_weight`` is allocated here first, then the buffers; the kernel allocates the copies
and the sort's three before it: the same tensors are alive at its peak. Read from PyTorch's
source (the two-pass path as torch 2.4 to 2.13 write it); an H100 with torch 2.11 measured
the largest of them alive at once, to the byte (``tests/test_impls_embedding.py``).
"""

from __future__ import annotations

from typing import NamedTuple

from memcalc.engine.program import Role, free, new

ATOMIC_MOST = 3072  # num_indices <= 3072 && !scale_grad_by_freq: the one-kernel path
NROWS_PER_THREAD = 10  # rows of a partial segment (EmbeddingBackwardKernel.cu)
OPMATH = {"float16": "float32", "bfloat16": "float32"}  # toOpMathType; others their own


class EmbeddingBackward(NamedTuple):
    """One ``embedding_dense_backward`` call as the CUDA kernel sees it: ``numel`` indices
    of ``index_dtype`` into ``weights`` rows of ``width``, the grad's ``dtype``. A traced
    program keeps these (``numel`` a polynomial in N) and recomputes the buffers at each
    length (``memcalc.tracing.fitted``)."""

    numel: int
    weights: int
    width: int
    dtype: str
    index_dtype: str
    scale_grad_by_freq: bool
    indices_copied: bool = False  # not contiguous: ``indices_.contiguous()`` copies them
    grad_copied: bool = False  # ``grad_.contiguous()`` likewise

    @property
    def sorted(self) -> bool:
        """Whether the kernel sorts the indices (``ATOMIC_MOST``)."""
        return self.numel > ATOMIC_MOST or self.scale_grad_by_freq

    def events(self, name: str, gpu=None) -> list:
        """The kernel's own buffers after its result, as program events named ``name: ...``:
        the contiguous copies of its inputs, and on the sorting path its buffers."""
        n, index, T = self.numel, self.index_dtype, Role.temporary
        copies = [(f"{name}: indices copy", (n,), index)] if self.indices_copied else []
        if self.grad_copied:
            copies.append((f"{name}: grad copy", (n, self.width), self.dtype))
        made = [new(c, s, d, T, "contiguous") for c, s, d in copies]
        return [*made, *self._sorting(name), *([free(*(c for c, *_ in copies))] if copies
                                                else [])]

    def _sorting(self, name: str) -> list:
        """The sorting path's buffers (none on the one-kernel path)."""
        if not self.sorted:
            return []
        n, index, T = self.numel, self.index_dtype, Role.temporary
        segments = min(n, self.weights)  # max_segments
        partials = n // NROWS_PER_THREAD + segments  # max_partial_segment
        buffers = [("sorted_indices", (n,), index, "empty_like"),
                   ("orig_indices", (n,), index, "empty_like"),
                   ("range", (n,), index, "arange")]
        counted = [("count", (n,), index, "empty_like")] if self.scale_grad_by_freq else []
        segmented = [("segment_offsets", (n,), index, "empty"),
                     ("num_of_segments", (), "int64", "empty"),
                     ("unique keys", (n,), index, "empty")]
        summed = [("partials_per_segment", (segments,), index, "empty"),
                  ("partials_per_segment_offset", (segments,), index, "empty"),
                  ("num_of_partial_segments", (), "int64", "empty"),
                  ("partial_segment_offset", (partials,), index, "empty"),
                  ("grad_weight_per_segment", (partials, self.width),
                   OPMATH.get(self.dtype, self.dtype), "empty")]
        made = lambda specs: [new(f"{name}: {b}", s, d, T, op) for b, s, d, op in specs]  # noqa: E731
        kept = [b for b, *_ in buffers if b != "range"] + [b for b, *_ in counted]
        kept += [b for b, *_ in segmented if b != "unique keys"] + [b for b, *_ in summed]
        return [*made(buffers), free(f"{name}: range"), *made(counted), *made(segmented),
                free(f"{name}: unique keys"), *made(summed),
                free(*(f"{name}: {b}" for b in reversed(kept)))]
