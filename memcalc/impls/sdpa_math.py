"""``sdpa-math``: ``F.scaled_dot_product_attention`` on the math backend.

Reference code: ``memcalc/validation/reference/sdpa_math.py``. The math backend is the
composite ``_scaled_dot_product_attention_math`` of
``aten/src/ATen/native/transformers/attention.cpp`` (torch 2.13), which a user reaches on
CUDA with ``sdpa_kernel(SDPBackend.MATH)`` and which meta and CPU tensors always take
(``_fused_sdp_choice_meta``). What it allocates, in order:

* fp16/bf16 inputs are upcast to float32 first (``query_acc``, ``key_acc``, ``value_acc``:
  ``allowFP16BF16ReductionMathSDP()`` is off by default), so every N x M tensor is
  float32 whatever the input dtype, and the output and the returned weights are cast back;
* the softmax scale is split as ``sqrt(scale)`` over ``q`` and over ``k^T``: two
  ``(B, H, N|M, D)`` float32 products, both saved by the first matmul;
* ``is_causal`` builds an ``(N, M)`` float32 additive mask from a bool ``tril``
  (``convert_boolean_attn_mask``: ``where(mask, 0, -inf)``);
* GQA: ``repeat_interleave`` of k and v to H heads (``pre_process_group_query_attention_input``),
  a clone of shape ``(B, Hk, H/Hk, M, D)`` each; the value copy is saved;
* ``_safe_softmax`` (saves its result; ``safe_softmax``); ``SafeSoftmaxBackward0`` is
  ``_softmax_backward_data``.

The mask is added in place (``attn.add_``) and ``_safe_softmax`` runs its composite, as on
a GPU; the emulated tracer makes both so as well (``memcalc/tracing/tracer.py``).

q, k and v laid out ``(B, N, H, D)`` and seen through ``.transpose(1, 2)`` (``Dims.layout``
``"BNHD"``: DeepSpeed-Ulysses' local attention, ``memcalc.impls.ulysses``) change what the
matmuls copy: ``matmul`` folds a 4-d operand's batch and heads with ``reshape``, a view only
where their strides chain (``memcalc.engine.strides.merges``), else a clone, which the bmm
saves in the operand's place; ``_unsafe_view``'s backward folds the grad the same way
(``UnsafeViewBackward0``). GQA's repeated k and v are contiguous clones, folded as views.
"""

from __future__ import annotations

from memcalc.impls.registry import register
from memcalc.impls.common import (dout_copy, fold, folds, freed, softmax_backward,
                                  transposed_results, with_loss)
from memcalc.engine.program import (Dims, Program, Role, cublas, first_unpack, free, last_save, new, release)

A, S, O, G, T = Role.activation, Role.saved, Role.output, Role.gradient, Role.temporary
F32 = "float32"


def upcast(d: Dims) -> bool:
    """Whether the inputs are cast to float32 (fp16 and bf16 are; fp32 is used as is)."""
    return d.dtype != F32


def gqa(d: Dims) -> bool:
    """Whether k and v have fewer heads than q and are repeated to ``H`` heads."""
    return d.Hk != d.H


def saves_v(d: Dims) -> bool:
    """Whether ``bmm(p, v)`` saves the caller's v itself (float32, no GQA, folded as a
    view): the one input the math path saves."""
    return saved_v(d, leaves=False) == "v"


def inputs_fp32(d: Dims) -> list:
    """``query_acc, key_acc, value_acc = q/k/v.to(float32)`` (fp16/bf16 only)."""
    if not upcast(d):
        return []
    kv = (d.B, d.Hk, d.M, d.D)
    return [
        new("q32", (d.B, d.H, d.N, d.D), F32, A, "_to_copy"),  # (B, H, N, D) query_acc
        new("k32", kv, F32, A, "_to_copy"),  # (B, Hk, M, D) key_acc
        new("v32", kv, F32, S if saved_v(d) == "v32" else A,
            "_to_copy"),  # (B, Hk, M, D) saved by bmm(p, v), unless its fold or repeat is
    ]


def causal_mask(d: Dims) -> list:
    """``where(ones(N, M, bool).tril(), 0., -inf)``: the ``(N, M)`` float32 additive mask."""
    if not d.causal:
        return []
    return [
        new("ones", (d.N, d.M), "bool", T, "ones"),  # (N, M)
        new("tril", (d.N, d.M), "bool", T, "tril"),  # (N, M)
        free("ones"),
        new("zero", (), F32, T, "scalar_tensor"),  # () where's scalar 0.0
        new("-inf", (), F32, T, "scalar_tensor"),  # () where's scalar -inf
        new("mask", (d.N, d.M), F32, T, "where"),  # (N, M) 0 or -inf
        free("tril", "zero", "-inf"),
    ]


