"""Branches written once for one integer or a whole grid of them.

A kernel's launch configuration (``memcalc.impls.reductions``) is a chain of decisions on
sizes. Written with these helpers instead of ``if``, ``min`` and ``max``, the same function
computes it for one configuration (Python ints and bools: the scalar replay) and for a
million (numpy arrays of int64 or of Python ints: the grid path), so there is one model of
the launch, not one per path. numpy is imported only when an array is seen: the CLI's
scalar path does not load it.
"""

from __future__ import annotations


def where(cond, a, b):
    """``a if cond else b``; element by element where ``cond`` is an array (both sides are
    then computed: each must be defined, if not meaningful, where it is not chosen)."""
    if _one(cond):
        return a if cond else b
    import numpy as np

    return np.where(cond, a, b)


def minimum(a, b):
    """``min(a, b)``, element by element over arrays."""
    return where(b < a, b, a)


def maximum(a, b):
    """``max(a, b)``, element by element over arrays."""
    return where(b > a, b, a)


def negate(cond):
    """``not cond``, element by element over a boolean array (``~`` on a bool is -2)."""
    return (not cond) if _one(cond) else ~cond


def every(cond) -> bool:
    """Whether ``cond`` holds for one configuration, or for every one of a grid."""
    return bool(cond) if _one(cond) else bool(cond.all())


def div_up(a, b):
    """``ceil(a / b)`` for positive integers (``at::ceil_div``)."""
    return -(-a // b)


def _one(value) -> bool:
    """A single value (a Python or numpy scalar), not an array."""
    return getattr(value, "ndim", 0) == 0
