"""memcalc.engine.units: exact byte formatting (MiB, the largest binary unit, percentages)."""

from fractions import Fraction

import pytest

from memcalc.engine.units import GiB, KiB, MiB, decimal, fixed, human, mib, ratio_number, share


def test_mib_rounds_an_exact_half_up():
    """3,276,800 B is exactly 3.125 MiB: half up gives 3.13 where float formatting
    (round half to even) would print 3.12."""
    assert mib(3_276_800) == "3.13"  # 25 x 2^17 B = 25/8 MiB = 3.125 MiB
    assert mib(3_276_799) == "3.12"  # one byte under the half: 3.12499... MiB
    assert mib(0) == "0.00"


def test_mib_is_exact_beyond_float_precision():
    """Integer arithmetic only: 2^60 + 1/8 MiB has no float, yet its last digits are right."""
    # (2^80 + 2^17) B / 2^20 = 2^60 + 0.125 MiB; 2^60 = 1024^6 = 1,152,921,504,606,846,976
    assert mib(2**80 + 2**17) == "1,152,921,504,606,846,976.13"


def test_human_picks_the_largest_unit_at_each_boundary():
    assert human(0) == "0 B"
    assert human(1_023) == "1023 B"  # under 1 KiB: plain bytes, no separator, no decimals
    assert human(1_024) == "1.00 KiB"  # 2^10 B
    assert human(1_536) == "1.50 KiB"  # 1,536 / 1,024 = 1.5
    assert human(1_048_576) == "1.00 MiB"  # 2^20 B
    assert human(1_073_741_824) == "1.00 GiB"  # 2^30 B
    assert GiB == 1_073_741_824  # 1024 x 1024 x 1024


def test_human_goes_past_gib_for_steps_no_gpu_holds():
    """seq_len 10^12 printed 26-digit GiB figures; the binary units go on to YiB."""
    assert human(2**40 - 1) == "1.00 TiB"  # rounds up to the next unit, shown in it
    assert human(3 * 2**50) == "3.00 PiB"
    assert human(2**80) == "1.00 YiB" and human(2**90) == "1,024.00 YiB"  # the last unit
    assert human(-5 * 2**60) == "-5.00 EiB"


def test_share_rounds_half_up_to_one_decimal():
    assert share(1, 16) == "6.3%"  # 100 / 16 = 6.25, half up (half to even: 6.2)
    assert share(1, 8) == "12.5%"  # 100 / 8 = 12.5
    assert share(3, 3) == "100.0%"
    assert share(0, 5) == "0.0%"


def test_share_of_a_zero_whole_is_a_dash():
    """No percentage of nothing: a dash, not a ZeroDivisionError."""
    assert share(0, 0) == "-"
    assert share(5, 0) == "-"


def test_fixed_with_no_places_is_a_grouped_integer():
    """``places=0`` (used by the threshold and sweep tables) prints no decimal point."""
    assert fixed(5, 2, 0) == "3"  # 2.5 rounds half up
    assert fixed(7, 3, 0) == "2"  # 2.33...
    assert fixed(1_234_567, 1, 0) == "1,234,567"


def test_a_negative_figure_is_its_magnitude_signed():
    """A difference may be negative: rounding the magnitude, not flooring the signed value
    (which gave -1.50 for -0.5 MiB)."""
    assert mib(-524_288) == "-0.50"  # -2^19 B = -0.5 MiB
    assert share(-1, 16) == "-6.3%"  # -100 / 16 = -6.25, magnitude half up
    assert human(-2_048) == "-2.00 KiB"  # |-2,048| B = 2 KiB
    assert fixed(-5, 2, 0) == "-3"  # -2.5: magnitude 2.5 rounds half up to 3


def test_human_shows_a_figure_that_rounds_up_in_the_next_unit():
    """Never ``1,024.00 KiB``: from 199/200 of a unit on, the figure rounds to 1.00 of it."""
    assert 1_043_334 == -(-199 * MiB // 200)  # the first byte count >= 199/200 MiB
    assert human(1_043_334) == "1.00 MiB"
    assert human(1_043_333) == "1,018.88 KiB"  # 1,043,333 / 1,024 = 1,018.879...
    assert human(MiB - 1) == "1.00 MiB"  # 1,048,575 B
    assert human(GiB - 1) == "1.00 GiB"
    assert human(KiB - 1) == "1023 B"  # bytes stay exact below 1 KiB


def test_decimal_is_exact_for_denominators_of_twos_and_fives():
    assert decimal(Fraction(159, 2)) == "79.5"
    assert decimal(Fraction(1, 1024)) == "0.0009765625"  # 2^-10 = 5^10 / 10^10
    assert decimal(Fraction(3, 40)) == "0.075"  # 40 = 2^3 x 5: three places
    assert decimal(Fraction(-3, 8)) == "-0.375"
    assert decimal(Fraction(80)) == "80"
    with pytest.raises(ValueError, match="no finite decimal"):
        decimal(Fraction(1, 3))


def test_a_ratio_for_csv_and_json_is_a_plain_number_or_none():
    """Six decimals, half up, exactly; no separator, no unit; None without a denominator."""
    assert ratio_number(68_783_104, 67_993_600) == 1.011611  # 1.0116113...
    assert ratio_number(1, 16) == 0.0625 and ratio_number(3, 3) == 1.0
    assert ratio_number(1, 2_000_000) == 0.000001  # 0.0000005, half up
    assert ratio_number(2_000_000_000, 3) == 666_666_666.666667  # no "666,666,666.67"
    assert ratio_number(5, 0) is None
