"""``sdpa``: ``F.scaled_dot_product_attention`` as a user calls it, on the kernel torch picks.

Users think "PyTorch SDPA", not a kernel. torch picks one per call (``sdp_utils.cpp``
``select_sdp_backend``: the GPU's compute capability, the dtype, the head dim, a mask,
causal, grouped heads, the release); ``memcalc.impls.sdpa_select`` decides it the same way,
and this implementation is that kernel's model (``sdpa-flash``, ``sdpa-efficient``,
``sdpa-cudnn`` or ``sdpa-math``). The rules are the installed torch's release, its version
read from its package metadata without importing it (the command line imports no torch),
else the newest written; results name the kernel picked and why (``Impl.how``).
"""

from __future__ import annotations

from functools import lru_cache

from memcalc.engine.dims import Dims
from memcalc.engine.program import ITEMSIZE, Program
from memcalc.impls import load_before
from memcalc.impls.registry import IMPLS, register
from memcalc.impls.sdpa_select import (CUDNN, EFFICIENT, FLASH, MATH, Call, Choice, Release,
                                       select)

load_before("sdpa")  # the kernels it picks among

BACKENDS = {FLASH: "sdpa-flash", EFFICIENT: "sdpa-efficient", CUDNN: "sdpa-cudnn",
            MATH: "sdpa-math"}
# the attn_mask a --mask gives the call (sdpa-efficient's): padding (B, 1, 1, M), full
MASKS = {"padding": lambda d: (d.B, 1, 1, d.M), "full": lambda d: (d.B, 1, d.N, d.M)}


@lru_cache(maxsize=1)
def installed_release() -> Release:
    """The installed torch's rules, else (no torch, or a release past those written) the
    newest: read from its metadata, no import."""
    from importlib import metadata

    try:
        return Release.of(metadata.version("torch"))
    except (metadata.PackageNotFoundError, ValueError):
        return Release()


def call_of(d: Dims) -> Call:
    """The SDPA call of a step of ``d``'s sizes: q ``(B, H, N, D)``, k and v ``(B, Hk, M,
    D)`` (``enable_gqa`` with fewer key/value heads), causal as configured."""
    q, kv = (d.B, d.H, d.N, d.D), (d.B, d.Hk, d.M, d.D)
    mask = MASKS[d.mask](d) if d.mask in MASKS else None
    return Call(q, kv, kv, d.dtype, mask=mask, is_causal=d.causal, enable_gqa=d.Hk != d.H,
                requires_grad=not d.forward_only, itemsize=ITEMSIZE[d.dtype])


def choice(d: Dims) -> Choice:
    """The kernel torch's rules pick for ``d``, and why the ones before it were not."""
    return select(call_of(d), tuple(d.compute_capability), release=installed_release())


def picked(d: Dims) -> str:
    """What a result says of it: ``torch 2.13's rules pick cudnn (priority ...)``."""
    return f"torch {installed_release().text()}'s rules pick {choice(d).reason()}"


@register("sdpa", "F.scaled_dot_product_attention: the kernel torch's rules pick for the "
          "GPU, dtype and shape (flash, memory-efficient, cuDNN or math)", gqa=True,
          traced=False, source="PyTorch's CUDA kernel sources (the kernel its rules pick)",
          masks=tuple(MASKS), how=picked, runs=lambda d: BACKENDS[choice(d).backend])
def build(d: Dims) -> Program:
    kernel = BACKENDS[choice(d).backend]
    if d.mask in MASKS and d.mask not in IMPLS[kernel].masks:  # cuDNN takes one since 2.5
        reading = ", ".join(k for k in BACKENDS.values() if d.mask in IMPLS[k].masks)
        raise ValueError(f"--mask: sdpa runs {kernel} here ({picked(d)}), which memcalc "
                         f"models without an attn_mask; --impl {reading} reads one")
    try:
        return IMPLS[kernel].program(d)
    except ValueError as refused:  # a kernel torch runs here that memcalc does not model
        field, sep, why = str(refused).partition(": ")
        where = f"{field}: " if sep and field.startswith("--") else ""
        raise ValueError(f"{where}sdpa runs {kernel} here ({picked(d)}), and "
                         f"{why if where else refused}") from None
