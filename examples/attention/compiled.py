"""A self-attention block that compiles its attention in its constructor, as code written
for speed does: ``memcalc trace`` follows the compiled call as inductor builds it for the
GPU, and with ``--compile eager`` traces the block uncompiled, saying so.

    memcalc trace examples/attention/compiled.py:CompiledAttention --input x=B,N,512 --heads 8
    memcalc trace examples/attention/compiled.py:CompiledAttention --input x=B,N,512 --heads 8 --compile eager
"""

import torch
import torch.nn.functional as F
from torch import nn


def attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class CompiledAttention(nn.Module):
    """x (B, N, 512) -> qkv projection, 8 heads of 64, causal SDPA (compiled), output
    projection."""

    def __init__(self, dim: int = 512, heads: int = 8):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.attention = torch.compile(attention)

    def forward(self, x):
        b, n, dim = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        return self.out(self.attention(q, k, v).transpose(1, 2).reshape(b, n, dim))
