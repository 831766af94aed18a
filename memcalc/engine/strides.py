"""Strides of dense tensors and of their permuted views: where torch copies and where it
does not.

A tensor is described by the shape its memory is laid out in (contiguous) and ``order``, the
permutation that gives the shape the code sees (``x.permute(order)``, ``x.transpose(1, 2)``
is ``(0, 2, 1, 3)``). Two questions decide whether an op copies:

* ``.contiguous()`` (and ``reshape(...).contiguous()``) copies unless the view is contiguous
  (``TensorImpl::compute_contiguous``, ``c10/core/Contiguity.h``: sizes of 1 aside);
* ``reshape`` merging two dims returns a view when their strides chain, else clones
  (``computeStride`` in ``aten/src/ATen/TensorUtils.cpp``, the rule ``view`` checks):
  ``matmul`` folds a batch of 4-d operands so (``aten/src/ATen/native/LinearAlgebra.cpp``).

The sizes are integers here: these are layout facts of one configuration.
"""

from __future__ import annotations

from math import prod


def permuted(shape: tuple, order: tuple) -> tuple:
    """``shape`` permuted by ``order``, as ``x.permute(order).shape``."""
    return tuple(shape[i] for i in order)


def _view(shape: tuple, order: tuple) -> list[tuple[int, int]]:
    """(size, stride) of each dim of the contiguous ``shape`` permuted by ``order``, sizes of
    1 left out (their strides never matter)."""
    strides = [prod(shape[i + 1:]) for i in range(len(shape))]
    return [(shape[i], strides[i]) for i in order if shape[i] != 1]


def contiguous_after(shape: tuple, order: tuple) -> bool:
    """Whether a contiguous ``shape`` permuted by ``order`` is still contiguous, so that
    ``.contiguous()`` returns it."""
    kept = _view(shape, order)
    return all(stride == prod(size for size, _ in kept[j + 1:])
               for j, (_, stride) in enumerate(kept))


def merges(shape: tuple, order: tuple, dim: int) -> bool:
    """Whether ``reshape`` can merge dims ``dim`` and ``dim + 1`` of the contiguous ``shape``
    permuted by ``order`` into a view (their strides chain: ``stride[dim] == size[dim + 1] x
    stride[dim + 1]``, or either has size 1), rather than clone."""
    outer, inner = order[dim], order[dim + 1]
    if shape[outer] == 1 or shape[inner] == 1:
        return True
    strides = [prod(shape[i + 1:]) for i in range(len(shape))]
    return strides[outer] == shape[inner] * strides[inner]
