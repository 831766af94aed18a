"""Linear forms over the grid's atoms: arithmetic, size classes and guard simplification."""

import numpy as np
import pytest

from memcalc.engine.allocator import round_segment
from memcalc.engine.forms import Form, _simplify, _size_classes, constant, size_class

MiB = 1_048_576  # 2^20


def parts(form: Form) -> tuple[dict, int, int]:
    return form.terms, form.const, form.value


def test_adding_an_integer_shifts_constant_and_value_only():
    f = Form({0: 1}, 0, 1024)  # one atom worth 1024 B in this configuration
    assert parts(f + 512) == ({0: 1}, 512, 1536)  # 1024 + 512
    assert parts(512 + f) == ({0: 1}, 512, 1536)
    assert parts(f - 512) == ({0: 1}, -512, 512)  # 1024 - 512
    assert parts(f) == ({0: 1}, 0, 1024)  # the operand is unchanged
    assert parts(constant(2 * MiB)) == ({}, 2_097_152, 2_097_152)  # 2 x 2^20


def test_a_numpy_integer_is_an_integer_and_a_float_is_refused():
    """The grid's sizes come from numpy arrays: an ``np.int64`` constant shifts as an int
    does (it was taken for a Form); a float is no byte count."""
    f = Form({0: 1}, 0, 1024)
    assert parts(f + np.int64(512)) == ({0: 1}, 512, 1536)  # 1024 + 512
    assert parts(f - np.int64(512)) == ({0: 1}, -512, 512)  # 1024 - 512
    assert parts(np.int64(10) - f) == ({0: -1}, 10, -1014)  # 10 - 1024
    with pytest.raises(TypeError):
        f + 0.5


def test_combining_forms_adds_coefficients_and_drops_the_cancelled_atoms():
    a = Form({0: 1, 1: 2}, 3, 100)
    b = Form({1: 2, 2: -1}, 4, 50)
    # atom 1: 2 + 2 = 4; atom 2: 0 + (-1) = -1; const 3 + 4 = 7; value 100 + 50 = 150
    assert parts(a + b) == ({0: 1, 1: 4, 2: -1}, 7, 150)
    # atom 1: 2 - 2 = 0, dropped; atom 2: 0 - (-1) = 1; const 3 - 4 = -1; value 100 - 50 = 50
    assert parts(a - b) == ({0: 1, 2: 1}, -1, 50)
    assert parts(a - a) == ({}, 0, 0)  # every atom cancels: a constant
    assert a.terms == {0: 1, 1: 2} and b.terms == {1: 2, 2: -1}  # operands not mutated


def test_integer_minus_form_negates_then_shifts():
    f = Form({2: 3}, 1, 1537)
    # 10 - (3 x atom2 + 1) = -3 x atom2 + 9, worth 10 - 1537 = -1527
    assert parts(10 - f) == ({2: -3}, 9, -1527)


def test_value_follows_the_form_evaluated_on_its_atoms():
    """A form's ``value`` is its figure for the configuration being replayed: it must stay
    ``const + sum(coef * atom)`` through any chain of operations."""
    atoms = {0: 3 * MiB, 1: 4 * MiB}  # a 3 MiB block and its 2 MiB-rounded segment
    r, g = (Form({i: 1}, 0, v) for i, v in atoms.items())
    slack = (g - r) - 1  # 1 x atom1 - 1 x atom0 - 1
    f = 5 - slack + r + g  # 2 x atom0 + 0 x atom1 + 6: atom1 cancels
    assert parts(f) == ({0: 2}, 6, 6_291_462)  # 2 x 3 x 2^20 + 6 = 6,291,456 + 6


def test_signature_is_the_sorted_terms_and_constant_not_the_value():
    a = Form({3: 1, 0: 2}, 4, 100)
    b = Form({0: 2, 3: 1}, 4, 999)  # same form, other order of terms, other value
    assert a.signature == b.signature == (((0, 2), (3, 1)), 4)
    assert Form({0: 2, 3: 1}, 5, 100).signature != a.signature  # the constant counts


