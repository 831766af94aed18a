"""Vectorized predictions: ``predict``'s figures for whole grids at once, to the byte.

An implementation's program has the same events for every size; only the sizes change.
This module evaluates one program for many configurations with numpy, in three steps.

1. **Symbolic sizes.** The program builder is called once per group (same implementation,
   dtype, flags, protocol) with the integer fields that vary across the grid replaced by
   ``Sym`` placeholders. Every tensor size comes out as an expression (``8 * N * M * 4``),
   evaluated later as an ``int64`` array over the grid. A builder that branches on a size
   (``if d.N > 1024``, ``range(d.N // d.chunk)``, ``max(...)``) raises ``SizeDependent``
   naming the fields it looked at; those fields are then held fixed (the grid is split by
   their values) and the build retried.

2. **Paths.** The caching allocator decides, at every ``malloc``, the pool (size <= 1 MiB),
   which cached free block fits best, whether it is split (remainder >= 512 B small pool,
   > 1 MiB large pool: ``should_split``) and, for a new segment, its size (2 MiB, 20 MiB or
   the request rounded to 2 MiB). All are comparisons between sizes. Replaying the program
   once for one configuration, with every block, segment and counter kept as an integer
   linear form over *atoms* (the rounded block size ``round_size(n)`` of each distinct
   tensor size ``n``, and its segment size ``ceil(r / 2 MiB) * 2 MiB``), records each decision
   as a guard ``form >= 0`` and each figure as a form (a peak: the maximum of the forms at
   the moments just before memory is freed). A configuration that satisfies every guard of
   a path makes exactly the same decisions, so its figures are those forms evaluated on its
   own atoms: exact, with no approximation. A configuration that violates a guard takes
   another path; one of them is replayed to record that path, and so on. Paths are cached.
   Each new path is checked once against ``memcalc.timeline.predict`` on the configuration
   that recorded it.

   So the places where the allocator's state makes a plain closed form impossible are
   exactly the guards: a block that is not split because its remainder is <= 1 MiB (the
   allocated block is then the whole cached block or segment, a form of several atoms),
   best-fit reuse of a cached block (which block wins depends on the sizes of all free
   blocks) and the reserved memory (which segments exist). They are handled by splitting
   the grid into paths, not by approximating.

   Paths are grouped by *signature*: the class of every distinct size (none, small pool,
   below 10 MiB, from 10 MiB with a fresh segment split or not), which decides the guards
   on one size alone. A configuration is matched to its path by its outcomes on the
   distinct guards of its signature's paths (a bit string), and each path's figures are
   one matrix product (float64 where that is exact, int64 otherwise).

3. **Fallback to the scalar replay** (``predict``), configuration by configuration, where a
   path does not pay or does not exist. ``Figures.fallback`` counts them by reason:

   * ``structure``: the builder branches on the sequence length (a loop over chunks:
     the events themselves change with N), so there is one program per configuration;
   * ``overflow``: a size or a sum could exceed ``int64`` (beyond 2^52 B per tensor, about
     4 PiB); Python integers keep those exact;
   * ``small``: fewer than ``SCALAR_BELOW`` configurations share a program, and ``tail``:
     at most ``SCALAR_TAIL`` configurations, over all calls, reached a signature with no
     path that holds (recording a path costs about four replays);
   * ``paths``: more than ``MAX_PATHS`` new paths in one call for one signature;
   * ``unmodelled``: a recorded path disagreed with ``predict`` on the configuration that
     recorded it (this module mirrors ``timeline.py`` and ``allocator.py``; a rule added
     there and not here shows up as this, and the tests fail on it).

The reserved peak computed here is the one of an unbounded device (``capacity=None``):
under a capacity, PyTorch frees cached segments and retries before raising, which changes
the replay. ``classify`` therefore decides "fits" only where that cannot matter (reserved
peak <= budget: fits; the blocks' rounded sizes alone exceed the budget: does not) and
leaves the rest to ``memcalc.budget.fit``, the one definition of fitting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Any, Iterable

import numpy as np

from memcalc.allocator import (MIN_BLOCK, MIN_LARGE_ALLOC, ROUND_LARGE, SMALL_SIZE,
                               CachingAllocator, Sizes, round_segment, round_size)
from memcalc.breakdown import FIGURES as BREAKDOWN_FIGURES
from memcalc.config import Config
from memcalc.impls import get_impl
from memcalc.quadratic import quadratic_names
from memcalc.tensors import Tensor
from memcalc.timeline import Ledger, Live, input_tensors, replay

AXES = ("batch", "heads", "seq_len", "head_dim", "kv_len", "kv_heads")
"""The shape fields a grid can vary (``Shape``'s fields)."""
# the Breakdown's figures, plus two the grid path also reports
FIGURES = BREAKDOWN_FIGURES + ("floor_peak_bytes", "quadratic_bytes")
CHUNK = 1 << 15  # configurations per numpy pass: keeps the arrays in cache
MAX_PATHS = 256  # per group and call, before the rest falls back to the scalar replay
SCALAR_BELOW = 32  # groups smaller than this take the scalar replay: recording would not pay
SCALAR_TAIL = 4  # so do the last few configurations of a signature that no path covers
SAFE = 1 << 62  # every size, atom and figure must stay below this to use int64

# Dims field -> the leaf name of its placeholder
_LEAF = {"B": "B", "H": "H", "N": "N", "M": "M", "D": "D", "Hk": "Hk", "chunk": "chunk"}


# --- symbolic sizes ----------------------------------------------------------------------

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
                parts = self.args[1] if self.op in ("mul", "add") else self.args
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
    elif x.op == "floordiv":
        value = max(bound_sym(x.args[0], leafmax, memo), 1)
        bound_sym(x.args[1], leafmax, memo)
    else:
        value = bound_sym(x.args[1], leafmax, memo)
        bound_sym(x.args[0], leafmax, memo)
    memo[x.key] = value
    return value


# --- linear forms over atoms -------------------------------------------------------------

class Form:
    """``const + sum(coef * atom)`` over atom ids, with its value for the configuration
    being replayed. Atom ``2 * i`` is the rounded block size of the group's size ``i``,
    atom ``2 * i + 1`` its segment size (rounded up to 2 MiB)."""

    __slots__ = ("terms", "const", "value")

    def __init__(self, terms: dict, const: int, value: int):
        self.terms, self.const, self.value = terms, const, value

    def __add__(self, other) -> "Form":
        return self.shifted(other) if isinstance(other, int) else _combine(self, other, 1)

    __radd__ = __add__

    def __sub__(self, other) -> "Form":
        return self.shifted(-other) if isinstance(other, int) else _combine(self, other, -1)

    def __rsub__(self, other: int) -> "Form":
        return self.negated().shifted(other)

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


# --- the recorded replay ---------------------------------------------------------------

class FormSizes(Sizes):
    """The allocator's arithmetic over ``Form``s: every decision is recorded as a guard.
    A request's block is the atom of its size (kind 0), its large segment the atom of its
    size rounded to 2 MiB (kind 1)."""

    def __init__(self, group: "_Group", env: dict):
        self.group, self.env = group, env
        self.values: dict[int, int] = {}  # atom id -> value for this configuration
        self.guards: dict[tuple, Form] = {}

    def _atom(self, kind: int, nbytes) -> Form:
        if not isinstance(nbytes, Sym):
            r = round_size(nbytes)
            return constant(r if kind == 0 else round_segment(r))
        atom = 2 * self.group.index[nbytes.key] + kind
        if atom not in self.values:
            r = round_size(evaluate_sym(nbytes, self.env))
            self.values[atom] = r if kind == 0 else round_segment(r)
        return Form({atom: 1}, 0, self.values[atom])

    def block(self, nbytes) -> Form:
        return self._atom(0, nbytes)

    def large_segment(self, nbytes, block) -> Form:
        return self._atom(1, nbytes)

    def ge0(self, form) -> bool:
        """``form >= 0`` for this configuration; records the outcome as a guard."""
        if isinstance(form, int):
            return form >= 0
        holds = form.value >= 0
        if form.terms:
            guard = form if holds else form.negated().shifted(-1)  # f < 0 <=> -f - 1 >= 0
            self.guards.setdefault(guard.signature, guard)
        return holds

    def key(self, size, addr) -> "_Key":
        return _Key(self, size, addr)

    def top(self, peak, value):
        return value  # peaks are taken from the recorder's moments, as forms


class _Key:
    """A free block's place in its pool: by size (a recorded decision), then address.
    Within one path the blocks' addresses keep their order, so comparing their values
    decides nothing new."""

    __slots__ = ("sizes", "size", "addr")

    def __init__(self, sizes: FormSizes, size, addr):
        self.sizes, self.size = sizes, size
        self.addr = addr.value if isinstance(addr, Form) else addr

    def __lt__(self, other: "_Key") -> bool:
        gap = other.size - self.size
        if not self.sizes.ge0(gap):
            return False
        return self.sizes.ge0(gap - 1) or self.addr < other.addr


class Recorder(Ledger):
    """``memcalc.timeline``'s ledger over ``Form`` sizes: the same replay, recording the
    figures as forms. Besides the allocated bytes it keeps, at each moment, the rounded
    request sizes alive (``floor``) and the blocks of the N x M tensors (``quad``); a peak
    is the largest of the moments just before memory is freed."""

    def __init__(self, group: "_Group", env: dict, workspace_bytes: int,
                 quadratic: frozenset[str]):
        self.sizes = FormSizes(group, env)
        allocator = CachingAllocator(sizes=self.sizes)
        allocator.allocated = allocator.reserved = ZERO  # counters are forms from the start
        super().__init__(workspace_bytes, allocator=allocator)
        self.nbytes = group.nbytes
        self.quadratic = quadratic
        self.floor = self.quad = ZERO
        self.rounded: dict[Any, Form] = {}
        self.moments: list | None = None  # of the phase being measured
        self.pending = None
        self.phases: dict[str, list] = {}

    def alloc(self, key, item) -> None:
        nbytes = self.nbytes.get(id(item), item.nbytes)
        live = self.live[key] = Live(item, self.allocator.malloc(nbytes))
        self.rounded[key] = r = self.sizes.block(nbytes)
        self.floor = self.floor + r
        if item.name in self.quadratic and live.block is not None:
            self.quad = self.quad + live.block_bytes
        if self.moments is not None:
            self.pending = (self.allocator.allocated, self.floor, self.quad)

    def free(self, key) -> None:
        live = self.live.pop(key)
        if self.moments is not None and self.pending is not None:
            self.moments.append(self.pending)  # the moment before the first free of a run
            self.pending = None
        if live.item.name in self.quadratic and live.block is not None:
            self.quad = self.quad - live.block_bytes
        self.floor = self.floor - self.rounded.pop(key)
        self.allocator.free(live.block)

    def reset_peak(self) -> None:
        """``reset_peak_memory_stats``: the peak restarts from what is allocated now."""
        self.allocator.reset_peaks()
        self.moments, self.pending = [], (self.allocator.allocated, self.floor, self.quad)

    def end_phase(self, phase: str) -> None:
        """The measured phase ends: keep its moments."""
        if self.pending is not None:
            self.moments.append(self.pending)
        self.phases[phase], self.moments, self.pending = self.moments, None, None


@dataclass
class Path:
    """One recorded replay. ``cols`` are the atom ids its forms use (then the constant
    column); every other field is a matrix of forms, one row each, over those columns."""

    signature: Any
    cols: np.ndarray
    guards: np.ndarray  # (G, c): each row >= 0 on this path
    saved: np.ndarray  # (1, c)
    reserved: np.ndarray  # (1, c)
    forward: np.ndarray  # (Kf, c) allocated at the forward's moments
    backward: np.ndarray  # (Kb, c)
    floor: np.ndarray  # (Kf + Kb, c) rounded request sizes alive at those moments
    forward_quad: np.ndarray  # (Kf, c) blocks of N x M tensors at those moments
    backward_quad: np.ndarray  # (Kb, c)
    figures: dict[str, int]  # of the configuration that recorded it
    coef_sum: int = 0  # the largest sum of |coefficients| of a row, plus one

    def __post_init__(self):
        rows = [m[:, :-1] for m in (self.guards, self.saved, self.reserved, self.forward,
                                     self.backward, self.floor, self.forward_quad,
                                     self.backward_quad) if len(m)]
        self.coef_sum = max(int(np.abs(r).sum(axis=1).max()) for r in rows) + 1


def _dedupe_moments(moments: list[tuple[Form, Form, Form]]) -> list[tuple[Form, Form, Form]]:
    """Drop a moment whose forms all repeat an earlier one's (the first is the one the
    ledger reports; its figures are the same)."""
    seen, out = set(), []
    for m in moments:
        sig = tuple(f.signature for f in m)
        if sig not in seen:
            seen.add(sig)
            out.append(m)
    return out


def record(group: "_Group", env: dict, workspace_bytes: int, quadratic: frozenset[str],
           classes: list[int], signature: Any) -> Path:
    """Replay ``group``'s program for the configuration ``env`` (symbolic leaf values),
    recording its path."""
    rec = Recorder(group, env, workspace_bytes, quadratic)
    step = replay(rec, group.dims, group.program, rec.end_phase)
    saved = ZERO
    for live in step.saved:
        if live.block is not None:
            saved = saved + live.block_bytes
    forward = _dedupe_moments(rec.phases["forward"])
    backward = _dedupe_moments(rec.phases.get("backward", [(ZERO, ZERO, ZERO)]))
    guards = _simplify(list(rec.sizes.guards.values()), classes)
    alloc_f, floor_f, quad_f = (list(x) for x in zip(*forward))
    alloc_b, floor_b, quad_b = (list(x) for x in zip(*backward))
    reserved = rec.allocator.reserved
    blocks = [guards, [saved], [reserved], alloc_f, alloc_b, floor_f + floor_b, quad_f, quad_b]
    atoms = sorted({a for forms in blocks for f in forms for a in f.terms})
    column = {a: j for j, a in enumerate(atoms)}

    def matrix(forms: list[Form]) -> np.ndarray:
        out = np.zeros((len(forms), len(atoms) + 1), dtype=np.int64)
        for row, f in enumerate(forms):
            for a, c in f.terms.items():
                out[row, column[a]] = c
            out[row, -1] = f.const
        return out

    fwd = max(f.value for f in alloc_f)
    bwd = max(f.value for f in alloc_b) if "backward" in rec.phases else 0
    figures = {"saved_bytes": saved.value, "forward_peak_bytes": fwd, "backward_peak_bytes": bwd,
               "peak_bytes": max(fwd, bwd), "reserved_peak_bytes": reserved.value}
    return Path(signature, np.array(atoms + [-1], dtype=np.int64), *map(matrix, blocks), figures)


# --- evaluation over a grid --------------------------------------------------------------

def _forms(matrix: np.ndarray, atoms: np.ndarray) -> np.ndarray:
    """Every row of ``matrix`` (a form) on every configuration (columns of ``atoms``, whose
    last row is ones): ``(rows, n)``."""
    out = np.empty((matrix.shape[0], atoms.shape[1]), dtype=np.int64)
    for row, coefs in enumerate(matrix):
        acc = out[row]
        nonzero = np.flatnonzero(coefs)
        if len(nonzero) == 0:
            acc.fill(0)
            continue
        first = True
        for i in nonzero:
            c = int(coefs[i])
            if first:
                np.multiply(atoms[i], c, out=acc)
                first = False
            elif c == 1:
                acc += atoms[i]
            elif c == -1:
                acc -= atoms[i]
            else:
                acc += c * atoms[i]
    return out


@dataclass(frozen=True)
class Figures:
    """Figures of a grid, one entry per configuration (``int64`` arrays, or object arrays
    of Python ints where a figure needs more). ``floor_peak_bytes``: the largest sum of
    rounded request sizes alive at one moment of the measured step (no replay, under any
    capacity, reserves less). ``quadratic_bytes``: what the N x M tensors
    (``quadratic_names``) hold at the peak. ``path``: the recorded path used, -1 for the
    scalar replay. ``fallback``: configurations replayed one by one, by reason."""

    saved_bytes: np.ndarray
    forward_peak_bytes: np.ndarray
    backward_peak_bytes: np.ndarray
    peak_bytes: np.ndarray
    reserved_peak_bytes: np.ndarray
    floor_peak_bytes: np.ndarray
    quadratic_bytes: np.ndarray
    path: np.ndarray
    fallback: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.path)

    def row(self, i: int) -> dict[str, int]:
        return {k: int(getattr(self, k)[i]) for k in FIGURES}


