"""DeepSpeed-Ulysses as DeepSpeed runs it: the reference of ``--cp-method ulysses``
(``memcalc/impls/ulysses.py``).

``DistributedAttention`` (``deepspeed/sequence/layer.py``, DeepSpeed 0.19.8) around a local
attention, called as a batch-first caller does (``scatter_idx=2, gather_idx=1``,
``batch_dim_idx=0``) on this rank's ``(B, N / P, H, D)`` rows of q, k, v; the local attention
is the implementation's own reference (SDPA with its backend pinned) on ``.transpose(1, 2)``
views of the ``(B, N, H / P, D)`` tensors, its output transposed back. Runs in the process
group already set up (the tracer's fake one for rank r of P). DeepSpeed is an optional
dependency (the ``deepspeed`` extra); nothing here imports it until called.
"""

from __future__ import annotations

from typing import Callable


def distributed(local: Callable, heads_first: bool = True) -> Callable:
    """``DistributedAttention(local)`` over this process's group, as ``fn(q, k, v)`` on a
    rank's (B, N / P, H, D) rows; ``heads_first``: ``local`` takes (B, H, N, D) (SDPA's),
    else (B, N, H, D) (``flash_attn_func``'s)."""
    local = _transposed(local) if heads_first else local

    def attn(q, k, v):
        import torch.distributed as dist

        from memcalc.tracing.context_parallel import deepspeed_layer

        layer = deepspeed_layer().DistributedAttention(local, dist.group.WORLD, scatter_idx=2,
                                                       gather_idx=1)
        return layer(q, k, v, batch_dim_idx=0)
    return attn


def _transposed(local: Callable) -> Callable:
    """``local`` (which takes and returns (B, H, N, D)) on (B, N, H, D) tensors."""
    def attn(q, k, v):
        return local(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    return attn
