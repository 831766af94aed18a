"""Reference code of ``checkpoint-<impl>`` (``memcalc/impls/checkpoint.py``): another
implementation's reference code under non-reentrant activation checkpointing, one wrapper
per wrapper the registry generated."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

from torch.utils.checkpoint import checkpoint

from memcalc.impls import impl_names
from memcalc.impls.checkpoint import PREFIX
from memcalc.validation import reference as package
from memcalc.validation.reference import REFERENCES, reference


def checkpointed(fn):
    """``checkpoint(fn, q, k, v, use_reentrant=False)`` with the options ``fn`` declares."""
    accepted = inspect.signature(fn).parameters

    def ref(q, k, v, causal=False, chunk=64):
        options = {k: v for k, v in (("causal", causal), ("chunk", chunk)) if k in accepted}
        return checkpoint(fn, q, k, v, use_reentrant=False, **options)

    ref.__doc__ = f"``{fn.__name__}`` under ``torch.utils.checkpoint`` (non-reentrant)."
    return ref


def _register_all() -> None:
    """Import the other reference modules first (this one sorts before them)."""
    for module in pkgutil.iter_modules(package.__path__):
        if module.name != __name__.rsplit(".", 1)[1]:
            importlib.import_module(f"{package.__name__}.{module.name}")
    impl_names()  # load the registry, wrappers included
    for name in [n for n in impl_names() if n.startswith(PREFIX)]:
        inner = name.removeprefix(PREFIX)
        if inner in REFERENCES:
            reference(name)(checkpointed(REFERENCES[inner]))


_register_all()
