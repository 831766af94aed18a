"""``flash-attn``: the flash-attn package's ``flash_attn_func`` (FlashAttention-2, 2.7 and later).

Source-derived (``traced=False``), read from Dao-AILab/flash-attention at v2.8.3
(``060c9188``; v2.8.0 to v2.8.3.post1 allocate alike):

* ``flash_attn/flash_attn_interface.py`` ``FlashAttnFunc`` (L807-890): an
  ``autograd.Function`` on ``(B, N, H, D)`` tensors, so autograd sees none of the ops inside.
  A head dim not a multiple of 8 is padded with ``F.pad`` (q, k, v, in that order, L829-833);
  ``ctx.save_for_backward(q, k, v, out_padded, softmax_lse, rng_state)`` (L847) keeps the
  padded copies and the padded output, and the output is its slice (a view, L856).
  ``maybe_contiguous`` copies only a tensor whose last stride is not 1 (L19).
* ``csrc/flash_attn/flash_api.cpp`` ``mha_fwd`` (L350-512): ``out = empty_like(q)`` (L431),
  ``softmax_lse (B, H, N)`` float32 (L441), ``p = empty({0})`` without dropout (0 bytes: no
  block), the split-KV accumulators of ``set_params_splitkv`` when the heuristic splits
  (L472-476, as PyTorch's vendored copy: ``memcalc.impls.sdpa_flash``), freed as ``mha_fwd``
  returns, and ``rng_state`` ``(2,)`` int64 (L483), always.
* ``FlashAttnFunc.backward`` (L862-889): ``dq, dk, dv = empty_like`` of the saved (padded)
  q, k, v, ``F.pad`` of the grad when padded; ``mha_bwd`` (L767-971): ``softmax_d (B, H,
  round128(N))`` (L883), ``dq_accum (B, round128(N), H, dr)`` float32, or with
  ``deterministic`` ``zeros (ceil(SMs / (B H)), B, round128(N), H, dr)`` (L886-892), and for
  grouped heads ``dk_expanded``, ``dv_expanded (B, M, H, dp)`` (L897-904), summed into dk,
  dv. ``dr`` is ``round(dp, 32 if dp <= 128 else 64)`` from 2.8.0 (2.6.2-2.7.4: 32 up to
  192, else 256). The grads returned are slices of dq, dk, dv: when padded, not the leaves'
  layout, so ``AccumulateGrad`` clones them (``torch/csrc/autograd/functions/accumulate_grad.h``).

* The varlen functions (``FlashAttnVarlenFunc`` L893-995 and its packed twins; a trace's
  ``flash_attn_varlen_func``): the same Function on ``(total, H, D)`` tensors holding ``b``
  sequences (``d.varlen``; B = 1, N and M the total rows), whose ``cu_seqlens`` the node
  saves. ``mha_varlen_fwd`` (L515-755): softmax_lse unpadded ``(H, total_q)`` (L652), no
  split-KV outside decoding (L700-706); ``mha_varlen_bwd`` (L974-1200): ``softmax_d (H,
  total_q + 128 b)`` and ``dq_accum (total_q + 128 b, H, dr)`` (L1100-1117: 128 rows
  apart per sequence), ``nsplits`` over ``b H``; ``dk_expanded (total_k, H, dp)`` (L1122).

Inputs are ``(B, N, H, D)`` as ``flash_attn_func`` takes them, and so is ``grad_out``.
"""

from __future__ import annotations

from memcalc.engine.inputs import Input, input_tensors
from memcalc.engine.program import Dims, Program, Role, free, new, release
from memcalc.impls.accepted import Accepted
from memcalc.impls.common import with_loss
from memcalc.impls.registry import register
from memcalc.impls.device import gpu_of
from memcalc.impls.sdpa_flash import F32, cc_text, head_dims, round_up, split_accumulators
from memcalc.impls.sdpa_flash import pads as flash_pads

S, O, G, T = Role.saved, Role.output, Role.gradient, Role.temporary

# flash_attn_func's layout: (batch, seqlen, heads, head dim)
BNHD = (Input("q", ("B", "N", "H", "D")), Input("k", ("B", "M", "K", "D")),
        Input("v", ("B", "M", "K", "D")))

MAX_HEAD_DIM = 256  # flash_api.cpp mha_fwd: "only supports head dimension at most 256"


def inputs(d: Dims) -> tuple:
    """q, k, v and ``grad_out`` in ``(B, N, H, D)``."""
    return tuple(input_tensors(d, BNHD, ((d.B, d.N, d.H, d.D), d.dtype)))


def accepted(d: Dims) -> tuple[Accepted, ...]:
    return (Accepted("head_dim", most=MAX_HEAD_DIM, kernel="flash-attn",
                     most_source="flash_api.cpp mha_fwd"),)


