"""Replays a program through the allocator model, following the measurement protocol.

``Ledger`` is shared with the emulated backend (``memcalc/validation/emulated.py``): both
hand allocations to the same allocator model and take their live sets the same way, so a
difference between prediction and trace can only come from the tensors and lifetimes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, NamedTuple

from memcalc.allocator import Block, CachingAllocator
from memcalc.breakdown import Breakdown, Component
from memcalc.config import Config
from memcalc.impls import get_impl
from memcalc.tensors import Cublas, Dims, Event, Free, Program, Release, Role, Tensor


class Entry(NamedTuple):
    """One entry of a recording ledger's history: an allocation, a free or a phase mark,
    and the allocated and reserved bytes right after it."""

    kind: str  # alloc | free | phase
    component: Component | None
    allocated: int
    reserved: int
    label: str = ""


@dataclass
class Live:
    """An allocation the ledger holds, with its block."""

    component: Component
    block: Block | None


class Ledger:
    """Live allocations, keyed by whatever names them, over one allocator model."""

    def __init__(self, workspace_bytes: int, capacity: int | None = None, record: bool = False):
        self.allocator = CachingAllocator(capacity)
        self.workspace_bytes = workspace_bytes
        self.live: dict[Hashable, Live] = {}
        self.peak_live: tuple[Component, ...] = ()
        self.history: list[Entry] | None = [] if record else None

    def alloc(self, key: Hashable, component: Component) -> None:
        """Allocate ``component``; remember the live set when the peak rises."""
        before = self.allocator.peak_allocated
        block = self.allocator.malloc(component.nbytes)
        size = block.size if block is not None else 0
        self.live[key] = Live(component.model_copy(update={"block_bytes": size}), block)
        if self.allocator.peak_allocated > before:
            self.peak_live = self.components()
        self._record("alloc", self.live[key].component)

    def free(self, key: Hashable) -> None:
        live = self.live.pop(key)
        self.allocator.free(live.block)
        self._record("free", live.component)

    def _record(self, kind: str, component: Component | None, label: str = "") -> None:
        """With ``record``, keep every event and the allocated bytes after it."""
        if self.history is not None:
            a = self.allocator
            self.history.append(Entry(kind, component, a.allocated, a.reserved, label))

    def phase(self, label: str) -> None:
        """Mark the start of a protocol phase in the history."""
        self._record("phase", None, label)

    def ensure_workspace(self, thread: str, source: str = "") -> None:
        """The thread's cuBLAS workspace, created at its first cuBLAS call."""
        key = ("cublas_workspace", thread)
        if key not in self.live:
            name = f"cuBLAS workspace, {thread} thread"
            self.alloc(key, Component(name=name, role=Role.workspace, op="cublas",
                                      shape=(self.workspace_bytes,), dtype="uint8",
                                      nbytes=self.workspace_bytes, block_bytes=0,
                                      source=source))

    def reset_peak(self) -> None:
        self.allocator.reset_peaks()
        self.peak_live = self.components()

    def components(self) -> tuple[Component, ...]:
        return tuple(v.component for v in self.live.values())

    def block_bytes(self, key: Hashable) -> int:
        return self.live[key].component.block_bytes


def predict(config: Config, capacity: int | None = None, ledger: Ledger | None = None) -> Breakdown:
    """The breakdown of one step of ``config``, by replaying its program (DESIGN.md s.1).

    With ``capacity``, raises ``OutOfMemory`` where the device would; pass a recording
    ``ledger`` to keep the event history."""
    program = get_impl(config.impl).build(Dims.of(config))
    ledger = ledger or Ledger(config.workspace_bytes, capacity)
    _inputs(ledger, config)
    grad = not config.protocol.forward_only
    ledger.phase("warm-up")
    _step(ledger, program, grad)  # warm-up: creates the workspaces, fills the cache
    ledger.reset_peak()
    before = set(ledger.live)
    ledger.phase("forward")
    _run(ledger, program.forward, "main", grad)
    forward_live = ledger.peak_live
    reserved = ledger.allocator.peak_reserved
    saved = tuple(v.component for k, v in ledger.live.items()
                  if k not in before and v.component.role is not Role.output)
    ledger.reset_peak()
    backward_live = ()
    if grad:
        ledger.phase("backward")
        _run(ledger, program.backward, "autograd", grad)
        backward_live = ledger.peak_live
    reserved = max(reserved, ledger.allocator.peak_reserved)
    ledger.phase("end")
    _release(ledger, Role.output)  # protocol: del out
    return Breakdown(config=config, forward_live=forward_live, backward_live=backward_live,
                     saved=saved, reserved_peak_bytes=reserved)


def _inputs(ledger: Ledger, config: Config) -> None:
    """``q, k, v`` and ``grad_out``, allocated in that order (protocol step 1)."""
    d = Dims.of(config)
    names = ["q", "k", "v"]
    if config.protocol.loss == "grad" and not config.protocol.forward_only:
        names.append("grad_out")
    for name in names:
        heads, rows = (d.H, d.N) if name in ("q", "grad_out") else (d.Hk, d.M)
        t = Tensor(name, (d.B, heads, rows, d.D), d.dtype, Role.input, "randn")
        ledger.alloc(name, _component(t))


def _step(ledger: Ledger, program: Program, grad: bool) -> None:
    """The warm-up step, then release its output and the leaf grads (protocol step 2)."""
    _run(ledger, program.forward, "main", grad)
    if grad:
        _run(ledger, program.backward, "autograd", grad)
    _release(ledger, Role.output, Role.gradient)


def _release(ledger: Ledger, *roles: Role) -> None:
    """Free every live tensor of these roles (``del out``; ``q.grad = None``)."""
    for key, live in list(ledger.live.items()):
        if live.component.role in roles:
            ledger.free(key)


def _run(ledger: Ledger, events: tuple[Event, ...], thread: str, grad: bool) -> None:
    """Apply events in order. Under no_grad, ``saved`` tensors die with their last reference."""
    for event in events:
        if isinstance(event, Tensor):
            ledger.alloc(event.name, _component(event))
        elif isinstance(event, Cublas):
            ledger.ensure_workspace(thread)
        elif isinstance(event, Release) and grad:
            for name in event.names:
                ledger.free(name)
        elif isinstance(event, Free):
            for name in event.names:
                if not (grad and ledger.live[name].component.role is Role.saved):
                    ledger.free(name)


def _component(t: Tensor) -> Component:
    return Component(name=t.name, role=t.role, op=t.op, shape=t.shape, dtype=t.dtype,
                     nbytes=t.nbytes, block_bytes=0)

