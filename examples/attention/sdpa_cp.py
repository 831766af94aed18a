"""Attention as a model calls it, for ``memcalc trace --cp P``: under context parallelism
each rank calls ``scaled_dot_product_attention`` on its own rows (two chunks of N / 2P),
and PyTorch's ring attention (``torch.distributed.tensor.experimental.context_parallel``)
runs it across the ranks:

    memcalc trace examples/attention/sdpa_cp.py:attn --causal --cp 4 --seq 131072 \\
        --heads 32 --head-dim 128 --dtype bf16 --batch 1

The flash backend is pinned, to compare with ``memcalc breakdown --impl sdpa-flash --cp P``;
unpinned, torch 2.13 takes cuDNN on an H100 (``--impl sdpa-cudnn``).
"""

import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def attn(q, k, v, causal=True):
    """One rank's attention over its shard of q, k, v (B, H, N / P, D)."""
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
