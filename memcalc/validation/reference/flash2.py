"""Reference code of ``flash2`` (``memcalc/impls/flash2.py``): a user-written
FlashAttention-2 in Triton, wrapped in a ``torch.autograd.Function``.

Written the way the Triton tutorial ``python/tutorials/06-fused-attention.py`` does it,
with masks so that any length works (the tutorial needs ``N % 128 == 0``):

* forward: ``o = torch.empty_like(q)``, ``M = torch.empty((B, H, N), float32)`` (the
  row logsumexp, base 2), one kernel launch, ``ctx.save_for_backward(q, k, v, o, M)``;
* backward: ``do = do.contiguous()`` (a copy only when the grad is not contiguous, as
  under ``loss="sum"``, whose grad is a stride-0 expand), ``dq, dk, dv = empty_like``
  (dq is written once per query block by its own kernel, no fp32 atomics, so no
  ``zeros_like``), ``delta = torch.empty_like(M)`` filled by a preprocess kernel with
  ``rowsum(dO * O)``, then one kernel for dk, dv and one for dq.

Unlike the tutorial, k is not pre-scaled into a copy (``arg_k = k * (sm_scale *
RCP_LN2)`` there): the kernels scale the scores themselves. A user who copies the
tutorial verbatim holds one more ``k``-sized temporary in backward.

Every allocation is ordinary torch code. The kernels run where Triton can run them (CUDA,
or CPU tensors under ``TRITON_INTERPRET=1``); on the meta device the launches are
skipped, so the emulated backend traces exactly the allocations a GPU run makes.
"""

from __future__ import annotations

import math

import torch

from memcalc.validation.reference import reference

try:  # Triton is optional: only a live run (or the interpreter test) launches kernels
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

LOG2E = 1.4426950408889634  # 1 / ln(2): scores go through exp2


