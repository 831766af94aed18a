"""The emulated backend: the protocol on PyTorch's meta device, memory from the model of
the caching allocator.

A ``TorchDispatchMode`` sees every aten op below autograd. Each op's outputs that own a
storage not seen before are handed to the ``Ledger`` (the same one the analytical model
replays through); a weak reference to the storage tells when it dies (a Python ``del``,
autograd releasing a saved tensor, a grad reset), and its block is freed before the next
op runs. The cuBLAS workspace of a thread is allocated right after the outputs of that
thread's first cuBLAS op (``getCurrentCUDABlasHandle`` runs inside the blas call, after
the output exists: ``aten/src/ATen/cuda/CublasHandlePool.cpp``). On CUDA, backward ops run
on the autograd engine's device thread (``torch/csrc/autograd/engine.cpp``), which gets its
own handle and workspace; the tracer knows it is in backward from ``_current_graph_task_id``.

Nothing is materialized: memory and time do not depend on seq_len.
"""

from __future__ import annotations

import linecache
import os
import sys
from typing import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
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

    def __init__(self, workspace_bytes: int, capacity: int | None = None):
        super().__init__()
        self.ledger = Ledger(workspace_bytes, capacity, record=True)
        self.refs: dict[int, StorageWeakRef] = {}
        # ("alloc", key, component) | ("free", key) | ("cublas",) | ("mark", what):
        # the run as a program, for memcalc/trace.py
        self.events: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.collect_frees()
        if func in CUDA_COMPOSITES:
            with self:
                return CUDA_COMPOSITES[func](*args, **(kwargs or {}))
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
        """Free the blocks of every storage that died since the last op."""
        for key, ref in list(self.refs.items()):
            if ref.expired():
                del self.refs[key]
                self.ledger.free(key)
                self.events.append(("free", key))

    def _track(self, t: torch.Tensor, op: str) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.refs or storage.nbytes() == 0:
            return
        thread = _thread()
        role = Role.input if op == "randn" else (
            Role.temporary if thread == "autograd" else Role.activation)
        where, code = _where()
        component = Component(name=f"{op} ({where})", role=role, op=op, shape=tuple(t.shape),
                              dtype=str(t.dtype).removeprefix("torch."),
                              nbytes=storage.nbytes(), block_bytes=0, source=code)
        self.refs[key] = StorageWeakRef(storage)
        self.ledger.alloc(key, component)
        self.events.append(("alloc", key, self.ledger.live[key].component))

    def mark(self, what: str) -> None:
        """Note a protocol point (a counter read) in the event log, after pending frees."""
        self.collect_frees()
        self.events.append(("mark", what))


class TracerProbe:
    """The counters of ``harness.Probe``, read from a tracer's allocator model. It also
    keeps what a live GPU cannot tell: the live set behind each counter it reads."""

    def __init__(self, tracer: Tracer):
        self.tracer = tracer
        self.allocator = tracer.ledger.allocator
        self.marks: list[set] = []  # live keys at each ``allocated()`` read
        self.peaks: list[tuple[Component, ...]] = []  # live set at each ``max_allocated()``
        self.output_key = None

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
        self.tracer.mark("reset_peak")
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


def run_traced(config: Config, fn: Callable, tracer: Tracer, probe: TracerProbe) -> Measured:
    """The protocol for ``fn`` on the meta device, under ``tracer``."""
    proto = config.protocol
    with tracer:
        inputs = make_inputs(torch, *_shapes(config), getattr(torch, config.dtype.torch_name),
                             "meta", need_grad=not proto.forward_only,
                             grad_out=proto.loss == "grad" and not proto.forward_only)
        _name_inputs(tracer, inputs)
        measured = run_protocol(torch, fn, probe, inputs, proto.forward_only)
        del inputs
    return measured


def _name_inputs(tracer: Tracer, inputs) -> None:
    """Call the protocol's inputs by their names, not by the line that made them."""
    for name, t in zip(("q", "k", "v", "grad_out"), inputs):
        if t is not None:
            live = tracer.ledger.live[t.untyped_storage()._cdata]
            live.component = live.component.model_copy(update={"name": name, "source": ""})


def measure(config: Config, fn: Callable | None = None, capacity: int | None = None) -> Breakdown:
    """Run the protocol for ``config`` on the meta device and read the breakdown off the
    trace; ``fn(q, k, v)`` defaults to the reference code of ``config.impl``. With
    ``capacity``, the allocator model raises ``OutOfMemory`` where the device would."""
    tracer = Tracer(config.workspace_bytes, capacity)
    probe = TracerProbe(tracer)
    measured = run_traced(config, fn or reference_fn(config), tracer, probe)
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
    from memcalc.validation import figures_of

    predicted = figures_of(predict(config))
    return Check(config=config, predicted=predicted, measured=figures_of(measure(config)))


def environment() -> dict[str, str]:
    return {"torch": torch.__version__, "device": "emulated",
            "how": "meta device, allocator model"}
