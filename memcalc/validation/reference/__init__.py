"""The torch code each built-in implementation models: what a user would write.

One module per family, mirroring ``memcalc/impls``; each registers its functions with
``@reference(name)``. The emulated backend traces exactly these functions, so the model
and the code cannot drift apart unnoticed (``tests/test_validate_emulated.py``). Every
function takes leaf tensors ``q, k, v`` of shape ``(B, H, N, d)`` (k, v: ``(B, H, M, d)``)
and returns ``out`` of shape ``(B, H, N, d)``, but the flash-attn packages', which take and
return ``(B, N, H, d)`` (their implementations' ``inputs``).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Callable

REFERENCES: dict[str, Callable] = {}


def reference(name: str):
    """Register ``fn`` as the reference code of implementation ``name``."""

    def register(fn):
        REFERENCES[name] = fn
        return fn

    return register


def reference_fn(config) -> Callable:
    """The reference code of ``config.impl`` with its options bound: ``fn(q, k, v)``.
    A reference function takes ``causal`` and, if it declares them, ``chunk`` and
    ``deterministic``."""
    import inspect

    _load()
    ref = REFERENCES[config.impl]
    options = {"causal": config.causal, "chunk": config.chunk,
               "deterministic": config.protocol.deterministic}
    accepted = inspect.signature(ref).parameters
    bound = {k: v for k, v in options.items() if k in accepted}
    return lambda q, k, v: ref(q, k, v, **bound)


def _load() -> None:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
