"""Foreach kernels whose CUDA implementation allocates more than their meta kernel:
``_foreach_norm``, the per-tensor norms ``clip_grad_norm_`` sums into the total norm
(``torch/nn/utils/clip_grad.py``, ``_get_total_norm``).

``foreach_tensor_norm_cuda`` (``aten/src/ATen/native/cuda/ForeachReduceOp.cu``) takes the
fast route when every tensor is dense, of one floating dtype, and the norm is the 1-, 2- or
infinity-norm: it zero-fills a buffer of partial norms in the accumulation type, one per
chunk of 65,536 elements of the longest tensor for every tensor (``output_per_tensor``),
then makes each tensor's 0-d norm (``vec_res``; the meta kernel makes those alone), and an
empty tensor's norm as a 0-d zero after the kernels; the buffer, and the norms no tensor
took, die as it returns. Otherwise it runs ``foreach_tensor_norm_slow``: one
``linalg_vector_norm`` per tensor, traced as it runs.
"""

from __future__ import annotations

from math import inf

import torch

from memcalc.engine.program import Role

CHUNK = 65536  # kChunkSize, aten/src/ATen/native/cuda/MultiTensorApply.cuh


def fast_route(tensors, p: float) -> bool:
    """``can_use_fast_route`` and ``use_slowpath`` of ForeachReduceOp.cu: one floating
    dtype, every tensor dense, a 1-, 2- or infinity-norm."""
    from memcalc.tracing.tracer import dense

    dtypes = {t.dtype for t in tensors}
    return (len(dtypes) == 1 and next(iter(dtypes)).is_floating_point
            and all(dense(t) for t in tensors) and p in (1.0, 2.0, inf))


def foreach_norm(paths, tensors, ord=2, dtype=None) -> list:
    """``_foreach_norm`` as ``foreach_tensor_norm_cuda`` runs it (the module docstring)."""
    p = float(ord)
    tracer = paths.tracer
    with tracer:
        if not tensors or not fast_route(tensors, p):  # foreach_tensor_norm_slow
            return [torch.linalg.vector_norm(t, ord, dtype=dtype) for t in tensors]
        out = dtype or tensors[0].dtype
        opmath = torch.float64 if out == torch.float64 else torch.float32  # toOpMathType
        chunks = max(-(-t.numel() // CHUNK) for t in tensors)
        with tracer.naming("_foreach_norm partial norms", Role.temporary, "_foreach_norm"):
            partial = torch.zeros(len(tensors) * chunks, dtype=opmath, device="meta")
        with tracer.naming("_foreach_norm", Role.temporary, "_foreach_norm"):
            made = [torch.empty((), dtype=out, device="meta") for _ in tensors]
            taken = iter(made)
            norms = [next(taken) if t.numel() else torch.zeros((), dtype=out, device="meta")
                     for t in tensors]
        del partial, made, taken
        tracer.collect_frees()
    return norms


# what the tracer runs for each op on the GPU's code paths, in place of its meta kernel
OPS = {torch.ops.aten._foreach_norm.Scalar: foreach_norm}
