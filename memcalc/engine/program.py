"""The vocabulary implementations declare themselves in: tensors and lifetime events.

An implementation is two lists of events, forward and backward, in the order the torch
code runs its ops:

* ``new(name, shape, dtype, role, op)``: an op allocates a tensor;
* ``cublas()``: the op just declared called cuBLAS (the thread's workspace is created
  there if the thread has none yet);
* ``free(*names)``: the last Python reference dies. A tensor whose role is ``saved``
  stays alive anyway, until autograd releases it: unless the step runs under
  ``torch.no_grad()``, where nothing is saved and the free takes effect;
* ``release(*names)``: a backward node finished and autograd dropped its saved tensors.

``memcalc/engine/replay.py`` replays these events through the allocator model.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from math import prod
from typing import NamedTuple

from memcalc.engine.dims import Dims

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4,
            "int16": 2, "int8": 1, "uint64": 8, "uint32": 4, "bool": 1, "uint8": 1,
            "complex64": 8, "complex128": 16, "float8_e4m3fn": 1, "float8_e5m2": 1}


class Role(str, Enum):
    """What a tensor is for; decides how it is reported and when it can die."""

    input = "input"
    activation = "activation"
    saved = "saved"
    output = "output"
    gradient = "gradient"
    temporary = "temporary"
    # a compiled backward's buffer holding forward values the partitioner chose to
    # recompute rather than save (``memcalc/compiling``)
    recomputed = "recomputed"
    workspace = "workspace"
    parameter = "parameter"  # an nn.Module's parameters: resident, made before the step
    buffer = "buffer"  # registered buffers and module-level tensors: resident as well
    optimizer_state = "optimizer state"  # moments, momentum buffers: made by the first step()
    unsharded = "unsharded parameter"  # FSDP's all-gathered parameters, between reshards
    collective = "collective buffer"  # FSDP's all-gather and reduce-scatter buffers


class _TensorFields(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: str
    role: Role
    op: str
    bytes: int  # the requested bytes, computed once: every replay reads them (as Component's)


def dense_bytes(shape: tuple[int, ...], dtype: str) -> int:
    """The bytes of a dense tensor: ``shape x element``."""
    return prod(shape) * ITEMSIZE[dtype]


class Tensor(_TensorFields):
    """A tensor an implementation allocates: name, shape, dtype, role and the op; its
    requested bytes are ``shape x element`` unless ``storage_bytes`` says otherwise
    (traced code). An immutable tuple: a long loop declares a million of them, and a
    tuple is made in half the time of a frozen dataclass."""

    __slots__ = ()

    def __new__(cls, name: str, shape: tuple[int, ...], dtype: str, role: Role, op: str,
                storage_bytes: int | None = None) -> "Tensor":
        nbytes = dense_bytes(shape, dtype) if storage_bytes is None else storage_bytes
        return tuple.__new__(cls, (name, shape, dtype, role, op, nbytes))

    def replace(self, *, name: str | None = None, role: Role | None = None) -> "Tensor":
        """The same allocation under another name or role (its bytes stay)."""
        return self._replace(name=name or self.name, role=role or self.role)


# Events are values; not frozen, so that a million of them are made at the speed of
# plain objects (no program changes its events once built)
@dataclass(slots=True, unsafe_hash=True)
class Free:
    names: tuple[str, ...]


@dataclass(slots=True, unsafe_hash=True)
class Release:
    names: tuple[str, ...]


@dataclass(frozen=True)
class Cublas:
    """The op just declared called cuBLAS, on the thread of its phase (forward and the
    optimizer: the main thread; backward: the autograd engine's), or on ``thread`` where
    the events of several phases run as one list (a traced warm-up step)."""

    thread: str | None = None


@dataclass(frozen=True)
class Stream:
    """The allocations that follow are made on CUDA stream ``number`` (0: the default
    one), each stream's blocks a pool of their own (``memcalc.engine.allocator``): what
    FSDP's all-gather and reduce-scatter buffers are made on (``memcalc.tracing.fsdp``)."""

    number: int = 0


@dataclass(frozen=True)
class Mark:
    """A labelled point between events; allocates and frees nothing (the timeline skips
    it). ``memcalc/impls/checkpoint.py`` reads two labels: ``LAST_SAVE`` and ``FIRST_UNPACK``."""

    label: str


LAST_SAVE = "last_save"
FIRST_UNPACK = "first_unpack"

Event = Tensor | Free | Release | Cublas | Stream | Mark


def new(name: str, shape: tuple[int, ...], dtype: str, role: Role, op: str) -> Tensor:
    """Declare that ``op`` allocates tensor ``name``. Made as ``Tensor.__new__`` makes it,
    without calling it: a class call through a Python ``__new__`` takes longer than making
    the tuple (a million-row chunked loop declares 600,000 tensors; 0.96 -> 0.69 us each)."""
    shape = tuple(shape)
    return tuple.__new__(Tensor, (name, shape, dtype, role, op, dense_bytes(shape, dtype)))


def free(*names: str) -> Free:
    """The Python references to ``names`` die here."""
    return Free(names)


def release(*names: str) -> Release:
    """Autograd drops these saved tensors here (after the node that saved them ran)."""
    return Release(names)


def cublas() -> Cublas:
    """The op just declared calls cuBLAS."""
    return _CUBLAS


_CUBLAS = Cublas()  # an immutable value: one serves every declaration


def last_save() -> Mark:
    """Forward: autograd packs the step's last saved tensor here (an op saving its inputs
    packs them before it allocates). Non-reentrant checkpoint's recomputation stops here."""
    return Mark(LAST_SAVE)


def first_unpack() -> Mark:
    """Backward: the first node that reads a saved tensor starts here (where
    non-reentrant checkpoint recomputes the forward)."""
    return Mark(FIRST_UNPACK)


class Phase(NamedTuple):
    """One measured phase of a step, from a reset peak: ``forward``, ``backward`` (on the
    autograd engine's thread) or ``optimizer`` (``step()`` and ``zero_grad()``)."""

    label: str
    events: tuple[Event, ...]


@dataclass(frozen=True)
class Program:
    """What one training step of an implementation allocates, forward then backward, and
    what exists before it: ``inputs``, allocated before the warm-up step (None: ``q, k, v``
    and ``grad_out``, ``memcalc.engine.inputs.input_tensors``; a traced module's parameters,
    buffers and own inputs otherwise).

    A traced training loop's step is more than a forward and a backward (micro-steps whose
    grads accumulate, an optimizer whose state the warm-up creates): then ``warm_up`` holds
    the warm-up step's events as traced, every free in them (its cuBLAS calls name their
    thread), and ``phases`` the measured step phase by phase; ``forward`` and ``backward``
    are its first micro-step's."""

    forward: tuple[Event, ...]
    backward: tuple[Event, ...]
    inputs: tuple[Event, ...] | None = None
    warm_up: tuple[Event, ...] | None = None
    phases: tuple[Phase, ...] | None = None

    def measured(self, grad: bool) -> tuple[Phase, ...]:
        """The measured step's phases: ``phases``, or the forward then (with ``grad``) the
        backward."""
        if self.phases is not None:
            return self.phases
        return (Phase("forward", self.forward),) + ((Phase("backward", self.backward),)
                                                    if grad else ())


__all__ = ["Dims", "Event", "Mark", "Phase", "Program", "Role", "Tensor", "cublas", "first_unpack",
           "free", "last_save", "new", "release"]


# dtype aliases: torch's names and the usual short ones (``memcalc.config.DType``)
DTYPE_ALIASES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "f32": "fp32", "single": "fp32",
    "torch.float32": "fp32", "torch.float": "fp32",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "f16": "fp16", "torch.float16": "fp16",
    "torch.half": "fp16",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
}


def dtype_name(value) -> str | None:
    """The canonical dtype (``fp32``, ``fp16``, ``bf16``) for an alias, a torch dtype or
    its string; None when it is none of them."""
    return DTYPE_ALIASES.get(str(value).strip().lower())
