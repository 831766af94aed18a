"""DeepSpeed-Ulysses: what one rank allocates when the sequence is traded for heads.

``deepspeed/sequence/layer.py`` (DeepSpeed 0.19.8): ``DistributedAttention(local_attn,
group, scatter_idx=2, gather_idx=1)`` called with ``batch_dim_idx=0`` on each rank's rows of
q, k and v, ``(B, n, H, D)`` with ``n = N / P``. Four all-to-alls (``single_all_to_all``)
give each rank every row of ``H / P`` heads, ``(B, N, H / P, D)``; the local attention
runs on them (``LOCAL``: SDPA's flash, cuDNN or memory-efficient kernel, called on
``.transpose(1, 2)`` views as a (B, N, H, D) caller does, flash-attn's ``flash_attn_func``
on the tensors themselves, or the math path on the views: SDPA's math backend, the naive
family, whose matmuls copy by the views' layout, ``Dims.layout``); one more all-to-all
gives the output back as ``(B, n, H, D)``, first made contiguous where the local
attention's output is not (the math path's). In backward
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
received buffer itself. ``_SeqAllToAll`` saves no tensor; a fused kernel's node saves the
all-to-all'd q, k, v, its output and logsumexp (its model's ``saved`` tensors), which live
to its backward; the math path saves what its model says (``Local.saves``), released where
its backward lets go of them. Every rank does the same: no rank is busier.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from memcalc.engine.program import Dims, Free, Release, Role, Tensor, free, release
from memcalc.engine.strides import contiguous_after, permuted
from memcalc.impls import flash_attn, naive, sdpa_cudnn, sdpa_efficient, sdpa_flash, sdpa_math
from memcalc.impls.common import transposed_results
from memcalc.impls.device import gpu_of
from memcalc.impls.frame import Frame, prefixed, roled

S, O, G, T = Role.saved, Role.output, Role.gradient, Role.temporary


def _none(d: Dims) -> tuple:
    """A fused kernel's output and grads: made in the caller's (B, N, h, D) layout."""
    return ()


@dataclass(frozen=True)
class Local:
    """A kernel as ``DistributedAttention``'s local attention, on (B, N, h, D)-contiguous
    q, k, v, each field a function of the local sizes:

    * ``forward``, ``backward``: its events as its model declares them (in backward the
      incoming grad is ``grad``; a release of ``q``, ``k`` or ``v`` is of that layer);
    * ``saves``: which of ``q``, ``k``, ``v``, ``out`` its node saves (a fused kernel: all);
    * ``grads``: the names of q's, k's and v's grads;
    * ``strided``: which of ``out``, ``dq``, ``dk``, ``dv`` are not (B, N, h, D)-contiguous,
      so that the all-to-all copies them first (a fused kernel: none)."""

    forward: Callable[[Dims], list]
    backward: Callable[[Dims], list]
    saves: Callable[[Dims], tuple] = lambda d: ("q", "k", "v", "out")
    grads: Callable[[Dims], tuple] = lambda d: ("dq", "dk", "dv")
    strided: Callable[[Dims], tuple] = _none


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
    # the math path on the .transpose(1, 2) views (d.layout "BNHD"): matmul's folds copy
    # where the views' strides do not chain; it saves v alone of its inputs, and that only
    # in float32 without GQA
    "sdpa-math": Local(sdpa_math.forward, lambda d: sdpa_math.backward(d, leaves=False),
                       lambda d: ("v",) if sdpa_math.saves_v(d) else (),
                       sdpa_math.node_grads, sdpa_math.strided_results),
}


def _written_out(events: Callable, saves: Callable, grads: tuple, k_grad_transposed: bool):
    """A naive-family attention as the local one: ``events(d, leaves)`` its model's."""
    return Local(lambda d: events(d)[0], lambda d: events(d, leaves=False)[1], saves,
                 lambda d: grads, lambda d: transposed_results(d, k_grad_transposed))


LOCAL |= {
    # attention written out on the .transpose(1, 2) views: the bmms save q, k, v where they
    # fold as views, their clones elsewhere; k's grad is k^T's, transposed
    "naive": _written_out(naive.naive_events, naive.saved_inputs, ("dq", "dk_t", "dv"), True),
    "naive-softmax": _written_out(naive.softmax_events, naive.saved_inputs,
                                  ("dq", "dk_t", "dv"), True),
    # a custom Function: ctx.save_for_backward(q, k, v, p), its grads made (B, H, rows, D)
    "naive-weights": _written_out(naive.weights_events, lambda d: ("q", "k", "v"),
                                  ("dq", "dk", "dv"), False),
}
KERNELS = tuple(LOCAL)
WRITTEN_OUT = ("sdpa-math", "naive", "naive-softmax", "naive-weights")  # no head-dim padding
# _generate_layout_params, batch_dim_idx = 0: (permutation before, permutation after) of
# [B, n, P, h, D] -> [P, B, n, h, D] -> [B, P, n, h, D] (heads scattered, rows gathered)
SCATTER_HEADS = ((2, 0, 1, 3, 4), (1, 0, 2, 3, 4))
# [B, P, n, h, D] -> [P, B, n, h, D] -> [B, n, P, h, D] (rows scattered, heads gathered)
SCATTER_ROWS = ((1, 0, 2, 3, 4), (1, 2, 0, 3, 4))


