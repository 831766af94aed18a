"""Symbolic sizes for the grid path: a program built once with some sizes as placeholders.

``Sym`` is a placeholder (``Sym.leaf("N")``) with the integer arithmetic programs use (``*``,
``+``, ``-``, ``//``, ``%``, ``**``); every tensor size comes out as an expression, evaluated
later over a whole grid (``evaluate_sym``) or bounded (``bound_sym``). A builder that
compares or branches on a placeholder raises ``SizeDependent`` naming the leaves involved;
``memcalc.analysis.vectorized`` then holds those fields fixed.
"""

from __future__ import annotations

from math import prod
from typing import Any, Iterable

import numpy as np

class SizeDependent(Exception):
    """The program builder made a decision on a size (named by its leaves)."""

    def __init__(self, leaves: Iterable[str] = ()):
        self.leaves = frozenset(leaves)
        super().__init__(f"program depends on {', '.join(sorted(self.leaves)) or 'a size'}")


def _key(x):
    return x.key if isinstance(x, Sym) else ("int", x)


def _order(x) -> str:
    return repr(_key(x))


class Sym:
    """An integer size expression over named leaves (``N``, ``B``...), canonical enough that
    ``(B * H, N, M)`` and ``(B, H, N, M)`` give the same product. Arithmetic builds
    expressions; anything that needs the value (``bool``, ``int``, ``<``) raises
    ``SizeDependent``, except comparisons of identical expressions."""

    __slots__ = ("op", "args", "key", "_leaves")

    def __init__(self, op: str, args: tuple, key: tuple):
        self.op, self.args, self.key, self._leaves = op, args, key, None

    @staticmethod
    def leaf(name: str) -> "Sym":
        return Sym("leaf", (name,), ("leaf", name))

    @property
    def leaves(self) -> frozenset[str]:
        if self._leaves is None:
            if self.op == "leaf":
                self._leaves = frozenset(self.args)
            else:
                parts = self.args[1] if self.op in ("mul", "add", "apply") else self.args
                if self.op == "add":
                    parts = [t for _, t in parts]
                self._leaves = frozenset().union(*(p.leaves for p in parts if isinstance(p, Sym)))
        return self._leaves

    # arithmetic
    def __mul__(self, other):
        return _mul(self, other)

    __rmul__ = __mul__

    def __add__(self, other):
        return _add(self, other)

    __radd__ = __add__

    def __neg__(self):
        return _mul(-1, self)

    def __pos__(self):
        return self

    def __sub__(self, other):
        return _add(self, _mul(-1, other)) if _is_num(other) else NotImplemented

    def __rsub__(self, other):
        return _add(other, _mul(-1, self)) if _is_num(other) else NotImplemented

    def __floordiv__(self, other):
        return _binary("floordiv", self, other)

    def __rfloordiv__(self, other):
        return _binary("floordiv", other, self)

    def __mod__(self, other):
        return _binary("mod", self, other)

    def __rmod__(self, other):
        return _binary("mod", other, self)

    def __pow__(self, exponent):
        if isinstance(exponent, int) and exponent >= 0:
            return prod([self] * exponent)
        raise SizeDependent(self.leaves)

    # anything that needs a value
    def _compare(self, other, equal_result: bool):
        if _key(self) == _key(other):
            return equal_result
        raise SizeDependent(self.leaves | (other.leaves if isinstance(other, Sym) else set()))

    def __eq__(self, other):
        return self._compare(other, True)

    def __ne__(self, other):
        return self._compare(other, False)

    def __le__(self, other):
        return self._compare(other, True)

    def __ge__(self, other):
        return self._compare(other, True)

    def __lt__(self, other):
        return self._compare(other, False)

    def __gt__(self, other):
        return self._compare(other, False)

    def _value(self, *_):
        raise SizeDependent(self.leaves)

    __bool__ = __int__ = __index__ = __float__ = __truediv__ = __rtruediv__ = _value
    __round__ = __trunc__ = __floor__ = __ceil__ = _value

    def __hash__(self):
        return hash(self.key)

    def __repr__(self):
        return f"Sym({self.key!r})"


def _is_num(x) -> bool:
    return isinstance(x, (int, np.integer, Sym))


def _mul(a, b):
    if not (_is_num(a) and _is_num(b)):
        return NotImplemented
    const, factors = 1, []
    for x in (a, b):
        if isinstance(x, Sym) and x.op == "mul":
            const *= x.args[0]
            factors += x.args[1]
        elif isinstance(x, Sym):
            factors.append(x)
        else:
            const *= int(x)
    if const == 0 or not factors:
        return const
    factors = tuple(sorted(factors, key=_order))
    if const == 1 and len(factors) == 1:
        return factors[0]
    return Sym("mul", (const, factors), ("mul", const, tuple(f.key for f in factors)))


