"""A small language model built from ``torch.nn``'s own attention modules, as many first
models are: token embeddings, ``n_layer`` blocks around ``nn.MultiheadAttention`` (causal
mask, ``need_weights=False``) or ``nn.TransformerEncoderLayer``, the head and the
cross-entropy loss; ``forward(idx, targets)`` returns the loss.

    memcalc trace examples/torch_nn/mha_lm.py:MhaLM --input idx=B,N:int64 --input targets=B,N:int64 --seq 1024 --batch 4 --optimizer adamw
    memcalc trace examples/torch_nn/mha_lm.py:MhaLM --input idx=B,N:int64 --input targets=B,N:int64 --seq 1024 --batch 4 --optimizer adamw --autocast bf16
    memcalc trace examples/torch_nn/mha_lm.py:EncoderLM --input idx=B,N:int64 --input targets=B,N:int64 --seq 1024 --batch 4 --optimizer adamw
    memcalc oom --trace examples/torch_nn/mha_lm.py:MhaLM --input idx=B,N:int64 --input targets=B,N:int64 --batch 4 --optimizer adamw --gpu-gb 16

``MhaLM``: two blocks of width 256 and 4 heads, ``batch_first=True``; ``EncoderLM``: two
``nn.TransformerEncoderLayer`` (pre-norm, GELU, ``batch_first=True``) with a causal mask.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, WIDTH, HEADS, LAYERS = 8192, 256, 4, 2


class Block(nn.Module):
    """Pre-norm block: ``nn.MultiheadAttention`` with a causal mask, then an MLP."""

    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.ln_2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(),
                                 nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x, mask):
        h = self.ln_1(x)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False, is_causal=True)
        x = x + a
        return x + self.mlp(self.ln_2(x))


class MhaLM(nn.Module):
    """Embeddings, ``LAYERS`` blocks of ``nn.MultiheadAttention``, the head, the loss."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx, targets):
        n = idx.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=idx.device)
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x, mask)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


class EncoderLM(nn.Module):
    """Embeddings, ``nn.TransformerEncoder`` of ``LAYERS`` pre-norm layers with a causal
    mask, the head, the loss."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0,
                                           activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx, targets):
        n = idx.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=idx.device)
        x = self.encoder(self.wte(idx), mask=mask, is_causal=True)
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
