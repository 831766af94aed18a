"""The emulated backend: the protocol on PyTorch's meta device, memory from the model of
the caching allocator.

A ``TorchDispatchMode`` sees every aten op below autograd. Each op's outputs that own a
storage not seen before are handed to the ``Ledger`` (the same one the analytical model
replays through); a weak reference to the storage's Python object, which torch keeps as
long as the storage, tells when it dies (a Python ``del``, autograd releasing a saved
tensor, a grad reset), and its block is freed before the next op runs. The cuBLAS workspace of a thread is allocated right after the outputs of that
thread's first cuBLAS op (``getCurrentCUDABlasHandle`` runs inside the blas call, after
the output exists: ``aten/src/ATen/cuda/CublasHandlePool.cpp``). On CUDA, backward ops run
on the autograd engine's device thread (``torch/csrc/autograd/engine.cpp``), which gets its
own handle and workspace; the tracer knows it is in backward from ``_current_graph_task_id``.

Nothing is materialized: memory does not depend on seq_len, and time only through the ops
a loop runs (linear in them: a chunked loop at 65,536 rows traces in about 20 s).
"""

from __future__ import annotations

import linecache
import os
import sys
import weakref
from contextlib import contextmanager
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from memcalc.breakdown import Breakdown, Component
from memcalc.config import Config
from memcalc.tensors import Role
from memcalc.timeline import Ledger
from memcalc.validation.compare import Check
from memcalc.validation.harness import Measured, make_inputs, run_protocol
from memcalc.validation.reference import reference_fn

