"""The public API: its docstring examples run as tests."""

import doctest

import pytest

import memcalc


def test_docstring_examples():
    """The package's own and its API functions' (``memcalc.api``, which it exports), and
    its configuration models' (``memcalc.Mesh``, ``memcalc.Step``)."""
    pytest.importorskip("torch")
    from memcalc import api, config

    results = [doctest.testmod(module, extraglobs={"memcalc": memcalc})
               for module in (memcalc, api, config)]
    assert sum(r.attempted for r in results) >= 8 and not any(r.failed for r in results)


def test_api_errors_name_the_field():
    """One line, naming the keyword, suggesting a near miss: no pydantic text or link."""
    with pytest.raises(ValueError, match=r"^seq_len: Input should be greater than or equal to "
                                         r"1 \(got 0\)$"):
        memcalc.breakdown(seq_len=0)
    with pytest.raises(ValueError, match=r"^impl: unknown implementation 'naiv' \(did you mean "
                                         r"'naive' or 'naive-softmax' or 'naive-weights'\?\)"):
        memcalc.breakdown(impl="naiv")
    with pytest.raises(ValueError, match=r"^gpu: a GPU preset .*; known: a100-40gb"):
        memcalc.breakdown(gpu=None)  # not the Device model's memory_bytes, which it does not take


