"""``checkpoint-<impl>``: any traced implementation under non-reentrant activation checkpointing.

Reference code: ``memcalc/validation/reference/checkpoint.py``,
``torch.utils.checkpoint.checkpoint(fn, q, k, v, use_reentrant=False)``. The programs are
generated from the registry: each wraps another implementation's program, following
``torch/utils/checkpoint.py`` (torch 2.13, ``_checkpoint_without_reentrant_generator``):

* forward: the inner forward runs under saved-tensor hooks whose ``pack_hook`` keeps a
  placeholder, not the tensor, so every tensor dies with its last Python reference, as
  under ``no_grad``: the inner program with its saved tensors demoted to activations.
  Nothing is saved (q, k, v are leaves, kept by the caller anyway);
* backward: the first node that unpacks a saved tensor (the inner program's
  ``first_unpack`` mark) triggers the recomputation of the inner forward on the autograd
  thread (its cuBLAS workspace), with grad enabled. With ``early_stop`` (the default) the
  recomputation raises ``_StopRecomputationError`` as soon as the last saved tensor is
  packed again (the inner program's ``last_save`` mark); the tensors the recomputation
  still references die as the exception unwinds, the repacked ones stay in
  ``frame.recomputed`` until the node that saved them unpacks them. The inner backward
  then runs unchanged, except that a node's saved tensors die as its ``apply`` returns
  (``early_releases``).

Wrapped: the traced implementations of this package (``wrappable``); functions registered
later (``memcalc trace``) are not. Implementations without marks: the recomputation stops before the first output tensor
(its op saves its inputs) and the first backward node unpacks at once. A custom
``autograd.Function`` packs ``ctx.save_for_backward`` only after its forward returns
(``torch/autograd/function.py``), so its whole forward is recomputed, output included.
"""

from __future__ import annotations

from memcalc.impls import load_before
from memcalc.impls.registry import IMPLS, Impl, register
from memcalc.engine.program import (FIRST_UNPACK, LAST_SAVE, Dims, Event, Free, Mark, Program, Release, Role, Tensor, free)

load_before("checkpoint")  # the implementations it wraps

# traced implementations this wrapper cannot describe, and why
UNSUPPORTED = {
    "flash2": "a custom Function that saves its own output: the recomputed output would "
              "stay alive until its backward, which its program does not declare",
}
PREFIX = "checkpoint-"


def recomputed(name: str) -> str:
    """The name of the recomputation's copy of the inner output (the original is alive)."""
    return f"{name} (recomputed)"


def stop_index(name: str, forward: tuple[Event, ...]) -> int:
    """How many inner forward events the recomputation runs before it stops."""
    marks = [i for i, e in enumerate(forward) if isinstance(e, Mark) and e.label == LAST_SAVE]
    if marks:
        return marks[-1]
    return next(i for i, e in enumerate(forward)
                if isinstance(e, Tensor) and e.role is Role.output)


def unpack_index(backward: tuple[Event, ...]) -> int:
    """Where the recomputation runs in the inner backward: at its ``first_unpack`` mark,
    else right after ``out.sum()`` and the seed grad of ``loss="sum"`` (``common.with_loss``)."""
    for i, e in enumerate(backward):
        if isinstance(e, Mark) and e.label == FIRST_UNPACK:
            return i
    i = 0
    while isinstance(backward[i], Tensor) and backward[i].name in ("loss", "dloss"):
        i += 1
    return i


def unsaved_forward(forward: tuple[Event, ...]) -> list[Event]:
    """The inner forward with nothing saved: saved tensors become activations, so their
    Python frees take effect."""
    demote = lambda e: e.replace(role=Role.activation) if (
        isinstance(e, Tensor) and e.role is Role.saved) else e
    return [demote(e) for e in forward if not isinstance(e, Mark)]


def recomputation(forward: tuple[Event, ...], stop: int) -> list[Event]:
    """The inner forward up to ``stop`` (grad enabled: saved tensors are kept), then the
    unwinding frees every other tensor it still holds. An output it allocates is a copy,
    renamed and temporary."""
    outputs = {e.name for e in forward[:stop] if isinstance(e, Tensor) and e.role is Role.output}
    events: list[Event] = []
    live: dict[str, Tensor] = {}
    for e in forward[:stop]:
        if isinstance(e, Tensor):
            if e.name in outputs:
                e = e.replace(name=recomputed(e.name), role=Role.temporary)
            live[e.name] = e
        elif isinstance(e, Free):
            e = free(*[recomputed(n) if n in outputs else n for n in e.names])
            for n in e.names:
                if live[n].role is not Role.saved:
                    del live[n]
        elif isinstance(e, Mark):
            continue
        events.append(e)
    return events + [free(*[n for n, t in live.items() if t.role is not Role.saved])]


def early_releases(backward: list[Event]) -> list[Event]:
    """Each release moved before the engine's ``sum_to`` allocations of its node.

    Without checkpoint a node's saved tensors live until the engine calls
    ``release_variables`` after ``call_function``, which includes ``validate_outputs``:
    there a grad of a broadcast input is reduced (``sum_to``) to the input's shape
    (``torch/csrc/autograd/engine.cpp``). Under checkpoint the unpack hook hands the node
    the recomputed tensor and drops its own reference, so the tensor dies when the node's
    ``apply`` returns, before those sums. Programs declare a ``sum_to`` as a ``sum`` right
    before the node's release (e.g. ``DivBackward0``'s grad of a ``(..., 1)`` divisor)."""
    events: list[Event] = []
    for e in backward:
        if not isinstance(e, Release):
            events.append(e)
            continue
        i = len(events)
        while i > 0 and _precedes_release(events[i - 1]):
            i -= 1
        events.insert(i, e)  # a few places from the end: linear in the events (a chunked
        # loop's backward has a release per chunk)
    return events


def _precedes_release(e: Event) -> bool:
    """Whether a release moves before ``e``: a free, or a node's ``sum_to``."""
    return isinstance(e, Free) or (isinstance(e, Tensor) and e.op == "sum")


def wrap(name: str):
    """The program builder of ``checkpoint-<name>``."""

    def build(d: Dims) -> Program:
        inner = IMPLS[name].program(d)
        at = unpack_index(inner.backward)
        backward = [*inner.backward[:at],
                    *recomputation(inner.forward, stop_index(name, inner.forward)),
                    *early_releases(list(inner.backward[at:]))]
        return Program(tuple(unsaved_forward(inner.forward)),
                       tuple(e for e in backward if not isinstance(e, Mark)))

    build.__doc__ = f"``{name}`` under non-reentrant ``torch.utils.checkpoint``."
    return build


def wrappable(impl: Impl) -> bool:
    """Traced (validated against the emulated trace), not itself a wrapper, not unsupported."""
    return impl.traced and not impl.name.startswith(PREFIX) and impl.name not in UNSUPPORTED


def _register_all() -> None:
    """Register one wrapper per wrappable implementation registered so far
    (``memcalc/impls/__init__.py`` loads this module last)."""
    for impl in [i for i in IMPLS.values() if wrappable(i)]:
        register(f"{PREFIX}{impl.name}",
                 f"{impl.name} in torch.utils.checkpoint: nothing saved, recomputed in backward",
                 gqa=impl.gqa, accepted=impl.accepted, chunked=impl.chunked)(wrap(impl.name))


_register_all()
