"""nanoGPT's ``CausalSelfAttention`` as karpathy/nanoGPT's ``model.py`` writes it: ``forward(x)``
takes the hidden states ``(B, T, C)``; the fused ``c_attn`` projection makes q, k and v; the
flash path is ``F.scaled_dot_product_attention(is_causal=True)``; the slow path (PyTorch < 2.0)
keeps a causal ``bias`` buffer and runs ``masked_fill``, softmax and dropout by hand.

    memcalc trace examples/attention/nanogpt.py:CausalSelfAttention --input x=B,N,768 --seq 1024 --batch 8
    memcalc trace examples/attention/nanogpt.py:CausalSelfAttention --input x=B,N,768 --seq 1024 --batch 8 --autocast bf16 --gpu a100-40gb
    memcalc trace examples/attention/nanogpt.py:MixedPrecision --input x=B,N,768 --seq 1024 --batch 8 --gpu a100-40gb
    memcalc trace examples/attention/nanogpt.py:SlowCausalSelfAttention --input x=B,N,768 --seq 1024 --batch 8
    memcalc oom --trace examples/attention/nanogpt.py:SlowCausalSelfAttention --input x=B,N,768 --batch 8 --gpu-gb 24

The configuration is GPT-2 small's (``GPTConfig`` in nanoGPT: 12 heads of 64, 1024 positions).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    block_size: int = 1024
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):

    flash = True  # nanoGPT: hasattr(torch.nn.functional, 'scaled_dot_product_attention')

    def __init__(self, config=GPTConfig()):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # key, query, value projections for all heads, but in a batch
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        # output projection
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # regularization
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        if not self.flash:
            # causal mask to ensure that attention is only applied to the left in the input sequence
            self.register_buffer("bias", torch.tril(torch.ones(config.block_size, config.block_size))
                                        .view(1, 1, config.block_size, config.block_size))

    def forward(self, x):
        B, T, C = x.size() # batch size, sequence length, embedding dimensionality (n_embd)

        # calculate query, key, values for all heads in batch and move head forward to be the batch dim
        q, k, v  = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) # (B, nh, T, hs)

        # causal self-attention; Self-attend: (B, nh, T, hs) x (B, nh, hs, T) -> (B, nh, T, T)
        if self.flash:
            # efficient attention using Flash Attention CUDA kernels
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True)
        else:
            # manual implementation of attention
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:,:,:T,:T] == 0, float('-inf'))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v # (B, nh, T, T) x (B, nh, T, hs) -> (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C) # re-assemble all head outputs side by side

        # output projection
        y = self.resid_dropout(self.c_proj(y))
        return y


class SlowCausalSelfAttention(CausalSelfAttention):
    """nanoGPT's path without flash attention (PyTorch < 2.0), with a causal mask for up
    to 16,384 positions (so that memcalc oom can look past GPT-2's 1,024)."""

    flash = False

    def __init__(self):
        super().__init__(GPTConfig(block_size=16384))


class MixedPrecision(CausalSelfAttention):
    """The same attention with autocast written in its forward, as nanoGPT's training loop
    wraps the model (``ctx = torch.amp.autocast(device_type, dtype=ptdtype)``)."""

    def forward(self, x):
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            return super().forward(x)
