"""``flash2``: a user-written FlashAttention-2 kernel (Triton) in a custom autograd Function.

Reference code: ``memcalc/validation/reference/flash2.py`` (modelled on the Triton tutorial
``python/tutorials/06-fused-attention.py``). Every allocation is torch code, the kernel
launches are skipped on the meta device, so this model is checked against the emulated
trace to the byte (``memcalc/data/grids/flash2.json``). ``Dims``: ``B`` batch, ``H``
heads, ``N`` query rows, ``M`` key rows, ``D`` head dim.

No op of the step calls cuBLAS: the step holds no cuBLAS workspace (DESIGN.md s.2).
"""

from __future__ import annotations

from memcalc.impls.registry import register
from memcalc.impls.common import with_loss
from memcalc.engine.program import Dims, Program, Role, free, new, release

S, O, G, T = Role.saved, Role.output, Role.gradient, Role.temporary


def forward(d: Dims) -> list:
    """``o = empty_like(q)``, the base-2 row logsumexp ``M``; ``save_for_backward(q, k, v,
    o, M)``: q, k, v are the inputs and o is the output, so only ``M`` is new."""
    return [
        new("out", (d.B, d.H, d.N, d.D), d.dtype, O, "empty_like"),  # (B, H, N, D) like q
        new("lse", (d.B, d.H, d.N), "float32", S, "empty"),  # (B, H, N) float32, saved
        free("lse"),  # the Python name dies with forward(); ctx keeps it
    ]


def backward(d: Dims) -> list:
    """``do.contiguous()``, ``dq, dk, dv = empty_like``, ``delta = empty_like(M)``;
    the Python locals die when backward() returns, then autograd drops ``M``."""
    dt = d.dtype
    copy = d.loss == "sum"  # out.sum()'s grad is a stride-0 expand: contiguous() copies it
    return [
        *([new("do", (d.B, d.H, d.N, d.D), dt, T, "clone")] if copy else []),  # (B, H, N, D)
        new("dq", (d.B, d.H, d.N, d.D), dt, G, "empty_like"),  # (B, H, N, D) q.grad as is
        new("dk", (d.B, d.H, d.M, d.D), dt, G, "empty_like"),  # (B, H, M, D)
        new("dv", (d.B, d.H, d.M, d.D), dt, G, "empty_like"),  # (B, H, M, D)
        new("delta", (d.B, d.H, d.N), "float32", T, "empty_like"),  # (B, H, N) rowsum(dO * O)
        free("delta", *(["do"] if copy else [])),
        release("lse"),
    ]


@register("flash2", "user FlashAttention-2 (Triton) Function: saves q, k, v, out and L")
def flash2(d: Dims) -> Program:
    """Saved for backward: the (B, H, N) float32 logsumexp only (q, k, v are inputs, out
    is the output); backward adds dq, dk, dv and the (B, H, N) float32 ``delta``."""
    return Program(tuple(forward(d)), tuple(with_loss(d, backward(d))))
