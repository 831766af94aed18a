"""nanoGPT-style causal self-attention (after karpathy/nanoGPT's ``CausalSelfAttention``),
written for ``memcalc trace``: ``forward(q, k, v)`` takes the heads already split, so that
the protocol's ``(B, H, N, d)`` inputs go in; the rest is nanoGPT's code: the causal
``bias`` buffer made in ``__init__``, the flash path through
``F.scaled_dot_product_attention(is_causal=True)``, the slow path with ``masked_fill``,
softmax and attention dropout, the output projection ``c_proj``.

    memcalc trace examples/attention/nanogpt.py:CausalSelfAttention --heads 12 --head-dim 64 --seq 1024 --dtype bf16 --gpu a100-40gb
    memcalc trace examples/attention/nanogpt.py:SlowCausalSelfAttention --heads 12 --head-dim 64 --seq 1024 --dtype bf16
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

N_EMBD, N_HEAD, BLOCK_SIZE, DROPOUT = 768, 12, 1024, 0.0
DTYPE = torch.bfloat16  # the parameters' dtype (nanoGPT casts the model or uses autocast)


class CausalSelfAttention(nn.Module):
    """The attention and output projection of a nanoGPT block (heads already split)."""

    flash = True

    def __init__(self):
        super().__init__()
        self.c_proj = nn.Linear(N_EMBD, N_EMBD, bias=False, dtype=DTYPE)
        self.attn_dropout = nn.Dropout(DROPOUT)
        self.resid_dropout = nn.Dropout(DROPOUT)
        self.dropout = DROPOUT
        # causal mask, made at construction (nanoGPT keeps it even when flash is used)
        self.register_buffer("bias", torch.tril(torch.ones(BLOCK_SIZE, BLOCK_SIZE))
                             .view(1, 1, BLOCK_SIZE, BLOCK_SIZE))

    def forward(self, q, k, v):
        B, nh, T, hs = q.size()
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, nh * hs)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class SlowCausalSelfAttention(CausalSelfAttention):
    """nanoGPT's path without flash attention (PyTorch < 2.0)."""

    flash = False
