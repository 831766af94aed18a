"""HF-llama-style eager attention (after transformers' ``eager_attention_forward``),
written for ``memcalc trace``: scores in the input dtype, ``softmax(dtype=torch.float32)``
cast back, attention dropout in training, output returned as ``(B, N, H, d)``.

    memcalc trace examples/attention/hf_llama.py:attn --heads 32 --head-dim 128 --seq 4096 --batch 1 --dtype fp16 --causal
"""

import torch
import torch.nn as nn

ATTENTION_DROPOUT = 0.1


def attn(query, key, value, causal=False):
    """``eager_attention_forward`` with a causal additive mask built here when asked."""
    scaling = query.shape[-1] ** -0.5
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if causal:
        n, m = query.shape[-2], key.shape[-2]
        mask = torch.full((n, m), torch.finfo(query.dtype).min, dtype=query.dtype,
                          device=query.device).triu(1)
        attn_weights = attn_weights + mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=ATTENTION_DROPOUT, training=True)
    attn_output = torch.matmul(attn_weights, value)
    return attn_output.transpose(1, 2).contiguous()  # (B, N, H, d)
