"""A GPT-2 block (pre-norm attention and MLP, 768 wide, 12 heads), to trace eagerly or
compiled whole as ``torch.compile(model)`` does:

    memcalc trace examples/attention/gpt_block.py:Block --input x=B,N,768 --compile
    memcalc trace examples/attention/gpt_block.py:Block --input x=B,N,768
"""

import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """x (B, N, 768) -> x + attention(ln_1(x)) -> x + mlp(ln_2(x))."""

    def __init__(self, dim: int = 768, heads: int = 12):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.c_fc, self.mlp_proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, n, dim = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2)
                   for t in self.c_attn(self.ln_1(x)).split(dim, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, n, dim))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))
