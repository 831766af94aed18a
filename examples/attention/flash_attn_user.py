"""Attention through the flash-attn package, as training code calls it: q, k, v in
(batch, seqlen, heads, head_dim). On a machine without CUDA (or without flash-attn),
``memcalc trace`` runs it with its model of the package:

    memcalc trace examples/attention/flash_attn_user.py:attn \\
        --input q=B,N,H,D --input k=B,M,K,D --input v=B,M,K,D --causal --dtype bf16

and the packed calls with ``--input qkv=B,N,3,H,D`` (``attn_qkvpacked``) or
``--input q=B,N,H,D --input kv=B,M,2,K,D`` (``attn_kvpacked``). ``attn_varlen`` packs the B
sequences of N rows into one (B N, H, D) batch, as ``flash_attn_varlen_func`` takes them:
``--input q=B*N,H,D --input k=B*M,K,D --input v=B*M,K,D``.
"""

import torch
from flash_attn import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                        flash_attn_varlen_func)
from flash_attn_interface import flash_attn_func as flash_attn3_func


def attn(q, k, v, causal=False):
    """FlashAttention-2 (the flash-attn package)."""
    return flash_attn_func(q, k, v, causal=causal)


def attn3(q, k, v, causal=False):
    """FlashAttention-3 on Hopper."""
    return flash_attn3_func(q, k, v, causal=causal)


def attn_qkvpacked(qkv, causal=False):
    """FlashAttention-2 on one packed (batch, seqlen, 3, heads, head_dim) projection."""
    return flash_attn_qkvpacked_func(qkv, causal=causal)


def attn_kvpacked(q, kv, causal=False):
    """FlashAttention-2 on q and a packed (batch, seqlen, 2, kv_heads, head_dim) kv."""
    return flash_attn_kvpacked_func(q, kv, causal=causal)


def attn_varlen(q, k, v, causal=False, sequences=4):
    """FlashAttention-2 on ``sequences`` sequences of equal length packed into q (total_q,
    heads, head_dim) and k, v (total_k, kv_heads, head_dim), with their int32 offsets."""
    n, m = q.shape[0] // sequences, k.shape[0] // sequences
    cu_q = torch.arange(0, q.shape[0] + 1, n, dtype=torch.int32, device=q.device)
    cu_k = torch.arange(0, k.shape[0] + 1, m, dtype=torch.int32, device=k.device)
    return flash_attn_varlen_func(q, k, v, cu_q, cu_k, n, m, causal=causal)
