"""Patching a module when user code imports it, not before: a stand-in that replaces part of
a library (FlexAttention's ``flex_attention``, transformers' flash-attention checks) patches
it as soon as its import has run, so that a trace of code that never imports it pays
nothing for it."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from contextlib import contextmanager


@contextmanager
def on_import(name: str, patch):
    """``patch(module)`` for module ``name`` now if it is imported, else as soon as an
    import has run its code (a finder ahead of the others wraps its loader)."""
    if name in sys.modules:
        patch(sys.modules[name])
        yield
        return
    finder = _PatchingFinder(name, patch)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


class _PatchingFinder(importlib.abc.MetaPathFinder):
    """Finds module ``name`` as the other finders do, and patches it once it has run."""

    def __init__(self, name: str, patch):
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # the real spec, from the finders after this one
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            run, patch = spec.loader.exec_module, self.patch

            def exec_module(module):
                run(module)
                patch(module)

            spec.loader = _Loader(spec.loader, exec_module)
        return spec


class _Loader(importlib.abc.Loader):
    """``loader`` with its ``exec_module`` replaced."""

    def __init__(self, loader, exec_module):
        self.loader, self.exec_module = loader, exec_module

    def create_module(self, spec):
        return self.loader.create_module(spec)
