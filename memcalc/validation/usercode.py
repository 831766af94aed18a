"""Attention as users write it, for live runs where CUDA's code paths differ from the meta
device's: sdpa with the backend torch picks, sdpa pinned to cuDNN, fused training dropout
and a float32 softmax of half-precision scores. Their model is ``memcalc trace`` (the
tracer); the live run records what the GPU does whether or not the tracer follows it yet.

Each function is registered as implementation ``trace:<name>`` (``register``) so that a
``Config`` can name it; torch is imported only when a function runs.
"""

from __future__ import annotations

import math


def sdpa_default(q, k, v, causal=False):
    """nanoGPT's call: ``F.scaled_dot_product_attention`` on the backend torch picks for the
    device (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``); meta takes math."""
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def sdpa_cudnn(q, k, v, causal=False):
    """sdpa pinned to cuDNN attention, which sizes a workspace inside cuDNN at run time
    (``aten/src/ATen/native/cudnn/MHA.cpp``); the live run records it per shape."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, "CUDNN_ATTENTION", None)
    if backend is None:
        raise RuntimeError("this torch has no SDPBackend.CUDNN_ATTENTION")
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def dropout_attention(q, k, v, causal=False):
    """Eager attention with training dropout (HF's eager path): on CUDA ``native_dropout``
    is one kernel that saves a bool mask (``aten/src/ATen/native/cuda/Dropout.cu``)."""
    import torch
    import torch.nn.functional as F

    s = _scores(q, k, causal)
    p = F.dropout(torch.softmax(s, dim=-1), p=0.1, training=True)
    return p @ v


def float_softmax(q, k, v, causal=False):
    """HF llama's eager softmax: float32 softmax of fp16 scores, cast back; on CUDA one
    kernel with ``half_to_float`` (``aten/src/ATen/native/SoftMax.cpp``), on meta a float32
    copy first."""
    import torch

    s = _scores(q, k, causal)
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return p @ v


def _scores(q, k, causal: bool):
    """``q k^T / sqrt(d)``, the later keys masked to -inf when causal (eager code's mask:
    a bool ``(N, M)`` upper triangle and ``masked_fill``)."""
    import torch

    s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1),
                          float("-inf"))
    return s


USER_CODE = {"sdpa-default": sdpa_default, "sdpa-cudnn": sdpa_cudnn,
             "dropout": dropout_attention, "float-softmax": float_softmax}


def register() -> dict[str, str]:
    """Register each function as ``trace:<name>`` (once); its implementation name by key."""
    from memcalc.impls import impl_names
    from memcalc.tracing import register_function

    known = set(impl_names())
    return {key: (f"trace:{key}" if f"trace:{key}" in known else register_function(fn, key))
            for key, fn in USER_CODE.items()}
