"""One step's breakdown: a configuration's program, replayed (``memcalc.engine.replay``)
and read as the figures ``torch.cuda`` would report.

``predict`` is where a configuration meets the engine: it asks the registry for the
program of ``config.impl`` at ``config.dims``, replays it through a ``Ledger`` (with the
device's capacity, when asked) and builds the ``Breakdown`` from the live sets at the two
peaks and what the forward saved.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable

from memcalc.analysis.breakdown import Breakdown
from memcalc.config import Config
from memcalc.engine.allocator import MirrorBroken, OutOfMemory
from memcalc.engine.component import Component
from memcalc.engine.program import Dims, Program, Role, Tensor
from memcalc.engine.replay import Ledger, collector_paused, replay, step_inputs
from memcalc.impls import get_impl
from memcalc.impls.ring import step_program


_SHARED: ContextVar[dict | None] = ContextVar("shared_predictions", default=None)


@contextmanager
def shared_predictions():
    """Inside, ``predict(config)`` (unbounded, unrecorded) replays each configuration once:
    a command that asks for the same step from several places (``compare``: its rows and
    the threshold search's first probe) shares the result."""
    token = _SHARED.set({})
    try:
        yield
    finally:
        _SHARED.reset(token)


# a step's program at one rank's sizes (``Dims``, ``cp_rank`` among them), in place of its
# implementation's: a direct trace of traced code where its own is fitted (``Impl.exact``)
Build = Callable[[Dims], Program]


def predict(config: Config, capacity: int | None = None, ledger: Ledger | None = None,
            build: Build | None = None) -> Breakdown:
    """The breakdown of one step of ``config``, by replaying its program (or the programs
    ``build`` makes of each rank's step).

    With ``capacity``, raises ``OutOfMemory`` where the device would; pass a recording
    ``ledger`` to keep the event history."""
    shared = _SHARED.get()
    if shared is not None and capacity is None and ledger is None and build is None:
        if config not in shared:
            shared[config] = _predict(config, None, None, None)
        return shared[config]
    return _predict(config, capacity, ledger, build)


def _predict(config: Config, capacity: int | None, ledger: Ledger | None,
             build: Build | None) -> Breakdown:
    with collector_paused():  # on again once the program and the replay's ledger are gone
        return _replayed(config, capacity, ledger, build)


def _replayed(config: Config, capacity: int | None, ledger: Ledger | None,
              build: Build | None = None) -> Breakdown:
    """The replay, its small pool mirrored in the measured step where that is exact; a
    ledger of the caller's (its history is read afterwards) is never mirrored under a
    capacity, since a release there would have to replay it again."""
    if ledger is not None:
        ledger.allocator.may_mirror = capacity is None
        return _replayed_in(config, ledger, build)
    try:
        ledger = Ledger(config.workspace_bytes, capacity, settings=config.protocol.allocator)
        return _replayed_in(config, ledger, build)
    except MirrorBroken:  # the capped measured step released segments: every decision made
        ledger = Ledger(config.workspace_bytes, capacity, settings=config.protocol.allocator)
        ledger.allocator.may_mirror = False
        return _replayed_in(config, ledger, build)


def _replayed_in(config: Config, ledger: Ledger, build: Build | None = None) -> Breakdown:
    """One GPU's step; under context parallelism, every rank's (each in a ledger of its
    own: a rank that runs out is the step's ``OutOfMemory``), the busiest one's shown
    (``busiest``)."""
    d = config.dims
    of = build or (lambda rank_dims: None)  # None: the implementation's own
    if d.cp == 1:
        return _rank_replayed(config, d, ledger, of(d))
    ranks = [on_rank(r, lambda r=r: _rank_replayed(config, d.replace(cp_rank=r),
                                                   _like(ledger, config),
                                                   of(d.replace(cp_rank=r))))
             for r in range(d.cp)]
    rank = busiest(ranks)
    return ranked(_rank_replayed(config, d.replace(cp_rank=rank), ledger,
                                 of(d.replace(cp_rank=rank))), rank, ranks)


def on_rank(rank: int, step: Callable[[], Breakdown]) -> Breakdown:
    """``step()``, rank ``rank``'s: an ``OutOfMemory`` it raises says which rank ran out."""
    try:
        return step()
    except OutOfMemory as oom:
        oom.rank = rank
        raise


def ranked(shown: Breakdown, rank: int, ranks: list[Breakdown]) -> Breakdown:
    """``shown`` (rank ``rank``'s step) with which rank it is and every rank's peaks."""
    return shown.model_copy(update=dict(
        rank=rank, rank_peaks=tuple(b.peak_bytes for b in ranks),
        rank_reserved=tuple(b.reserved_peak_bytes for b in ranks)))


def busiest(ranks: list[Breakdown]) -> int:
    """The rank whose step must fit first: the highest ``max_memory_reserved`` (the fit is
    judged on it: the allocator's segments, not only the tensors), then the highest
    ``max_memory_allocated``, then the lowest rank."""
    return max(range(len(ranks)), key=lambda r: (ranks[r].reserved_peak_bytes,
                                                 ranks[r].peak_bytes, -r))


def rank_breakdown(config: Config, rank: int, ledger: Ledger | None = None,
                   program: Program | None = None) -> Breakdown:
    """Rank ``rank``'s step under ``--cp`` (``predict`` shows the busiest), replayed in
    ``ledger`` (a recording one, to read its history); ``program``: another program of the
    step than the configuration's (torch's ring over one rank, which ``--cp 1`` is not)."""
    return _rank_replayed(config, config.dims.replace(cp_rank=rank),
                          ledger or Ledger(config.workspace_bytes,
                                                     settings=config.protocol.allocator), program)


def _like(ledger: Ledger, config: Config) -> Ledger:
    """A new ledger of ``ledger``'s capacity and mirroring (another rank's device)."""
    other = Ledger(config.workspace_bytes, ledger.allocator.capacity,
                   settings=ledger.allocator.settings)
    other.allocator.may_mirror = ledger.allocator.may_mirror
    return other


def _rank_replayed(config: Config, d, ledger: Ledger, program: Program | None = None
                   ) -> Breakdown:
    peaks: dict[str, tuple[int, tuple[Component, ...]]] = {}

    def read(phase: str) -> None:  # a phase measured again (a micro-step) keeps the higher
        if ledger.allocator.peak_allocated > peaks.get(phase, (-1,))[0]:
            peaks[phase] = (ledger.allocator.peak_allocated, ledger.peak_live)

    step = replay(ledger, d, program or step_program(get_impl(config.impl), d), read)
    forward = peaks["forward"][1]
    if d.forward_only:  # under no_grad nothing is kept for a backward: the tracer's roles
        forward = tuple(_unsaved(c) for c in forward)
    return Breakdown(config=config, forward_live=forward,
                     backward_live=peaks.get("backward", (0, ()))[1],
                     optimizer_live=peaks.get("optimizer", (0, ()))[1],
                     saved=tuple(v.component for v in step.saved),
                     reserved_peak_bytes=step.reserved_peak)


def _unsaved(component: Component) -> Component:
    """A tensor the program declares saved, reported as the activation it is when the step
    runs under ``torch.no_grad()`` (it dies with its last reference)."""
    if component.role is not Role.saved:
        return component
    return component.model_copy(update={"role": Role.activation})


def tensor_sizes(config: Config, rank: int | None = None) -> dict[str, tuple[int, ...]]:
    """The requested bytes of every tensor the step declares, by name, one entry per
    declaration in program order (inputs, a traced loop's warm-up and every measured
    phase included): a name may be declared again (cuDNN's workspace, 256 B in the
    forward and the size of dq's accumulator in the backward). Under ``--cp``, rank
    ``rank``'s step (its ring steps hold other blocks than rank 0's)."""
    d = config.dims if rank is None else config.dims.replace(cp_rank=rank)
    program = step_program(get_impl(config.impl), d)
    sizes: dict[str, tuple[int, ...]] = {}
    phases = (e for phase in program.measured(not d.forward_only) for e in phase.events)
    for t in (*step_inputs(program, d), *(program.warm_up or ()), *phases):
        if isinstance(t, Tensor):
            sizes[t.name] = (*sizes.get(t.name, ()), t.bytes)
    return sizes
