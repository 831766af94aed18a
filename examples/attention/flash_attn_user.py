"""Attention through the flash-attn package, as training code calls it: q, k, v in
(batch, seqlen, heads, head_dim). On a machine without CUDA (or without flash-attn),
``memcalc trace`` runs it with its model of the package:

    memcalc trace examples/attention/flash_attn_user.py:attn \\
        --input q=B,N,H,D --input k=B,M,K,D --input v=B,M,K,D --causal --dtype bf16
"""

from flash_attn import flash_attn_func
from flash_attn_interface import flash_attn_func as flash_attn3_func


def attn(q, k, v, causal=False):
    """FlashAttention-2 (the flash-attn package)."""
    return flash_attn_func(q, k, v, causal=causal)


def attn3(q, k, v, causal=False):
    """FlashAttention-3 on Hopper."""
    return flash_attn3_func(q, k, v, causal=causal)
