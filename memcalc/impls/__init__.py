"""The implementations, one module each, loaded once in this order.

Each module registers its builders in ``memcalc.impls.registry``; ``checkpoint`` comes last
because it wraps the traced implementations registered before it.

May import: ``memcalc.errors`` and ``engine``.
"""

from __future__ import annotations

from memcalc.impls import flash2, linear, naive, sdpa_efficient, sdpa_flash, sdpa_math  # noqa: F401
from memcalc.impls import sdpa_cudnn  # noqa: F401,E402
from memcalc.impls import sdpa  # noqa: F401,E402  (the kernel torch picks, of those above)
from memcalc.impls import flash_attn, flash_attn3, flex  # noqa: F401,E402  (packages, flex)
from memcalc.impls import checkpoint  # noqa: F401,E402  (wraps the ones above)
from memcalc.impls.registry import IMPLS, Impl, register  # noqa: F401


def get_impl(name: str) -> Impl:
    """The implementation called ``name``; a ValueError listing the known ones otherwise."""
    if name not in IMPLS:
        from memcalc.errors import did_you_mean

        raise ValueError(f"unknown implementation {name!r}{did_you_mean(name, IMPLS)}; known: "
                         f"{', '.join(IMPLS)}")
    return IMPLS[name]


def canonical(name):
    """``name`` as registered when it differs only in case (``Naive``, ``SDPA-Flash``: GPU
    and dtype names are taken in any case too); otherwise as given."""
    if not isinstance(name, str) or name in IMPLS:
        return name
    return next((known for known in IMPLS if known.lower() == name.lower()), name)


def impl_names() -> list[str]:
    """Every registered name, in registration order."""
    return list(IMPLS)
