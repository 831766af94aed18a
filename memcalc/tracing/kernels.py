"""A fused SDPA kernel, traced as memcalc's own model of it.

The kernel's forward and backward are an ``autograd.Function`` whose bodies replay the
model's events (``memcalc/impls/sdpa_flash.py``, ``sdpa_efficient.py``,
``memcalc/impls/sdpa_cudnn.py``), built from the call's ``Dims``: every declared tensor becomes
a meta tensor handed to the tracer with the model's name, shape and role, and dies where the
model frees or releases it. The output and the gradients the node returns are real tensors
with the strides the CUDA kernel gives them (so what autograd does next, an
``AccumulateGrad`` copy or none, is traced as it runs); layout copies inside the kernel are
decided from the strides of the tensors actually passed. One source of truth: no size is
written here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from memcalc.impls import sdpa_efficient, sdpa_flash
from memcalc.engine.program import Dims, Free, Release, Role, Tensor
from memcalc.impls import sdpa_cudnn as cudnn
from memcalc.impls.device import gpu_of
from memcalc.tracing.errors import NotModelled
from memcalc.impls.sdpa_select import CUDNN, EFFICIENT, FLASH, Call


def dims_of(call: Call, gpu) -> Dims:
    """The model's sizes for this SDPA call, on the emulated GPU."""
    return sized(call.q, call.k, call.dtype, call.is_causal, call.requires_grad, gpu)


def sized(q: tuple, k: tuple, dtype: str, causal: bool, grad: bool, gpu,
          deterministic: bool = False) -> Dims:
    """The model's sizes for a kernel called with q ``(B, H, N, D)`` and k ``(B, Hk, M, D)``
    (shapes), on the emulated GPU; ``grad``: a backward will run."""
    (B, H, N, D), (_, Hk, M, _) = q, k
    return Dims(B, H, N, M, D, dtype, bool(causal), "grad", Hk, 64, not grad, gpu.sm_count,
                tuple(gpu.compute_capability), bool(deterministic))


