"""The registry of attention implementations: one name, one program builder, one source.

Implementation modules (``memcalc/impls/``) register their builders with ``@register``; a
builder is a small pure function from ``Dims`` to a ``Program`` (its tensors and their
lifetimes), in the manner of ``torch/utils/flop_counter.py``'s registry of formulas.
``memcalc.impls`` imports every module of the package once, explicitly, so the registry
does not depend on who imports what first. A name registered twice is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from memcalc.impls.accepted import Accepted, context_parallel, every
from memcalc.engine.dims import Dims
from memcalc.engine.inputs import QKV, Input
from memcalc.engine.status import detail
from memcalc.engine.program import Program
from memcalc.engine.work import check_program


def no_rules(d: Dims) -> tuple[Accepted, ...]:
    """What an implementation that refuses no size declares."""
    return ()


@dataclass(frozen=True)
class Impl:
    """A registered implementation: its name, a one-line summary and its program."""

    name: str
    summary: str
    build: Callable[[Dims], Program]
    gqa: bool = False  # supports fewer key/value heads than query heads
    traced: bool = True  # validated against the emulated trace; False: source-derived only
    # the sizes it accepts, for the other sizes of ``d``: what its check refuses, what a
    # search probes (``memcalc.impls.accepted``)
    accepted: Callable[[Dims], tuple[Accepted, ...]] = no_rules
    chunked: bool = False  # reads Dims.chunk (--chunk): a loop over chunks of rows
    # the shape fields its program reads (``Shape``'s names), None: all; titles leave the
    # others out (a traced module called with x=(B, N, 768) reads no heads nor head dim)
    reads: frozenset[str] | None = None
    source: str = "PyTorch's CUDA kernel sources"  # where a source-derived one is read from
    inputs: tuple[Input, ...] = QKV  # what its step is called with (the live runs' too)
    masks: tuple[str, ...] = ()  # the kinds of Dims.mask (--mask) it reads
    user_code: bool = False  # a user's function registered by ``memcalc trace``
    # traced code's program of one direct trace at exactly these sizes (its ``build`` may be
    # fitted over lengths), to confirm an answer with; and how its programs are made
    exact: Callable[[Dims], Program] | None = None
    how: Callable[[Dims], str] | None = None
    # what a title says after the sizes, given --dtype's name (None: that name): a traced
    # step's dtypes (--dtype only where an input takes it, its weights', autocast's) and
    # the training loop around it
    title: Callable[[str], str] | None = None
    # what it runs as with d's sizes, shown beside its name (``sdpa``: the kernel picked)
    runs: Callable[[Dims], str] | None = None
    # traced code under --cp: the implementation whose kernel its ring runs, as its traces
    # saw it ("sdpa-efficient"; "": flash's or cuDNN's), for the lengths the ring takes
    ring_kernel: Callable[[Dims], str] | None = None

    def rule(self, d: Dims, field: str) -> Accepted:
        """The values of ``field`` this implementation accepts with ``d``'s other sizes."""
        if d.cp > 1 and field in ("seq_len", "kv_len"):  # the ring's sharding
            kernel = self.ring_kernel(d) if self.ring_kernel else self.name
            return context_parallel(d.cp, field, kernel, d.cp_method)
        return next((a for a in self.accepted(d) if a.field == field), every(field))

    def program(self, d: Dims) -> Program:
        """The program for ``d``. Builders are pure functions of their sizes, so small
        programs are built once per implementation and sizes (a re-registered
        implementation is another ``Impl``, another key); long ones (chunked loops at
        large lengths) are not kept. Every caller goes through here: the replay, the
        solver's event counts, the N x M test, a wrapper's inner program."""
        key = (self, d)
        if key in _PROGRAMS:
            return _PROGRAMS[key]
        detail("building the program")  # a loop at millions of rows: seconds
        self._check_work(d)
        built = self.build(d)
        if len(built.forward) + len(built.backward) <= CACHED_EVENTS:
            if len(_PROGRAMS) >= CACHED_PROGRAMS:
                del _PROGRAMS[next(iter(_PROGRAMS))]  # the oldest
            _PROGRAMS[key] = built
        return built


    def _check_work(self, d: Dims) -> None:
        """Refuse, before building it, a program whose events would take more memory than
        ``memcalc.engine.work``'s limit; estimated from this builder's programs at 2,048 and 4,096
        rows (seq_len and kv_len scaled alike). Sizes it refuses there are left to it."""
        if not (isinstance(d.N, int) and isinstance(d.M, int)):
            return  # symbolic sizes: the grid path's one program for every length
        length = max(d.N, d.M)

        def events_at(n: int) -> int:
            p = self.program(d.replace(N=max(1, d.N * n // length), M=max(1, d.M * n // length)))
            return len(p.forward) + len(p.backward)

        check_program(f"{self.name}: at seq_len {d.N:,}", length, events_at)


IMPLS: dict[str, Impl] = {}
_PROGRAMS: dict[tuple[Impl, Dims], Program] = {}
CACHED_PROGRAMS, CACHED_EVENTS = 128, 20_000  # how many programs are kept, and how large


def add(impl: Impl, replace: bool = False) -> Impl:
    """Register ``impl``; a second implementation of the same name is an error unless
    ``replace`` says the caller means it (a traced function traced again)."""
    if impl.name in IMPLS and not replace:
        raise ValueError(f"implementation {impl.name!r} is already registered")
    IMPLS[impl.name] = impl
    return impl


def register(name: str, summary: str, gqa: bool = False, traced: bool = True,
             accepted: Callable[[Dims], tuple[Accepted, ...]] = no_rules,
             chunked: bool = False, source: str = Impl.source,
             inputs: tuple[Input, ...] = QKV, masks: tuple[str, ...] = (),
             how: Callable[[Dims], str] | None = None,
             runs: Callable[[Dims], str] | None = None):
    """Decorator: register ``build`` as implementation ``name``. ``traced=False`` marks a
    model derived from kernel sources that the meta device cannot check (fused CUDA kernels),
    ``source`` says whose; ``accepted``: the sizes it accepts (``Impl.accepted``);
    ``chunked``: it reads ``--chunk``; ``inputs``: its step's arguments, ``(B, H, N, d)``
    q, k, v by default; ``masks``: the kinds of ``--mask`` it reads; ``how``: what a result
    says of how its program is made, ``runs``: what it runs as (``sdpa``: the kernel picked,
    and why)."""

    def wrap(build: Callable[[Dims], Program]):
        add(Impl(name, summary, build, gqa, traced, accepted, chunked, source=source,
                 inputs=inputs, masks=masks, how=how, runs=runs))
        return build

    return wrap
