"""Vectorized predictions: ``predict``'s figures for whole grids at once, to the byte.

An implementation's program has the same events for every size; only the sizes change.
This module evaluates one program for many configurations with numpy, in three steps; the
pieces live beside it: ``memcalc.engine.symbolic`` (placeholder sizes), ``memcalc.engine.forms`` (linear
forms, size classes and guards) and ``memcalc.engine.recorder`` (the recorded replay).

1. **Symbolic sizes.** The program builder is called once per group (same implementation,
   dtype, flags, protocol) with the integer fields that vary across the grid replaced by
   ``Sym`` placeholders. Every tensor size comes out as an expression (``8 * N * M * 4``),
   evaluated later as an ``int64`` array over the grid. A builder that branches on a size
   (``if d.N > 1024``, ``range(d.N // d.chunk)``, ``max(...)``) raises ``SizeDependent``
   naming the fields it looked at; those fields are then held fixed (the grid is split by
   their values) and the build retried.

2. **Paths.** The caching allocator (``memcalc.engine.allocator``, the one model, here over sizes
   that are ``Form``s: ``FormSizes``) decides, at every ``malloc``, the pool (size <= 1 MiB),
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
   Each new path is checked once against ``memcalc.analysis.predict.predict`` on the configuration
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
   * ``small``: fewer than ``SCALAR_BELOW`` configurations share a program, and ``tail``:
     at most ``SCALAR_TAIL`` configurations, over all calls, reached a signature with no
     path that holds (recording a path costs about four replays);
   * ``paths``: more than ``MAX_PATHS`` new paths in one call for one signature;
   * ``unmodelled``: a recorded path disagreed with ``predict`` on the configuration that
     recorded it (both run ``engine.replay.replay`` over ``allocator.CachingAllocator``, this
     one on forms: a disagreement is a bug in the forms' arithmetic, and the tests fail
     on it).

   Configurations whose sizes could exceed ``int64`` (beyond 2^52 B per tensor, about
   4 PiB) are no fallback: they take the same paths, evaluated on Python integers
   (``object`` arrays), exact and slower.

The reserved peak computed here is the one of an unbounded device (``capacity=None``):
under a capacity, PyTorch frees cached segments and retries before raising, which changes
the replay. ``classify`` therefore decides "fits" only where that cannot matter (reserved
peak <= budget: fits; the blocks' rounded sizes alone exceed the budget: does not) and
leaves the rest to ``memcalc.analysis.budget.fit``, the one definition of fitting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from memcalc.engine.allocator import MIN_BLOCK, ROUND_LARGE, round_size
from memcalc.analysis.breakdown import FIGURES as BREAKDOWN_FIGURES
from memcalc.config import Config
from memcalc.engine.forms import _size_classes
from memcalc.impls import get_impl
from memcalc.analysis.quadratic import quadratic_names
from memcalc.engine.recorder import Group as _Group, Path, record
from memcalc.engine.symbolic import SizeDependent, Sym, bound_sym, evaluate_sym  # noqa: F401
from memcalc.impls.reductions import forget

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
    """``matrix`` (forms) times ``atoms``: in float64 when that is exact, else in float64
    limbs (``_limb_product``), else int64, or Python integers when the atoms need them."""
    if floats is not None:
        return _float_product(matrix.astype(np.float64) if matrix_f is None else matrix_f,
                              floats)
    limbed = _limb_product(matrix, atoms, matrix_f)
    if limbed is not None:
        return limbed
    if atoms.dtype == object:
        return matrix.astype(object) @ atoms
    return _forms(matrix, atoms)


def _float_product(mf: np.ndarray, floats: np.ndarray) -> np.ndarray:
    """``mf @ floats`` as int64, for products every partial sum of which is an exact float."""
    n = floats.shape[1]
    if n <= BLOCK:
        return (mf @ floats).astype(np.int64)
    out = np.empty((mf.shape[0], n), dtype=np.int64)
    for start in range(0, n, BLOCK):  # small blocks: BLAS stays on one fast thread
        out[:, start:start + BLOCK] = mf @ floats[:, start:start + BLOCK]
    return out


def _limb_product(matrix: np.ndarray, atoms: np.ndarray,
                  matrix_f: np.ndarray | None) -> np.ndarray | None:
    """``matrix @ atoms``, exact, with float64 products: the atoms are cut into limbs of
    ``bits`` bits, few enough that every partial sum of ``matrix`` times one limb is below
    2^53 (an exact float); the limbs' products are then shifted back together in int64.
    None where some result could pass 2^62 (then only Python integers hold it)."""
    if atoms.size == 0 or int(atoms.min()) < 0:
        return None
    weights = np.abs(matrix).astype(np.float64)
    largest = atoms.max(axis=1).astype(np.float64)  # each atom's largest value
    if (weights @ largest).max(initial=0) >= 2.0 ** 61:  # a sum of |c| a: some result might
        return None  # pass 2^62 (the float sum is within a part in 2^50 of the true one)
    bits = 52
    while bits > 1 and (weights @ np.minimum(largest, 2.0 ** bits - 1)).max(initial=0) >= 2.0 ** 52:
        bits -= 1  # a limb < 2^bits: every partial sum below 2^53, exact as a float
    whole = atoms.astype(np.int64)
    mf = matrix_f if matrix_f is not None else matrix.astype(np.float64)
    out = np.zeros((matrix.shape[0], atoms.shape[1]), dtype=np.int64)
    for shift in range(0, max(int(whole.max()).bit_length(), 1), bits):
        limb = (whole >> shift) & ((1 << bits) - 1)
        out += _float_product(mf, limb.astype(np.float64)) << shift
    return out


def _floats(atoms: np.ndarray, coef_sum: int) -> np.ndarray | None:
    """``atoms`` as float64 when every partial sum of a form stays below 2^53 (then the
    float matrix product is exact), else None."""
    if atoms.dtype != object and atoms.size and coef_sum * int(atoms.max()) < FLOAT_EXACT:
        return atoms.astype(np.float64)
    return None


def _atom_rows(sizes: list, env: dict, n: int) -> np.ndarray:
    """For each distinct size: its rounded block and its 2 MiB-rounded segment, one row
    each over the ``n`` configurations, then a row of ones (the forms' constant column).
    ``int64``, or Python integers (``object``) when ``env``'s leaves are."""
    exact = any(getattr(v, "dtype", None) == object for v in env.values())
    rows = np.empty((2 * len(sizes) + 1, n), dtype=object if exact else np.int64)
    memo: dict = {}
    for i, expr in enumerate(sizes):
        nbytes = np.broadcast_to(evaluate_sym(expr, env, memo), (n,))
        r = np.maximum(-(-nbytes // MIN_BLOCK) * MIN_BLOCK, MIN_BLOCK)  # round_size
        r[nbytes <= 0] = 0
        rows[2 * i], rows[2 * i + 1] = r, -(-r // ROUND_LARGE) * ROUND_LARGE
    rows[-1] = 1
    return rows


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
        if self.base.cp > 1 or self.base.tp > 1:  # the grid's sizes are the whole step's,
            # not a rank's (Dims.of divides them): each configuration replayed as it is
            self._scalar(leaves, np.arange(n), out, path_ids, fallback, "parallel")
            return Figures(**out, path=path_ids, fallback=fallback)
        if self.base.protocol.alloc_conf:  # expandable segments are modelled one
            # configuration at a time (memcalc.engine.allocator): each replayed as it is
            self._scalar(leaves, np.arange(n), out, path_ids, fallback, "alloc_conf")
            return Figures(**out, path=path_ids, fallback=fallback)
        for start in range(0, n, CHUNK):
            sl = slice(start, min(n, start + CHUNK))
            chunk = {k: v[sl] for k, v in leaves.items()}
            self._evaluate(chunk, np.arange(sl.start, sl.stop), out, path_ids, fallback,
                           frozenset())
        forget()  # the reduction kernels' per-configuration cache (impls.reductions)
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
        if not safe.all():  # sizes past int64: the same paths on Python integers
            self._evaluate_group(group, {k: v[~safe].astype(object) for k, v in leaves.items()},
                                 idx[~safe], out, path_ids, fallback)
            leaves, idx = {k: v[safe] for k, v in leaves.items()}, idx[safe]
            if len(idx) == 0:
                return
        self._evaluate_group(group, leaves, idx, out, path_ids, fallback)

    def _evaluate_group(self, group: _Group, leaves: dict, idx: np.ndarray, out: dict,
                        path_ids: np.ndarray, fallback: dict) -> None:
        n = len(idx)
        env = {k: (v if k in group.symbolic else int(v[0])) for k, v in leaves.items()}
        rows = _atom_rows(group.sizes, env, n)
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
            if not self._check(path, rep):  # the replay here and engine/replay.py disagree
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
                self.groups[key] = _Group.build(self.impl, d, symbolic)
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
        if atoms.dtype == object:  # Python integers: so must the figures be
            out.update({k: v.astype(object) for k, v in out.items() if v.dtype != object})
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
        ``memcalc.engine.replay`` learns a rule this module does not mirror, the difference shows
        here and the configurations take the scalar replay, counted as "unmodelled".)"""
        from memcalc.analysis.predict import predict

        return predict(self._config(rep)).figures() == path.figures

    def _config(self, env: dict) -> Config:
        """The configuration at one point: the grid's sizes, key/value length and heads
        following the queries' where the grid has none (the evaluator is shared by bases
        that differ in shape: one built from a base with a kv_len must not keep it)."""
        sizes = {"kv_len": None, "kv_heads": None, **{_FIELDS[k]: v for k, v in env.items()}}
        return self.base.replace(**sizes)

    def _scalar(self, leaves: dict, idx: np.ndarray, out: dict, path_ids: np.ndarray,
                fallback: dict, reason: str) -> None:
        """The scalar replay, configuration by configuration."""
        if len(idx) == 0:
            return
        from memcalc.analysis.predict import predict

        fallback[reason] = fallback.get(reason, 0) + len(idx)
        for j, i in enumerate(idx):
            env = {k: int(v[j]) for k, v in leaves.items()}
            figures = scalar_figures(predict(self._config(env)), self.quadratic)
            for k, v in figures.items():
                if k not in out:  # a training step's optimizer peak: inside peak_bytes
                    continue
                if abs(v) >= SAFE and out[k].dtype != object:
                    out[k] = out[k].astype(object)
                out[k][i] = v
            path_ids[i] = -1


def scalar_figures(b, quadratic: frozenset[str]) -> dict[str, int]:
    """``Figures``' entries from one ``Breakdown``. Its floor is taken at the two phase
    peaks (the rounded sizes alive at any moment bound every replay from below)."""
    floor = max(sum(round_size(c.bytes) for c in live) for live in (b.forward_live, b.backward_live))
    quad = sum(c.allocated for c in b.components if c.name in quadratic)
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
    ``memcalc.analysis.budget.fit`` decides, replaying under the capacity).

    Fits when the reserved peak on an unbounded device is within the budget: the replay
    under that capacity never reaches it, so it is the same replay. Does not fit when the
    rounded request sizes alive at one moment already exceed the budget: under any
    capacity the reserved memory would have to hold them. In between, whether releasing
    the cached segments and retrying (as PyTorch does) saves the step is up to the replay."""
    out = np.full(len(figures), -1, dtype=np.int64)
    out[np.asarray(figures.reserved_peak_bytes <= budget_bytes, dtype=bool)] = 1
    out[np.asarray(figures.floor_peak_bytes > budget_bytes, dtype=bool)] = 0
    return out
