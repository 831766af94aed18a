"""A fused SDPA kernel, traced as the aten op a GPU runs, whose work is memcalc's model of it.

``scaled_dot_product_attention`` on a GPU calls one aten op per fused backend
(``attention.cpp``): ``_scaled_dot_product_flash_attention`` (after padding a head dim
that is not a multiple of 8, and slicing the output back), ``_efficient_attention`` or
``_cudnn_attention``. A trace calls that op through the dispatcher as well, so everything
that watches ops sees it as on a GPU: autograd makes the op's own node
(``ScaledDotProductFlashAttentionBackward0``) and saves what ``derivatives.yaml`` says, a
selective-checkpoint policy (``create_selective_checkpoint_contexts``) or any other
``TorchDispatchMode`` is asked about it and may keep its outputs, full checkpointing frees
them. Below them the tracer hands the op (and its backward op) to ``OPS`` here, which replay
the model's events (``memcalc/impls/sdpa_flash.py``, ``sdpa_efficient.py``,
``sdpa_cudnn.py``) built from the call's ``Dims``: every declared tensor becomes a meta
tensor handed to the tracer with the model's name, shape and role, and dies where the model
frees it; the op's outputs are returned, with the strides the CUDA kernel gives them (so
what autograd does next, an ``AccumulateGrad`` copy or none, is traced as it runs); layout
copies inside the kernel are decided from the strides of the tensors actually passed. One
source of truth: no size is written here.
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
    roles: dict = field(default_factory=dict)  # each live tensor's role in the model
    padded: bool = False
    out_copy: bool = False
    inputs: int = 3  # the tensors the call takes and returns grads for: q, k, v (or packed)
    op: bool = False  # an aten op's implementation: every output made is returned, not kept

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
                self.roles[event.name] = event.role  # the trace may report another
            elif isinstance(event, Free):
                for name in event.names:
                    if name in self.live:
                        if grad and self.roles[name] is Role.saved:
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
        self.replay(events, {"out": make}, grad or self.op)
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
    """A modelled kernel that is a Python ``autograd.Function`` on a GPU too (the flash-attn
    packages' ``FlashAttnFunc``, compiled FlexAttention): saves q, k, v and the output, only
    the output when the kernel padded them (its copies are in ``kernel.kept`` with the
    model's other saved tensors), and what else the call keeps (a BlockMask's tensors). One
    named subclass per Function, so that the backward's tensors are named after the node
    torch names (``FlashAttnFuncBackward``), not this class."""

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
    """The node of one Function, named as torch names it (``FlashAttnFuncBackward``)."""
    return type(name, (Node,), {})


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


# --- the aten ops ----------------------------------------------------------------------------

aten = torch.ops.aten
# the op each fused backend is on a GPU, and its backward (``native_functions.yaml``; the
# same schemas from torch 2.4 to 2.15)
FORWARD = {FLASH: aten._scaled_dot_product_flash_attention.default,
           EFFICIENT: aten._scaled_dot_product_efficient_attention.default,
           CUDNN: aten._scaled_dot_product_cudnn_attention.default}
BACKWARD = {FLASH: aten._scaled_dot_product_flash_attention_backward.default,
            EFFICIENT: aten._scaled_dot_product_efficient_attention_backward.default,
            CUDNN: aten._scaled_dot_product_cudnn_attention_backward.default}


def op_kernel(paths, backend: str, q, k, v, causal, grad: bool, mask_grad: bool = False,
              dropout: float = 0.0) -> Kernel:
    """The model of one call of ``backend``'s op on ``q, k, v`` as the op gets them
    (padded, expanded): ``grad``, whether it computes what a backward needs (the
    logsumexp); every output it makes is returned (``op``), not kept."""
    call = Call(tuple(q.shape), tuple(k.shape), tuple(v.shape),
                str(q.dtype).removeprefix("torch."), mask_requires_grad=mask_grad,
                dropout=float(dropout), is_causal=bool(causal), requires_grad=grad,
                itemsize=q.element_size())
    return Kernel(backend, dims_of(call, paths.gpu), call, paths,
                  *meta_copies(paths.tracer, (q, k, v)), op=True)


def checked(paths, backend: str, kernel: Kernel) -> Kernel:
    """What the GPU's kernel refuses, or memcalc's model does not cover, as one line; the
    backend noted as modelled (a caveat of the result)."""
    d, call = kernel.d, kernel.call
    if call.v[-1] != call.q[-1]:  # efficient and cuDNN (192/128) take it: their outputs
        # are v's width, and memcalc's programs have one head dim
        raise NotModelled(f"scaled_dot_product_attention: a value head dim ({call.v[-1]}) "
                          f"unlike the query's ({call.q[-1]}) is not modelled for the "
                          f"{backend} backend")
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
    paths.kernels[backend] = None
    return kernel


def _empty(like) -> torch.Tensor:
    """``at::empty({0}, ...)``: the debug mask a call that asks for none returns (0 bytes)."""
    return torch.empty(0, dtype=like.dtype, device="meta")


def _cpu_scalar() -> torch.Tensor:
    """A philox seed or offset the efficient kernel makes on the CPU without dropout
    (``_efficient_attention_forward``, attention.cu): not a device allocation."""
    return torch.empty((), dtype=torch.int64)


def flash_forward(paths, query, key, value, dropout_p=0.0, is_causal=False,
                  return_debug_mask=False, *, scale=None) -> tuple:
    """``_scaled_dot_product_flash_attention_cuda`` (attention.cu): output, logsumexp,
    cum_seq_q and cum_seq_k (undefined), max_q, max_k, rng_state, unused, debug mask."""
    kernel = checked(paths, FLASH, op_kernel(paths, FLASH, query, key, value, is_causal,
                                             needs_grad(query, key, value), dropout=dropout_p))
    out = kernel.forward()
    kept = kernel.kept
    return (out, kept.pop("lse"), None, None, query.shape[2], key.shape[2],
            kept.pop("rng_state"), kept.pop("philox_offset"), _empty(query))


def efficient_forward(paths, query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0,
                      is_causal=False, *, scale=None) -> tuple:
    """``_scaled_dot_product_efficient_attention_cuda``: output, logsumexp (0 columns when
    not asked for), philox seed and offset."""
    kernel = checked(paths, EFFICIENT, op_kernel(paths, EFFICIENT, query, key, value,
                                                 is_causal, bool(compute_log_sumexp),
                                                 dropout=dropout_p))
    out = kernel.forward()
    lse = kernel.kept.pop("lse", None)
    if lse is None:
        lse = torch.empty((query.shape[0], query.shape[1], 0), dtype=torch.float32,
                          device="meta")
    return out, lse, _cpu_scalar(), _cpu_scalar()


def cudnn_forward(paths, query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0,
                  is_causal=False, return_debug_mask=False, *, scale=None) -> tuple:
    """``_scaled_dot_product_cudnn_attention_cuda``: output, softmax statistics (undefined
    when not asked for), cum_seq_q, cum_seq_k (undefined), max_q, max_k, philox seed and
    offset, debug mask."""
    kernel = checked(paths, CUDNN, op_kernel(paths, CUDNN, query, key, value, is_causal,
                                             bool(compute_log_sumexp), dropout=dropout_p))
    out = kernel.forward()
    kept = kernel.kept
    return (out, kept.pop("lse", None), None, None, query.shape[2], key.shape[2],
            kept.pop("seed"), kept.pop("offset"), _empty(query))


def flash_backward(paths, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                   max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *,
                   scale=None) -> tuple:
    """``_scaled_dot_product_flash_attention_backward_cuda``: dq, dk, dv."""
    kernel = op_kernel(paths, FLASH, query, key, value, is_causal, True, dropout=dropout_p)
    kernel.out_copy = not out.transpose(1, 2).is_contiguous()
    return kernel.backward(grad_out)


def efficient_backward(paths, grad_out_, query, key, value, attn_bias, out, logsumexp,
                       philox_seed, philox_offset, dropout_p, grad_input_mask, is_causal=False,
                       *, scale=None) -> tuple:
    """``_scaled_dot_product_efficient_attention_backward_cuda``: dq, dk, dv, and the
    attn_bias's grad when ``grad_input_mask`` asks for it (else undefined)."""
    kernel = op_kernel(paths, EFFICIENT, query, key, value, is_causal, True,
                       mask_grad=bool(grad_input_mask[3]), dropout=dropout_p)
    grads = kernel.backward(grad_out_)
    return (*grads, None) if len(grads) == 3 else grads


def cudnn_backward(paths, grad_out, query, key, value, out, logsumexp, philox_seed,
                   philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                   is_causal, *, scale=None) -> tuple:
    """``_scaled_dot_product_cudnn_attention_backward_cuda``: dq, dk, dv."""
    kernel = op_kernel(paths, CUDNN, query, key, value, is_causal, True, dropout=dropout_p)
    return kernel.backward(grad_out)


# what the tracer runs for each op on the GPU's code paths (``CudaPaths.kernel``), in place
# of its meta kernel
OPS = {FORWARD[FLASH]: flash_forward, FORWARD[EFFICIENT]: efficient_forward,
       FORWARD[CUDNN]: cudnn_forward, BACKWARD[FLASH]: flash_backward,
       BACKWARD[EFFICIENT]: efficient_backward, BACKWARD[CUDNN]: cudnn_backward}


# --- scaled_dot_product_attention's call of the op ---------------------------------------------

def run(backend: str, q, k, v, call: Call, mask=None, scale=None) -> torch.Tensor:
    """``scaled_dot_product_attention``'s fused case as ``attention.cpp`` writes it: the
    backend's aten op on ``(q, k, v)`` (``mask``: the attn_mask as the kernel gets it,
    ``cuda_paths.fused_mask``), through the dispatcher, so that autograd, checkpointing and
    every dispatch mode see it; for flash, q, k, v padded to a head dim that is a multiple
    of 8 first and the output sliced back. Returns the output."""
    if call.mask_requires_grad and torch.is_grad_enabled() and not call.requires_grad:
        raise NotModelled("scaled_dot_product_attention: an attn_mask that requires grad "
                          "when q, k and v do not is not modelled")
    if backend == FLASH:
        size = q.shape[-1]
        q, k, v = (pad_last_dim(t) for t in (q, k, v))
        out = FORWARD[FLASH](q, k, v, call.dropout, call.is_causal, False, scale=scale)[0]
        return out[..., :size] if out.shape[-1] != size else out  # post_process_flash_output
    return FORWARD[backend](q, k, v, mask, call.requires_grad, call.dropout, call.is_causal,
                            scale=scale)[0]


def pad_last_dim(t: torch.Tensor) -> torch.Tensor:
    """``pad_last_dim<8, false>`` (``attention.cpp``): ``t`` as it is when its last dim is a
    multiple of 8, else ``at::pad`` to the next multiple (a new tensor, which autograd
    sees: ``ConstantPadNdBackward0``)."""
    size = t.shape[-1]
    return t if size % 8 == 0 else torch.constant_pad_nd(t, (0, 8 - size % 8))


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
