"""DeepSpeed-Ulysses: what one rank allocates when the sequence is traded for heads.

``deepspeed/sequence/layer.py`` (DeepSpeed 0.19.8): ``DistributedAttention(local_attn,
group, scatter_idx=2, gather_idx=1)`` called with ``batch_dim_idx=0`` on each rank's rows of
q, k and v, ``(B, n, H, D)`` with ``n = N / P``. Four all-to-alls (``single_all_to_all``)
give each rank every row of ``H / P`` heads, ``(B, N, H / P, D)``; the local attention
runs on them (``LOCAL``: SDPA's flash, cuDNN or memory-efficient kernel, called on
``.transpose(1, 2)`` views as a (B, N, H, D) caller does, or flash-attn's
``flash_attn_func`` on the tensors themselves); one more all-to-all gives the output back as
``(B, n, H, D)``. In backward
each all-to-all runs again in the other direction (``_SeqAllToAll.backward``): the output's
grad first, the kernel's backward, then v's, k's and q's grads (the autograd engine's order:
latest node first).

One all-to-all, ``single_all_to_all`` then ``_generate_layout_params`` (batch first):

* the input reshaped to ``[B, n, P, h, D]`` (scatter heads) or ``[B, P, n, h, D]`` (scatter
  rows), a view, then ``permute(...).contiguous()`` to ``[P, B, n, h, D]``: a copy unless
  already contiguous (B = 1 when scattering rows);
* ``torch.empty_like`` of it: the received buffer, filled by ``dist.all_to_all_single``
  (synchronous: NCCL's stash of the input ends with the call);
* the received buffer ``permute(...).contiguous()`` to ``[B, P, n, h, D]`` or ``[B, n, P, h,
  D]``, a copy unless contiguous (B = 1 when gathering rows), reshaped (a view).

The sent and received buffers die when the function returns, unless the result is the
received buffer itself. ``_SeqAllToAll`` saves no tensor; the kernel's node saves the
all-to-all'd q, k, v, its output and logsumexp (its model's ``saved`` tensors), which live
to its backward. Every rank does the same: no rank is busier.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Callable

from memcalc.engine.program import Dims, Free, Release, Role, Tensor, free, release
from memcalc.impls import flash_attn, sdpa_cudnn, sdpa_efficient, sdpa_flash
from memcalc.impls.device import gpu_of
from memcalc.impls.frame import Frame, prefixed, roled

S, O, G, T = Role.saved, Role.output, Role.gradient, Role.temporary


@dataclass(frozen=True)
class Local:
    """A kernel as ``DistributedAttention``'s local attention, on (B, N, h, D)-contiguous
    q, k, v: its forward's events and its backward's, as its model declares them."""

    forward: Callable[[Dims], list]
    backward: Callable[[Dims], list]


LOCAL = {
    # F.scaled_dot_product_attention on .transpose(1, 2) views: the output, the grad and
    # dq, dk, dv are (B, N, h, D)-contiguous, so _flash_attention_backward copies nothing
    "sdpa-flash": Local(lambda d: sdpa_flash.forward(d, gpu_of(d), "cuda"),
                        lambda d: sdpa_flash.backward(d, "cuda", False, False)),
    # cuDNN's: its output in q's layout, (B, N, h, D) as the grad's, so no grad copy; the
    # logsumexp only where a grad is needed (compute_log_sumexp), as the efficient kernel's
    "sdpa-cudnn": Local(lambda d: sdpa_cudnn.forward(d, not d.forward_only,
                                                     sdpa_cudnn.Workspace()),
                        lambda d: sdpa_cudnn.backward(d, False, sdpa_cudnn.Workspace())),
    "sdpa-efficient": Local(lambda d: sdpa_efficient.forward(d, "cuda", not d.forward_only),
                            lambda d: sdpa_efficient.backward(d, "cuda", False, leaves=False)),
    # flash_attn_func on the (B, N, h, D) tensors themselves; the grad is contiguous
    "flash-attn": Local(flash_attn.forward, lambda d: flash_attn.node_backward(d, False)),
}
KERNELS = tuple(LOCAL)
# _generate_layout_params, batch_dim_idx = 0: (permutation before, permutation after) of
# [B, n, P, h, D] -> [P, B, n, h, D] -> [B, P, n, h, D] (heads scattered, rows gathered)
SCATTER_HEADS = ((2, 0, 1, 3, 4), (1, 0, 2, 3, 4))
# [B, P, n, h, D] -> [P, B, n, h, D] -> [B, n, P, h, D] (rows scattered, heads gathered)
SCATTER_ROWS = ((1, 0, 2, 3, 4), (1, 2, 0, 3, 4))


def permuted(shape: tuple, order: tuple) -> tuple:
    return tuple(shape[i] for i in order)


def contiguous_after(shape: tuple, order: tuple) -> bool:
    """Whether a contiguous ``shape`` permuted by ``order`` is still contiguous, so that
    ``.contiguous()`` returns it (``TensorImpl::compute_contiguous``: sizes of 1 aside)."""
    strides = [prod(shape[i + 1:]) for i in range(len(shape))]
    kept = [(shape[i], strides[i]) for i in order if shape[i] != 1]
    return all(stride == prod(size for size, _ in kept[j + 1:])
               for j, (_, stride) in enumerate(kept))


@dataclass(frozen=True)
class Ulysses:
    """One rank's step: ``d`` the rank's sizes (``N`` its ``n`` rows, ``H`` and ``Hk`` every
    head), ``P`` ranks."""

    d: Dims
    P: int
    kernel: str = "sdpa-flash"

    @property
    def local(self) -> Dims:
        """The local attention's sizes: every row, ``H / P`` and ``Hk / P`` heads."""
        d, P = self.d, self.P
        return d.replace(N=d.N * P, M=d.M * P, H=d.H // P, Hk=d.Hk // P, cp=1)


def all_to_all(f: Frame, x: str, layout: tuple, order: tuple[tuple, tuple], dtype: str,
               name: str, into: str, expanded: bool = False) -> str:
    """``single_all_to_all`` of the tensor ``x`` viewed as ``layout``, its result (a new
    tensor, or the received buffer) bound to the variable ``into``; returns the result.
    ``expanded``: ``x`` is a stride-0 expand (``out.sum()``'s grad), which
    ``reshape(...).contiguous()`` materializes before the permute copies it."""
    before, after = order
    sent_shape = permuted(layout, before)  # (P, B, n, h, D)
    sent = x
    if expanded:  # input_t = input.reshape(...).contiguous()
        sent = f.new(f"{name}: materialized", layout, dtype, "clone")
        f.hold("input_t", sent)
        f.drop(sent)
    if not contiguous_after(layout, before):  # input_t = input_t.permute(...).contiguous()
        sent = f.new(f"{name}: sent", sent_shape, dtype, "clone")
    f.hold("input_t", sent)
    received = f.new(f"{name}: received", sent_shape, dtype, "empty_like")  # (P, B, n, h, D)
    result = received
    if not contiguous_after(sent_shape, after):
        result = f.new(name, permuted(sent_shape, after), dtype, "clone")
    f.hold(into, result)
    f.drop("input_t", f"{name}: materialized", f"{name}: sent", received, name)  # locals
    return result


def heads_all_to_all(f: Frame, u: Ulysses, x: str, heads: int, name: str, into: str,
                     expanded: bool = False) -> str:
    """Rows to heads: ``x`` (B, n, heads, D) to (B, N, heads / P, D)."""
    d, layout = u.d, (u.d.B, u.d.N, u.P, heads // u.P, u.d.D)  # [B, n, P, h, D]
    return all_to_all(f, x, layout, SCATTER_HEADS, d.dtype, name, into, expanded)


def rows_all_to_all(f: Frame, u: Ulysses, x: str, heads: int, name: str, into: str) -> str:
    """Heads to rows: ``x`` (B, N, heads / P, D) to (B, n, heads, D)."""
    d, layout = u.d, (u.d.B, u.P, u.d.N, heads // u.P, u.d.D)  # [B, P, n, h, D]
    return all_to_all(f, x, layout, SCATTER_ROWS, d.dtype, name, into)


# the step's own tensors, held by the caller throughout (the protocol's q, k, v, grad_out)
CALLER = ("q", "k", "v", "grad_out")


LOCAL_PREFIX = "local: "  # the local attention's tensors


def _local(name: str) -> str:
    return LOCAL_PREFIX + name


def forward(u: Ulysses) -> tuple[list, tuple[str, ...]]:
    """``DistributedAttention.forward``: q, k, v to heads, the kernel, the output back to
    rows; the events, and what the kernel's node saves."""
    d, f = u.d, Frame()
    f.hold("caller", *CALLER)
    layers = tuple(heads_all_to_all(f, u, x, heads, f"{x} to heads", f"{x}_layer")
                   for x, heads in (("q", d.H), ("k", d.Hk), ("v", d.Hk)))
    events, kept = kernel_forward(LOCAL[u.kernel], u.local)
    kept = tuple(map(_local, kept))
    f.kernel(prefixed(events, LOCAL_PREFIX), kept)
    f.drop(*kept[1:])  # the call returns the output alone; autograd keeps the rest
    f.hold("context_layer", kept[0])
    out = rows_all_to_all(f, u, kept[0], d.H, "output to rows", "output")
    f.hold("saved", *layers, kept[0])
    f.drop(*[v for v in list(f.bound) if v not in ("saved", "output", "caller")])
    f.flush()
    saved = layers + kept
    return roled(roled(f.events, saved, S), (out,), O) + [free(*layers, kept[0])], saved


def kernel_forward(local: Local, d: Dims) -> tuple[list, tuple[str, ...]]:
    """The kernel's forward less its last free of what its node saves (the frame follows
    those), and the names of what it makes that the caller or its node keeps: the output,
    then the saved tensors."""
    events = local.forward(d)
    saved = [e.name for e in events if isinstance(e, Tensor) and e.role is S]
    if events and isinstance(events[-1], Free) and set(events[-1].names) <= set(saved):
        events = events[:-1]
    return events, ("out", *saved)


def backward(u: Ulysses, saved: tuple[str, ...]) -> list:
    """The output's all-to-all back, the kernel's backward (its grads and out laid out
    (B, N, h, D): no copies), its saved tensors released, then v's, k's and q's grads to
    rows, each the leaf's grad as it is."""
    d, f = u.d, Frame()
    f.hold("caller", *CALLER)
    heads_all_to_all(f, u, "grad_out", d.H, "grad to heads", "grad", d.loss == "sum")
    events = [e for e in LOCAL[u.kernel].backward(u.local) if not isinstance(e, Release)]
    dq, dk, dv = map(_local, ("dq", "dk", "dv"))
    f.kernel(prefixed(events, LOCAL_PREFIX), (dq, dk, dv))
    f.drop("grad")  # the engine's buffer for the kernel's node, gone with its call
    f.flush()
    f.events.append(release(*saved))
    grads = []
    for x, dx, heads in (("v", dv, d.Hk), ("k", dk, d.Hk), ("q", dq, d.H)):
        f.hold("dx", dx)  # the engine's buffer for the all-to-all's node
        f.drop(dx)
        grads.append(rows_all_to_all(f, u, dx, heads, f"{x}.grad", f"{x} grad"))
        f.drop("dx")
    f.drop(*[v for v in list(f.bound) if not v.endswith(" grad") and v != "caller"])
    f.flush()
    return roled(f.events, tuple(grads), G)


def refusal(impl: str, user_code: bool, cp: int, shape, tp: int = 1) -> str:
    """Why ``cp`` ranks cannot run this step under DeepSpeed-Ulysses as modelled (one line
    naming the option), or ""; ``shape`` is the whole sequence's, its heads over ``tp``
    tensor-parallel ranks."""
    if impl not in KERNELS and not user_code:
        return (f"cp_method: ulysses is modelled with {', '.join(KERNELS)} as the local "
                f"attention, not {impl} (attention written out: memcalc trace runs it, "
                f"e.g. examples/attention/ulysses_eager.py)")
    if shape.seq_len % cp:
        return f"seq_len: under {cp} ranks a multiple of {cp} (got N = {shape.seq_len:,})"
    heads, key_heads = shape.heads // tp, shape.key_heads // tp  # a tensor-parallel rank's
    if heads % cp or key_heads % cp:
        per = " a tensor-parallel rank holds" if tp > 1 else ""
        return (f"cp: {cp} ranks must divide the heads ({heads}) and the key/value heads "
                f"({key_heads}){per} under ulysses (DeepSpeed's uneven-head all-to-all is "
                "not modelled)")
    return ""


def program(d: Dims, kernel: str = "sdpa-flash"):
    """Rank ``d.cp_rank``'s step of ``d.cp`` under DeepSpeed-Ulysses; ``d`` holds the rank's
    own rows and every head."""
    from memcalc.engine.program import Program
    from memcalc.impls.common import with_loss
    from memcalc.impls.flash_attn import inputs

    u = Ulysses(d, d.cp, kernel)
    events, saved = forward(u)
    # the rank's rows of q, k, v and grad_out as DeepSpeed takes them: (B, n, H, D)
    return Program(tuple(events), tuple(with_loss(d, backward(u, saved))), inputs(d))
