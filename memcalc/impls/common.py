"""Events every implementation shares: the loss of the protocol, the softmax's backward,
``matmul``'s folds of q, k, v laid out ``(B, N, H, D)`` (``Dims.layout``)."""

from __future__ import annotations

from memcalc.engine.program import Dims, Role, cublas, free, new
from memcalc.engine.strides import contiguous_after, merges
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


# q, k, v laid out (B, N, H, D) as the code sees them after .transpose(1, 2); k^T's, its
# last two dims transposed once more
TRANSPOSED, K_TRANSPOSED = (0, 2, 1, 3), (0, 2, 3, 1)


def folds(d: Dims, operand: str) -> bool:
    """Whether ``matmul`` folds ``operand``'s batch and heads into one dim as a view:
    ``q``, ``k``, ``v`` (or a tensor of the same layout: ``q * scale``, the output's grad),
    ``k^T`` or ``v^T``, in ``d.layout``. Else ``reshape`` clones it (``_matmul_impl``,
    ``aten/src/ATen/native/LinearAlgebra.cpp``; ``memcalc.engine.strides.merges``). Grouped
    heads repeated (``repeat_interleave``: a clone of an expand) are contiguous."""
    if d.layout == "BHND" or (operand[0] != "q" and d.Hk != d.H):
        return True
    rows, heads = (d.N, d.H) if operand[0] == "q" else (d.M, d.Hk)
    order = K_TRANSPOSED if operand.endswith("^T") else TRANSPOSED
    return merges((d.B, rows, heads, d.D), order, 0)


def fold(d: Dims, operand: str, name: str, shape: tuple, dtype: str,
         role: Role = Role.saved) -> list:
    """``matmul``'s fold of ``name`` (``operand``'s layout) to ``(B*H, ...)``: nothing, or a
    clone of ``shape``, which ``BmmBackward0`` saves in its place (``role``: a temporary
    where nothing records the matmul)."""
    return [] if folds(d, operand) else [new(f"{name} fold", shape, dtype, role, "clone")]


def freed(folded: list) -> list:
    """The free of a fold's clone after its bmm: saved, or (under ``no_grad``, in a custom
    Function) gone there."""
    return [free(*(t.name for t in folded))] if folded else []


def transposed_results(d: Dims, k_grad_transposed: bool) -> tuple[str, ...]:
    """Of the output and q's, k's, v's grads (``out``, ``dq``, ``dk``, ``dv``), made
    ``(B, H, rows, D)``-contiguous (k's ``(B, H, D, M)`` where ``k_grad_transposed``: the
    grad of ``k^T``), those not contiguous seen ``(B, rows, H, D)`` through
    ``.transpose(1, 2)``, as a caller laid out so reads them."""
    heads_first = {"out": (d.B, d.H, d.N, d.D), "dq": (d.B, d.H, d.N, d.D),
                   "dk": (d.B, d.Hk, d.M, d.D), "dv": (d.B, d.Hk, d.M, d.D)}
    seen = {x: contiguous_after(shape, TRANSPOSED) for x, shape in heads_first.items()}
    if k_grad_transposed:
        seen["dk"] = contiguous_after((d.B, d.Hk, d.D, d.M), (0, 3, 1, 2))
    return tuple(x for x, contiguous in seen.items() if not contiguous)
