"""``flash-attn3``: FlashAttention-3 on Hopper, ``flash_attn_interface.flash_attn_func``.

Source-derived (``traced=False``), read from Dao-AILab/flash-attention ``hopper/`` at
``0251105a`` (the design of the January 2025 refactor, 7a802796; the 2024 beta padded the
head dim and rounded otherwise, and is not modelled):

* ``hopper/flash_attn_interface.py`` ``FlashAttnFunc`` (L552-639): an ``autograd.Function``
  on ``(B, N, H, D)`` tensors calling the custom op ``_flash_attn_forward`` with
  ``num_splits=1`` (L820: no split-KV accumulators; their ``torch.tensor([])`` stand-ins
  hold 0 bytes), and ``ctx.save_for_backward(q, k, v, out, softmax_lse)`` (L600): the
  user's own tensors, no copies. The head dim must be a multiple of 8: nothing is padded.
* ``hopper/flash_api.cpp`` ``mha_fwd``: ``out (B, N, H, D)`` (L872), ``softmax_lse (B, H, N)``
  float32 (L887) and, on sm90 for a causal call, the scheduler's ``tile_count_semaphore`` of
  ``1 + 2 round4(B)`` int32 (L988-1025: the semaphore and two per-batch vectors), freed as
  ``mha_fwd`` returns.
* ``FlashAttnFunc.backward`` (L614): ``dq, dk, dv = empty_like``; ``_flash_attn_backward``
  (L284) copies a grad whose last stride is not 1; ``mha_bwd`` (L1267-1568), with ``hd =
  round_up_headdim(D)`` and the sm90 tiles ``kBlockM``, ``kBlockN`` (L1367-1395):
  ``softmax_d`` and ``softmax_lse_log2 (B, H, round(N, kBlockM))`` float32, ``dq_accum (B, H,
  round(N, kBlockM) hd)`` float32, for grouped heads ``dk_accum``, ``dv_accum (B, Hk,
  round(M, kBlockN) hd)`` float32 zeros, ``dq_semaphore (ceil(N / kBlockM), B, H)`` int32, and
  for grouped heads under ``deterministic`` ``dk_semaphore``, ``dv_semaphore (ceil(M / kBlockN),
  B, Hk)`` int32. The semaphores die as ``mha_bwd`` returns, the rest as the Python op
  returns (L285-309).

Inputs are ``(B, N, H, D)`` as ``flash_attn_func`` takes them, and so is ``grad_out``.
"""

from __future__ import annotations

from memcalc.engine.program import Dims, Program, Role, free, new, release
from memcalc.impls.accepted import Accepted
from memcalc.impls.common import with_loss
from memcalc.impls.flash_attn import BNHD, inputs
from memcalc.impls.registry import register
from memcalc.impls.device import gpu_of
from memcalc.impls.sdpa_flash import F32, cc_text, round_up

S, O, G, T = Role.saved, Role.output, Role.gradient, Role.temporary
I32 = "int32"


def accepted(d: Dims) -> tuple[Accepted, ...]:
    return (Accepted("head_dim", step=8, most=256, kernel="FlashAttention-3",
                     step_source="hopper/flash_api.cpp mha_fwd: head_size % 8 == 0",
                     most_source="hopper/flash_api.cpp mha_fwd"),)


def check(d: Dims) -> None:
    """What memcalc models: Hopper (sm90), fp16 or bf16, head dims FA3 compiles."""
    gpu = gpu_of(d)
    if gpu.compute_capability[0] != 9:
        raise ValueError(f"--gpu: flash-attn3: memcalc models FlashAttention-3's Hopper kernels "
                         f"(compute capability 9.x), not {cc_text(gpu)}")
    if d.dtype == F32:
        raise ValueError("--dtype: flash-attn3: FlashAttention-3 trains in fp16 and bf16 only "
                         "(hopper/flash_api.cpp mha_bwd)")
    for rule in accepted(d):
        rule.refuse("flash-attn3", d.D)
    if d.deterministic and headdim(d) == 256 and not d.forward_only:
        raise ValueError("--deterministic: flash-attn3: no deterministic backward for head dims "
                         "above 192 (hopper/flash_api.cpp mha_bwd L1370)")


def headdim(d: Dims) -> int:
    """``round_up_headdim``: the compiled head dim at or above D (64, 96, 128, 192, 256)."""
    return next(h for h in (64, 96, 128, 192, 256) if d.D <= h)


def tiles(d: Dims) -> tuple[int, int]:
    """(kBlockM, kBlockN) of the sm90 backward kernel (flash_api.cpp L1373-1382; no
    softcap, no local window)."""
    hd = headdim(d)
    block_m = 128 if hd <= 64 else 64 if hd <= 96 else (64 if d.causal else 80) if hd <= 128 else 64
    block_n = 128 if hd <= 128 else 96 if hd <= 192 else 80
    return block_m, block_n