# rounded block r -> class: 0 none, 1 small pool, 2 large pool below 10 MiB, 3 from 10 MiB
# with a fresh segment split (round_segment(r) - r > 1 MiB), 4 from 10 MiB, not split
BOUNDARIES = [
    (0, 0),
    (512, 1),  # the smallest block
    (1_048_576, 1),  # 1 MiB: still the small pool
    (1_049_088, 2),  # 1 MiB + 512
    (10_485_248, 2),  # 10 MiB - 512
    (10_485_760, 4),  # 10 MiB: segment 10 MiB, rest 0
    (10_486_272, 3),  # 10 MiB + 512: segment 12 MiB, rest 12,582,912 - 10,486,272 = 2,096,640
    (11_533_824, 3),  # 11 MiB - 512: rest 12,582,912 - 11,533,824 = 1,049,088 > 1 MiB
    (11_534_336, 4),  # 11 MiB: rest exactly 1,048,576, not > 1 MiB
    (11_534_848, 4),  # 11 MiB + 512: rest 1,048,064
]


@pytest.mark.parametrize("r, cls", BOUNDARIES)
def test_size_class_at_the_pool_and_split_boundaries(r, cls):
    assert size_class(r) == cls


def test_vectorized_size_classes_agree_with_size_class():
    """The grid computes the classes of many configurations at once from the atoms' values
    (block r and its segment g); it must classify exactly as ``size_class``."""
    r = np.array([b for b, _ in BOUNDARIES], dtype=np.int64)
    g = np.array([round_segment(b) for b, _ in BOUNDARIES], dtype=np.int64)
    assert _size_classes(r, g).tolist() == [cls for _, cls in BOUNDARIES]


# guards ``form >= 0`` over size 0 (atoms 0: block, 1: segment) and size 1 (atoms 2, 3)
ANY_BLOCK = Form({0: 1}, -1, 0)  # r0 - 1 >= 0: a block of size 0 is allocated
SMALL_POOL = Form({0: -1}, MiB, 0)  # 1 MiB - r0 >= 0: size 0 is served by the small pool
BIG_SEGMENT = Form({3: 1}, -10 * MiB, 0)  # g1 - 10 MiB >= 0
SPLIT = Form({2: -1, 3: 1}, -(MiB + 1), 0)  # g1 - r1 - (1 MiB + 1) >= 0: segment is split


def signatures(forms):
    return [f.signature for f in forms]


def test_simplify_drops_the_guards_the_size_classes_decide():
    # size 0 in class 1: r0 in [512, 1 MiB], so r0 - 1 >= 511 and 1 MiB - r0 >= 0;
    # size 1 in class 3: g1 >= 10 MiB, and g1 - r1 in [1 MiB + 512, 2 MiB - 512], so
    # g1 - r1 - 1 MiB - 1 >= 511
    assert _simplify([ANY_BLOCK, SMALL_POOL, BIG_SEGMENT, SPLIT], [1, 3]) == []


def test_simplify_keeps_the_guards_the_size_classes_leave_open():
    # size 0 in class 2: r0 in [1 MiB + 512, 10 MiB - 512], so r0 - 1 >= 0 still holds but
    # 1 MiB - r0 >= 0 is a real bound (r0 <= 1 MiB); size 1 in class 2: no 10 MiB segment,
    # so both guards on g1 stay
    out = _simplify([ANY_BLOCK, SMALL_POOL, BIG_SEGMENT, SPLIT], [2, 2])
    assert signatures(out) == [
        (((2, -1), (3, 1)), -1_048_577),  # SPLIT kept as it is: -(2^20 + 1)
        (((3, 1),), -10_485_760),  # g1 >= 10 x 2^20, as a lower bound
        (((0, -1),), 1_048_576),  # r0 <= 2^20, as an upper bound
    ]
    # size 1 in class 4: g1 - r1 in [0, 1 MiB], so "split" (> 1 MiB) is not decided
    assert signatures(_simplify([SPLIT], [1, 4])) == [SPLIT.signature]


