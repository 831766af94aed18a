"""Symbolic sizes: canonical products, and decisions on unknown sizes refused."""

import pytest

from memcalc.engine.symbolic import SizeDependent, Sym, evaluate_sym


def test_products_are_canonical():
    b, h, n, m = (Sym.leaf(x) for x in "BHNM")
    assert ((b * h) * n * m * 4).key == (b * (h * n) * m * 4).key  # (B*H, N, M) == (B, H, N, M)
    assert (n + n).key == (2 * n).key
    assert evaluate_sym(-(-n // 128) * 128, {"N": 129}) == 256  # round up to 128


def test_decisions_on_sizes_raise():
    n, d = Sym.leaf("N"), Sym.leaf("D")
    with pytest.raises(SizeDependent) as error:
        max(n, d)
    assert error.value.leaves == {"N", "D"}
    with pytest.raises(SizeDependent):
        bool(n > 1024)
    assert (n == n) and not (n != n)  # the same expression compares without a value