@dataclass
class _Group:
    """A program built with some fields symbolic, its distinct sizes and its paths."""

    dims: Any  # the sizes, some of them ``Sym`` placeholders
    program: Any
    symbolic: frozenset[str]
    sizes: list[Sym]
    index: dict[tuple, int]
    nbytes: dict[int, Any]  # id(tensor event) -> its size expression
    paths: list[Path] = field(default_factory=list)
    by_signature: dict = field(default_factory=dict)


FLOAT_EXACT = 1 << 53  # integers below this are exact in float64
BLOCK = 1024  # columns per matrix product (larger ones make OpenBLAS spawn slow threads)
HOT_PATHS = 4  # paths tried one by one, most used first, before matching by bit strings


class _Bank:
    """The paths recorded for one signature (same size classes), and the distinct guards
    of all of them: a configuration's outcomes on those guards, as a bit string, select its
    path (the one whose own guards all hold; paths differ in a decision, so at most one)."""

    def __init__(self):
        self.paths: list[Path] = []
        self.pids: list[int] = []
        self.hits: list[int] = []  # configurations each path has taken
        self.unmatched = 0  # configurations no path covered, over all calls
        self._built = None

    def add(self, pid: int, path: Path) -> None:
        self.paths.append(path)
        self.pids.append(pid)
        self.hits.append(0)
        self._built = None

    def build(self):
        """(atom rows, distinct guards as int64 and float64, each path's guard bitmask,
        largest coefficient sum)."""
        if self._built is None:
            atoms = sorted({int(a) for p in self.paths for a in p.cols[:-1]})
            column = {a: j for j, a in enumerate(atoms)}
            rows: dict[bytes, int] = {}
            masks = []
            for p in self.paths:
                wide = np.zeros((len(p.guards), len(atoms) + 1), dtype=np.int64)
                wide[:, [column[int(a)] for a in p.cols[:-1]] + [len(atoms)]] = p.guards
                mask = 0
                for g in wide:
                    mask |= 1 << rows.setdefault(g.tobytes(), len(rows))
                masks.append(mask)
            guards = np.array([np.frombuffer(k, dtype=np.int64) for k in rows],
                              dtype=np.int64).reshape(len(rows), len(atoms) + 1)
            coef = int(np.abs(guards[:, :-1]).sum(axis=1).max(initial=0)) + 1
            self._built = (np.array(atoms + [-1], dtype=np.int64), guards,
                           guards.astype(np.float64), masks, coef)
        return self._built


