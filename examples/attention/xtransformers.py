"""x-transformers-style attention (after lucidrains/x-transformers' ``Attend``), written
for ``memcalc trace``: einsum scores, causal ``masked_fill`` with the dtype's most negative
value, softmax in float32 cast back, attention dropout, einsum with the values.

    memcalc trace examples/attention/xtransformers.py:Attend --heads 8 --head-dim 64 --seq 2048 --dtype fp16 --causal
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attend(nn.Module):
    """Scaled dot-product attention with softmax in float32 and attention dropout."""

    def __init__(self, dropout=0.1):
        super().__init__()
        self.attn_dropout = nn.Dropout(dropout)

    def forward(self, q, k, v, causal=False):
        scale = q.shape[-1] ** -0.5
        dots = torch.einsum("b h i d, b h j d -> b h i j", q, k) * scale
        if causal:
            i, j = dots.shape[-2:]
            causal_mask = torch.ones((i, j), dtype=torch.bool, device=dots.device).triu(j - i + 1)
            dots = dots.masked_fill(causal_mask, -torch.finfo(dots.dtype).max)
        attn = F.softmax(dots, dim=-1, dtype=torch.float32).type(dots.dtype)
        attn = self.attn_dropout(attn)
        return torch.einsum("b h i j, b h j d -> b h i d", attn, v)
