"""Reference code of the flash-attn packages (``memcalc/impls/flash_attn.py``,
``flash_attn3.py``): ``flash_attn_func`` on ``(B, N, H, d)`` tensors, as training code calls
it. Only the live CUDA backend runs these, where the package is installed
(``memcalc.validation.cases.fused_cases``); the import is inside, so that loading the
references needs no package.
"""

from __future__ import annotations

from memcalc.validation.reference import reference


@reference("flash-attn")
def flash_attn(q, k, v, causal=False, deterministic=False):
    """flash-attn 2.x ``flash_attn_func``."""
    from flash_attn import flash_attn_func

    return flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)


@reference("flash-attn3")
def flash_attn3(q, k, v, causal=False, deterministic=False):
    """FlashAttention-3 (Hopper) ``flash_attn_interface.flash_attn_func``."""
    from flash_attn_interface import flash_attn_func

    return flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)