def check(d: Dims, name: str) -> None:
    """What ``mha_fwd`` refuses."""
    gpu = gpu_of(d)
    if gpu.compute_capability < (8, 0):
        raise ValueError(f"--gpu: {name}: FlashAttention needs compute capability 8.0 or newer, "
                         f"not {cc_text(gpu)} (flash_api.cpp mha_fwd)")
    if d.dtype == F32:
        raise ValueError(f"--dtype: {name}: FlashAttention supports fp16 and bf16 only "
                         f"(flash_api.cpp mha_fwd)")
    for rule in accepted(d):
        rule.refuse(name, d.D)


def seq_first(d: Dims, rows, heads, width) -> tuple:
    """The packages' layout: (B, rows, heads, width), or (rows, heads, width) for the varlen
    functions, whose sequences are packed into the rows (``d.varlen``; B is 1 there)."""
    return (rows, heads, width) if d.varlen else (d.B, rows, heads, width)


def sequences(d: Dims):
    """``batch_size`` as ``mha_varlen_fwd`` reads it (``cu_seqlens_q.numel() - 1``), or B."""
    return d.varlen or d.B


def pads(d: Dims) -> list:
    """``F.pad`` of q, k, v to a multiple of 8 inside the Function's forward (saved), in
    the packages' layout."""
    return flash_pads(d, lambda rows, heads, width: seq_first(d, rows, heads, width))


def forward(d: Dims) -> list:
    """``FlashAttnFunc.forward``: pads, ``mha_fwd``, and what the node saves."""
    saved = [t.name for t in pads(d)] + ["lse", "rng_state"]
    return pads(d) + mha_fwd(d) + [free(*saved)]  # autograd holds them (save_for_backward)


def mha_fwd(d: Dims) -> list:
    """``mha_fwd`` (the op ``flash_attn::_flash_attn_forward``) on q, k, v padded already:
    the output, softmax_lse, the split-KV accumulators (freed as it returns), rng_state."""
    padded, _ = head_dims(d)
    accum = [] if d.varlen else split_accumulators(d, gpu_of(d))  # varlen: only to decode
    return [
        new("out", seq_first(d, d.N, d.H, padded), d.dtype, O, "empty_like"),  # ([B,] N, H, dp)
        lse(d),
        *accum,
        new("rng_state", (2,), "int64", S, "empty"),  # (2,) philox seed, offset: 512-B block
        *([free(*(t.name for t in reversed(accum)))] if accum else []),  # mha_fwd returns
    ]


def lse(d: Dims):
    """softmax_lse, float32: (B, H, N) (``mha_fwd``), or unpadded (H, total_q) for the
    varlen functions (``mha_varlen_fwd``, L652)."""
    shape = (d.H, d.N) if d.varlen else (d.B, d.H, d.N)  # (H, N) or (B, H, N)
    return new("lse", shape, F32, S, "empty")


def softmax_d(d: Dims):
    """``mha_bwd``'s float32 (B, H, round128(N)); ``mha_varlen_bwd``'s (H, total_q + 128 b),
    128 rows apart per sequence (L1100)."""
    if d.varlen:
        return new("softmax_d", (d.H, d.N + 128 * d.varlen), F32, T, "empty")  # (H, N + 128 b)
    return new("softmax_d", (d.B, d.H, round_up(d.N, 128)), F32, T, "empty")  # (B, H, r128(N))