def repeat_kv(d: Dims) -> list:
    """GQA: ``k.repeat_interleave(H // Hk, dim=-3)``, the same for v: an expand and a clone."""
    if not gqa(d):
        return []
    rep = (d.B, d.Hk, d.H // d.Hk, d.M, d.D)
    return [
        new("k_rep", rep, F32, A, "clone"),  # (B, Hk, H/Hk, M, D) key_expanded
        new("v_rep", rep, F32, S, "clone"),  # (B, Hk, H/Hk, M, D) saved by bmm(p, v)
    ]


def safe_softmax(d: Dims, scores: str) -> list:
    """``_safe_softmax(attn, -1)`` as torch 2.13 runs it: a CompositeExplicitAutograd kernel
    with no CUDA kernel (``aten/src/ATen/native/transformers/attention.cpp``), so on a GPU
    each of its inner ops allocates: the softmax (the result: ``where_out`` writes the
    fully-masked rows' zeros into it, allocating nothing), the ``isneginf`` bool mask, the
    fully-masked-row mask and a 0-d zero, the three locals freed at its return (from torch
    2.6 on, pytorch/pytorch#139613; torch 2.5 compared with a ``-inf`` scalar and allocated
    ``where``'s result apart: ``memcalc.tracing.tracer.SAFE_SOFTMAX``, what the trace
    runs, by release)."""
    bhnm = (d.B, d.H, d.N, d.M)
    return [
        new("p", bhnm, F32, S, "_softmax"),  # (B, H, N, M) at::softmax(attn), then where_out
        new("masked", bhnm, "bool", T, "isneginf"),  # (B, H, N, M) attn == -inf
        new("masked_rows", (d.B, d.H, d.N, 1), "bool", T, "all"),  # (B, H, N, 1)
        new("zero", (), F32, T, "scalar_tensor"),  # () 0.0, one 512-B block
        free("masked", "masked_rows", "zero"),
        free(scores),
    ]


def weights(d: Dims) -> list:
    """``attn = _safe_softmax(attn, -1)``: its result is saved by ``SafeSoftmaxBackward0``
    and by ``bmm(p, v)``; for fp16/bf16 the weights are also returned cast back, then
    dropped by sdpa."""
    events = safe_softmax(d, "qk")
    if upcast(d):
        events.append(new("p_cast", (d.B, d.H, d.N, d.M), d.dtype, T, "_to_copy"))  # (B, H, N, M)
    return events


def output(d: Dims) -> list:
    """``out = (p @ v).to(dtype)``: the bmm is the output itself for fp32. The bmm packs
    ``p`` and ``v``, the last saved tensors, before it allocates."""
    bnd = (d.B * d.H, d.N, d.D)
    v = "v_rep" if gqa(d) else ("v32" if upcast(d) else "v")
    v_fold = fold(d, "v", v, (d.B, d.H, d.M, d.D), F32)  # (B, H, M, D)
    if not upcast(d):
        return [*v_fold, last_save(), new("out", bnd, F32, O, "bmm"), cublas(),  # (B*H, N, D)
                *freed(v_fold)]
    return [
        *v_fold,
        last_save(),
        new("o32", bnd, F32, T, "bmm"),  # (B*H, N, D) attn @ value_acc
        cublas(),
        *freed(v_fold),
        new("out", (d.B, d.H, d.N, d.D), d.dtype, O, "_to_copy"),  # (B, H, N, D)
    ]


def forward(d: Dims) -> list:
    """The forward of ``_scaled_dot_product_attention_math``, locals freed at its return."""
    folded = (fold(d, "q", "qs", (d.B, d.H, d.N, d.D), F32)  # (B, H, N, D)
              + fold(d, "k^T", "ks", (d.B, d.H, d.D, d.M), F32))  # (B, H, D, M)
    return [
        *inputs_fp32(d),
        new("qs", (d.B, d.H, d.N, d.D), F32, S if folds(d, "q") else A,
            "mul"),  # (B, H, N, D) q * sqrt(scale)
        *causal_mask(d),
        *repeat_kv(d),
        new("ks", (d.B, d.H, d.D, d.M), F32, S if folds(d, "k^T") else A,
            "mul"),  # (B, H, D, M) k^T * sqrt(scale)
        *folded,
        new("qk", (d.B * d.H, d.N, d.M), F32, A, "bmm"),  # (B*H, N, M)
        cublas(),
        free("ks"),  # a temporary: only autograd keeps it
        *freed(folded),
        # causal: attn.add_(*attn_mask), in place (the tracer makes it so too:
        # memcalc.tracing.tracer.Tracer.math_mask_add)
        *weights(d),
        *output(d),
        free(*[n for n in ("q32", "k32", "v32", "k_rep", "v_rep", "mask", "p_cast", "o32")
               if _declared(d, n)], "qs", "p"),
    ]


def _declared(d: Dims, name: str) -> bool:
    """Whether ``forward`` declares ``name`` for these dims."""
    if name in ("q32", "k32", "v32", "p_cast", "o32"):
        return upcast(d)
    if name in ("k_rep", "v_rep"):
        return gqa(d)
    return name == "mask" and d.causal


def grad_out_fp32(d: Dims, leaves: bool = True) -> list:
    """``ToCopyBackward0`` of the output cast: the incoming grad as float32. Unless the
    inputs are leaves, the incoming grad is the engine's buffer (``grad``), gone with it."""
    if not upcast(d):
        return []
    return [new("dout32", (d.B, d.H, d.N, d.D), F32, T, "_to_copy"),  # (B, H, N, D)
            *([] if leaves else [free("grad")])]


def saved_v(d: Dims, leaves: bool = True) -> str | None:
    """What ``bmm(p, v)`` saved of v: the repeated heads, a fold's clone, the float32 copy,
    or v itself (None where v is the caller's leaf, which outlives the step)."""
    if gqa(d):
        return "v_rep"
    v = "v32" if upcast(d) else "v"
    if not folds(d, "v"):
        return f"{v} fold"
    return None if v == "v" and leaves else v


def values_backward(d: Dims, leaves: bool = True) -> list:
    """``BmmBackward0`` of ``p @ v``: ``dv`` then ``dp``; releases what it saved of v. Where
    the grad does not fold as a view, ``UnsafeViewBackward0`` clones it first."""
    dv_role = T if upcast(d) or gqa(d) else G
    dout = "dout32" if upcast(d) else (None if leaves else "grad")
    events = []
    if not folds(d, "q"):  # grad.reshape(B*H, N, D): the matmul's output was _unsafe_view'd
        events = [new("dout fold", (d.B, d.H, d.N, d.D), F32, T, "clone"),  # (B, H, N, D)
                  *([free(dout)] if dout else [])]
        dout = "dout fold"
    v = saved_v(d, leaves)
    return events + [
        new("dv_bmm", (d.B * d.H, d.M, d.D), F32, dv_role, "bmm"),  # (B*H, M, D) p^T @ dout
        *dout_copy(d, "dv", expanded=dout is None),
        new("dp", (d.B * d.H, d.N, d.M), F32, T, "bmm"),  # (B*H, N, M) dout @ v^T
        *dout_copy(d, "dp", expanded=dout is None),
        *([release(v)] if v else []),
        *([free(dout)] if dout else []),
        *softmax_backward("ds", (d.B, d.H, d.N, d.M), F32),  # (B, H, N, M), and dp * p inside
        release("p"),
        free("dp"),
    ]


def scores_backward(d: Dims) -> list:
    """``BmmBackward0`` of ``qs @ ks``: grads of both scaled operands; releases them (or
    their folds' clones)."""
    return [
        new("dks", (d.B * d.H, d.D, d.M), F32, T, "bmm"),  # (B*H, D, M) qs^T @ ds
        new("dqs", (d.B * d.H, d.N, d.D), F32, T, "bmm"),  # (B*H, N, D) ds @ ks^T
        release(*(x if folds(d, operand) else f"{x} fold"
                  for x, operand in (("qs", "q"), ("ks", "k^T")))),
        free("ds"),
        new("dk_t", (d.B, d.H, d.D, d.M), F32, T, "mul"),  # (B, H, D, M) MulBackward1
        free("dks"),
    ]


def leaves_backward(d: Dims, leaves: bool = True) -> list:
    """From the scaled grads to the inputs' grads, in the autograd engine's order (highest
    sequence number first; ``AccumulateGrad`` first of all, ``torch/csrc/autograd/engine.cpp``).
    ``leaves``: q, k, v are leaves, whose ``AccumulateGrad`` copies a grad of other strides
    into the leaf's layout; else the grads go on as they are (``node_grads``)."""
    if gqa(d):
        return _leaves_gqa(d)
    if not upcast(d):
        return [
            # dk_t is (B, H, M, D) with transposed strides: AccumulateGrad copies it
            *([new("dk", (d.B, d.H, d.M, d.D), F32, G, "new_empty_strided"),  # (B, H, M, D)
               free("dk_t")] if leaves else []),
            new("dq", (d.B, d.H, d.N, d.D), F32, G, "mul"),  # (B, H, N, D) MulBackward1
            free("dqs"),
        ]
    bhnd, bhmd = (d.B, d.H, d.N, d.D), (d.B, d.H, d.M, d.D)
    dk = "dk_cast" if leaves else "dk"
    return [
        new("dq32", bhnd, F32, T, "mul"),  # (B, H, N, D) MulBackward1 of q * sqrt(scale)
        free("dqs"),
        new("dv", bhmd, d.dtype, G, "_to_copy"),  # (B, H, M, D) ToCopyBackward0 of v
        free("dv_bmm"),
        new(dk, bhmd, d.dtype, T if leaves else G, "_to_copy"),  # (B, H, M, D) dk_t's strides
        free("dk_t"),
        *([new("dk", bhmd, d.dtype, G, "new_empty_strided"),  # (B, H, M, D) AccumulateGrad copy
           free("dk_cast")] if leaves else []),
        new("dq", bhnd, d.dtype, G, "_to_copy"),  # (B, H, N, D) ToCopyBackward0 of q
        free("dq32"),
    ]


def node_grads(d: Dims) -> tuple[str, str, str]:
    """The grads of q, k and v as the node hands them on when they are not leaves."""
    if upcast(d):
        return "dq", "dk", "dv"
    return ("dq32", "dk_sum", "dv_sum") if gqa(d) else ("dq", "dk_t", "dv_bmm")


def strided_results(d: Dims) -> tuple[str, ...]:
    """Of ``out``, ``dq``, ``dk``, ``dv``, those not contiguous seen ``(B, rows, H, D)``: all
    are made ``(B, H, rows, D)``-contiguous but k's grad without GQA, which keeps ``k^T``'s
    ``(B, H, D, M)`` memory (``MulBackward1`` of ``ks``, cast as it is)."""
    return transposed_results(d, k_grad_transposed=not gqa(d))


def _leaves_gqa(d: Dims) -> list:
    """GQA: ``ExpandBackward0`` sums the repeated heads back, v first then k (the later
    created node runs first), then q, then the casts back for fp16/bf16."""
    grouped = (d.B, d.Hk, 1, d.M, d.D)
    events = [
        new("dv_sum", grouped, F32, T if upcast(d) else G, "sum"),  # (B, Hk, 1, M, D)
        free("dv_bmm"),
        new("dk_sum", grouped, F32, T if upcast(d) else G, "sum"),  # (B, Hk, 1, M, D)
        free("dk_t"),
        new("dq32", (d.B, d.H, d.N, d.D), F32, T if upcast(d) else G, "mul"),  # (B, H, N, D)
        free("dqs"),
    ]
    if upcast(d):
        kv = (d.B, d.Hk, d.M, d.D)
        events += [
            new("dv", kv, d.dtype, G, "_to_copy"),  # (B, Hk, M, D) ToCopyBackward0
            free("dv_sum"),
            new("dk", kv, d.dtype, G, "_to_copy"),  # (B, Hk, M, D) ToCopyBackward0
            free("dk_sum"),
            new("dq", (d.B, d.H, d.N, d.D), d.dtype, G, "_to_copy"),  # (B, H, N, D)
            free("dq32"),
        ]
    return events


@register("sdpa-math", "F.scaled_dot_product_attention, math backend (float32 inside)",
          gqa=True)
def sdpa_math(d: Dims) -> Program:
    """``scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=Hk < H)``
    under ``sdpa_kernel(SDPBackend.MATH)``."""
    return Program(tuple(forward(d)), tuple(with_loss(d, backward(d))))


def backward(d: Dims, leaves: bool = True) -> list:
    """The backward of the composite, from the output's grad to q's, k's and v's."""
    return (grad_out_fp32(d, leaves) + [first_unpack()] + values_backward(d, leaves)
            + scores_backward(d) + leaves_backward(d, leaves))
