"""The measurement protocol of DESIGN.md section 1, written once for every backend.

A backend supplies a *probe* (the five ``torch.cuda`` counters it needs) and a device to
allocate on; ``run_protocol`` does the rest, so the live CUDA run and the emulated run
cannot follow different protocols.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol


class Probe(Protocol):
    """What the protocol reads from a device: ``torch.cuda``'s counters, by another name."""

    def allocated(self) -> int: ...
    def max_allocated(self) -> int: ...
    def max_reserved(self) -> int: ...
    def reset_peak(self) -> None: ...
    def block_bytes(self, tensor) -> int: ...


@dataclass(frozen=True)
class Measured:
    """The figures one protocol run reads off its probe."""

    saved_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    reserved_peak_bytes: int

    @property
    def peak_bytes(self) -> int:
        return max(self.forward_peak_bytes, self.backward_peak_bytes)


def make_inputs(torch, shape, kv_shape, dtype, device, need_grad: bool, grad_out: bool,
                out_like: tuple | None = None):
    """Allocate ``q, k, v`` (leaves) and, for ``loss="grad"``, ``grad_out``, in that order.
    ``grad_out`` is shaped like q unless ``out_like = (shape, dtype)`` gives the function's
    output (a traced function may return another layout, e.g. ``(B, N, H, d)``)."""
    q = torch.randn(shape, dtype=dtype, device=device, requires_grad=need_grad)
    k = torch.randn(kv_shape, dtype=dtype, device=device, requires_grad=need_grad)
    v = torch.randn(kv_shape, dtype=dtype, device=device, requires_grad=need_grad)
    out_shape, out_dtype = out_like or (shape, dtype)
    dout = torch.randn(out_shape, dtype=out_dtype, device=device) if grad_out else None
    return q, k, v, dout


def _step(attn: Callable, q, k, v, dout, probe: Probe | None):
    """Forward and backward once; with a probe, read the counters around each phase."""
    if probe is not None:
        probe.reset_peak()
        a0 = probe.allocated()
    out = attn(q, k, v)
    if probe is None:
        _backward(out, dout)
        return None
    saved = probe.allocated() - a0 - probe.block_bytes(out)
    fwd_peak, fwd_reserved = probe.max_allocated(), probe.max_reserved()
    probe.reset_peak()
    _backward(out, dout)
    del out
    reserved = max(fwd_reserved, probe.max_reserved())
    return Measured(saved, fwd_peak, probe.max_allocated(), reserved)


def _backward(out, dout) -> None:
    if dout is None:
        out.sum().backward()
    else:
        out.backward(dout)


def run_protocol(torch, attn: Callable, probe: Probe, inputs, forward_only: bool,
                 parameters: tuple = ()) -> Measured:
    """Warm-up step, reset, then the measured step (DESIGN.md section 1).

    ``inputs`` are ``(q, k, v, grad_out)`` from ``make_inputs``; the warm-up output and
    the leaf grads are released before the measured step, the grads of ``parameters``
    (a traced module's) too, as ``zero_grad(set_to_none=True)`` does.
    """
    q, k, v, dout = inputs
    if forward_only:
        return _forward_only(torch, attn, probe, q, k, v)
    _step(attn, q, k, v, dout, None)
    for leaf in (q, k, v, *parameters):
        leaf.grad = None
    return _step(attn, q, k, v, dout, probe)


def _forward_only(torch, attn: Callable, probe: Probe, q, k, v) -> Measured:
    """Inference: the same forward under ``torch.no_grad()``, nothing saved, no backward."""
    with torch.no_grad():
        out = attn(q, k, v)
        del out
        probe.reset_peak()
        a0 = probe.allocated()
        out = attn(q, k, v)
        saved = probe.allocated() - a0 - probe.block_bytes(out)
        fwd_peak = probe.max_allocated()
        del out
    return Measured(saved, fwd_peak, 0, probe.max_reserved())