# what each class says of a block r (multiples of 512 B) and of g - r, its segment's slack
# (g rounds r up to 2 MiB): closed ranges, None for no upper end
R_RANGES = [
    (0, 0, 0),
    (1, 512, 1_048_576),  # [MIN_BLOCK, 1 MiB]
    (2, 1_049_088, 10_485_248),  # [1 MiB + 512, 10 MiB - 512]
    (3, 10_485_760, None),  # from 10 MiB = 10 x 2^20
    (4, 10_485_760, None),
]
SLACK_RANGES = [
    (3, 1_049_088, 2_096_640),  # split: > 1 MiB, so [1 MiB + 512, 2 MiB - 512]
    (4, 0, 1_048_576),  # not split: [0, 1 MiB]
]


def implied(guard: Form, classes: list[int]) -> bool:
    return _simplify([guard], classes) == []


@pytest.mark.parametrize("cls, lo, hi", R_RANGES)
def test_a_class_decides_exactly_the_bounds_of_its_block_range(cls, lo, hi):
    """A guard on a block alone is dropped when it holds over the whole range of the class,
    and kept when one block of the range breaks it: the ranges must be exact."""
    assert implied(Form({0: 1}, -lo, 0), [cls])  # r >= lo
    assert not implied(Form({0: 1}, -(lo + 1), 0), [cls])  # r >= lo + 1: r = lo breaks it
    assert not implied(Form({0: -1}, lo - 1, 0), [cls])  # r <= lo - 1
    if hi is None:
        assert not implied(Form({0: -1}, 1 << 62, 0), [cls])  # no bound above
    else:
        assert implied(Form({0: -1}, hi, 0), [cls])  # r <= hi
        assert not implied(Form({0: -1}, hi - 1, 0), [cls])  # r <= hi - 1: r = hi breaks it


@pytest.mark.parametrize("cls, lo, hi", SLACK_RANGES)
def test_a_large_class_decides_exactly_the_slack_of_its_segment(cls, lo, hi):
    assert implied(Form({0: -1, 1: 1}, -lo, 0), [cls])  # g - r >= lo
    assert not implied(Form({0: -1, 1: 1}, -(lo + 1), 0), [cls])
    assert not implied(Form({0: -2, 1: 1}, -lo, 0), [cls])  # g - 2r: not the slack (< 0)
    assert implied(Form({0: 1, 1: -1}, hi, 0), [cls])  # g - r <= hi
    assert not implied(Form({0: 1, 1: -1}, hi - 1, 0), [cls])
    assert implied(Form({1: 1}, -10_485_760, 0), [cls])  # g >= 10 MiB
    assert not implied(Form({1: 1}, -10_485_761, 0), [cls])


def test_simplify_merges_one_atom_guards_into_the_tightest_bounds():
    """``c * atom + k >= 0`` bounds an integer atom: from below by ceil(-k / c) when c > 0,
    from above by floor(k / -c) when c < 0; of several, the tightest is kept."""
    guards = [
        Form({0: 1}, -12 * MiB, 0),  # r0 >= 12 MiB
        Form({0: 2}, -(32 * MiB + 1), 0),  # 2 r0 >= 33,554,433: r0 >= 16,777,216.5
        Form({0: -1}, 64 * MiB, 0),  # r0 <= 64 MiB
        Form({0: -3}, 100 * MiB, 0),  # 3 r0 <= 104,857,600: r0 <= 34,952,533.3
    ]
    out = _simplify(guards, [3])  # class 3: r0 >= 10 MiB, which none of them is implied by
    assert signatures(out) == [
        (((0, 1),), -16_777_217),  # r0 >= 16 MiB + 1 = ceil(33,554,433 / 2)
        (((0, -1),), 34_952_533),  # r0 <= floor(104,857,600 / 3); 3 x 34,952,533 = 104,857,599
    ]


def test_simplify_keeps_the_strongest_of_guards_that_differ_in_their_constant():
    """``T + k >= 0`` with a smaller ``k`` asks more of ``T``: it implies the others."""
    guards = [
        Form({0: 1, 2: -1}, 5, 0),
        Form({0: 1, 2: -1}, 3, 0),  # the strongest of the three
        Form({2: -1, 0: 1}, 7, 0),  # the same terms written in another order
        Form({0: 2, 2: -1}, 0, 0),  # other terms: a guard of its own
    ]
    out = _simplify(guards, [3, 3])  # atoms 0 and 2 are two sizes' blocks: nothing implied
    assert signatures(out) == [(((0, 1), (2, -1)), 3), (((0, 2), (2, -1)), 0)]
