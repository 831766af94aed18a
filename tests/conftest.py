"""Fixtures shared by the test modules."""

import os

import pytest

from memcalc.impls import IMPLS, impl_names, register

# Output is checked as a pipe without COLUMNS gets it (the piped width) unless a test sets
# it: pytest-xdist's workers set COLUMNS=80 and LINES=24, a shell may set others.
# The caching allocator's settings, which memcalc reads from the environment, are the
# allocator's defaults unless a test sets them.
for _name in ("COLUMNS", "LINES", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
    os.environ.pop(_name, None)


def pytest_configure(config):
    """``-n`` without ``--dist``: pytest-xdist's ``worksteal``, not its ``load``, so that a
    worker left idle takes the tests queued behind another worker's long one."""
    if getattr(config.option, "dist", "no") == "load" and not any(
            a.startswith("--dist") for a in config.invocation_params.args):
        config.option.dist = "worksteal"


def pytest_collection_modifyitems(items):
    """The tests marked ``first`` (among the slow suite's longest) before the rest: the
    other workers share the rest meanwhile (``worksteal``), so that no long test starts
    last."""
    items.sort(key=lambda item: item.get_closest_marker("first") is None)


@pytest.fixture(autouse=True)
def registry_restored():
    """Every test leaves the registry as it found it: a function a test traces (as
    ``memcalc trace`` registers it) is gone after it, so that a test over every
    implementation does not depend on which tests ran before."""
    before = set(impl_names())  # every module loaded: only the test's own are removed
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


@pytest.fixture
def ledger_steps():
    """A ledger history as its measured step's allocations and frees (bytes), to compare a
    model with a trace event by event (``tests/test_impls_ring.py``, ``test_impls_ulysses.py``)."""
    return _steps


def _steps(entries):
    """The measured step's allocations and frees (frees between two allocations as one
    sorted group: the tracer takes a batch of deaths in the order the tensors were made)."""
    start = [i for i, e in enumerate(entries) if (e.kind, e.label) == ("phase", "forward")][-1]
    out, frees = [], []
    for e in entries[start:]:
        if e.kind == "phase":
            continue
        if e.kind == "free":
            frees.append(e.component.bytes)
            continue
        if frees:
            out.append(("free", tuple(sorted(frees))))
            frees = []
        out.append((e.kind, e.component.bytes))
    return out