def _product(matrix: np.ndarray, atoms: np.ndarray, floats: np.ndarray | None,
             matrix_f: np.ndarray | None = None) -> np.ndarray:
    """``matrix`` (forms) times ``atoms``: in float64 when that is exact, else int64."""
    if floats is not None:
        mf = matrix_f if matrix_f is not None else matrix.astype(np.float64)
        n = floats.shape[1]
        if n <= BLOCK:
            return (mf @ floats).astype(np.int64)
        out = np.empty((mf.shape[0], n), dtype=np.int64)
        for start in range(0, n, BLOCK):  # small blocks: BLAS stays on one fast thread
            out[:, start:start + BLOCK] = mf @ floats[:, start:start + BLOCK]
        return out
    return _forms(matrix, atoms)


def _floats(atoms: np.ndarray, coef_sum: int) -> np.ndarray | None:
    """``atoms`` as float64 when every partial sum of a form stays below 2^53 (then the
    float matrix product is exact), else None."""
    if atoms.size and coef_sum * int(atoms.max()) < FLOAT_EXACT:
        return atoms.astype(np.float64)
    return None


class Evaluator:
    """Evaluates grids of one base configuration's implementation, dtype, flags and
    protocol, caching programs and paths across calls."""

    def __init__(self, base: Config):
        self.base = base
        self.impl = get_impl(base.impl)
        self.grad = not base.protocol.forward_only
        self.workspace_bytes = base.workspace_bytes
        self.groups: dict[tuple, Any] = {}
        self.quadratic: frozenset[str] = quadratic_names(base)
        self.paths_recorded = 0
        self.varying: frozenset[str] = frozenset()

    def evaluate(self, axes: dict[str, np.ndarray]) -> Figures:
        n = len(axes["batch"])
        out = {k: np.zeros(n, dtype=np.int64) for k in FIGURES}
        path_ids = np.full(n, -1, dtype=np.int64)
        fallback: dict[str, int] = {}
        leaves = _leaves_of(axes, n)
        # the fields that vary over the whole grid stay symbolic in every chunk, so that
        # chunks share programs and paths
        self.varying = frozenset(k for k, v in leaves.items() if v.min() != v.max())
        for start in range(0, n, CHUNK):
            sl = slice(start, min(n, start + CHUNK))
            chunk = {k: v[sl] for k, v in leaves.items()}
            self._evaluate(chunk, np.arange(sl.start, sl.stop), out, path_ids, fallback,
                           frozenset())
        return Figures(**out, path=path_ids, fallback=fallback)

    def _evaluate(self, leaves: dict, idx: np.ndarray, out: dict, path_ids: np.ndarray,
                  fallback: dict, fixed: frozenset[str]) -> None:
        """Configurations ``idx`` (leaf arrays ``leaves``); ``fixed`` names the leaves the
        builder branched on, held constant by splitting the grid by their values."""
        if len(idx) == 0:
            return
        for name in fixed:
            values = leaves[name]
            if values.min() != values.max():
                uniques = np.unique(values)
                if name in ("N", "M") or len(uniques) * 4 > len(values):
                    return self._scalar(leaves, idx, out, path_ids, fallback, "structure")
                for v in uniques:
                    m = values == v
                    self._evaluate({k: a[m] for k, a in leaves.items()}, idx[m], out,
                                   path_ids, fallback, fixed)
                return
        if len(idx) < SCALAR_BELOW:
            return self._scalar(leaves, idx, out, path_ids, fallback, "small")
        symbolic = frozenset(k for k, v in leaves.items() if k not in fixed and (
            k in self.varying or v.min() != v.max()))
        if not symbolic:  # identical configurations: one replay
            symbolic = frozenset({"N"})
        key = tuple(sorted((k, None if k in symbolic else int(v[0])) for k, v in leaves.items()))
        group = self._group(key, symbolic, leaves)
        if isinstance(group, SizeDependent):
            needed = (group.leaves & symbolic) or symbolic
            return self._evaluate(leaves, idx, out, path_ids, fallback, fixed | needed)
        safe = self._safe(group, leaves)
        if not safe.all():
            self._scalar({k: v[~safe] for k, v in leaves.items()}, idx[~safe], out, path_ids,
                         fallback, "overflow")
            leaves, idx = {k: v[safe] for k, v in leaves.items()}, idx[safe]
            if len(idx) == 0:
                return
        self._evaluate_group(group, leaves, idx, out, path_ids, fallback)

    def _evaluate_group(self, group: _Group, leaves: dict, idx: np.ndarray, out: dict,
                        path_ids: np.ndarray, fallback: dict) -> None:
        n = len(idx)
        env = {k: (v if k in group.symbolic else int(v[0])) for k, v in leaves.items()}
        memo: dict = {}
        rows = np.empty((2 * len(group.sizes) + 1, n), dtype=np.int64)
        for i, expr in enumerate(group.sizes):
            nbytes = np.broadcast_to(evaluate_sym(expr, env, memo), (n,))
            r = rows[2 * i]
            np.floor_divide(nbytes + (MIN_BLOCK - 1), MIN_BLOCK, out=r)
            r *= MIN_BLOCK
            np.maximum(r, MIN_BLOCK, out=r)
            r[nbytes <= 0] = 0
            g = rows[2 * i + 1]
            np.floor_divide(r + (ROUND_LARGE - 1), ROUND_LARGE, out=g)
            g *= ROUND_LARGE
        rows[-1] = 1
        codes = _size_classes(rows[0:-1:2], rows[1:-1:2])
        if len(group.sizes) <= 27:
            signature = (codes * (5 ** np.arange(len(group.sizes), dtype=np.int64))[:, None]).sum(0)
        else:  # an exact key per configuration, as bytes
            packed = np.ascontiguousarray(codes.T.astype(np.int8))
            signature = packed.view(np.dtype((np.void, packed.shape[1])))[:, 0]
        order = np.argsort(signature, kind="stable")
        bounds = np.flatnonzero(signature[order][1:] != signature[order][:-1]) + 1
        for members in np.split(order, bounds):
            sig = signature[members[0]]
            sig = int(sig) if isinstance(sig, np.integer) else bytes(sig)
            self._match(group, sig, codes[:, members[0]], rows[:, members], leaves, members,
                        idx, out, path_ids, fallback)

    def _match(self, group: _Group, sig, classes, rows: np.ndarray, leaves: dict,
               members: np.ndarray, idx: np.ndarray, out: dict, path_ids: np.ndarray,
               fallback: dict) -> None:
        """Configurations of one signature: apply its paths, record new ones as needed."""
        bank = group.by_signature.setdefault(sig, _Bank())
        todo = np.ones(len(members), dtype=bool)
        if bank.paths:
            self._apply(bank, rows, todo, idx[members], out, path_ids)
        recorded = 0
        while todo.any():
            left = int(todo.sum())
            bank.unmatched += left
            if recorded >= MAX_PATHS or bank.unmatched <= SCALAR_TAIL:
                rest = members[todo]
                return self._scalar({k: v[rest] for k, v in leaves.items()}, idx[rest], out,
                                    path_ids, fallback, "paths" if recorded >= MAX_PATHS else "tail")
            first = int(np.flatnonzero(todo)[0])
            rep = {k: int(v[members[first]]) for k, v in leaves.items()}
            path = record(group, {k: rep[k] for k in group.symbolic}, self.workspace_bytes,
                          self.quadratic, [int(c) for c in classes], sig)
            if not self._check(path, rep):  # the replay here and timeline.py disagree
                rest = members[todo]
                return self._scalar({k: v[rest] for k, v in leaves.items()}, idx[rest], out,
                                    path_ids, fallback, "unmodelled")
            group.paths.append(path)
            bank.add(len(group.paths) - 1, path)
            recorded += 1
            self.paths_recorded += 1
            self._apply(bank, rows, todo, idx[members], out, path_ids)
            if todo[first]:
                raise AssertionError("a recorded path rejects its own configuration")

    def _group(self, key: tuple, symbolic: frozenset, leaves: dict):
        if key not in self.groups:
            dims = {name: (Sym.leaf(name) if name in symbolic else int(v[0]))
                    for name, v in leaves.items()}
            d = _dims(self.base, dims)
            try:
                program = self.impl.build(d)
                inputs = input_tensors(d)
                sizes: dict[tuple, Sym] = {}
                each: dict[int, Any] = {}
                for t in (*inputs, *program.forward, *program.backward):
                    if isinstance(t, Tensor):
                        nbytes = each[id(t)] = t.nbytes
                        if isinstance(nbytes, Sym):
                            sizes.setdefault(nbytes.key, nbytes)
                self.groups[key] = _Group(d, program, symbolic, list(sizes.values()),
                                          {k: i for i, k in enumerate(sizes)}, each)
            except SizeDependent as error:
                self.groups[key] = error
            except Exception:  # noqa: BLE001 - a placeholder used as a number
                self.groups[key] = SizeDependent(symbolic)
        return self.groups[key]

    def _safe(self, group: _Group, leaves: dict) -> np.ndarray:
        """Configurations whose sizes (and every intermediate value) stay below 2^52, so
        that the forms' sums of up to 1024 atoms stay below 2^62."""
        n = len(next(iter(leaves.values())))
        limit = SAFE >> 10
        leafmax = {k: int(np.abs(v).max()) for k, v in leaves.items()}
        memo: dict = {}
        if max((bound_sym(x, leafmax, memo) for x in group.sizes), default=0) < limit:
            return np.ones(n, dtype=bool)
        fenv = {k: v.astype(np.float64) for k, v in leaves.items()}
        fmemo: dict = {}
        for x in group.sizes:
            evaluate_sym(x, fenv, fmemo)
        safe = np.ones(n, dtype=bool)
        for v in fmemo.values():
            safe &= np.broadcast_to(np.abs(np.asarray(v, dtype=np.float64)) < limit / 4, (n,))
        return safe

    def _apply(self, bank: _Bank, rows: np.ndarray, todo: np.ndarray,
               targets: np.ndarray, out: dict, path_ids: np.ndarray) -> None:
        """Match the configurations still to do to ``bank``'s paths by their outcomes on
        the bank's guards; evaluate each path's figures on the ones it holds for."""
        if len(bank.paths) > 2:  # the most used paths first, each on its own guards
            for i in np.argsort(bank.hits)[::-1][:HOT_PATHS]:
                path, where = bank.paths[i], np.flatnonzero(todo)
                atoms = rows[path.cols][:, where]
                holds = (_product(path.guards, atoms, _floats(atoms, path.coef_sum)) >= 0).all(axis=0)
                sel = where[holds]
                if len(sel):
                    self._figures(path, bank.pids[i], rows[:, sel], targets[sel], out, path_ids)
                    todo[sel] = False
                    bank.hits[i] += len(sel)
                if not todo.any():
                    return
                if 8 * len(sel) < len(where):  # a cold path: the bit strings do better
                    break
        cols, guards, guards_f, masks, coef = bank.build()
        where = np.flatnonzero(todo)
        atoms = rows[cols][:, where]
        outcome = _product(guards, atoms, _floats(atoms, coef), guards_f) >= 0
        packed = np.ascontiguousarray(np.packbits(outcome, axis=0, bitorder="little").T)
        keys = packed.view(np.dtype((np.void, packed.shape[1])))[:, 0]
        uniques, inverse = np.unique(keys, return_inverse=True)
        choice = np.full(len(uniques), -1, dtype=np.int64)
        for u, key in enumerate(uniques):
            bits = int.from_bytes(bytes(key), "little")
            for i, mask in enumerate(masks):
                if bits & mask == mask:
                    choice[u] = i
                    break
        which = choice[inverse.reshape(-1)]
        for i in np.unique(which[which >= 0]):
            sel = np.flatnonzero(which == i)
            self._figures(bank.paths[i], bank.pids[i], rows[:, where[sel]], targets[where[sel]],
                          out, path_ids)
            todo[where[sel]] = False
            bank.hits[i] += len(sel)

    def _figures(self, path: Path, pid: int, rows: np.ndarray, target: np.ndarray, out: dict,
                 path_ids: np.ndarray) -> None:
        """``path``'s figures on configurations (columns of ``rows``) that follow it."""
        atoms = rows[path.cols]
        floats = _floats(atoms, path.coef_sum)
        forward = _product(path.forward, atoms, floats)
        backward = _product(path.backward, atoms, floats)
        fwd, bwd = forward.max(axis=0), backward.max(axis=0)
        out["saved_bytes"][target] = _product(path.saved, atoms, floats)[0]
        out["reserved_peak_bytes"][target] = _product(path.reserved, atoms, floats)[0]
        out["forward_peak_bytes"][target] = fwd
        out["backward_peak_bytes"][target] = bwd
        out["peak_bytes"][target] = np.maximum(fwd, bwd)
        out["floor_peak_bytes"][target] = _product(path.floor, atoms, floats).max(axis=0)
        if self.quadratic:
            at_f, at_b = np.argmax(forward, axis=0)[None], np.argmax(backward, axis=0)[None]
            quad_f = np.take_along_axis(_product(path.forward_quad, atoms, floats), at_f, 0)[0]
            quad_b = np.take_along_axis(_product(path.backward_quad, atoms, floats), at_b, 0)[0]
            out["quadratic_bytes"][target] = np.where(bwd > fwd, quad_b, quad_f)
        path_ids[target] = pid

    def _check(self, path: Path, rep: dict) -> bool:
        """The recorded path's figures for its configuration equal ``predict``'s. (If
        ``memcalc.timeline`` learns a rule this module does not mirror, the difference shows
        here and the configurations take the scalar replay, counted as "unmodelled".)"""
        from memcalc.timeline import predict

        return predict(self._config(rep)).figures() == path.figures

    def _config(self, env: dict) -> Config:
        return self.base.replace(**{_FIELDS[k]: v for k, v in env.items()})

    def _scalar(self, leaves: dict, idx: np.ndarray, out: dict, path_ids: np.ndarray,
                fallback: dict, reason: str) -> None:
        """The scalar replay, configuration by configuration."""
        if len(idx) == 0:
            return
        from memcalc.timeline import predict

        fallback[reason] = fallback.get(reason, 0) + len(idx)
        for j, i in enumerate(idx):
            env = {k: int(v[j]) for k, v in leaves.items()}
            figures = scalar_figures(predict(self._config(env)), self.quadratic)
            for k, v in figures.items():
                if abs(v) >= SAFE and out[k].dtype != object:
                    out[k] = out[k].astype(object)
                out[k][i] = v
            path_ids[i] = -1


