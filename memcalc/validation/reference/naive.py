"""Reference code of the naive family (``memcalc/impls/naive.py``).

Causal masks are built inside the step, as a user would: ``torch.ones(N, M, bool)``,
then ``triu(diagonal=1)``, then ``masked_fill(mask, -inf)`` on the scores.
"""

from __future__ import annotations

import math

import torch

from memcalc.validation.reference import reference


def causal_mask(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``(N, Nk)`` bool, True above the diagonal: the positions a query may not see."""
    ones = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device)
    return torch.triu(ones, diagonal=1)


def scores(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    """``q @ k^T / sqrt(d)``, masked when causal."""
    s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    if causal:
        s = s.masked_fill(causal_mask(q, k), float("-inf"))
    return s


@reference("naive")
def naive(q, k, v, causal=False):
    """Custom softmax that keeps ``exp_x`` (the seeds' benchmark code)."""
    s = scores(q, k, causal)
    m = s.max(dim=-1, keepdim=True).values
    e = torch.exp(s - m)
    p = e / e.sum(dim=-1, keepdim=True)
    return torch.matmul(p, v)


@reference("naive-softmax")
def naive_softmax(q, k, v, causal=False):
    """The same attention with ``torch.softmax``."""
    s = scores(q, k, causal)
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, v)


class _WeightsOnly(torch.autograd.Function):
    """Attention that saves only the softmax weights ``p`` (and q, k, v) for backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal):
        p = torch.softmax(scores(q, k, causal), dim=-1)
        ctx.save_for_backward(q, k, v, p)
        return torch.matmul(p, v)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, p = ctx.saved_tensors
        dv = torch.matmul(p.transpose(-2, -1), dout)
        dp = torch.matmul(dout, v.transpose(-2, -1))
        ds = torch._softmax_backward_data(dp, p, -1, p.dtype) / math.sqrt(q.size(-1))
        del dp
        dq = torch.matmul(ds, k)
        dk = torch.matmul(ds.transpose(-2, -1), q)
        return dq, dk, dv, None


@reference("naive-weights")
def naive_weights(q, k, v, causal=False):
    """A custom autograd Function that saves only the softmax weights."""
    return _WeightsOnly.apply(q, k, v, causal)
