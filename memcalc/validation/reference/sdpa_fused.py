"""Reference code of the fused SDPA backends (``memcalc/impls/sdpa_flash.py``,
``sdpa_efficient.py``, ``sdpa_cudnn.py``): what a user writes, pinned to one backend.

Only the live CUDA backend runs these (the kernels have no meta implementation that
allocates what they do; the models are source-derived, ``traced=False``). The backward
needs no context manager: the backend is fixed when the forward records its node.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from memcalc.validation.reference import reference
from memcalc.validation.reference.sdpa_math import gqa


def _sdpa(backend: SDPBackend, q, k, v, causal: bool):
    """``F.scaled_dot_product_attention`` with only ``backend`` allowed (an error, not a
    silent fallback, when the inputs do not fit it)."""
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa(q, k))


@reference("sdpa-flash")
def sdpa_flash(q, k, v, causal=False):
    """The FlashAttention-2 backend (fp16/bf16; grouped-query heads allowed)."""
    return _sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, causal)


@reference("sdpa-efficient")
def sdpa_efficient(q, k, v, causal=False):
    """The memory-efficient (CUTLASS) backend."""
    return _sdpa(SDPBackend.EFFICIENT_ATTENTION, q, k, v, causal)


@reference("sdpa-cudnn")
def sdpa_cudnn(q, k, v, causal=False):
    """The cuDNN backend (Hopper and newer)."""
    return _sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, causal)


__all__ = ["sdpa_cudnn", "sdpa_efficient", "sdpa_flash", "torch"]
