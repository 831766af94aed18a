"""The measurement protocol of DESIGN.md section 1, written once for every backend.

A backend supplies a *probe* (the five ``torch.cuda`` counters it needs) and a device to
allocate on; ``run_protocol`` does the rest, so the live CUDA run and the emulated run
cannot follow different protocols.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol

from memcalc.engine.dims import Dims
from memcalc.engine.inputs import QKV, Input, input_tensors


class Probe(Protocol):
    """What the protocol reads from a device: ``torch.cuda``'s counters, by another name."""

    def allocated(self) -> int: ...
    def max_allocated(self) -> int: ...
    def max_reserved(self) -> int: ...
    def reset_peak(self, phase: str = "") -> None: ...
    def block_bytes(self, tensor) -> int: ...


@dataclass(frozen=True)
class Measured:
    """The figures one protocol run reads off its probe."""

    saved_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    reserved_peak_bytes: int
    optimizer_peak_bytes: int | None = None  # a training loop's step() and zero_grad()

    @property
    def peak_bytes(self) -> int:
        return max(self.forward_peak_bytes, self.backward_peak_bytes,
                   self.optimizer_peak_bytes or 0)


@dataclass(frozen=True)
class Training:
    """What makes the step a training loop's: ``optimizer`` (anything with torch's
    ``step()`` and ``zero_grad(set_to_none=...)``; None: none) stepped after
    ``accumulate`` forward and backward passes whose grads accumulate, clipped to a total
    norm of ``clip`` first (None: not clipped)."""

    optimizer: object = None
    accumulate: int = 1
    clip: float | None = None

    @property
    def loop(self) -> bool:
        """Whether the step runs as a training loop (else the attention protocol)."""
        return self.optimizer is not None or self.accumulate > 1


class Inputs(NamedTuple):
    """What the step is called with: the leaves in call order, and ``grad_out`` (None for
    ``--loss sum``, a forward-only step, or a 0-d output)."""

    leaves: tuple
    grad_out: object


def make_inputs(torch, d: Dims, device, inputs: tuple[Input, ...] = QKV,
                out_like: tuple | None = None) -> Inputs:
    """Allocate the step's inputs (``q, k, v`` unless ``inputs`` says otherwise) in order,
    the floating ones leaves that need grad (``Input.needs_grad``), then ``grad_out``: shaped
    like q unless ``out_like = (shape, dtype)`` gives the function's output (a traced
    function may return another layout, e.g. ``(B, N, H, d)``). Integer and bool inputs
    hold their fill (``memcalc.engine.inputs.FILLS``)."""
    leaves = tuple(_made(torch, i, d, device) for i in inputs)
    declared = input_tensors(d, (), out_like)  # grad_out, if the step has one
    dout = None
    if declared:
        dtype = getattr(torch, declared[0].dtype) if isinstance(declared[0].dtype, str) \
            else declared[0].dtype
        dout = _random(torch, declared[0].shape, dtype, device)
    return Inputs(leaves, dout)


def _random(torch, shape, dtype, device, requires_grad: bool = False):
    """``randn``; on the meta device, which holds no values, ``empty``: the same block,
    without torch's Python reference of ``randn`` for meta (``torch/_refs``), whose
    ``torch._check`` imports ``torch.fx.experimental.symbolic_shapes`` (0.27 s a trace)."""
    make = torch.empty if str(device) == "meta" else torch.randn
    return make(shape, dtype=dtype, device=device, requires_grad=requires_grad)


