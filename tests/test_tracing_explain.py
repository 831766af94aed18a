"""``memcalc.tracing.explain``: where a failure is named (the user's code, or a library
they call), never torch, memcalc or Python's own library."""

import contextlib
import os

import pytest

pytest.importorskip("torch")

from memcalc.tracing.explain import _STDLIB, written_by_users  # noqa: E402


def test_python_s_own_library_is_never_named_but_packages_installed_inside_it_are():
    """``contextlib`` is Python's; a package in a Python without a virtual environment
    sits in site-packages inside the standard library's folder, and is named."""
    assert not written_by_users(contextlib.__file__)
    assert written_by_users(os.path.join(_STDLIB, "site-packages", "transformers", "a.py"))
    assert written_by_users(os.path.join(os.getcwd(), "examples", "model.py"))
