"""Events every implementation shares: the loss of the protocol, the softmax's backward."""

from __future__ import annotations

from memcalc.engine.program import Dims, Role, cublas, free, new
from memcalc.impls.reductions import reduced


def with_loss(d: Dims, backward: list) -> list:
    """Wrap backward events with what ``loss="sum"`` adds: ``out.sum()`` and the engine's
    seed grad, two 0-d tensors alive until ``backward()`` returns. Their grad reaches the
    first node as a stride-0 expand, with no copy on the meta device. (On CUDA, ``bmm``
    copies a stride-0 operand inside the kernel, ``prepare_batch_matrix_for_cublas`` in
    ``aten/src/ATen/native/cuda/Blas.cpp``: a transient the meta trace cannot see.)"""
    if d.loss != "sum":
        return backward
    out = (d.B, d.H, d.N, d.D)  # any layout: a dense tensor reduced whole is one run
    return [
        *reduced("loss", (), d.dtype, Role.temporary, d, out, tuple(range(4))),  # () out.sum()
        new("dloss", (), d.dtype, Role.temporary, "ones_like"),  # () seed grad of backward()
        *backward,
        free("loss", "dloss"),
    ]


def softmax_backward(name: str, shape: tuple, dtype: str) -> list:
    """``_softmax_backward_data`` as CUDA runs it (``aten/src/ATen/native/cuda/SoftMax.cu``,
    ``softmax_backward_cuda_out``): its structured output ``name``, then ``Tensor tmp = grad
    * output`` inside the kernel, freed as it returns, a second tensor of the scores' shape
    for the length of the op. The meta kernel makes the output only; the tracer adds the
    same temporary (``memcalc.tracing.tracer.CUDA_TEMPORARIES``). Read from the
    source; not yet checked on a GPU."""
    return [
        new(name, shape, dtype, Role.temporary, "_softmax_backward_data"),  # grad_input
        new(f"{name} tmp", shape, dtype, Role.temporary, "mul"),  # grad * output
        free(f"{name} tmp"),
    ]


def dout_copy(d: Dims, product: str, expanded: bool = True) -> list:
    """The cuBLAS call of a ``bmm`` taking ``dout``, after its result: under ``loss="sum"``
    ``dout`` is the stride-0 expand of the loss's grad (unless ``expanded`` is False: a
    cast made it anew), which ``baddbmm_out_cuda_impl`` clones contiguous before asking for
    its handle (``prepare_batch_matrix_for_cublas``, ``aten/src/ATen/native/cuda/Blas.cpp``)
    and frees as it returns; the tracer does the same (``tracer._bmm_copies``)."""
    if d.loss != "sum" or not expanded:
        return [cublas()]
    copy = f"dout copy for {product}"
    return [new(copy, (d.B * d.H, d.N, d.D), d.dtype, Role.temporary, "clone"),  # (B*H, N, D)
            cublas(), free(copy)]
