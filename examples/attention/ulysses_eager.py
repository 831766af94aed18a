"""DeepSpeed-Ulysses around attention written out (scores, causal mask, softmax), for
``memcalc trace --cp P --cp-method ulysses``, traced as written. ``breakdown --impl
naive-softmax --cp-method ulysses`` models the same ops as memcalc's reference writes them
(``memcalc/validation/reference/naive.py``), which rebinds the scores to their masked copy;
this function keeps the unmasked ``scores`` in a variable to its return, one (B, H / P, N,
N) tensor more at its forward peak:

    memcalc trace examples/attention/ulysses_eager.py:attn --input q=B,N,H,D \\
        --input k=B,N,H,D --input v=B,N,H,D --cp 4 --cp-method ulysses \\
        --seq 8192 --heads 32 --head-dim 128 --dtype bf16 --batch 1
"""

import math

import torch
import torch.distributed as dist
from deepspeed.sequence.layer import DistributedAttention


def eager(q, k, v):
    """Causal attention over every row of this rank's heads: (B, N, h, D) in and out."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    n = scores.shape[-1]
    above = torch.ones(n, n, dtype=torch.bool, device=scores.device).triu(1)
    return (scores.masked_fill(above, float("-inf")).softmax(-1) @ v).transpose(1, 2)


def attn(q, k, v):
    """One rank's step on its rows of q, k, v (B, N / P, H, D), batch first."""
    layer = DistributedAttention(eager, dist.group.WORLD, scatter_idx=2, gather_idx=1)
    return layer(q, k, v, batch_dim_idx=0)
