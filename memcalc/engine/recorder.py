"""The recorded replay: ``memcalc.engine.replay``'s protocol over ``Form`` sizes, as a path.

``FormSizes`` gives the one allocator model (``memcalc.engine.allocator``) its arithmetic over
forms, recording each decision as a guard; ``Recorder`` is the replay's ledger over
those sizes; ``record`` replays a group's program for one configuration and returns its
``Path``: the guards and every figure as forms, as integer matrices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from memcalc.engine.allocator import CachingAllocator, Sizes, round_segment, round_size
from memcalc.engine.forms import ZERO, Form, _simplify, constant
from memcalc.engine.symbolic import Sym, evaluate_sym
from memcalc.engine.program import Tensor
from memcalc.engine.replay import Ledger, Live, replay, step_inputs

@dataclass
class Group:
    """A program built with some fields symbolic, its distinct sizes and its paths."""

    dims: Any  # the sizes, some of them ``Sym`` placeholders
    program: Any
    symbolic: frozenset[str]
    sizes: list[Sym]
    index: dict[tuple, int]
    nbytes: dict[int, Any]  # id(tensor event) -> its size expression
    paths: list[Path] = field(default_factory=list)
    by_signature: dict = field(default_factory=dict)

    @classmethod
    def build(cls, impl, d, symbolic: frozenset[str]) -> "Group":
        """``impl``'s program over ``d`` (some sizes ``Sym`` placeholders), with its distinct
        symbolic sizes in the order they are first declared, the inputs' first."""
        program = impl.build(d)
        sizes: dict[tuple, Sym] = {}
        each: dict[int, Any] = {}
        for t in (*step_inputs(program, d), *program.forward, *program.backward):
            if isinstance(t, Tensor):
                nbytes = each[id(t)] = t.bytes
                if isinstance(nbytes, Sym):
                    sizes.setdefault(nbytes.key, nbytes)
        return cls(d, program, symbolic, list(sizes.values()),
                   {k: i for i, k in enumerate(sizes)}, each)


class FormSizes(Sizes):
    """The allocator's arithmetic over ``Form``s: every decision is recorded as a guard.
    A request's block is the atom of its size (kind 0), its large segment the atom of its
    size rounded to 2 MiB (kind 1)."""

    def __init__(self, group: "Group", env: dict):
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

    plain_keys = False  # comparing two keys records a guard
    may_mirror = False  # the measured step's decisions are guards too

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
    """``memcalc.engine.replay``'s ledger over ``Form`` sizes: the same replay, recording the
    figures as forms. Besides the allocated bytes it keeps, at each moment, the rounded
    request sizes alive (``floor``) and the blocks of the N x M tensors (``quad``); a peak
    is the largest of the moments just before memory is freed."""

    def __init__(self, group: "Group", env: dict, workspace_bytes: int,
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

    def alloc(self, key, item, stream: int = 0) -> None:
        nbytes = self.nbytes.get(id(item), item.bytes)
        live = self.live[key] = Live(item, self.allocator.malloc(nbytes, stream))
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


def record(group: "Group", env: dict, workspace_bytes: int, quadratic: frozenset[str],
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
    # no capacity, so nothing is released: reserved memory only grows, and its final count
    # is the reserved peak (a form; the recording sizes keep no peaks, ``Sizes.top``)
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
