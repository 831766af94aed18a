"""Four ways to write custom-softmax attention that a person would call "the same code".

Trace them side by side: ``python examples/custom_softmax/compare.py``, or one at a time:
``memcalc trace examples/custom_softmax/variants.py:divide --seq 16384``.
"""

import math

import torch


def divide(q, k, v):
    """The hand counts' version: divide by the row sum; ``max`` saves int64 indices."""
    s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    e = torch.exp(s - s.max(dim=-1, keepdim=True).values)
    return (e / e.sum(dim=-1, keepdim=True)) @ v


def reciprocal(q, k, v):
    """Multiply by the reciprocal of the row sum instead of dividing."""
    s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    e = torch.exp(s - s.max(dim=-1, keepdim=True).values)
    return (e * e.sum(dim=-1, keepdim=True).reciprocal()) @ v


def detached_max(q, k, v):
    """Detach the row max (it does not change the softmax): no argmax saved, no scatter."""
    s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    e = torch.exp(s - s.amax(dim=-1, keepdim=True).detach())
    return (e / e.sum(dim=-1, keepdim=True)) @ v


def in_place(q, k, v):
    """In-place ops where autograd allows them: ``exp_`` and ``div_`` on fresh tensors."""
    s = q @ k.transpose(-2, -1)
    s.div_(math.sqrt(q.size(-1)))
    s = (s - s.amax(dim=-1, keepdim=True).detach()).exp_()
    return (s / s.sum(dim=-1, keepdim=True)) @ v
