"""Functional collectives in a trace, as NCCL runs them on a GPU and not as the meta device
does (context parallelism's K/V exchange: ``memcalc/tracing/context_parallel.py``).

``torch.distributed._functional_collectives`` issues a collective (``_c10d_functional``
ops: ``all_gather_into_tensor``, ``all_to_all_single``, ...) asynchronously and wraps its
output to be waited on at first use. Two facts differ between a GPU and meta:

* ``_wrap_tensor_autograd`` returns an ``AsyncCollectiveTensor`` around the output on a GPU
  (no memory); its fake kernel, the one meta runs, makes an ``empty_like`` copy.
* ``ProcessGroupNCCL::collective`` keeps the inputs of an async collective alive
  (``stashed_for_allocator_safety_``) until the work is waited on, so the caching allocator
  cannot hand their blocks out while NCCL reads them; from torch 2.8 on, in place of
  ``recordStream`` (pytorch/pytorch#150398). A fake process group keeps nothing.

``Collectives`` mends both: the wrap is an alias, and each collective's inputs are held
until the first op that reads its output, which is where the wait happens
(``AsyncCollectiveTensor.wait``, or the first op on it). Both were measured on an H100 with
torch 2.11 and NCCL 2.28 (``validation/nccl_stash.py``): the input stays allocated, a second
later too, until the wait. ``group="fake"``: a fake process group's collectives, which keep
nothing (``validation/cp_one_gpu.py``).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

STASH_SINCE = (2, 8)  # pytorch/pytorch#150398: stashing instead of recordStream


# the ops are registered when ``torch.distributed._functional_collectives`` is imported, so
# they are known here by name
WRAP, WAIT = "_wrap_tensor_autograd", "wait_tensor"


def _functional(func) -> str | None:
    """The name of a ``_c10d_functional`` op, else None."""
    if getattr(func, "namespace", "") != "_c10d_functional":
        return None
    return func.overloadpacket.__name__


def is_collective(func) -> bool:
    """A ``_c10d_functional`` collective (not the wait, nor the wrap)."""
    return _functional(func) not in (None, WRAP, WAIT)


def _storages(tensors) -> list[torch.Tensor]:
    return [t for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "meta"]


class Collectives:
    """The stashes of the collectives in flight, keyed by their outputs' storages."""

    def __init__(self, release: tuple[int, int], group: str = "nccl"):
        # NCCL's stash; a fake process group (``group="fake"``) keeps nothing
        self.stash_inputs = group == "nccl" and tuple(release[:2]) >= STASH_SINCE
        self.in_flight: dict[int, list[torch.Tensor]] = {}

    def wrap(self, func, args):
        """``_wrap_tensor_autograd``: the output itself (an alias), as on a GPU; None for any
        other op."""
        if _functional(func) == WRAP:
            return torch.ops.aten.alias.default(args[0])
        return None

    def wait_for(self, args, kwargs) -> None:
        """An op reading a collective's output waits for it first: its inputs go."""
        if not self.in_flight:
            return
        for t in _storages(tree_leaves((args, kwargs))):
            self.in_flight.pop(t.untyped_storage()._cdata, None)

    def issued(self, func, args, kwargs, out) -> None:
        """After a collective: hold its inputs until its output is waited for."""
        if not (self.stash_inputs and is_collective(func)):
            return
        inputs = _storages(tree_leaves((args, kwargs)))
        for t in _storages(tree_leaves(out)):
            self.in_flight[t.untyped_storage()._cdata] = inputs