def _blocks(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D): 64-row tiles, 32 for wide heads (shared memory)."""
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    tile = 64 if block_d <= 128 else 32
    return tile, tile, block_d


def _launch(kernel, grid, *args, **meta) -> None:
    """Launch a Triton kernel; a no-op on the meta device (nothing to compute)."""
    if args[0].device.type == "meta":
        return
    if triton is None:
        raise RuntimeError("flash2 needs Triton to run on a real device (pip install triton)")
    kernel[grid](*args, **meta)


if triton is not None:

    @triton.jit
    def _fwd_kernel(Q, K, V, O, L, qk_scale, N, M, D, s_b, s_h, s_n, k_b, k_h, k_n,
                    H: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """One query tile of one (batch, head): online softmax over key tiles."""
        pid_m, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols0 = tl.arange(0, BLOCK_N)
        dims = tl.arange(0, BLOCK_D)
        row_ok, dim_ok = rows < N, dims < D
        q_base = b * s_b + h * s_h
        kv_base = b * k_b + h * k_h
        q = tl.load(Q + q_base + rows[:, None] * s_n + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        hi = M
        if CAUSAL:
            hi = tl.minimum(M, (pid_m + 1) * BLOCK_M)
        for start in range(0, hi, BLOCK_N):
            cols = start + cols0
            col_ok = cols < M
            kt = tl.load(K + kv_base + cols[None, :] * k_n + dims[:, None],
                         mask=col_ok[None, :] & dim_ok[:, None], other=0.0)
            s = tl.dot(q, kt) * qk_scale
            ok = col_ok[None, :]
            if CAUSAL:
                ok = ok & (rows[:, None] >= cols[None, :])
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + kv_base + cols[:, None] * k_n + dims[None, :],
                        mask=col_ok[:, None] & dim_ok[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        acc = acc / l_i[:, None]
        tl.store(L + bh * N + rows, m_i + tl.math.log2(l_i), mask=row_ok)
        tl.store(O + q_base + rows[:, None] * s_n + dims[None, :], acc.to(O.dtype.element_ty),
                 mask=row_ok[:, None] & dim_ok[None, :])

    @triton.jit
    def _bwd_preprocess(O, DO, Delta, N, D, s_b, s_h, s_n, H: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        """``delta = rowsum(dO * O)`` in float32, one query tile per program."""
        pid_m, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_D)
        mask = (rows < N)[:, None] & (dims < D)[None, :]
        offs = b * s_b + h * s_h + rows[:, None] * s_n + dims[None, :]
        o = tl.load(O + offs, mask=mask, other=0.0).to(tl.float32)
        do = tl.load(DO + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(Delta + bh * N + rows, tl.sum(o * do, 1), mask=rows < N)

    @triton.jit
    def _probs(q, kt, L_ptr, rows, cols, N, M, qk_scale, CAUSAL: tl.constexpr):
        """Softmax weights of a (query tile, key tile), zero where masked."""
        lse = tl.load(L_ptr + rows, mask=rows < N, other=0.0)
        p = tl.math.exp2(tl.dot(q, kt) * qk_scale - lse[:, None])
        ok = (rows < N)[:, None] & (cols < M)[None, :]
        if CAUSAL:
            ok = ok & (rows[:, None] >= cols[None, :])
        return tl.where(ok, p, 0.0)

    @triton.jit
    def _bwd_dkdv(Q, K, V, DO, DK, DV, L, Delta, sm_scale, qk_scale, N, M, D,
                  s_b, s_h, s_n, k_b, k_h, k_n, H: tl.constexpr, CAUSAL: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """dk, dv of one key tile, looping over the query tiles that see it."""
        pid_n, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        dims = tl.arange(0, BLOCK_D)
        kv_mask = (cols < M)[:, None] & (dims < D)[None, :]
        kv_offs = b * k_b + h * k_h + cols[:, None] * k_n + dims[None, :]
        k = tl.load(K + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(V + kv_offs, mask=kv_mask, other=0.0)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        lo = 0
        if CAUSAL:
            lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
        for start in range(lo, N, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            q_mask = (rows < N)[:, None] & (dims < D)[None, :]
            q_offs = b * s_b + h * s_h + rows[:, None] * s_n + dims[None, :]
            q = tl.load(Q + q_offs, mask=q_mask, other=0.0)
            do = tl.load(DO + q_offs, mask=q_mask, other=0.0)
            p = _probs(q, tl.trans(k), L + bh * N, rows, cols, N, M, qk_scale, CAUSAL)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do)
            delta = tl.load(Delta + bh * N + rows, mask=rows < N, other=0.0)
            ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
        tl.store(DK + kv_offs, (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
        tl.store(DV + kv_offs, dv.to(DV.dtype.element_ty), mask=kv_mask)

    @triton.jit
    def _bwd_dq(Q, K, V, DO, DQ, L, Delta, sm_scale, qk_scale, N, M, D,
                s_b, s_h, s_n, k_b, k_h, k_n, H: tl.constexpr, CAUSAL: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """dq of one query tile, written once: no atomics, no float32 buffer."""
        pid_m, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_D)
        q_mask = (rows < N)[:, None] & (dims < D)[None, :]
        q_offs = b * s_b + h * s_h + rows[:, None] * s_n + dims[None, :]
        q = tl.load(Q + q_offs, mask=q_mask, other=0.0)
        do = tl.load(DO + q_offs, mask=q_mask, other=0.0)
        delta = tl.load(Delta + bh * N + rows, mask=rows < N, other=0.0)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        hi = M
        if CAUSAL:
            hi = tl.minimum(M, (pid_m + 1) * BLOCK_M)
        for start in range(0, hi, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            kv_mask = (cols < M)[:, None] & (dims < D)[None, :]
            kv_offs = b * k_b + h * k_h + cols[:, None] * k_n + dims[None, :]
            k = tl.load(K + kv_offs, mask=kv_mask, other=0.0)
            v = tl.load(V + kv_offs, mask=kv_mask, other=0.0)
            p = _probs(q, tl.trans(k), L + bh * N, rows, cols, N, M, qk_scale, CAUSAL)
            ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k)
        tl.store(DQ + q_offs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)

else:  # pragma: no cover - names for _launch when Triton is missing
    _fwd_kernel = _bwd_preprocess = _bwd_dkdv = _bwd_dq = None


def _strides(q: torch.Tensor, k: torch.Tensor) -> tuple[int, ...]:
    """Batch, head and row strides of q (shared by o, do, dq) and of k (shared by v, dk, dv)."""
    return (*q.stride()[:3], *k.stride()[:3])


class _Flash2(torch.autograd.Function):
    """FlashAttention-2: saves q, k, v, out and the base-2 row logsumexp ``M``."""

    @staticmethod
    def forward(ctx, q, k, v, causal):
        B, H, N, D = q.shape
        o = torch.empty_like(q)  # (B, H, N, D)
        lse = torch.empty((B, H, N), device=q.device, dtype=torch.float32)  # (B, H, N)
        bm, bn, bd = _blocks(D)
        scale = 1.0 / math.sqrt(D)
        grid = (triton.cdiv(N, bm) if triton else 0, B * H)
        _launch(_fwd_kernel, grid, q, k, v, o, lse, scale * LOG2E, N, k.shape[2], D,
                *_strides(q, k), H=H, CAUSAL=causal, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal = causal
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        do = do.contiguous()  # (B, H, N, D): a copy only for a non-contiguous grad
        B, H, N, D = q.shape
        M = k.shape[2]
        dq = torch.empty_like(q)  # (B, H, N, D)
        dk = torch.empty_like(k)  # (B, H, M, D)
        dv = torch.empty_like(v)  # (B, H, M, D)
        delta = torch.empty_like(lse)  # (B, H, N) float32: rowsum(dO * O)
        bm, bn, bd = _blocks(D)
        scale = 1.0 / math.sqrt(D)
        cdiv = triton.cdiv if triton else (lambda a, b: 0)
        strides = _strides(q, k)
        _launch(_bwd_preprocess, (cdiv(N, bm), B * H), o, do, delta, N, D, *strides[:3],
                H=H, BLOCK_M=bm, BLOCK_D=bd)
        meta = dict(H=H, CAUSAL=ctx.causal, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd)
        args = (scale, scale * LOG2E, N, M, D, *strides)
        _launch(_bwd_dkdv, (cdiv(M, bn), B * H), q, k, v, do, dk, dv, lse, delta, *args, **meta)
        _launch(_bwd_dq, (cdiv(N, bm), B * H), q, k, v, do, dq, lse, delta, *args, **meta)
        return dq, dk, dv, None


@reference("flash2")
def flash2(q, k, v, causal=False):
    """A user-written FlashAttention-2 kernel (Triton) in a custom autograd Function."""
    return _Flash2.apply(q, k, v, causal)
