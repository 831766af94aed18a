"""Linear forms over the grid's atoms, and the guards that select a recorded path.

A ``Form`` is ``const + sum(coef * atom)`` with its value for the configuration being
replayed; atom ``2 * i`` is the rounded block of the group's size ``i``, atom ``2 * i + 1``
its 2 MiB-rounded segment. The allocator's decisions over forms are guards ``form >= 0``;
the size classes decide the guards on one size alone, so ``_simplify`` drops those.
"""

from __future__ import annotations

from operator import index

import numpy as np

from memcalc.engine.allocator import (MIN_BLOCK, MIN_LARGE_ALLOC, ROUND_LARGE, SMALL_SIZE, round_segment)

class Form:
    """``const + sum(coef * atom)`` over atom ids, with its value for the configuration
    being replayed. Atom ``2 * i`` is the rounded block size of the group's size ``i``,
    atom ``2 * i + 1`` its segment size (rounded up to 2 MiB)."""

    __slots__ = ("terms", "const", "value")

    def __init__(self, terms: dict, const: int, value: int):
        self.terms, self.const, self.value = terms, const, value

    def __add__(self, other) -> "Form":
        # a constant may be any exact integer (numpy's too); operator.index refuses a float
        return _combine(self, other, 1) if isinstance(other, Form) else self.shifted(index(other))

    __radd__ = __add__

    def __sub__(self, other) -> "Form":
        return _combine(self, other, -1) if isinstance(other, Form) else self.shifted(-index(other))

    def __rsub__(self, other: int) -> "Form":
        return self.negated().shifted(index(other))

    def shifted(self, const: int) -> "Form":
        return Form(self.terms, self.const + const, self.value + const)

    def negated(self) -> "Form":
        return Form({i: -c for i, c in self.terms.items()}, -self.const, -self.value)

    @property
    def signature(self) -> tuple:
        return tuple(sorted(self.terms.items())), self.const


ZERO = Form({}, 0, 0)


def constant(value: int) -> Form:
    return Form({}, value, value)


def _combine(a: Form, b: Form, sign: int) -> Form:
    terms = a.terms
    if b.terms:
        terms = dict(a.terms)
        for i, c in b.terms.items():
            v = terms.get(i, 0) + sign * c
            if v:
                terms[i] = v
            else:
                del terms[i]
    return Form(terms, a.const + sign * b.const, a.value + sign * b.value)


# --- size classes: the decisions that depend on one size alone ---------------------------

# class of a rounded size r: 0 none (0 B); 1 small pool; 2 large pool, below 10 MiB (a 20 MiB
# segment, always split); 3 from 10 MiB, a fresh segment is split (rest > 1 MiB); 4 from
# 10 MiB, a fresh segment is not split (rest <= 1 MiB: the whole segment is allocated).
_R_RANGE = {0: (0, 0), 1: (MIN_BLOCK, SMALL_SIZE),
            2: (SMALL_SIZE + MIN_BLOCK, MIN_LARGE_ALLOC - MIN_BLOCK),
            3: (MIN_LARGE_ALLOC, None), 4: (MIN_LARGE_ALLOC, None)}
_SLACK_RANGE = {3: (SMALL_SIZE + MIN_BLOCK, ROUND_LARGE - MIN_BLOCK), 4: (0, SMALL_SIZE)}  # g - r


def size_class(r: int) -> int:
    if r == 0:
        return 0
    if r <= SMALL_SIZE:
        return 1
    if r < MIN_LARGE_ALLOC:
        return 2
    return 3 if round_segment(r) - r > SMALL_SIZE else 4


def _size_classes(r: np.ndarray, g: np.ndarray) -> np.ndarray:
    codes = np.full(r.shape, 4, dtype=np.int64)
    codes[g - r > SMALL_SIZE] = 3
    codes[r < MIN_LARGE_ALLOC] = 2
    codes[r <= SMALL_SIZE] = 1
    codes[r == 0] = 0
    return codes


def _holds_on(c: int, k: int, lo: int, hi: int | None) -> bool:
    """``c * x + k >= 0`` for every ``x`` in ``[lo, hi]`` (``hi`` None: unbounded)."""
    if hi is None:
        return c >= 0 and c * lo + k >= 0
    return c * lo + k >= 0 and c * hi + k >= 0


def _implied(guard: Form, classes: list[int]) -> bool:
    """Whether the size classes (the path's signature) already decide ``guard``."""
    items = list(guard.terms.items())
    if len(items) == 1:
        (atom, c), = items
        i, kind = divmod(atom, 2)
        if kind == 0:
            lo, hi = _R_RANGE[classes[i]]
            return _holds_on(c, guard.const, lo, hi)
        return classes[i] >= 3 and _holds_on(c, guard.const, MIN_LARGE_ALLOC, None)
    if len(items) == 2:
        (a, ca), (b, cb) = sorted(items)
        if b == a + 1 and a % 2 == 0 and ca == -cb and classes[a // 2] >= 3:
            lo, hi = _SLACK_RANGE[classes[a // 2]]
            return _holds_on(cb, guard.const, lo, hi)  # cb * (g - r) + const
    return False


def _simplify(guards: list[Form], classes: list[int]) -> list[Form]:
    """Drop the guards the signature implies; merge one-atom guards into bounds; keep the
    strongest of guards that differ only in their constant."""
    lo: dict[int, int] = {}
    hi: dict[int, int] = {}
    strongest: dict[tuple, Form] = {}
    for g in guards:
        if _implied(g, classes):
            continue
        if len(g.terms) == 1:
            (atom, c), = g.terms.items()
            if c > 0:  # atom >= ceil(-k / c)
                lo[atom] = max(lo.get(atom, -(1 << 80)), -(g.const // c))
            else:  # atom <= floor(k / -c)
                hi[atom] = min(hi.get(atom, 1 << 80), g.const // -c)
            continue
        key = tuple(sorted(g.terms.items()))
        if key not in strongest or g.const < strongest[key].const:
            strongest[key] = g
    out = list(strongest.values())
    out += [Form({a: 1}, -v, 0) for a, v in lo.items()]
    out += [Form({a: -1}, v, 0) for a, v in hi.items()]
    return out
