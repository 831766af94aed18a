"""Which kernel ``F.scaled_dot_product_attention`` runs on a CUDA device, decided the way
``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` ``select_sdp_backend`` decides it:
the backends in priority order, each taken when all its filters pass.

The rules changed across releases; ``Release.torch`` picks a release's (``--torch 2.4``), each
filter and each branch of the priority order naming the release it appeared in (read from
the PyPI wheels of 2.4 to 2.15: the header ``sdp_utils_cpp.h`` at each tag, and the filter
lists, template instantiations and constants of ``libtorch_cuda.so``; ``X.Y`` is the newest
patch, but for 2.5.0, which preferred cuDNN on sm90 and was withdrawn in 2.5.1).

Pure: no torch. ``Call`` is ``sdp_params`` (what the filters read from q, k, v and the
arguments), ``Flags`` the ``torch.backends.cuda.*_sdp_enabled()`` switches (which
``torch.nn.attention.sdpa_kernel`` sets, also on the meta device), ``Release`` the build
facts the choice depends on (cuDNN version, CUDA major version).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from memcalc.impls.sdpa_cudnn import head_dim_limit
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


NEWEST = (2, 15)  # the newest release whose rules are written here
OLDEST = (2, 4)


@dataclass(frozen=True)
class Release:
    """The torch release whose rules apply, and what the choice reads from its build:
    ``versionRuntimeCuDNN()`` and ``CUDA_VERSION``.

    Default: the newest rules, with a CUDA 13 build, cuDNN 9.19 and a cuDNN frontend new
    enough for head dim 256 (``kCuDNNFrontendSupportsD256``); ``Release.of("2.5")`` gives a
    release's rules with the cuDNN and CUDA its PyPI wheel ships (``PINS``)."""

    cudnn_version: int = 91900
    cuda_major: int = 13
    frontend_d256: bool = True
    torch: tuple[int, ...] = NEWEST  # (2, 5, 0) only for 2.5.0

    @classmethod
    def of(cls, version: str) -> "Release":
        """``2.5``, ``2.5.0``, ``2.13.0+cu130``: that release's rules and wheel; a ValueError
        naming what is known otherwise."""
        parts = str(version).split("+")[0].split(".")
        try:
            major, minor = int(parts[0]), int(parts[1])
            patch = int(parts[2]) if len(parts) > 2 else None
        except (ValueError, IndexError):
            raise ValueError(f"--torch: {version!r} is not a release like 2.5 or 2.13") from None
        if not OLDEST <= (major, minor) <= NEWEST:
            known = f"{OLDEST[0]}.{OLDEST[1]} to {NEWEST[0]}.{NEWEST[1]}"
            raise ValueError(f"--torch: no SDPA rules for {version} (known: {known})")
        cuda, cudnn = PINS[(major, minor)]
        torch = (major, minor, 0) if (major, minor, patch) == (2, 5, 0) else (major, minor)
        return cls(cudnn, cuda, (major, minor) >= (2, 14), torch)

    def text(self) -> str:
        return ".".join(map(str, self.torch))


# the CUDA major version and runtime cuDNN of each release's default PyPI wheel
PINS = {(2, 4): (12, 90100), (2, 5): (12, 90100), (2, 6): (12, 90100), (2, 7): (12, 90501),
        (2, 8): (12, 91002), (2, 9): (12, 91002), (2, 10): (12, 91002), (2, 11): (13, 91900),
        (2, 12): (13, 92000), (2, 13): (13, 92000), (2, 14): (13, 92400), (2, 15): (13, 92600)}


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
    """``check_prefer_cudnn_attention`` (2.10 on): cuDNN first on compute capability
    9.x/10.x with cuDNN > 9.15.0 (minor 0 or 3 only, but on CUDA 13 from 2.13), unless
    TORCH_CUDNN_SDPA_DEPRIORITIZED. 2.9's rule (TORCH_CUDNN_SDPA_PREFERRED, cuDNN >= 9.9 at
    compile time) is compiled out of its PyPI wheel (built against 9.8)."""
    # read with c10::utils::check_env (c10/util/env.cpp): "1" is true, "0" false, anything
    # else ignored with a warning
    if release.torch[:2] < (2, 10) or env.get("TORCH_CUDNN_SDPA_DEPRIORITIZED") == "1":
        return False
    major, minor = cc
    minor_ok = (release.cuda_major >= 13 and release.torch[:2] >= (2, 13)) or minor in (0, 3)
    return release.cudnn_version > 91500 and major in (9, 10) and minor_ok


