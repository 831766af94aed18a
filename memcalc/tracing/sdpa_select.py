"""Which kernel ``F.scaled_dot_product_attention`` runs on a CUDA device, decided the way
``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` ``select_sdp_backend`` decides it:
the backends in priority order, each taken when all its filters pass.

Pure: no torch. ``Call`` is ``sdp_params`` (what the filters read from q, k, v and the
arguments), ``Flags`` the ``torch.backends.cuda.*_sdp_enabled()`` switches (which
``torch.nn.attention.sdpa_kernel`` sets, also on the meta device), ``Release`` the build
facts the choice depends on (cuDNN version, CUDA major version).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from memcalc.impls.sdpa_efficient import minimum_gemm_alignment
from memcalc.impls.sdpa_flash import MAX_HEAD_DIM

FLASH, EFFICIENT, MATH, CUDNN = "flash", "efficient", "math", "cudnn"


@dataclass(frozen=True)
class Call:
    """``sdp_params``: shapes ``(B, H, N, d)``, dtype, mask, dropout, flags of the call."""

    q: tuple[int, ...]
    k: tuple[int, ...]
    v: tuple[int, ...]
    dtype: str
    mask: tuple[int, ...] | None = None
    mask_requires_grad: bool = False
    dropout: float = 0.0
    is_causal: bool = False
    enable_gqa: bool = False
    requires_grad: bool = True  # input_requires_grad: grad mode on and an input needs grad
    last_strides: tuple[int, int, int] = (1, 1, 1)  # stride(-1) of q, k, v
    storage_offsets: tuple[int, int, int] = (0, 0, 0)
    itemsize: int = 2


@dataclass(frozen=True)
class Flags:
    """The runtime switches (``check_runtime_disabled_*``) and deterministic mode."""

    flash: bool = True
    efficient: bool = True
    math: bool = True
    cudnn: bool = True
    deterministic: bool = False  # use_deterministic_algorithms(True), not warn_only


@dataclass(frozen=True)
class Release:
    """What the choice reads from the build: ``versionRuntimeCuDNN()`` and ``CUDA_VERSION``.

    Default: a CUDA 13 build with cuDNN 9.19 and a cuDNN frontend new enough for head dim
    256 (``kCuDNNFrontendSupportsD256``), which is what a current ``pip install torch``
    ships; older wheels (CUDA 12.x, cuDNN <= 9.15) never prefer cuDNN."""

    cudnn_version: int = 91900
    cuda_major: int = 13
    frontend_d256: bool = True


@dataclass(frozen=True)
class Choice:
    """The backend taken and, for each one tried before it, why it was not."""

    backend: str
    rejected: tuple[tuple[str, str], ...] = ()
    order: tuple[str, ...] = ()

    def reason(self) -> str:
        why = "; ".join(f"{b}: {r}" for b, r in self.rejected)
        return f"{self.backend} (priority {' > '.join(self.order)}{'; ' + why if why else ''})"


def prefer_cudnn(cc: tuple[int, int], release: Release, env=os.environ) -> bool:
    """``check_prefer_cudnn_attention``: cuDNN first on compute capability 9.x/10.x with
    cuDNN > 9.15.0 (on CUDA < 13 only minor 0 or 3), unless TORCH_CUDNN_SDPA_DEPRIORITIZED."""
    # read with c10::utils::check_env (c10/util/env.cpp): "1" is true, "0" false, anything
    # else ignored with a warning
    if env.get("TORCH_CUDNN_SDPA_DEPRIORITIZED") == "1":
        return False
    major, minor = cc
    minor_ok = release.cuda_major >= 13 or minor in (0, 3)
    return release.cudnn_version > 91500 and major in (9, 10) and minor_ok


def priority(cc: tuple[int, int], release: Release, env=os.environ) -> tuple[str, ...]:
    """``priority_order``: the context's default (flash, efficient, math, cudnn), or cuDNN
    first when ``prefer_cudnn``."""
    if prefer_cudnn(cc, release, env):
        return (CUDNN, FLASH, EFFICIENT, MATH)
    return (FLASH, EFFICIENT, MATH, CUDNN)


# --- filters: each returns None when it passes, else the reason -------------------------

def _shapes(c: Call, cc, r) -> str | None:
    """``check_tensor_shapes``: the fused kernels take 4-D q, k, v."""
    return None if len(c.q) == len(c.k) == len(c.v) == 4 else "q, k, v are not 4-D"


def _nonzero(c: Call, cc, r) -> str | None:
    """``check_nonzero_sequence_lengths_dense``."""
    return None if c.q[2] and c.k[2] and c.v[2] else "a sequence length is 0"


def _last_stride(c: Call, cc, r) -> str | None:
    """``check_last_dim_stride_equals_1_dense``."""
    return None if c.last_strides == (1, 1, 1) else "last dimension not contiguous"


def _heads(gqa: bool, same_kv: bool = True) -> Callable:
    """``check_batch_size_and_num_heads_dense<supports_gqa, requires_same_num_heads>``."""

    def check(c: Call, cc, r) -> str | None:
        if not c.q[0] == c.k[0] == c.v[0]:
            return "batch sizes differ"
        if c.q[1] == c.k[1] == c.v[1]:
            return None
        if not (c.enable_gqa and gqa):
            return "different head counts without enable_gqa"
        if c.q[1] % c.k[1] or (same_kv and c.k[1] != c.v[1]) or c.q[1] % c.v[1]:
            return "key/value heads do not divide query heads"
        return None

    return check


def _hardware(lo: tuple[int, int], hi: tuple[int, int], name: str) -> Callable:
    """``check_*_hardware_support``: ``check_sm_version<lo, hi>``."""
    return lambda c, cc, r: None if lo <= cc <= hi else (
        f"{name} needs sm{lo[0]}{lo[1]}..sm{hi[0]}{hi[1]}, device is {cc[0]}.{cc[1]}")


def _half(c: Call, cc, r) -> str | None:
    """``check_dtypes_low_precision``: fp16/bf16 on sm80+, fp16 before."""
    ok = ("float16", "bfloat16") if cc >= (8, 0) else ("float16",)
    return None if c.dtype in ok else f"dtype {c.dtype} (needs {' or '.join(ok)})"


def _no_mask(c: Call, cc, r) -> str | None:
    """``check_for_attn_mask``: flash takes no attn_mask."""
    return None if c.mask is None else "an attn_mask is given"


def _flash_head_dim(c: Call, cc, r) -> str | None:
    """``check_head_dim_size_flash``: equal head dims, at most 256."""
    d = c.q[-1]
    ok = d == c.k[-1] == c.v[-1] and d <= MAX_HEAD_DIM
    return None if ok else f"head dims differ or exceed {MAX_HEAD_DIM}"


def _flash_sm86(c: Call, cc, r) -> str | None:
    """``check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120``."""
    if not c.requires_grad or not ((8, 6) <= cc <= (8, 9) or (12, 0) <= cc <= (12, 1)):
        return None
    d = c.q[-1]
    return None if d <= 192 or (c.dropout == 0 and d > 224) else "training head dim in (192, 224]"


def _flash_causal(c: Call, cc, r) -> str | None:
    """``check_flash_causal_non_square_seqlens``."""
    return None if not c.is_causal or c.q[2] == c.k[2] else "is_causal with kv_len != seq_len"


def _alignment(c: Call, cc) -> int:
    """``minimum_gemm_alignment``: elements a head dim must be a multiple of."""
    return minimum_gemm_alignment(c.dtype in ("float16", "bfloat16"), tuple(cc))


def _efficient_head_dim(c: Call, cc, r) -> str | None:
    """``check_head_dim_size_mem_efficient``."""
    a = _alignment(c, cc)
    ok = c.q[-1] == c.k[-1] and c.q[-1] % a == 0 and c.v[-1] % a == 0 and c.q[-1] > 0
    return None if ok else f"head dim not a multiple of {a}"


def _efficient_ptr(c: Call, cc, r) -> str | None:
    """``check_data_ptr_alignment_mem_efficient``: storage offsets aligned on sm80+."""
    if cc[0] < 8:
        return None
    align = _alignment(c, cc) * c.itemsize
    bad = any(o * c.itemsize % align for o in c.storage_offsets)
    return "storage offsets not aligned" if bad else None


def _efficient_dtype(c: Call, cc, r) -> str | None:
    ok = ("float16", "float32", "bfloat16") if cc >= (8, 0) else ("float16", "float32")
    return None if c.dtype in ok else f"dtype {c.dtype}"


def _mask_shape(c: Call, cc, r) -> str | None:
    """``check_attn_mask_shape`` (cuDNN): 2-D or 4-D, broadcastable, no grad."""
    m = c.mask
    if m is None:
        return None
    if c.mask_requires_grad:
        return "attn_mask requires grad"
    if len(m) not in (2, 4):  # a 1-D or 3-D mask broadcasts in torch, not here
        return f"attn_mask shape {m}"
    rows_ok = m[-2] in (c.q[2], 1) and m[-1] in (c.k[2], 1)
    if rows_ok and (len(m) == 2 or (m[0] in (1, c.q[0]) and m[1] in (1, c.q[1]))):
        return None
    return f"attn_mask shape {m}"


def _cudnn_dropout(c: Call, cc, r) -> str | None:
    """``check_cudnn_dropout`` and the 9.11-9.13 dropout gap of ``can_use_cudnn_attention``."""
    if c.dropout * 16 != int(c.dropout * 16):
        return "dropout not a multiple of 1/16"
    if c.dropout > 0 and 91100 < r.cudnn_version < 91400:
        return "cuDNN 9.11-9.13 has no SDPA dropout"
    return None


def _cudnn_shapes(c: Call, cc, r: Release) -> str | None:
    """``check_cudnn_tensor_shapes`` (cuDNN >= 9): sizes, head-dim limit and alignment."""
    if c.q[0] > 65535 or c.q[1] > 65535:
        return "batch or heads > 65535"
    d_qk, d_v = c.q[3], c.v[3]
    sm90 = (cc[0] == 9 and cc[1] == 0) or cc[0] == 10
    sm107_old = cc == (10, 7) and r.cudnn_version <= 92500
    limit = 128
    if sm90 and not sm107_old and r.cudnn_version > 92200 and r.frontend_d256:
        limit = 256
    elif sm90 and r.cudnn_version >= 91100 and d_qk == 192 and d_v == 128:
        limit = 192
    if d_qk > limit or d_v > limit:
        return f"head dim > {limit}"
    if d_qk % 8 or d_v % 8:
        return "head dim not a multiple of 8"
    if c.k[2] == 1:
        return "key length 1"
    if c.dropout and c.q[2] == 1:
        return "query length 1 with dropout"
    return None


def _cudnn_d256_bprop(c: Call, cc, r: Release) -> str | None:
    """``check_cudnn_d256_bprop_head_dim``: which head dims have a backward on sm90/10x."""
    sm90 = (cc[0] == 9 and cc[1] == 0) or cc[0] == 10
    sm107_old = cc == (10, 7) and r.cudnn_version <= 92500
    if not c.requires_grad or not (r.cudnn_version > 92200 and r.frontend_d256 and sm90
                                   and not sm107_old):
        return None
    d_qk, d_v = c.q[3], c.v[3]
    ok = (d_qk <= 128 and d_v <= 128) or (d_qk, d_v) in ((192, 128), (256, 256))
    return None if ok else "no cuDNN backward for these head dims"


FILTERS: dict[str, tuple[Callable, ...]] = {
    CUDNN: (_shapes, _half, _mask_shape, _hardware((8, 0), (12, 1), "cuDNN"), _cudnn_dropout,
            _nonzero, _last_stride, _heads(True, False), _cudnn_shapes, _cudnn_d256_bprop),
    FLASH: (_shapes, _no_mask, _flash_head_dim, _hardware((8, 0), (12, 1), "flash"),
            _flash_sm86, _flash_causal, _half, _heads(True), _nonzero, _last_stride),
    EFFICIENT: (_hardware((5, 0), (12, 1), "efficient"), _shapes, _efficient_head_dim,
                _efficient_ptr, _nonzero, _last_stride, _heads(True), _efficient_dtype),
}


def rejection(backend: str, call: Call, cc: tuple[int, int], release: Release,
              flags: Flags) -> str | None:
    """Why ``can_use_<backend>`` is false, or None when the backend can run the call."""
    if not getattr(flags, backend):
        return "disabled (torch.backends.cuda / sdpa_kernel)"
    if backend == MATH:
        return None
    if backend == CUDNN and flags.deterministic:
        return "deterministic algorithms requested"
    return next((why for f in FILTERS[backend] if (why := f(call, cc, release))), None)


def select(call: Call, cc: tuple[int, int], flags: Flags = Flags(),
           release: Release = Release(), env=os.environ) -> Choice:
    """``select_sdp_backend``: the first backend of the priority order that can run the
    call; ValueError ("No available kernel") when none can."""
    order = priority(cc, release, env)
    rejected = []
    for backend in order:
        why = rejection(backend, call, cc, release, flags)
        if why is None:
            return Choice(backend, tuple(rejected), order)
        rejected.append((backend, why))
    raise ValueError("scaled_dot_product_attention: no available kernel on this GPU ("
                     + "; ".join(f"{b}: {w}" for b, w in rejected) + ")")