def _made(torch, i: Input, d: Dims, device):
    """One input tensor, as ``Input.filled`` says."""
    shape, dtype, fill = i.shape(d), getattr(torch, i.dtype_in(d)), i.filled(d)
    if fill == "randn":
        return _random(torch, shape, dtype, device, i.needs_grad(d))
    if fill == "arange":
        last = shape[-1] if shape else 1
        return torch.arange(last, dtype=dtype, device=device).expand(shape).contiguous()
    made = (torch.zeros if fill == "zeros" else torch.ones)(shape, dtype=dtype, device=device)
    if fill == "padded" and shape:
        made[(0,) * (len(shape) - 1) + (slice(shape[-1] - shape[-1] // 4, None),)] = 0
    return made


def _step(torch, attn: Callable, inputs: Inputs, probe: Probe | None):
    """Forward and backward once; with a probe, read the counters around each phase."""
    if probe is not None:
        probe.reset_peak("forward")
        a0 = probe.allocated()
    out = attn(*inputs.leaves)
    if probe is None:
        _backward(torch, out, inputs.grad_out)
        return None
    saved = probe.allocated() - a0 - probe.block_bytes(out)
    fwd_peak, fwd_reserved = probe.max_allocated(), probe.max_reserved()
    probe.reset_peak("backward")
    _backward(torch, out, inputs.grad_out)
    del out
    reserved = max(fwd_reserved, probe.max_reserved())
    return Measured(saved, fwd_peak, probe.max_allocated(), reserved)


def _loop_step(torch, attn: Callable, inputs: Inputs, probe: Probe | None,
               training: Training, parameters: tuple, held: list) -> Measured | None:
    """One optimizer step as a training loop runs it: ``training.accumulate`` forward and
    backward passes, the grads accumulating, then ``optimizer.step()`` and
    ``zero_grad(set_to_none=True)``. ``held`` is the loop's ``loss`` variable (a list of
    at most one): ``loss = model(...)`` drops the previous step's output only when the
    forward has returned, and this step's is held through the optimizer, into the next.
    With a probe, the figures: each phase's peak the highest of its micro-steps."""
    forward, backward, reserved, saved = [], [], [], 0
    for _ in range(training.accumulate):
        if probe is not None:
            probe.reset_peak("forward")
            a0 = probe.allocated()
        out = attn(*inputs.leaves)
        if probe is not None:
            saved = probe.allocated() - a0 - probe.block_bytes(out)
            forward.append(probe.max_allocated())
            reserved.append(probe.max_reserved())
        held[:] = [out]  # the previous step's loss dies here
        del out
        if probe is not None:
            probe.reset_peak("backward")
        _backward(torch, held[0], inputs.grad_out)
        if probe is not None:
            backward.append(probe.max_allocated())
            reserved.append(probe.max_reserved())
    if probe is not None:
        probe.reset_peak("optimizer")
    if training.clip is not None:  # as torchtitan's and the Hugging Face Trainer's loops do
        torch.nn.utils.clip_grad_norm_(parameters, training.clip, foreach=True)
    if training.optimizer is not None:
        training.optimizer.step()
        training.optimizer.zero_grad(set_to_none=True)
    _zero_grad((*inputs.leaves, *parameters))  # inputs' grads too, as the protocol resets them
    if probe is None:
        return None
    return Measured(saved, max(forward), max(backward),
                    max(*reserved, probe.max_reserved()), probe.max_allocated())


def _backward(torch, out, dout) -> None:
    """``out.backward(grad_out)``; a 0-d output (a loss) ``out.backward()``; else
    ``out.sum().backward()`` (``--loss sum``). Run as ``torch.autograd.backward`` runs it
    (``torch/autograd/__init__.py``): the seed of a scalar is ``ones_like`` (its
    ``_make_grads``), then the engine; without ``_make_grads``' checks of a given grad,
    which import sympy (``torch.fx.experimental.symbolic_shapes``, 0.27 s a trace)."""
    if dout is None:
        out = out if out.dim() == 0 else out.sum()
        dout = torch.ones_like(out, memory_format=torch.preserve_format)
    run = getattr(getattr(torch.autograd, "graph", None), "_engine_run_backward", None)
    if run is None or out.shape != dout.shape:  # torch < 2.4, or a mismatch to report
        out.backward(dout)
        return
    run((out,), (dout,), False, False, (), allow_unreachable=True, accumulate_grad=True)


def run_protocol(torch, attn: Callable, probe: Probe, inputs: Inputs, forward_only: bool,
                 parameters: tuple = (), training: Training = Training()) -> Measured:
    """Warm-up step, reset, then the measured step (DESIGN.md section 1).

    ``inputs`` from ``make_inputs``; the warm-up output and the leaf grads are released
    before the measured step, the grads of ``parameters`` (a traced module's) too, as
    ``zero_grad(set_to_none=True)`` does. A ``training`` loop's step (an optimizer,
    accumulated micro-steps) runs as ``_loop_step`` says, warm-up and measured alike: the
    warm-up's ``step()`` creates the optimizer's state.
    """
    if forward_only:
        return _forward_only(torch, attn, probe, inputs.leaves)
    _zero_grad(parameters)  # a module traced before keeps its grads: a step starts without
    if training.loop:
        held: list = []  # the loop's ``loss``
        _loop_step(torch, attn, inputs, None, training, parameters, held)
        return _loop_step(torch, attn, inputs, probe, training, parameters, held)
    _step(torch, attn, inputs, None)
    _zero_grad((*inputs.leaves, *parameters))
    return _step(torch, attn, inputs, probe)


def _zero_grad(leaves) -> None:
    """``zero_grad(set_to_none=True)`` of the leaves that need grad."""
    for leaf in leaves:
        if leaf.requires_grad:
            leaf.grad = None


def _forward_only(torch, attn: Callable, probe: Probe, leaves: tuple) -> Measured:
    """Inference: the same forward under ``torch.no_grad()``, nothing saved, no backward."""
    with torch.no_grad():
        out = attn(*leaves)
        del out
        probe.reset_peak("forward")
        a0 = probe.allocated()
        out = attn(*leaves)
        saved = probe.allocated() - a0 - probe.block_bytes(out)
        fwd_peak = probe.max_allocated()
        del out
    return Measured(saved, fwd_peak, 0, probe.max_reserved())