def priority(cc: tuple[int, int], release: Release, env=os.environ) -> tuple[str, ...]:
    """``priority_order``: the context's default (flash, efficient, math, cudnn), or cuDNN
    first when ``prefer_cudnn``; 2.4 lists cuDNN first (but keeps it off: ``_cudnn_opt_in``);
    2.5.0 put it first on sm90 and newer, second elsewhere."""
    if release.torch == (2, 4):
        return (CUDNN, FLASH, EFFICIENT, MATH)
    if release.torch == (2, 5, 0):
        return (CUDNN, FLASH, EFFICIENT, MATH) if cc[0] >= 9 else (FLASH, CUDNN, EFFICIENT, MATH)
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


def _heads(gqa_since: tuple[int, int] | None, same_kv: bool = True) -> Callable:
    """``check_batch_size_and_num_heads_dense<supports_gqa, requires_same_num_heads>``;
    ``supports_gqa`` from the release ``gqa_since`` (``enable_gqa`` itself is 2.5's)."""

    def check(c: Call, cc, r) -> str | None:
        if not c.q[0] == c.k[0] == c.v[0]:
            return "batch sizes differ"
        if c.q[1] == c.k[1] == c.v[1]:
            return None
        gqa = gqa_since is not None and r.torch[:2] >= max(gqa_since, (2, 5))
        if not (c.enable_gqa and gqa):
            if c.enable_gqa and gqa_since is not None:
                return f"grouped heads from torch {gqa_since[0]}.{gqa_since[1]}"
            return "different head counts without enable_gqa"
        if c.q[1] % c.k[1] or (same_kv and c.k[1] != c.v[1]) or c.q[1] % c.v[1]:
            return "key/value heads do not divide query heads"
        return None

    return check


def _newest_sm(r: Release) -> tuple[int, int]:
    """The last compute capability the fused kernels take: sm90 to 2.6, sm120 in 2.7, sm121
    from 2.8 (so on a B200, 2.6 runs math)."""
    return (9, 0) if r.torch[:2] <= (2, 6) else (12, 0) if r.torch[:2] == (2, 7) else (12, 1)


def _hardware(lo: tuple[int, int], name: str) -> Callable:
    """``check_*_hardware_support``: ``check_sm_version<lo, hi>``."""

    def check(c: Call, cc, r) -> str | None:
        hi = _newest_sm(r)
        return None if lo <= cc <= hi else (
            f"{name} needs sm{lo[0]}{lo[1]}..sm{hi[0]}{hi[1]}, device is {cc[0]}.{cc[1]}")

    return check


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
    """``check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120`` (sm120 from
    2.7, sm121 from 2.8)."""
    if r.torch[:2] < (2, 7):
        rtx = False
    else:
        rtx = (12, 0) <= cc <= ((12, 0) if r.torch[:2] == (2, 7) else (12, 1))
    if not c.requires_grad or not ((8, 6) <= cc <= (8, 9) or rtx):
        return None
    d = c.q[-1]
    return None if d <= 192 or (c.dropout == 0 and d > 224) else "training head dim in (192, 224]"


def _flash_causal(c: Call, cc, r) -> str | None:
    """``check_flash_causal_non_square_seqlens``."""
    return None if not c.is_causal or c.q[2] == c.k[2] else "is_causal with kv_len != seq_len"


def _grid_size(c: Call, cc, r) -> str | None:
    """The kernel's launch grid takes batch and heads as its y and z dimensions, at most
    65535 each: ``check_cudnn_tensor_shapes`` (2.13), ``check_flash_attention_grid_size``
    (2.15: "Flash attention does not support batch size or num_heads greater than")."""
    return "batch or heads > 65535" if c.q[0] > 65535 or c.q[1] > 65535 else None


def _alignment(c: Call, cc) -> int:
    """``minimum_gemm_alignment``: elements a head dim must be a multiple of."""
    return minimum_gemm_alignment(c.dtype in ("float16", "bfloat16"), tuple(cc))


def _efficient_head_dim(c: Call, cc, r) -> str | None:
    """``check_head_dim_size_mem_efficient``."""
    a = _alignment(c, cc)
    ok = c.q[-1] == c.k[-1] and c.q[-1] % a == 0 and c.v[-1] % a == 0 and c.q[-1] > 0
    return None if ok else f"head dim not a multiple of {a}"


def _efficient_ptr(c: Call, cc, r) -> str | None:
    """``check_data_ptr_alignment_mem_efficient`` (2.13): storage offsets aligned on sm80+."""
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
    """``check_cudnn_dropout`` (2.12) and the 9.11-9.13 dropout gap of
    ``can_use_cudnn_attention`` (2.9)."""
    if r.torch[:2] >= (2, 12) and c.dropout * 16 != int(c.dropout * 16):
        return "dropout not a multiple of 1/16"
    if r.torch[:2] >= (2, 9) and c.dropout > 0 and 91100 < r.cudnn_version < 91400:
        return "cuDNN 9.11-9.13 has no SDPA dropout"
    return None


