"""DeepSpeed-Ulysses with flash-attn's ``flash_attn_func`` as the local attention (as
Megatron-DeepSpeed pairs them), for ``memcalc trace --cp P --cp-method ulysses``: each rank's
(B, N / P, H, D) rows go through DeepSpeed's ``DistributedAttention`` into
``flash_attn_func`` on (B, N, H / P, D) tensors, as they come:

    memcalc trace examples/attention/ulysses_flash_attn.py:attn --input q=B,N,H,D \\
        --input k=B,N,H,D --input v=B,N,H,D --cp 4 --cp-method ulysses \\
        --seq 131072 --heads 32 --head-dim 128 --dtype bf16 --batch 1

Compare ``memcalc breakdown --impl flash-attn --cp P --cp-method ulysses``. In a trace,
``flash_attn`` is memcalc's stand-in for the package; on a GPU it is flash-attn 2.x.
"""

import torch.distributed as dist
from deepspeed.sequence.layer import DistributedAttention
from flash_attn import flash_attn_func


def attn(q, k, v):
    """One rank's step on its rows of q, k, v (B, N / P, H, D), batch first, causal."""
    layer = DistributedAttention(flash_attn_func, dist.group.WORLD, scatter_idx=2,
                                 gather_idx=1)
    return layer(q, k, v, batch_dim_idx=0, causal=True)
