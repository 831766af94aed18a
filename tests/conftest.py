"""Fixtures shared by the test modules."""

import pytest

from memcalc.impls import IMPLS, impl_names, register


@pytest.fixture(autouse=True)
def registry_restored():
    """Every test leaves the registry as it found it: a function a test traces (as
    ``memcalc trace`` registers it) is gone after it, so that a test over every
    implementation does not depend on which tests ran before."""
    before = set(IMPLS)
    yield
    for name in set(IMPLS) - before:
        IMPLS.pop(name)


@pytest.fixture
def scratch_register():
    """``register`` for the test's own implementations, removed from the registry after
    it (every module is loaded first: nothing registered here wraps them)."""
    before = set(impl_names())
    yield lambda name, summary, build: register(name, summary, traced=False)(build)
    for name in set(IMPLS) - before:
        IMPLS.pop(name)
