"""Replays a program through the allocator model, following the measurement protocol.

One replay (``replay``) serves every path: ``memcalc.analysis.predict`` on integers, the
grid recorder (``memcalc.engine.recorder``, a ``Ledger`` subclass) on symbolic sizes, and
the emulated tracer (``memcalc/tracing/tracer.py``), which hands its allocations to the
same ``Ledger``.
So a difference between prediction and trace can only come from the tensors and lifetimes.

The ledger keeps each allocation's declaration as it came (a ``Tensor`` of a program, or a
``Component`` of a trace) with its block; ``Component`` results are built only for the live
sets that are reported. The live set at a peak is not copied when the peak rises: the
ledger logs the allocations and frees of the phase and rebuilds that set once, on demand.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from functools import lru_cache
from typing import Hashable, NamedTuple

from memcalc.engine.allocator import DEFAULT_SETTINGS, Block, CachingAllocator, Settings
from memcalc.engine.component import Component
from memcalc.engine.deadline import tick
from memcalc.engine.dims import Dims
from memcalc.engine.inputs import input_tensors
from memcalc.engine.program import Cublas, Free, Program, Release, Role, Stream, Tensor
from memcalc.engine.status import detail, listening


class Entry(NamedTuple):
    """One entry of a recording ledger's history: an allocation, a free or a phase mark,
    and the allocated and reserved bytes right after it."""

    kind: str  # alloc | free | phase
    component: Component | None
    allocated: int
    reserved: int
    label: str = ""


class Live:
    """An allocation the ledger holds: its declaration (``Tensor`` or ``Component``) and
    block; ``component`` is the reported form, built once when first asked for."""

    __slots__ = ("item", "role", "block", "block_bytes", "_component")

    def __init__(self, item, block: Block | None):
        self.item = item
        self.role = item.role  # read per name of every free; the item is immutable
        self.block = block
        # taken now: a block's size is fixed while it is allocated, not once it is freed
        self.block_bytes = block.size if block is not None else 0
        self._component = None

    @property
    def component(self) -> Component:
        if self._component is None:
            self._component = _component(self.item, self.block_bytes)
        return self._component

    @component.setter
    def component(self, value: Component) -> None:
        self._component = value


def _component(item, block_bytes: int) -> Component:
    """The reported form of a declaration with the block it got."""
    if isinstance(item, Component):
        return item.model_copy(update={"allocated": block_bytes})
    return _declared(item, block_bytes)


@lru_cache(maxsize=4096)
def _declared(t: Tensor, block_bytes: int) -> Component:
    """A program's tensor as a component. Built from the program's own declaration, so
    nothing to validate; frozen, so shared by every replay of the same program
    (``program`` keeps its declarations). A copy of its kind's component under its name:
    a long loop reports a hundred thousand tensors of a few kinds, and a copy is made in
    half the time of a new component."""
    return _unnamed(t.role, t.op, t.shape, t.dtype, t.bytes, block_bytes).model_copy(
        update={"name": t.name})


@lru_cache(maxsize=1024)
def _unnamed(role: Role, op: str, shape: tuple[int, ...], dtype: str, nbytes: int,
             block_bytes: int) -> Component:
    """The component of every tensor of this kind, but for its name."""
    return Component.model_construct(name="", role=role, op=op, shape=shape, dtype=dtype,
                                      bytes=nbytes, allocated=block_bytes, source="")


class Ledger:
    """Live allocations, keyed by whatever names them, over one allocator model."""

    def __init__(self, workspace_bytes: int, capacity: int | None = None, record: bool = False,
                 allocator: CachingAllocator | None = None,
                 settings: Settings = DEFAULT_SETTINGS):
        self.allocator = allocator or CachingAllocator(capacity, settings=settings)
        self.workspace_bytes = workspace_bytes
        self.live: dict[Hashable, Live] = {}
        self.history: list[Entry] | None = [] if record else None
        self._start: dict[Hashable, Live] = {}  # the live set when the peak was last reset
        # changes since then; None until the first reset (the protocol reads the live set
        # at a peak only after one: a warm-up step's million changes need no log)
        self._log: list[tuple[Hashable, Live | None]] | None = None
        self._peak_at = 0  # how many of those changes the peak had seen

    def alloc(self, key: Hashable, item, stream: int = 0) -> None:
        """Allocate ``item`` (a ``Tensor`` or ``Component``: anything with ``bytes`` and
        ``role``) on ``stream`` (0: the default one); note where the peak rises."""
        allocator, log = self.allocator, self._log
        before = allocator.peak_allocated
        live = self.live[key] = Live(item, allocator.malloc(item.bytes, stream))
        if log is not None:
            log.append((key, live))
            if allocator.peak_allocated != before:
                self._peak_at = len(log)
        if self.history is not None:
            self._record("alloc", live)

    def free(self, key: Hashable) -> None:
        live = self.live.pop(key)
        self.allocator.free(live.block)
        if self._log is not None:
            self._log.append((key, None))
        if self.history is not None:
            self._record("free", live)

    def _record(self, kind: str, live: Live | None, label: str = "") -> None:
        """With ``record``, keep every event and the allocated bytes after it."""
        if self.history is not None:
            a, component = self.allocator, live.component if live else None
            self.history.append(Entry(kind, component, a.allocated, a.reserved, label))

    def phase(self, label: str) -> None:
        """Mark the start of a protocol phase in the history."""
        self._record("phase", None, label)

    def ensure_workspace(self, thread: str, source: str = "", library: str = "cuBLAS",
                         nbytes: int | None = None) -> None:
        """The thread's cuBLAS workspace, created at its first cuBLAS call (or, with
        ``library="cuBLASLt"``, a separate cuBLASLt workspace of ``nbytes``)."""
        key = (f"{library.lower()}_workspace", thread)
        if key not in self.live:
            size = self.workspace_bytes if nbytes is None else nbytes
            name = f"{library} workspace, {thread} thread"
            self.alloc(key, Component(name=name, role=Role.workspace, op=library.lower(),
                                      shape=(size,), dtype="uint8", bytes=size, allocated=0,
                                      source=source))

    def reset_peak(self) -> None:
        """``reset_peak_memory_stats()``: the peak restarts from what is alive now."""
        self.allocator.reset_peaks()
        self._start, self._log, self._peak_at = dict(self.live), [], 0

    @property
    def peak_live(self) -> tuple[Component, ...]:
        """What was alive at the peak since the last reset."""
        if self._log is None:
            raise RuntimeError("the live set at the peak is kept from the first reset_peak")
        live = dict(self._start)
        for key, entry in self._log[:self._peak_at]:
            if entry is None:
                del live[key]
            else:
                live[key] = entry
        return tuple(v.component for v in live.values())

    def components(self) -> tuple[Component, ...]:
        return tuple(v.component for v in self.live.values())

    def block_bytes(self, key: Hashable) -> int:
        return self.live[key].block_bytes


class Step(NamedTuple):
    """What ``replay`` leaves to read: what the measured forward left alive for backward
    (less the output), and the reserved peak of the measured step."""

    saved: list[Live]
    reserved_peak: object


def replay(ledger: Ledger, d: Dims, program: Program, on_phase=None) -> Step:
    """The measurement protocol over ``ledger``: inputs, a warm-up step, then the measured
    phases (forward and backward; a traced training loop's micro-steps and optimizer), each
    from a reset peak. ``on_phase(name)`` is called at the end of each measured phase
    (``"forward"``, ``"backward"``, ``"optimizer"``), where the caller reads its peak."""
    grad = not d.forward_only
    _run(ledger, step_inputs(program, d), "main", grad)
    ledger.allocator.mark_warm_up()
    _warm_up(ledger, program, grad)
    reserved, saved = None, []
    for label, events in program.measured(grad):
        ledger.reset_peak()
        before = set(ledger.live)
        _phase(ledger, label, len(events))
        _run(ledger, events, THREADS[label], grad)
        (on_phase or _ignore)(label)
        peak = ledger.allocator.peak_reserved
        reserved = peak if reserved is None else ledger.allocator.sizes.top(reserved, peak)
        if label == "forward":  # the last forward's: what it left alive for its backward
            saved = [v for k, v in ledger.live.items()
                     if k not in before and v.role is not Role.output]
    ledger.phase("end")
    if program.warm_up is None:
        _release(ledger, Role.output)  # protocol: del out
    return Step(saved, reserved)


# the thread each measured phase runs its cuBLAS calls on
THREADS = {"forward": "main", "backward": "autograd", "optimizer": "main"}


def _warm_up(ledger: Ledger, program: Program, grad: bool) -> None:
    """The warm-up step: the program's own (a traced training loop's, its frees included),
    else the forward and backward, then the protocol's ``del out`` and grads reset; the
    measured step then mirrors its small pool where that is exact (the same requests)."""
    if program.warm_up is not None:
        _phase(ledger, "warm-up", len(program.warm_up))
        _run(ledger, program.warm_up, "main", grad)
        return
    _phase(ledger, "warm-up", len(program.forward) + grad * len(program.backward))
    _run(ledger, program.forward, "main", grad)  # creates the workspaces, fills the cache
    if grad:
        _run(ledger, program.backward, "autograd", grad)
    _release(ledger, Role.output, Role.gradient)  # del out; q.grad = k.grad = v.grad = None
    ledger.allocator.mirror_small_pool()  # the same small-pool decisions as the warm-up's


def _ignore(phase: str) -> None:
    return None


_SAID = {"warm-up": "warm-up step", "forward": "measured forward",
         "backward": "measured backward", "optimizer": "measured optimizer step"}


def _phase(ledger: Ledger, label: str, events: int) -> None:
    """Mark a protocol phase of ``events`` events in the ledger, and on an open status
    line (a long loop's replay takes seconds per phase)."""
    ledger.phase(label)
    if listening():
        detail(f"{_SAID[label]} ({events:,} events)")


@contextmanager
def collector_paused():
    """Pause CPython's cyclic garbage collector while a program is built and replayed: a
    long loop makes millions of objects that are all still referenced, and every full
    collection walks them again (a third of a chunked replay at a million rows). Turned
    on only once they are freed: the first collection after it walks every object made
    while it was off and still alive (0.6 s when the program was still held)."""
    global _frozen
    if _frozen:  # objects an earlier Ctrl-C froze (below): collectable again
        gc.unfreeze()
        _frozen = False
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    except KeyboardInterrupt:
        # Ctrl-C unwinds with the program still held by the traceback: the collection that
        # turning the collector on starts would walk every object made while it was off
        # (1.2 s after a signal at 10 million rows). They wait in the permanent generation
        # (freed by reference counting as ever) until the next replay unfreezes them.
        if enabled:
            gc.freeze()
            _frozen = True
        raise
    finally:
        if enabled:
            gc.enable()


_frozen = False


def step_inputs(program: Program, d: Dims) -> tuple:
    """What exists before the warm-up step (protocol step 1): the program's own inputs (a
    traced module's state and arguments), else ``q, k, v`` and ``grad_out``."""
    return program.inputs if program.inputs is not None else tuple(input_tensors(d))


def _release(ledger: Ledger, *roles: Role) -> None:
    """Free every live tensor of these roles (``del out``; ``q.grad = None``)."""
    for key in [k for k, v in ledger.live.items() if v.role in roles]:
        ledger.free(key)


def _run(ledger: Ledger, events, thread: str, grad: bool) -> None:
    """Apply events in order. Under no_grad, ``saved`` tensors die with their last reference."""
    alloc, free, live = ledger.alloc, ledger.free, ledger.live
    stream = 0  # the CUDA stream allocations are made on (``Stream``)
    for start in range(0, len(events), _BATCH):
        tick(_BATCH)
        for event in events[start:start + _BATCH]:
            kind = type(event)
            if kind is Tensor:
                alloc(event.name, event, stream)
            elif kind is Free:
                for name in event.names:
                    if not (grad and live[name].role is Role.saved):
                        free(name)
            elif kind is Release:
                if grad:
                    for name in event.names:
                        free(name)
            elif kind is Cublas:
                ledger.ensure_workspace(event.thread or thread)
            elif kind is Stream:
                stream = event.number


_BATCH = 1024  # events counted at once towards the time limit
