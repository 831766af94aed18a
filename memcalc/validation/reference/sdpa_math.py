"""Reference code of ``sdpa-math`` (``memcalc/impls/sdpa_math.py``).

``scaled_dot_product_attention`` forced onto the math backend, as a user would force it.
On the meta device (and on CPU) sdpa always takes the math path
(``_fused_sdp_choice_meta`` in ``aten/src/ATen/native/transformers/attention.cpp``), so
the trace is of the same composite ``_scaled_dot_product_attention_math`` a CUDA device
runs under ``SDPBackend.MATH``.
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from memcalc.validation.reference import reference


@reference("sdpa-math")
def sdpa_math(q, k, v, causal=False):
    """``F.scaled_dot_product_attention`` on the math backend; GQA when k, v have fewer
    heads than q."""
    with sdpa_kernel(SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal, **gqa(q, k))


def gqa(q, k) -> dict:
    """``enable_gqa=True`` when k, v have fewer heads than q; nothing otherwise, so that
    torch 2.4 (whose sdpa has no ``enable_gqa``) runs every other configuration."""
    return {"enable_gqa": True} if k.size(1) != q.size(1) else {}