def scalar_figures(b, quadratic: frozenset[str]) -> dict[str, int]:
    """``Figures``' entries from one ``Breakdown``. Its floor is taken at the two phase
    peaks (the rounded sizes alive at any moment bound every replay from below)."""
    floor = max(sum(round_size(c.nbytes) for c in live) for live in (b.forward_live, b.backward_live))
    quad = sum(c.block_bytes for c in b.components if c.name in quadratic)
    return {**b.figures(), "floor_peak_bytes": floor, "quadratic_bytes": quad}


def _dims(base: Config, values: dict):
    """``base``'s sizes with the grid's leaf values (``M`` follows ``N`` and ``Hk`` follows
    ``H`` unless the grid sets them)."""
    return base.dims.replace(B=values["B"], H=values["H"], N=values["N"],
                             M=values.get("M", values["N"]), D=values["D"],
                             Hk=values.get("Hk", values["H"]), chunk=values["chunk"])


_FIELDS = {"B": "batch", "H": "heads", "N": "seq_len", "D": "head_dim", "M": "kv_len",
           "Hk": "kv_heads", "chunk": "chunk"}


def _leaves_of(axes: dict[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
    leaves = {"B": axes["batch"], "H": axes["heads"], "N": axes["seq_len"], "D": axes["head_dim"],
              "chunk": axes["chunk"]}
    if axes.get("kv_len") is not None:
        leaves["M"] = axes["kv_len"]
    if axes.get("kv_heads") is not None:
        leaves["Hk"] = axes["kv_heads"]
    return {k: np.ascontiguousarray(np.broadcast_to(np.asarray(v, dtype=np.int64), (n,)))
            for k, v in leaves.items()}


# --- module API --------------------------------------------------------------------------

_EVALUATORS: dict[str, Evaluator] = {}


def evaluator(base: Config) -> Evaluator:
    """The cached evaluator of ``base``'s implementation, dtype, flags and protocol."""
    key = base.model_dump_json(exclude={"shape": set(AXES), "chunk": True})
    if key not in _EVALUATORS:
        _EVALUATORS[key] = Evaluator(base)
    return _EVALUATORS[key]


def grid_axes(base: Config, **axes) -> dict[str, np.ndarray | None]:
    """``axes`` (shape field or ``chunk`` -> int or integer array) broadcast together and
    against ``base``, flattened in C order. ValueError naming the field on a size < 1, a
    kv_heads that does not divide heads, or GQA for an implementation without it."""
    s = base.shape
    values = {"batch": s.batch, "heads": s.heads, "seq_len": s.seq_len, "head_dim": s.head_dim,
              "kv_len": s.kv_len, "kv_heads": s.kv_heads, "chunk": base.chunk}
    unknown = set(axes) - set(values)
    if unknown:
        raise ValueError(f"unknown grid axis {sorted(unknown)[0]!r}; known: {', '.join(values)}")
    values.update(axes)
    arrays = {k: (None if v is None else np.asarray(v)) for k, v in values.items()}
    shape = np.broadcast_shapes(*(v.shape for v in arrays.values() if v is not None))
    n = int(np.prod(shape)) if shape else 1
    out: dict[str, np.ndarray | None] = {}
    for k, v in arrays.items():
        if v is None:
            out[k] = None
            continue
        if v.dtype.kind not in "iu" and not (v.dtype == object and all(isinstance(x, int) for x in v.flat)):
            raise ValueError(f"{k}: sizes must be integers")
        flat = np.broadcast_to(v, shape).reshape(n)
        low, high = (flat.min(), flat.max()) if n else (1, 1)
        if low < 1:
            raise ValueError(f"{k}: sizes must be >= 1 (got {int(low)})")
        if high >= 1 << 62:
            raise ValueError(f"{k}: sizes must be below 2^62")
        out[k] = flat.astype(np.int64)
    heads = out["heads"]
    kv_heads = out["kv_heads"] if out["kv_heads"] is not None else heads
    if n and (heads % kv_heads).any():
        raise ValueError("kv_heads: kv_heads must divide heads")
    if n and out["kv_heads"] is not None and (kv_heads != heads).any() and not get_impl(base.impl).gqa:
        raise ValueError(f"kv_heads: implementation {base.impl} needs kv_heads == heads")
    return out


def evaluate(base: Config, **axes) -> Figures:
    """``predict``'s figures (and ``Figures``' extras) for ``base`` with shape fields
    replaced by the grid ``axes`` (``seq_len=np.arange(1, 10**6)``, ``head_dim=[16, 64]``...;
    broadcast together, flattened in C order), all at once and to the byte."""
    arrays = grid_axes(base, **axes)
    if len(arrays["batch"]) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Figures(*(empty,) * len(FIGURES), path=empty)
    return evaluator(base).evaluate(arrays)


def classify(figures: Figures, budget_bytes: int) -> np.ndarray:
    """Per configuration: 1 fits in ``budget_bytes``, 0 does not, -1 undecided here (then
    ``memcalc.budget.fit`` decides, replaying under the capacity).

    Fits when the reserved peak on an unbounded device is within the budget: the replay
    under that capacity never reaches it, so it is the same replay. Does not fit when the
    rounded request sizes alive at one moment already exceed the budget: under any
    capacity the reserved memory would have to hold them. In between, whether releasing
    the cached segments and retrying (as PyTorch does) saves the step is up to the replay."""
    out = np.full(len(figures), -1, dtype=np.int64)
    out[np.asarray(figures.reserved_peak_bytes <= budget_bytes, dtype=bool)] = 1
    out[np.asarray(figures.floor_peak_bytes > budget_bytes, dtype=bool)] = 0
    return out
