"""Symbolic sizes: canonical products, and decisions on unknown sizes refused."""

import numpy as np
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


def _bigger_of_twice_or_hundred(n: int) -> int:
    return max(2 * n, 100)  # a branch on the size: no expression for it


def test_apply_is_the_function_now_for_integers_and_per_element_over_a_grid():
    from memcalc.engine.symbolic import apply, bound_sym

    bound = lambda n: max(2 * n, 100)  # noqa: E731 monotone: its value at the bound bounds it
    assert apply(_bigger_of_twice_or_hundred, (30,), bound) == 100
    n = Sym.leaf("N")
    size = apply(_bigger_of_twice_or_hundred, (n + 1,), bound)
    assert size.leaves == frozenset({"N"})
    assert evaluate_sym(size, {"N": np.array([10, 49, 50, 1000])}).tolist() == [100, 100, 102,
                                                                                2002]
    assert bound_sym(size * 3, {"N": 1000}) == 3 * 2002