@dataclass(frozen=True)
class Ulysses:
    """One rank's step: ``d`` the rank's sizes (``N`` its ``n`` rows, ``H`` and ``Hk`` every
    head), ``P`` ranks."""

    d: Dims
    P: int
    kernel: str = "sdpa-flash"

    @property
    def local(self) -> Dims:
        """The local attention's sizes: every row, ``H / P`` and ``Hk / P`` heads, on
        (B, N, h, D) tensors seen through ``.transpose(1, 2)``; its grad is the all-to-all's
        result, whatever the loss."""
        d, P = self.d, self.P
        return d.replace(N=d.N * P, M=d.M * P, H=d.H // P, Hk=d.Hk // P, cp=1, layout="BNHD",
                         loss="grad")


def all_to_all(f: Frame, x: str, layout: tuple, order: tuple[tuple, tuple], dtype: str,
               name: str, into: str, strided: bool = False) -> str:
    """``single_all_to_all`` of the tensor ``x`` viewed as ``layout``, its result (a new
    tensor, or the received buffer) bound to the variable ``into``; returns the result.
    ``strided``: ``x`` is not contiguous as ``layout`` (``out.sum()``'s stride-0 grad, a
    transposed view), so ``reshape(...).contiguous()`` copies it before the permute does."""
    before, after = order
    sent_shape = permuted(layout, before)  # (P, B, n, h, D)
    sent = x
    if strided:  # input_t = input.reshape(...).contiguous()
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
                     strided: bool = False) -> str:
    """Rows to heads: ``x`` (B, n, heads, D) to (B, N, heads / P, D)."""
    d, layout = u.d, (u.d.B, u.d.N, u.P, heads // u.P, u.d.D)  # [B, n, P, h, D]
    return all_to_all(f, x, layout, SCATTER_HEADS, d.dtype, name, into, strided)


def rows_all_to_all(f: Frame, u: Ulysses, x: str, heads: int, name: str, into: str,
                    strided: bool = False) -> str:
    """Heads to rows: ``x`` (B, N, heads / P, D) to (B, n, heads, D)."""
    d, layout = u.d, (u.d.B, u.P, u.d.N, heads // u.P, u.d.D)  # [B, P, n, h, D]
    return all_to_all(f, x, layout, SCATTER_ROWS, d.dtype, name, into, strided)


# the step's own tensors, held by the caller throughout (the protocol's q, k, v, grad_out)
CALLER = ("q", "k", "v", "grad_out")


LOCAL_PREFIX = "local: "  # the local attention's tensors


def _local(name: str) -> str:
    return LOCAL_PREFIX + name


def forward(u: Ulysses) -> tuple[list, tuple[str, ...], tuple[str, ...]]:
    """``DistributedAttention.forward``: q, k, v to heads, the kernel, the output back to
    rows; the events, what the kernel's node saves (of the layers, those it saves), and
    the layers (the kernel's q, k, v)."""
    d, f, local = u.d, Frame(), LOCAL[u.kernel]
    f.hold("caller", *CALLER)
    layers = tuple(heads_all_to_all(f, u, x, heads, f"{x} to heads", f"{x}_layer")
                   for x, heads in (("q", d.H), ("k", d.Hk), ("v", d.Hk)))
    events, kept = kernel_forward(local, u.local)
    kept = tuple(map(_local, kept))
    f.kernel(prefixed(events, LOCAL_PREFIX), kept[:1])  # what it saves is autograd's
    f.drop(*kept[1:])  # the call returns the output alone
    f.hold("context_layer", kept[0])
    out = rows_all_to_all(f, u, kept[0], d.H, "output to rows", "output",
                          "out" in local.strided(u.local))
    f.hold("locals", *layers, kept[0])  # DistributedAttention's, to its return
    f.drop(*[v for v in list(f.bound) if v not in ("locals", "output", "caller")])
    f.flush()
    saves = local.saves(u.local)
    saved = (tuple(t for x, t in zip(("q", "k", "v", "out"), layers + kept[:1]) if x in saves)
             + kept[1:])
    events = roled(roled(f.events, saved, S), (out,), O) + [free(*layers, kept[0])]
    return events, saved, layers


def kernel_forward(local: Local, d: Dims) -> tuple[list, tuple[str, ...]]:
    """The kernel's forward less its last free of what its node saves (the frame follows
    those), and the names of what it makes that the caller or its node keeps: the output,
    then the saved tensors."""
    events = local.forward(d)
    saved = [e.name for e in events if isinstance(e, Tensor) and e.role is S]
    if events and isinstance(events[-1], Free) and set(events[-1].names) <= set(saved):
        events = events[:-1]
    return events, ("out", *saved)


def backward(u: Ulysses, saved: tuple[str, ...], layers: tuple[str, ...]) -> list:
    """The output's all-to-all back, the kernel's backward (what it saved released where
    its model says, ``layers`` its q, k, v; the rest as it returns), then v's, k's and q's
    grads to rows, each as it is (a fused kernel's (B, N, h, D): no copy before)."""
    d, f, local = u.d, Frame(), LOCAL[u.kernel]
    f.hold("caller", *CALLER)
    grad = heads_all_to_all(f, u, "grad_out", d.H, "grad to heads", "grad", d.loss == "sum")
    f.hold(_local("grad"), grad)  # the engine's buffer for the kernel's node
    f.drop("grad")
    grads = tuple(map(_local, local.grads(u.local)))  # dq, dk, dv
    events = _inputs_named(prefixed(local.backward(u.local), LOCAL_PREFIX), layers)
    f.kernel(events, grads)
    f.drop(_local("grad"))  # gone with the call, unless the kernel let go of it before
    f.flush()
    released = {n for e in events if isinstance(e, Release) for n in e.names}
    f.events.append(release(*[t for t in saved if t not in released]))
    strided = local.strided(u.local)
    results = []
    for x, dx, heads in zip(("v", "k", "q"), grads[::-1], (d.Hk, d.Hk, d.H)):
        f.hold("dx", dx)  # the engine's buffer for the all-to-all's node
        f.drop(dx)
        results.append(rows_all_to_all(f, u, dx, heads, f"{x}.grad", f"{x} grad",
                                       f"d{x}" in strided))
        f.drop("dx")
    f.drop(*[v for v in list(f.bound) if not v.endswith(" grad") and v != "caller"])
    f.flush()
    return roled(f.events, tuple(results), G)


def _inputs_named(events: list, layers: tuple[str, ...]) -> list:
    """The kernel's releases of its inputs (``local: v``) as of the layers they are."""
    names = dict(zip(map(_local, ("q", "k", "v")), layers))
    return [release(*(names.get(n, n) for n in e.names)) if isinstance(e, Release) else e
            for e in events]


def refusal(impl: str, user_code: bool, cp: int, shape, tp: int = 1) -> str:
    """Why ``cp`` ranks cannot run this step under DeepSpeed-Ulysses as modelled (one line
    naming the option), or ""; ``shape`` is the whole sequence's, its heads over ``tp``
    tensor-parallel ranks."""
    if impl not in KERNELS and not user_code:
        return (f"cp_method: ulysses is modelled with {', '.join(KERNELS)} as the local "
                f"attention, not {impl} (your own code around DistributedAttention: memcalc "
                f"trace runs it, e.g. examples/attention/ulysses_eager.py)")
    if shape.seq_len % cp:
        return f"seq_len: under {cp} ranks a multiple of {cp} (got N = {shape.seq_len:,})"
    heads, key_heads = shape.heads // tp, shape.key_heads // tp  # a tensor-parallel rank's
    if (heads % cp or key_heads % cp) and not user_code:  # a trace runs DeepSpeed's own
        per = " a tensor-parallel rank holds" if tp > 1 else ""
        return (f"cp: {cp} ranks must divide the heads ({heads}) and the key/value heads "
                f"({key_heads}){per} under ulysses (DeepSpeed's uneven heads are not "
                "modelled; memcalc trace runs its code)")
    return ""


def program(d: Dims, kernel: str = "sdpa-flash"):
    """Rank ``d.cp_rank``'s step of ``d.cp`` under DeepSpeed-Ulysses; ``d`` holds the rank's
    own rows and every head."""
    from memcalc.engine.program import Program
    from memcalc.impls.common import with_loss
    from memcalc.impls.flash_attn import inputs

    u = Ulysses(d, d.cp, kernel)
    events, saved, layers = forward(u)
    # the rank's rows of q, k, v and grad_out as DeepSpeed takes them: (B, n, H, D)
    return Program(tuple(events), tuple(with_loss(d, backward(u, saved, layers))), inputs(d))
