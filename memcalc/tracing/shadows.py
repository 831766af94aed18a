"""Values for the small integer and bool tensors a trace makes, where meta tensors have none.

Code on the way to attention reads values: Hugging Face's mask builders ask whether a
padding mask is all ones (``padding_mask.all()``, ``transformers/masking_utils.py``) or
whether position ids are one sequence, and take another branch (another mask, another SDPA
call) by the answer. On the meta device such a read raises. The tracer keeps a CPU
*shadow* of each small tensor whose values it can know: integer and bool tensors made from
nothing (``ones``, ``arange``, ``full``: a mask, position ids, an input's fill) and
anything computed only from shadowed tensors; a read of a shadowed tensor
(``_local_scalar_dense``, ``.cpu()``) answers from its shadow, as the GPU would. Floating
data (activations, weights) never has values: a read of it still fails, with its hint.

Shadows are kept for tensors of up to ``LIMIT`` elements (a (B, N) mask, not an N x N one).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

LIMIT = 1 << 22  # elements: a (8, 524288) int64 mask is 32 MiB of host memory
READS = frozenset({torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default})


def _meta(value) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "meta"


def _meta_tensors(values) -> list:
    """The meta tensors among ``values`` and the lists and tuples in them (an op's
    arguments: a list of tensors is as deep as they go)."""
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.device.type == "meta":
                found.append(value)
        elif isinstance(value, (list, tuple)):
            found += [v for v in value if isinstance(v, torch.Tensor) and v.device.type == "meta"]
    return found


class Shadows:
    """The CPU values of tracked meta tensors, by tensor, while the tensor lives."""

    def __init__(self):
        self.values: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def of(self, t: torch.Tensor) -> torch.Tensor | None:
        entry = self.values.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def _set(self, t: torch.Tensor, value: torch.Tensor) -> None:
        key, values = id(t), self.values
        values[key] = (weakref.ref(t, lambda _, key=key: values.pop(key, None)), value)

    def read(self, func, args, kwargs):
        """The answer to a value read of shadowed tensors (``.item()``, ``if mask.all()``,
        ``torch.equal``, ``.cpu()``), or ``NotImplemented`` when there is none to give."""
        if func in READS or _to_host(func, kwargs):
            cpu = self._on_cpu(args, kwargs)
            if cpu is not None:
                return func(*cpu[0], **cpu[1])
        return NotImplemented

    def follow(self, func, args, kwargs, out) -> None:
        """After ``func`` ran on meta: shadow its small outputs when every meta tensor it
        read is shadowed (or it read none and made integers or bools), by running it on
        the shadows; an in-place op that cannot be followed leaves its operands unknown.
        Called for every op of a trace: what reads no shadowed tensor returns at once."""
        inputs = _meta_tensors((*args, *kwargs.values()))
        known = [t for t in inputs if id(t) in self.values]
        if inputs and not known:
            return None  # floating data, say: nothing known, nothing to forget
        leaves = _meta_tensors(out if isinstance(out, (tuple, list)) else (out,))
        if len(known) < len(inputs) or not leaves or any(t.numel() > LIMIT for t in leaves):
            return self._forget(func, known)
        if not inputs and any(t.is_floating_point() for t in leaves):
            return None  # random or empty floats: nothing known
        cpu = self._on_cpu(args, kwargs)
        if cpu is None:
            return self._forget(func, known)
        try:
            computed = func(*cpu[0], **cpu[1])
        except Exception:  # noqa: BLE001 - a CPU kernel missing: the values stay unknown
            return self._forget(func, known)
        for t, value in zip(tree_flatten(out)[0], tree_flatten(computed)[0]):
            if _meta(t) and isinstance(value, torch.Tensor):
                self._set(t, value)
        return None

    def _on_cpu(self, args, kwargs):
        """``(args, kwargs)`` with each meta tensor's shadow and the meta device as the CPU;
        None when a meta tensor has no shadow."""
        flat, spec = tree_flatten((args, kwargs))
        swapped = []
        for value in flat:
            if _meta(value):
                value = self.of(value)
                if value is None:
                    return None
            elif isinstance(value, torch.device) and value.type == "meta":
                value = torch.device("cpu")
            swapped.append(value)
        args, kwargs = tree_unflatten(swapped, spec)
        if kwargs.get("device") == "meta":
            kwargs = {**kwargs, "device": "cpu"}
        return args, kwargs

    def _forget(self, func, inputs) -> None:
        """An op that writes into its operands: their values are no longer known."""
        if func._schema.is_mutable:
            for t in inputs:
                self.values.pop(id(t), None)


def _to_host(func, kwargs) -> bool:
    """``t.cpu()`` / ``t.to("cpu")``: a copy to the host, whose values the shadow holds."""
    device = kwargs.get("device")
    return func is torch.ops.aten._to_copy.default and device is not None and \
        torch.device(device).type == "cpu"

