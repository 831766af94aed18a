"""The implementations, one module each, loaded in this order as they are first needed.

Each module registers its builders in ``memcalc.impls.registry``. A module may read those
before it: ``sdpa`` picks among the SDPA kernels, ``checkpoint`` wraps the traced ones. So
modules load as a prefix of ``MODULES``: asking for ``naive`` loads ``flash2``, ``linear``
and ``naive`` (the CLI's default step does not import the SDPA selection rules, a tenth of
its start-up); listing the names loads them all. The registration order, every list of
names, is that of ``MODULES`` whichever loaded first.

May import: ``memcalc.errors`` and ``engine``.
"""

from __future__ import annotations

import importlib

from memcalc.impls.registry import IMPLS, Impl, register  # noqa: F401

MODULES = ("flash2", "linear", "naive", "sdpa_flash", "sdpa_efficient", "sdpa_math",
           "sdpa_cudnn",
           "sdpa",  # the kernel torch picks, of those above
           "flash_attn", "flash_attn3", "flex",  # packages, FlexAttention
           "checkpoint")  # wraps the ones above


def load(through: str | None = None) -> None:
    """Import the modules of ``MODULES`` in order, through ``through`` (all when None)."""
    for module in MODULES:
        importlib.import_module(f"{__name__}.{module}")
        if module == through:
            return


def load_before(module: str) -> None:
    """Import the modules before ``module`` (what a module that reads them needs first)."""
    at = MODULES.index(module)
    if at:
        load(MODULES[at - 1])


def _module_of(name: str) -> str | None:
    """The module that probably registers ``name`` (``sdpa-flash``: ``sdpa_flash``;
    ``linear-causal-chunked``: ``linear``): a guess, checked by looking ``name`` up after."""
    for guess in (name.lower().replace("-", "_"), name.lower().split("-")[0]):
        if guess in MODULES:
            return guess
    return None


def registered() -> dict[str, Impl]:
    """Every implementation by name, in ``MODULES`` order (traced functions last)."""
    load()
    rank = {f"{__name__}.{m}": i for i, m in enumerate(MODULES)}
    order = sorted(IMPLS, key=lambda n: rank.get(IMPLS[n].build.__module__, len(MODULES)))
    if list(IMPLS) != order:  # a module imported out of turn (directly, by other code)
        ordered = {n: IMPLS[n] for n in order}
        IMPLS.clear()
        IMPLS.update(ordered)
    return IMPLS


def _load_for(name: str) -> None:
    """Load the modules through the one that probably registers ``name``, if any."""
    module = _module_of(name)
    if module:
        load(module)


def get_impl(name: str) -> Impl:
    """The implementation called ``name``; a ValueError listing the known ones otherwise."""
    if name not in IMPLS and isinstance(name, str):
        _load_for(name)
    if name not in IMPLS and name not in registered():
        from memcalc.errors import did_you_mean

        raise ValueError(f"unknown implementation {name!r}{did_you_mean(name, IMPLS)}; known: "
                         f"{', '.join(IMPLS)}")
    return IMPLS[name]


def canonical(name):
    """``name`` as registered when it differs only in case (``Naive``, ``SDPA-Flash``: GPU
    and dtype names are taken in any case too); otherwise as given."""
    if not isinstance(name, str) or name in IMPLS:
        return name
    _load_for(name)
    if name in IMPLS:
        return name
    return next((known for known in registered() if known.lower() == name.lower()), name)


def impl_names() -> list[str]:
    """Every registered name, in registration order."""
    return list(registered())