def dq_accum(d: Dims) -> list:
    """``mha_bwd``'s float32 accumulator of dq, (B, round128(N), H, dr); varlen's
    (total_q + 128 b, H, dr) (``mha_varlen_bwd`` L1110-1117); deterministic: one per split of
    the SMs, zeroed."""
    _, rounded = head_dims(d)
    rows = (d.N + 128 * d.varlen,) if d.varlen else (d.B, round_up(d.N, 128))
    if not d.deterministic:  # ([B,] rows, H, dr)
        return [new("dq_accum", (*rows, d.H, rounded), F32, T, "empty")]
    splits = -(-gpu_of(d).sm_count // (sequences(d) * d.H))  # (nsm + b*h - 1) / (b*h)
    return [new("dq_accum", (splits, *rows, d.H, rounded), F32, T, "zeros")]  # (S, [B,] rows, H, dr)


def backward(d: Dims) -> list:
    """The node's backward, then ``AccumulateGrad``'s clones of the slices when padded."""
    padded, _ = head_dims(d)
    return node_backward(d, d.loss == "sum") + (clones(d) if padded != d.D else [])


def grads(d: Dims, packed: str = "") -> list:
    """The grads ``FlashAttnFunc.backward`` makes for ``mha_bwd`` to write: dq, dk, dv; for
    ``flash_attn_qkvpacked_func`` (``packed="qkv"``) one ``dqkv`` whose slices it writes,
    for ``flash_attn_kvpacked_func`` (``"kv"``) dq and one ``dkv`` (flash_attn_interface.py,
    FlashAttnQKVPackedFunc / FlashAttnKVPackedFunc)."""
    padded, _ = head_dims(d)
    grad = T if padded != d.D else G
    def packs(rows, count, heads):  # ([B,] rows, count, heads, dp)
        return (*seq_first(d, rows, count, heads), padded)
    if packed == "qkv":  # ([B,] N, 3, H, dp)
        return [new("dqkv", packs(d.N, 3, d.H), d.dtype, grad, "empty")]
    dq = new("dq", seq_first(d, d.N, d.H, padded), d.dtype, grad, "empty_like")  # ([B,] N, H, dp)
    if packed == "kv":  # ([B,] M, 2, Hk, dp)
        return [dq, new("dkv", packs(d.M, 2, d.Hk), d.dtype, grad, "empty")]
    dk = seq_first(d, d.M, d.Hk, padded)  # ([B,] M, Hk, dp)
    return [dq, new("dk", dk, d.dtype, grad, "empty_like"),
            new("dv", dk, d.dtype, grad, "empty_like")]


def node_backward(d: Dims, strided_grad: bool, packed: str = "") -> list:
    """``FlashAttnFunc.backward``: the grads (``grads``), ``mha_bwd``'s buffers.
    ``strided_grad``: the grad's last stride is not 1 (``out.sum()``'s is an expand), so
    ``maybe_contiguous`` copies it, unless padding made a contiguous one already."""
    padded, _ = head_dims(d)
    pad = padded != d.D
    events = grads(d, packed)
    if pad:  # F.pad of the grad; contiguous, so no copy below: ([B,] N, H, dp)
        events.append(new("dout_pad", seq_first(d, d.N, d.H, padded), d.dtype, T,
                          "constant_pad_nd"))
    events += mha_bwd(d, strided_grad and not pad)
    events += [free("softmax_d"),  # its return value, discarded
               *([free("dout_pad")] if pad else []),
               release(*[t.name for t in pads(d)], "lse", "rng_state")]
    return events


def mha_bwd(d: Dims, copy: bool) -> list:
    """``mha_bwd`` (the op ``flash_attn::_flash_attn_backward``, into the dq, dk, dv it is
    given): the grad's copy (``copy``: its last stride is not 1, so ``maybe_contiguous``
    copies it), float32 ``softmax_d`` (returned) and ``dq_accum``, dk and dv of every head
    for grouped heads (summed into dk, dv); all but softmax_d freed as it returns."""
    padded, _ = head_dims(d)
    events = []
    if copy:  # ([B,] N, H, D)
        events.append(new("dout_c", seq_first(d, d.N, d.H, d.D), d.dtype, T, "contiguous"))
    events += [softmax_d(d), *dq_accum(d)]
    if d.Hk != d.H:
        expanded = seq_first(d, d.M, d.H, padded)  # ([B,] M, H, dp)
        events += [new("dk_expanded", expanded, d.dtype, T, "empty"),
                   new("dv_expanded", expanded, d.dtype, T, "empty")]
    expanded = ["dv_expanded", "dk_expanded"] if d.Hk != d.H else []
    return events + [free(*expanded, "dq_accum"),  # mha_bwd returns
                     *([free("dout_c")] if copy else [])]  # _flash_attn_backward returns


def clones(d: Dims) -> list:
    """The grads are slices of the padded dq, dk, dv: ``AccumulateGrad`` clones each into
    its leaf's layout, v's first (the engine runs them latest input first), and the slice's
    buffer dies with it."""
    events = []
    for name, heads, rows in (("v", d.Hk, d.M), ("k", d.Hk, d.M), ("q", d.H, d.N)):
        events += [new(f"{name}.grad", seq_first(d, rows, heads, d.D), d.dtype, G, "clone"),
                   free(f"d{name}")]  # ([B,] rows, heads, D)
    return events


def program(d: Dims) -> Program:
    return Program(tuple(forward(d)), tuple(with_loss(d, backward(d))), inputs(d))


@register("flash-attn", "flash-attn package flash_attn_func (FlashAttention-2): saves the "
          "(B, H, N) softmax_lse and rng_state", gqa=True, traced=False, accepted=accepted,
          source="flash-attn's sources (v2.8.3)", inputs=BNHD)
def flash_attn(d: Dims) -> Program:
    """Saved: softmax_lse, rng_state (and padded q, k, v when D % 8 != 0); backward: dq, dk,
    dv, float32 softmax_d and dq_accum, expanded dk, dv for grouped heads."""
    check(d, "flash-attn")
    return program(d)