def forward(d: Dims) -> list:
    """``mha_fwd``, then what the node saves (``out`` and ``lse``; q, k, v are the inputs)."""
    return mha_fwd(d) + [free("lse")]  # autograd holds it (ctx.save_for_backward)


def mha_fwd(d: Dims) -> list:
    """``mha_fwd`` (the op ``flash_attn_3::_flash_attn_forward``): the output, softmax_lse
    and, causal, the scheduler's counters (freed as it returns)."""
    semaphore = [new("tile_count_semaphore", (1 + 2 * round_up(d.B, 4),), I32, T, "zeros")] \
        if d.causal else []  # (1 + 2 round4(B),) scheduler metadata, causal on sm90
    return [
        new("out", (d.B, d.N, d.H, d.D), d.dtype, O, "empty"),  # (B, N, H, D)
        new("lse", (d.B, d.H, d.N), F32, S, "empty"),  # (B, H, N) softmax_lse
        *semaphore,
        *([free("tile_count_semaphore")] if semaphore else []),  # mha_fwd returns
    ]


def accumulators(d: Dims) -> list:
    """``mha_bwd``'s float32 buffers, in the order it allocates them."""
    block_m, block_n = tiles(d)
    hd, rows, keys = headdim(d), round_up(d.N, block_m), round_up(d.M, block_n)
    events = [
        new("softmax_d", (d.B, d.H, rows), F32, T, "empty"),  # (B, H, round(N, kBlockM))
        new("softmax_lse_log2", (d.B, d.H, rows), F32, T, "empty"),  # (B, H, round(N, kBlockM))
        new("dq_accum", (d.B, d.H, rows * hd), F32, T, "empty"),  # (B, H, round(N, kBlockM) hd)
    ]
    if d.Hk != d.H:
        events += [new("dk_accum", (d.B, d.Hk, keys * hd), F32, T, "zeros"),  # (B, Hk, Mr hd)
                   new("dv_accum", (d.B, d.Hk, keys * hd), F32, T, "zeros")]  # (B, Hk, Mr hd)
    return events


def semaphores(d: Dims) -> list:
    """``mha_bwd``'s int32 semaphores; dk's and dv's only for grouped heads, deterministic."""
    block_m, block_n = tiles(d)
    events = [new("dq_semaphore", (-(-d.N // block_m), d.B, d.H), I32, T, "empty")]
    if d.Hk != d.H and d.deterministic:
        shape = (-(-d.M // block_n), d.B, d.Hk)  # (ceil(M / kBlockN), B, Hk)
        events += [new("dk_semaphore", shape, I32, T, "zeros"),
                   new("dv_semaphore", shape, I32, T, "zeros")]
    return events


def node_backward(d: Dims, copy: bool) -> list:
    """``FlashAttnFunc.backward``: dq, dk, dv, then ``mha_bwd`` into them."""
    return [
        new("dq", (d.B, d.N, d.H, d.D), d.dtype, G, "empty_like"),  # (B, N, H, D)
        new("dk", (d.B, d.M, d.Hk, d.D), d.dtype, G, "empty_like"),  # (B, M, Hk, D)
        new("dv", (d.B, d.M, d.Hk, d.D), d.dtype, G, "empty_like"),  # (B, M, Hk, D)
        *mha_bwd(d, copy),
        free("softmax_d"),  # the op's return value, which the caller discards
        release("lse"),
    ]


def mha_bwd(d: Dims, copy: bool) -> list:
    """``_flash_attn_backward`` (the op ``flash_attn_3::_flash_attn_backward``): the grad's
    copy (``copy``: its last stride is not 1, so ``maybe_contiguous`` copies it),
    ``mha_bwd``'s buffers; all but softmax_d, which it returns, freed as it returns."""
    buffers, sems = accumulators(d), semaphores(d)
    return [
        *([new("dout_c", (d.B, d.N, d.H, d.D), d.dtype, T, "contiguous")] if copy else []),
        *buffers, *sems,
        free(*(t.name for t in reversed(sems))),  # mha_bwd returns
        # the Python op returns: its locals (the grad's copy, then the buffers it holds)
        free(*(["dout_c"] if copy else []), *(t.name for t in buffers[1:])),
    ]


@register("flash-attn3", "FlashAttention-3 (Hopper) flash_attn_interface.flash_attn_func: "
          "saves the (B, H, N) softmax_lse", gqa=True, traced=False, accepted=accepted,
          source="flash-attn's hopper/ sources (0251105a)", inputs=BNHD)
def flash_attn3(d: Dims) -> Program:
    """Saved: softmax_lse (q, k, v and out are the inputs and output); backward: dq, dk, dv,
    float32 softmax_d, softmax_lse_log2 and dq_accum, dk/dv accumulators for grouped heads,
    int32 semaphores."""
    check(d)
    backward = node_backward(d, d.loss == "sum")  # out.sum()'s grad is an expand: stride 0
    return Program(tuple(forward(d)), tuple(with_loss(d, backward)), inputs(d))