def needs_grad(*tensors) -> bool:
    """``input_requires_grad``: grad mode on and an input needs grad."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


@dataclass
class Kernel:
    """One fused call: its backend, sizes, model events and the real tensors it hands out."""

    backend: str
    d: Dims
    call: Call
    paths: object
    q: torch.Tensor  # untracked meta stand-ins with the strides of the call's q, k, v:
    k: torch.Tensor  # the kernel reads layouts only, and must not keep the user's
    v: torch.Tensor  # tensors alive (a padded flash node saves the padded copies)
    live: dict = field(default_factory=dict)
    kept: dict = field(default_factory=dict)  # saved for backward (autograd holds them)
    padded: bool = False
    out_copy: bool = False
    inputs: int = 3  # the tensors the call takes and returns grads for: q, k, v (or packed)

    @property
    def tracer(self):
        return self.paths.tracer

    def replay(self, events, real: dict[str, Callable], grad: bool) -> None:
        """Apply model events: allocate (real or plain meta tensors), free, release; what
        died before the call (a local of the function that returned into it) is freed
        first, as Python frees it when its last reference goes."""
        self.tracer.collect_frees()
        for event in events:
            if isinstance(event, Tensor):
                with self.tracer.quiet():
                    self.live[event.name] = real[event.name]() if event.name in real else \
                        torch.empty(event.shape, dtype=getattr(torch, event.dtype), device="meta")
                self.tracer.adopt(self.live[event.name], self._component(event))
            elif isinstance(event, Free):
                for name in event.names:
                    if name in self.live:
                        if grad and self.tracer.role_of(self.live[name]) is Role.saved:
                            self.kept[name] = self.live.pop(name)
                        else:
                            del self.live[name]
            elif isinstance(event, Release):
                for name in event.names:
                    self.kept.pop(name, None)
            self.tracer.collect_frees()

    def _component(self, event: Tensor):
        from memcalc.tracing.tracer import component

        return component(f"{self.backend} {event.name}", event.role, event.op, event.shape,
                         event.dtype, event.bytes)

    # forward ---------------------------------------------------------------------------

    def forward(self) -> torch.Tensor:
        d, grad = self.d, self.call.requires_grad
        if self.backend == FLASH:
            padded, _ = sdpa_flash.head_dims(d)
            self.padded = padded != d.D
            shape = (d.B, d.H, d.N, padded)  # q_pad is contiguous (B, H, N, dp)
            make = (lambda: torch.empty(shape, dtype=self.q.dtype, device="meta")) \
                if self.padded else (lambda: empty_like(self.q.transpose(1, 2)).transpose(1, 2))
            events = sdpa_flash.forward(d, gpu_of(d), "cuda")
        elif self.backend == EFFICIENT:
            make = lambda: torch.empty((d.B, d.N, d.H, d.D), dtype=self.q.dtype,  # noqa: E731
                                       device="meta").transpose(1, 2)
            events = sdpa_efficient.forward(d, "cuda", grad)
        else:
            make = lambda: matching_layout(self.q)  # noqa: E731
            events = cudnn.forward(d, grad, self.paths.workspace)
        self.replay(events, {"out": make}, grad)
        out = self.live.pop("out")
        self.out_copy = not out.transpose(1, 2).is_contiguous()
        if self.padded:
            self.kept["out"] = out  # the node saves the padded output
            return out[..., : d.D]
        return out

    # backward --------------------------------------------------------------------------

    def backward(self, grad_out: torch.Tensor) -> tuple:
        d = self.d
        transposed = not grad_out.transpose(1, 2).is_contiguous()
        if self.backend == FLASH:
            # padded: SliceBackward0 makes a (B, H, N, dp)-contiguous grad first
            grad_copy = (d.H > 1 and d.N > 1) if self.padded else transposed
            events = sdpa_flash.backward(d, "cuda", grad_copy, self.out_copy)
            names = ("q.grad", "k.grad", "v.grad") if self.padded else ("dq", "dk", "dv")
            like = (self.q, self.k, self.v)
            real = {n: (lambda t=t: torch.empty(t.shape, dtype=t.dtype, device="meta"))
                    if self.padded else (lambda t=t: empty_like(t))
                    for n, t in zip(names, like)}
        elif self.backend == EFFICIENT:
            bias_grad = self.call.mask_requires_grad
            events = sdpa_efficient.backward(d, "cuda", transposed, leaves=False,
                                             bias_grad=bias_grad)
            names = ("dq", "dk", "dv", *(["grad_bias"] if bias_grad else []))
            real = {n: (lambda t=t: torch.empty((t.shape[0], t.shape[2], t.shape[1], t.shape[3]),
                                                dtype=t.dtype, device="meta").transpose(1, 2))
                    for n, t in zip(names, (self.q, self.k, self.v))}
        else:
            grad_copy = cudnn.grad_copied(grad_out.stride())
            events = cudnn.backward(d, grad_copy, self.paths.workspace)
            names = ("dq", "dk", "dv")
            real = {n: (lambda t=t: empty_like(t)) for n, t in zip(names, (self.q, self.k, self.v))}
        self.replay(events, real, True)
        self.kept.clear()
        grads = tuple(self.live.pop(n) for n in names)
        if len(grads) == 4:  # grad_bias: the caller gets it sliced to the M keys
            grads = (*grads[:3], grads[3][..., : d.M])
        return grads


class Node(torch.autograd.Function):
    """A modelled kernel as autograd sees it: saves q, k, v and the output (as
    ``derivatives.yaml`` has the flash / efficient / cuDNN nodes do, and the packages'
    Functions), only the output when the kernel padded them (its copies are in
    ``kernel.kept`` with the model's other saved tensors), and what else the call keeps
    (an attn_mask, a BlockMask's tensors). One named subclass per kernel, so that the
    backward's tensors are named after the node torch names
    (``ScaledDotProductFlashAttentionBackward``), not this class."""

    @staticmethod
    def forward(ctx, kernel: Kernel, *tensors):
        """``tensors``: the call's ``kernel.inputs`` (q, k, v; a packed qkv; q and a packed
        kv), then what else it keeps."""
        inputs, kept = tensors[:kernel.inputs], tensors[kernel.inputs:]
        out = kernel.forward()
        ctx.kernel, ctx.count = kernel, len(tensors)
        ctx.save_for_backward(*((out,) if kernel.padded else (*inputs, out)), *kept)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        kernel = ctx.kernel
        del ctx.kernel
        grads = kernel.backward(grad_out)  # the inputs', and the attn_mask's when it needs one
        kernel.q = kernel.k = kernel.v = None
        return (None, *grads, *[None] * (ctx.count - len(grads)))


def node(name: str) -> type:
    """The node of one kernel, named as torch names it (less the 0)."""
    return type(name, (Node,), {})


NODES = {backend: node(name) for backend, name in (
    (FLASH, "ScaledDotProductFlashAttention"), (EFFICIENT, "ScaledDotProductEfficientAttention"),
    (CUDNN, "ScaledDotProductCudnnAttention"))}


def meta_copies(tracer, tensors) -> list:
    """Untracked meta tensors with the strides of ``tensors``: a kernel reads layouts only,
    and must not keep the user's tensors alive."""
    with tracer.quiet():
        return [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
                for t in tensors]


def launch(kernel: Kernel, node_type: type, grad: bool, *tensors) -> torch.Tensor:
    """``kernel`` through its autograd node (``tensors``: its inputs, then what it keeps)
    when a grad is needed; else its forward alone, under no_grad, keeping nothing."""
    if not grad:
        with torch.no_grad():
            out = kernel.forward()
        kernel.kept.clear()
        return out
    return node_type.apply(kernel, *tensors)


def run(paths, backend: str, q, k, v, call: Call, mask=None) -> torch.Tensor:
    """Run the fused ``backend`` on ``(q, k, v)`` as memcalc models it; ``mask``: the
    attn_mask as the kernel gets it (``cuda_paths.fused_mask``), which the node saves."""
    if call.v[-1] != call.q[-1]:  # efficient and cuDNN (192/128) take it: their outputs
        # are v's width, and memcalc's programs have one head dim
        raise NotModelled(f"scaled_dot_product_attention: a value head dim ({call.v[-1]}) "
                          f"unlike the query's ({call.q[-1]}) is not modelled for the "
                          f"{backend} backend")
    d = dims_of(call, paths.gpu)
    if call.mask_requires_grad and torch.is_grad_enabled() and not call.requires_grad:
        raise NotModelled("scaled_dot_product_attention: an attn_mask that requires grad "
                          "when q, k and v do not is not modelled")
    if backend == EFFICIENT:
        sdpa_efficient.check(d, gpu_of(d))
        if d.Hk != d.H:
            raise NotModelled("scaled_dot_product_attention: the efficient backend with "
                              "grouped key/value heads is not modelled (memcalc's "
                              "sdpa-efficient)")
        if call.dropout > 0:
            paths.note("efficient backend with dropout: its backward kernel's workspace is "
                       "modelled for the no-dropout kernels (kernels/cutlassB.h)")
    elif backend == FLASH:
        sdpa_flash.check(d, gpu_of(d))
    else:
        paths.note(cudnn.DEFAULT_NOTE if paths.workspace == cudnn.Workspace() else
                   f"cuDNN workspace: {paths.workspace.forward or 0} B forward, "
                   f"{paths.workspace.backward} B backward (as given)")
    kernel = Kernel(backend, d, call, paths, *meta_copies(paths.tracer, (q, k, v)))
    kept = () if mask is None else (mask,)  # attn_bias, saved (derivatives.yaml)
    return launch(kernel, NODES[backend], call.requires_grad, q, k, v, *kept)


def matching_layout(t: torch.Tensor) -> torch.Tensor:
    """``alloc_with_matching_layout`` (``aten/src/ATen/native/cudnn/MHA.cpp``): a new tensor
    of ``t``'s shape whose dimensions are laid out in the order of ``t``'s strides (a stable
    sort), dense or not: the output of a cuDNN call on q, k, v sliced from one projection
    is (B, N, H, d) in memory, as q is, so ``out.transpose(1, 2).contiguous()`` copies
    nothing. Measured on an H200 (torch 2.11): no copy there."""
    order = sorted(range(t.dim()), key=lambda i: t.stride()[i])
    strides, step = [0] * t.dim(), 1
    for i in order:
        strides[i] = step
        step *= t.shape[i]
    return torch.empty_strided(t.shape, strides, dtype=t.dtype, device="meta")


def empty_like(t: torch.Tensor) -> torch.Tensor:
    """``torch.empty_like(t)`` on the meta device (``preserve_format``: ``t``'s strides when
    it is dense and non-overlapping, else contiguous), made with ``empty_strided``, whose
    meta kernel is C++: ``empty_like``'s is torch's Python reference (``torch/_refs``),
    which imports sympy through ``torch.fx.experimental.symbolic_shapes`` (0.27 s a trace)."""
    from memcalc.tracing.tracer import dense

    if dense(t):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return torch.empty(t.shape, dtype=t.dtype, device="meta")
