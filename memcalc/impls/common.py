"""Events every implementation shares: the loss of the protocol."""

from __future__ import annotations

from memcalc.tensors import Dims, Role, free, new


def with_loss(d: Dims, backward: list) -> list:
    """Wrap backward events with what ``loss="sum"`` adds: ``out.sum()`` and the engine's
    seed grad, two 0-d tensors alive until ``backward()`` returns. Their grad reaches the
    first node as a stride-0 expand, with no copy on the meta device. (On CUDA, ``bmm``
    copies a stride-0 operand inside the kernel, ``prepare_batch_matrix_for_cublas`` in
    ``aten/src/ATen/native/cuda/Blas.cpp``: a transient the meta trace cannot see.)"""
    if d.loss != "sum":
        return backward
    return [
        new("loss", (), d.dtype, Role.temporary, "sum"),  # () out.sum()
        new("dloss", (), d.dtype, Role.temporary, "ones_like"),  # () seed grad of backward()
        *backward,
        free("loss", "dloss"),
    ]
