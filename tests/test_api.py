"""The public API: its docstring examples run as tests."""

import doctest

import pytest

import memcalc


def test_docstring_examples():
    pytest.importorskip("torch")
    result = doctest.testmod(memcalc, extraglobs={"memcalc": memcalc})
    assert result.attempted >= 8 and result.failed == 0


def test_api_errors_name_the_field():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="seq_len"):
        memcalc.breakdown(seq_len=0)