def _cudnn_shapes(c: Call, cc, r: Release) -> str | None:
    """``check_cudnn_tensor_shapes`` (cuDNN >= 9): sizes (2.13), head-dim limit and
    alignment, lengths of 1 (2.6)."""
    if r.torch[:2] >= (2, 13) and (grid := _grid_size(c, cc, r)):
        return grid
    d_qk, d_v = c.q[3], c.v[3]
    limit = head_dim_limit(d_qk, d_v, cc, r.torch, r.cudnn_version, r.frontend_d256)
    if d_qk > limit or d_v > limit:
        return f"head dim > {limit}"
    if d_qk % 8 or d_v % 8:
        return "head dim not a multiple of 8"
    if (2, 6) <= r.torch[:2] <= (2, 8) and (c.q[2] == 1 or c.k[2] == 1):
        return "sequence length 1"
    if r.torch[:2] >= (2, 9) and c.k[2] == 1:
        return "key length 1"
    if r.torch[:2] >= (2, 9) and c.dropout and c.q[2] == 1:
        return "query length 1 with dropout"
    return None


def _cudnn_opt_in(c: Call, cc, r: Release, env=os.environ) -> str | None:
    """2.4: ``cudnn_sdp_enabled()`` is off unless TORCH_CUDNN_SDPA_ENABLED=1
    (``check_runtime_enabled_cudnn``), and then for inference only
    (``check_cudnn_requires_grad``)."""
    if env.get("TORCH_CUDNN_SDPA_ENABLED") != "1":
        return "off unless TORCH_CUDNN_SDPA_ENABLED=1 (torch 2.4)"
    return "inference only (torch 2.4)" if c.requires_grad else None


def _cudnn_d256_bprop(c: Call, cc, r: Release) -> str | None:
    """``check_cudnn_d256_bprop_head_dim`` (2.14): which head dims have a backward on
    sm90/10x."""
    sm90 = (cc[0] == 9 and cc[1] == 0) or cc[0] == 10
    sm107_old = cc == (10, 7) and r.cudnn_version <= 92500
    if not c.requires_grad or not (r.cudnn_version > 92200 and r.frontend_d256 and sm90
                                   and not sm107_old):
        return None
    d_qk, d_v = c.q[3], c.v[3]
    ok = (d_qk <= 128 and d_v <= 128) or (d_qk, d_v) in ((192, 128), (256, 256))
    return None if ok else "no cuDNN backward for these head dims"


@dataclass(frozen=True)
class Rule:
    """A filter and the releases that apply it (``since`` to ``until``, both included)."""

    check: Callable
    since: tuple[int, int] = OLDEST
    until: tuple[int, int] = NEWEST

    def applies(self, r: Release) -> bool:
        return self.since <= r.torch[:2] <= self.until


FILTERS: dict[str, tuple[Rule, ...]] = {
    CUDNN: (Rule(_cudnn_opt_in, until=(2, 4)), Rule(_shapes), Rule(_half),
            Rule(_mask_shape, since=(2, 5)), Rule(_hardware((8, 0), "cuDNN")),
            Rule(_cudnn_dropout), Rule(_nonzero), Rule(_last_stride),
            # no head-count check 2.5-2.7; grouped heads with k, v heads apart from 2.8
            Rule(_heads((2, 8), False), since=(2, 8)), Rule(_cudnn_shapes, since=(2, 5)),
            Rule(_cudnn_d256_bprop, since=(2, 14))),
    FLASH: (Rule(_shapes), Rule(_no_mask), Rule(_flash_head_dim), Rule(_hardware((8, 0), "flash")),
            Rule(_flash_sm86), Rule(_flash_causal), Rule(_grid_size, since=(2, 15)), Rule(_half),
            Rule(_heads((2, 5))),
            Rule(_nonzero), Rule(_last_stride)),
    EFFICIENT: (Rule(_hardware((5, 0), "efficient")), Rule(_shapes), Rule(_efficient_head_dim),
                Rule(_efficient_ptr, since=(2, 13)), Rule(_nonzero), Rule(_last_stride),
                Rule(_heads((2, 14))), Rule(_efficient_dtype)),
}


def rejection(backend: str, call: Call, cc: tuple[int, int], release: Release,
              flags: Flags) -> str | None:
    """Why ``can_use_<backend>`` is false, or None when the backend can run the call."""
    if not getattr(flags, backend):
        return "disabled (torch.backends.cuda / sdpa_kernel)"
    if backend == MATH:
        return None
    if backend == CUDNN and flags.deterministic and release.torch[:2] >= (2, 5):
        return "deterministic algorithms requested"
    return next((why for rule in FILTERS[backend] if rule.applies(release)
                 and (why := rule.check(call, cc, release))), None)


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
