"""Plain ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``, as nanoGPT and most
modern code call it: ``memcalc trace`` picks the backend the GPU would pick.

    memcalc trace examples/attention/sdpa.py:attn --batch 4 --heads 32 --seq 8192 --head-dim 128 --dtype bf16 --gpu a100-40gb
"""

import torch.nn.functional as F


def attn(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
