"""The registry of attention implementations: one name, one program builder, one source.

Each module in this package registers its implementations with ``@register``; a builder
is a small pure function from ``Dims`` to a ``Program`` (its tensors and their lifetimes),
in the manner of ``torch/utils/flop_counter.py``'s registry of formulas.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable

from memcalc.tensors import Dims, Program


@dataclass(frozen=True)
class Impl:
    """A registered implementation: its name, a one-line summary and its program."""

    name: str
    summary: str
    build: Callable[[Dims], Program]
    gqa: bool = False  # supports fewer key/value heads than query heads
    traced: bool = True  # validated against the emulated trace; False: source-derived only


IMPLS: dict[str, Impl] = {}


def register(name: str, summary: str, gqa: bool = False, traced: bool = True):
    """Decorator: register ``build`` as implementation ``name``. ``traced=False`` marks a
    model derived from kernel sources that the meta device cannot check (fused CUDA kernels)."""

    def wrap(build: Callable[[Dims], Program]):
        IMPLS[name] = Impl(name, summary, build, gqa, traced)
        return build

    return wrap


def get_impl(name: str) -> Impl:
    """The implementation called ``name``; a ValueError listing the known ones otherwise."""
    _load()
    if name not in IMPLS:
        raise ValueError(f"unknown implementation {name!r}; known: {', '.join(IMPLS)}")
    return IMPLS[name]


def impl_names() -> list[str]:
    _load()
    return list(IMPLS)


def _load() -> None:
    """Import every module of this package: each registers its implementations."""
    for module in pkgutil.iter_modules(__path__):
        if not module.name.startswith("_") and module.name != "common":
            importlib.import_module(f"{__name__}.{module.name}")