def _split_term(x) -> tuple[int, Any]:
    """``x`` as ``coefficient * monomial``."""
    if isinstance(x, Sym) and x.op == "mul":
        rest = x.args[1]
        mono = rest[0] if len(rest) == 1 else Sym("mul", (1, rest), ("mul", 1, tuple(f.key for f in rest)))
        return x.args[0], mono
    return 1, x


def _add(a, b):
    if not (_is_num(a) and _is_num(b)):
        return NotImplemented
    const, terms = 0, {}
    for x in (a, b):
        parts = []
        if isinstance(x, Sym) and x.op == "add":
            const += x.args[0]
            parts = list(x.args[1])
        elif isinstance(x, Sym):
            parts = [_split_term(x)]
        else:
            const += int(x)
        for coef, mono in parts:
            k = mono.key
            c0, _ = terms.get(k, (0, mono))
            terms[k] = (c0 + coef, mono)
    items = tuple(sorted(((c, m) for c, m in terms.values() if c), key=lambda cm: _order(cm[1])))
    if not items:
        return const
    if const == 0 and len(items) == 1:
        return _mul(items[0][0], items[0][1])
    return Sym("add", (const, items), ("add", const, tuple((c, m.key) for c, m in items)))


def _binary(op: str, a, b):
    if not (_is_num(a) and _is_num(b)):
        return NotImplemented
    if not isinstance(a, Sym) and not isinstance(b, Sym):
        return a // b if op == "floordiv" else a % b
    return Sym(op, (a, b), (op, _key(a), _key(b)))


def apply(fn, sizes: tuple, bound):
    """``fn(*sizes)``, a size computed by a function with branches (a kernel's launch
    configuration, say): the value now when every size is an integer, else a placeholder
    that ``evaluate_sym`` evaluates element by element over a grid and ``bound_sym`` bounds
    with ``bound(*bounds of sizes)``. ``fn`` must be hashable and pure (a module function,
    or a ``functools.partial`` of one over hashable constants): it is the placeholder's
    identity."""
    if not any(isinstance(n, Sym) for n in sizes):
        return fn(*sizes)
    return Sym("apply", (fn, tuple(sizes), bound), ("apply", fn, tuple(_key(n) for n in sizes)))


def _apply_values(fn, values: list):
    """``fn`` over the sizes' values, element by element where they are arrays."""
    if not any(isinstance(v, np.ndarray) for v in values):
        return fn(*values)
    if hasattr(fn, "over_arrays"):
        return fn.over_arrays(*values)
    arrays = np.broadcast_arrays(*values)
    out = np.fromiter((fn(*map(int, row)) for row in zip(*(a.ravel() for a in arrays))),
                      dtype=np.int64, count=arrays[0].size)
    return out.reshape(arrays[0].shape)


def evaluate_sym(x, env: dict, memo: dict | None = None):
    """The value of ``x`` with leaves from ``env`` (ints or numpy arrays)."""
    if not isinstance(x, Sym):
        return x
    memo = {} if memo is None else memo
    if x.key in memo:
        return memo[x.key]
    if x.op == "leaf":
        value = env[x.args[0]]
    elif x.op == "mul":
        value = x.args[0]
        for f in x.args[1]:
            value = value * evaluate_sym(f, env, memo)
    elif x.op == "add":
        value = x.args[0]
        for c, m in x.args[1]:
            value = value + c * evaluate_sym(m, env, memo)
    elif x.op == "apply":
        value = _apply_values(x.args[0], [evaluate_sym(n, env, memo) for n in x.args[1]])
    else:
        a, b = evaluate_sym(x.args[0], env, memo), evaluate_sym(x.args[1], env, memo)
        value = a // b if x.op == "floordiv" else a % b
    memo[x.key] = value
    return value


def bound_sym(x, leafmax: dict, memo: dict | None = None) -> int:
    """An upper bound of ``|x|`` and of every intermediate value, given ``|leaf| <= leafmax``."""
    memo = {} if memo is None else memo
    if not isinstance(x, Sym):
        return abs(x)
    if x.key in memo:
        return memo[x.key]
    if x.op == "leaf":
        value = leafmax[x.args[0]]
    elif x.op == "mul":
        value = abs(x.args[0]) * prod(bound_sym(f, leafmax, memo) for f in x.args[1])
    elif x.op == "add":
        value = abs(x.args[0]) + sum(abs(c) * bound_sym(m, leafmax, memo) for c, m in x.args[1])
    elif x.op == "apply":
        value = x.args[2](*(bound_sym(n, leafmax, memo) for n in x.args[1]))
    elif x.op == "floordiv":
        value = max(bound_sym(x.args[0], leafmax, memo), 1)
        bound_sym(x.args[1], leafmax, memo)
    else:
        value = bound_sym(x.args[1], leafmax, memo)
        bound_sym(x.args[0], leafmax, memo)
    memo[x.key] = value
    return value
