"""Fixtures shared by the test modules."""

import pytest

from memcalc.impls import IMPLS, impl_names, register


@pytest.fixture
def scratch_register():
    """``register`` for the test's own implementations, removed from the registry after
    it (every module is loaded first: nothing registered here wraps them)."""
    before = set(impl_names())
    yield lambda name, summary, build: register(name, summary, traced=False)(build)
    for name in set(IMPLS) - before:
        IMPLS.pop(name)