# ops that call cuBLAS on CUDA (aten/src/ATen/native/cuda/Blas.cpp)
CUBLAS_OPS = frozenset(
    {"mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "_addmm_activation"}
)
_TORCH_DIR = os.path.dirname(torch.__file__)
_MEMCALC_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_REFERENCE_DIR = os.path.join(_MEMCALC_DIR, "validation", "reference")


def _is_user_code(path: str) -> bool:
    """Frames outside torch and memcalc are the user's; memcalc's reference code counts
    as user code (it is what a user would write)."""
    if path.startswith(_TORCH_DIR):
        return False
    return not path.startswith(_MEMCALC_DIR) or path.startswith(_REFERENCE_DIR)


def _safe_softmax(x, dim, dtype=None):
    """``_safe_softmax`` as ``aten/src/ATen/native/transformers/attention.cpp`` writes it:
    a CompositeExplicitAutograd kernel with no CUDA kernel, so on a GPU its inner ops
    allocate (softmax, two 512-B scalars, a bool mask, a row mask, the ``where``) while on
    the meta device its meta kernel allocates only the result."""
    out = torch.softmax(x, dim, dtype=dtype)
    neg_inf = torch.scalar_tensor(float("-inf"), dtype=out.dtype, device=out.device)
    masked = x.eq(neg_inf)
    masked_rows = torch.all(masked, dim, keepdim=True)
    zero = torch.scalar_tensor(0.0, dtype=out.dtype, device=out.device)
    return torch.where(masked_rows, zero, out)


# ops whose CUDA kernel is a composite of other ops: the tracer runs that composite so that
# its inner allocations are seen, as on a GPU
# (``_safe_softmax`` exists from torch 2.5 on; torch 2.4's sdpa has no such op)
CUDA_COMPOSITES = {op.default: _safe_softmax for op in
                   [getattr(torch.ops.aten, "_safe_softmax", None)] if op is not None}


class Tracer(TorchDispatchMode):
    """Dispatch mode that replays a meta-device run through the allocator model."""

    def __init__(self, workspace_bytes: int, capacity: int | None = None, paths=None):
        super().__init__()
        self.ledger = Ledger(workspace_bytes, capacity, record=True)
        # each tracked storage (by its StorageImpl's address): a weak reference to its
        # Python object, which torch keeps while anything holds the storage (a view, a
        # tensor autograd saved) and frees with it; the reference's callback notes the
        # death, in ``dead``, and its tracking order in ``order``, the order frees are taken
        self.refs: dict[int, weakref.ref] = {}
        self.order: dict[int, int] = {}
        self.dead: list[int] = []
        # ``memcalc.tracing.cuda_paths.CudaPaths`` for ``memcalc trace`` (the GPU's code
        # paths); None for validation, which checks the models of what meta runs
        self.paths = paths
        self._quiet = 0
        # ("alloc", key, component) | ("free", key) | ("cublas",) | ("mark", what):
        # the run as a program, for memcalc/trace.py
        self.events: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._quiet:
            return func(*args, **(kwargs or {}))
        self.collect_frees()
        if func in CUDA_COMPOSITES:
            with self:
                return CUDA_COMPOSITES[func](*args, **(kwargs or {}))
        if self.paths is not None:
            self.paths.observe(func)
            rule = self.paths.rule(func, args)
            if rule is not None:
                return rule(self.paths, func, args, kwargs or {})
        out = func(*args, **(kwargs or {}))
        op = func.overloadpacket.__name__
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                self._track(t, op)
        if op in CUBLAS_OPS:
            self.ledger.ensure_workspace(_thread(), _where()[0])
            self.events.append(("cublas",))
        return out

    def __exit__(self, *exc):
        self.collect_frees()
        return super().__exit__(*exc)

    def collect_frees(self) -> None:
        """Free the blocks of every storage that died since the last op, in the order they
        were tracked. Told by the storages' deaths, not found by checking every live one
        at every op (quadratic in a loop's saved tensors: a chunked loop at 65,536 rows
        traced in 565 s)."""
        if not self.dead:
            return
        dead = sorted(self.dead, key=self.order.__getitem__)
        self.dead.clear()  # the list the callbacks append to
        for key in dead:
            del self.refs[key], self.order[key]
            self.ledger.free(key)
            self.events.append(("free", key))

    def _track(self, t: torch.Tensor, op: str) -> None:
        role = Role.input if op == "randn" else (
            Role.temporary if _thread() == "autograd" else Role.activation)
        self.adopt(t, component(op, role, op, tuple(t.shape), str(t.dtype).removeprefix("torch."),
                                t.untyped_storage().nbytes()))

    def adopt(self, t: torch.Tensor, part: Component, located: bool = True) -> None:
        """Track ``t``'s storage as ``part`` (named after the calling line unless not
        ``located``) until it dies; a storage already tracked, or of 0 bytes, is left alone."""
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.dead:  # its last storage died in this op, and this one took its place
            self.collect_frees()
        if key in self.refs or storage.nbytes() == 0:
            return
        where, code = _where() if located else ("", "")
        name = f"{part.name} ({where})" if located else part.name
        named = part.model_copy(update={"name": name, "source": code, "nbytes": storage.nbytes()})
        note = self.dead.append
        self.refs[key] = weakref.ref(storage, lambda _, key=key: note(key))
        self.order[key] = len(self.events)
        self.ledger.alloc(key, named)
        self.events.append(("alloc", key, self.ledger.live[key].component))

    def role_of(self, t: torch.Tensor) -> Role:
        """The role ``t``'s storage was tracked with."""
        return self.ledger.live[t.untyped_storage()._cdata].component.role

    @contextmanager
    def quiet(self):
        """Ops run here allocate nothing the tracer sees (stand-ins for kernel tensors
        that ``adopt`` then tracks under the model's names)."""
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    def mark(self, what: str) -> None:
        """Note a protocol point (a counter read) in the event log, after pending frees."""
        self.collect_frees()
        self.events.append(("mark", what))


def component(name: str, role: Role, op: str, shape: tuple, dtype: str, nbytes: int) -> Component:
    """A traced allocation (its block is set by the ledger)."""
    return Component(name=name, role=role, op=op, shape=tuple(shape), dtype=dtype,
                     nbytes=nbytes, block_bytes=0)


class TracerProbe:
    """The counters of ``harness.Probe``, read from a tracer's allocator model. It also
    keeps what a live GPU cannot tell: the live set behind each counter it reads."""

    def __init__(self, tracer: Tracer):
        self.tracer = tracer
        self.allocator = tracer.ledger.allocator
        self.marks: list[set] = []  # live keys at each ``allocated()`` read
        self.peaks: list[tuple[Component, ...]] = []  # live set at each ``max_allocated()``
        self.output_key = None
        self.resets = 0

    def allocated(self) -> int:
        self.tracer.mark("allocated")
        self.marks.append(set(self.tracer.ledger.live))
        return self.allocator.allocated

    def max_allocated(self) -> int:
        self.tracer.mark("max_allocated")
        self.peaks.append(self.tracer.ledger.peak_live)
        return self.allocator.peak_allocated

    def max_reserved(self) -> int:
        return self.allocator.peak_reserved

    def reset_peak(self) -> None:
        """Reset the peak; the protocol resets it where the measured forward and the
        backward start, which the ledger's history marks as phases (for plots)."""
        self.tracer.mark("reset_peak")
        self.tracer.ledger.phase(("forward", "backward")[min(self.resets, 1)])
        self.resets += 1
        self.tracer.ledger.reset_peak()

    def block_bytes(self, tensor) -> int:
        """Block of ``out``, read right after the forward: the moment to note what the
        forward left alive besides it (``saved_bytes`` counts exactly these)."""
        key = self.output_key = tensor.untyped_storage()._cdata
        live = self.tracer.ledger.live
        self.output = live[key].component
        self.saved = tuple(v.component for k, v in live.items()
                           if k not in self.marks[0] and k != key)
        return self.tracer.ledger.block_bytes(key)


def _thread() -> str:
    """``autograd`` inside a backward pass (the engine's device thread on CUDA), else ``main``."""
    return "autograd" if torch._C._current_graph_task_id() != -1 else "main"


def _where() -> tuple[str, str]:
    """Where an op was called from: ``(file:line, code)`` of the innermost frame outside
    torch and this harness, or ``(autograd node, "")`` in backward, which has no user frame."""
    if _thread() == "autograd":
        node = torch._C._current_autograd_node()
        return (node.name() if node is not None else "autograd"), ""
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if _is_user_code(path):
            code = linecache.getline(path, frame.f_lineno).strip()
            return f"{os.path.basename(path)}:{frame.f_lineno}", code
        frame = frame.f_back
    return "?", ""


def run_traced(config: Config, fn: Callable, tracer: Tracer, probe: TracerProbe,
               state: tuple = (), out_like: tuple | None = None) -> Measured:
    """The protocol for ``fn`` on the meta device, under ``tracer`` (and, when the tracer
    has CUDA paths, their torch-function rules). ``state``: ``(name, tensor, role)`` the
    function keeps resident (a module's parameters and buffers), counted from the start;
    ``out_like``: ``grad_out``'s ``(shape, dtype)`` when not q's."""
    proto = config.protocol
    paths = tracer.paths
    if paths is not None:
        paths.tracer = tracer
    with tracer, (paths.mode() if paths is not None else _nothing()):
        for name, t, role in state:
            tracer.adopt(t, component(name, role, "resident", tuple(t.shape),
                                      str(t.dtype).removeprefix("torch."), 0), located=False)
        inputs = make_inputs(torch, *_shapes(config), getattr(torch, config.dtype.torch_name),
                             "meta", need_grad=not proto.forward_only,
                             grad_out=proto.loss == "grad" and not proto.forward_only,
                             out_like=out_like)
        _name_inputs(tracer, inputs)
        parameters = tuple(t for _, t, role in state if role is Role.parameter and t.requires_grad)
        measured = run_protocol(torch, fn, probe, inputs, proto.forward_only, parameters)
        del inputs
    return measured


@contextmanager
def _nothing():
    yield


def _name_inputs(tracer: Tracer, inputs) -> None:
    """Call the protocol's inputs by their names, not by the line that made them."""
    for name, t in zip(("q", "k", "v", "grad_out"), inputs):
        if t is not None:
            live = tracer.ledger.live[t.untyped_storage()._cdata]
            live.component = live.component.model_copy(update={"name": name, "source": ""})


def measure(config: Config, fn: Callable | None = None, capacity: int | None = None,
            paths=None, state: tuple = (), out_like: tuple | None = None,
            tracer: Tracer | None = None) -> Breakdown:
    """Run the protocol for ``config`` on the meta device and read the breakdown off the
    trace; ``fn(q, k, v)`` defaults to the reference code of ``config.impl``. With
    ``capacity``, the allocator model raises ``OutOfMemory`` where the device would.
    ``paths`` (``memcalc.tracing.cuda_paths.CudaPaths``): follow a GPU's code paths;
    ``state``, ``out_like``: see ``run_traced``; ``tracer``: a tracer to run under (to
    read its history afterwards)."""
    tracer = tracer or Tracer(config.workspace_bytes, capacity, paths)
    probe = TracerProbe(tracer)
    measured = run_traced(config, fn or reference_fn(config), tracer, probe, state, out_like)
    relabel = _roles(tracer, probe)
    backward_live = probe.peaks[1] if len(probe.peaks) > 1 else ()
    result = Breakdown(config=config, forward_live=relabel(probe.peaks[0]),
                       backward_live=relabel(backward_live), saved=relabel(probe.saved),
                       reserved_peak_bytes=measured.reserved_peak_bytes)
    _check_consistent(result, measured)
    return result


def _roles(tracer: Tracer, probe: TracerProbe) -> Callable:
    """Roles the trace only knows at the end: what the forward left alive is saved, the
    output is the output, and what the backward left alive are the leaf grads."""
    roles = {id(c): Role.saved for c in probe.saved}
    roles[id(probe.output)] = Role.output
    roles.update({id(c): Role.gradient for c in tracer.ledger.components()
                  if c.role is Role.temporary})

    def relabel(components):
        return tuple(c.model_copy(update={"role": roles[id(c)]}) if id(c) in roles else c
                     for c in components)

    return relabel


def _shapes(config: Config) -> tuple[tuple[int, ...], tuple[int, ...]]:
    s = config.shape
    return (s.batch, s.heads, s.seq_len, s.head_dim), (s.batch, s.key_heads, s.keys, s.head_dim)


def _check_consistent(result: Breakdown, measured: Measured) -> None:
    """The live sets must add up to the counters the protocol read."""
    for name in ("saved_bytes", "forward_peak_bytes", "backward_peak_bytes"):
        if getattr(result, name) != getattr(measured, name):
            raise AssertionError(f"trace bookkeeping: {name} {getattr(result, name)} "
                                 f"!= counter {getattr(measured, name)}")


def check(config: Config) -> Check:
    """The model against the trace for one configuration; tolerance 0."""
    from memcalc.timeline import predict
    from memcalc.validation.compare import figures_of

    predicted = figures_of(predict(config))
    return Check(config=config, predicted=predicted, measured=figures_of(measure(config)))


def environment() -> dict[str, str]:
    return {"torch": torch.__version__, "device": "emulated",
            "how": "meta device, allocator model"}
