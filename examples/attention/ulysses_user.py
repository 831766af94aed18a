"""DeepSpeed-Ulysses as a model calls it, for ``memcalc trace --cp P --cp-method ulysses``:
each rank holds its N / P rows of q, k, v as (B, N / P, H, D), and DeepSpeed's
``DistributedAttention`` trades them for every row of H / P heads around the attention
(``deepspeed/sequence/layer.py``; ``pip install 'memcalc[deepspeed]'``):

    memcalc trace examples/attention/ulysses_user.py:attn --input q=B,N,H,D \\
        --input k=B,N,H,D --input v=B,N,H,D --cp 4 --cp-method ulysses \\
        --seq 131072 --heads 32 --head-dim 128 --dtype bf16 --batch 1

The trace gives DeepSpeed a fake process group in which it is each rank in turn. The flash
backend is pinned, to compare with ``memcalc breakdown --impl sdpa-flash --cp P
--cp-method ulysses``.
"""

import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.sequence.layer import DistributedAttention
from torch.nn.attention import SDPBackend, sdpa_kernel


def local_attention(q, k, v, causal=True):
    """Attention over every row of this rank's heads: (B, N, h, D) in and out (fewer
    key/value heads: grouped-query attention)."""
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=causal,
                                             enable_gqa=k.shape[2] != q.shape[2])
    return out.transpose(1, 2)


def attn(q, k, v):
    """One rank's step on its rows of q, k, v (B, N / P, H, D), batch first."""
    layer = DistributedAttention(local_attention, dist.group.WORLD, scatter_idx=2,
                                 gather_idx=1)
    return layer(q, k, v, batch_dim_idx=0)

