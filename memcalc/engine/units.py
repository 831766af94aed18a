"""Byte formatting with integer arithmetic only: binary units, named as such."""

from __future__ import annotations

from fractions import Fraction

from memcalc.engine.allocator import KiB, MiB

GiB = 1024 * MiB


def fixed(numerator: int, denominator: int, places: int) -> str:
    """``numerator / denominator`` (``denominator > 0``) to ``places`` decimals, exactly:
    its magnitude rounded half up, then its sign (``-0.50``, not ``-1.50``: a floor
    division would round a negative value away from zero)."""
    sign = "-" if numerator < 0 else ""
    scale = 10**places
    q = (abs(numerator) * scale * 2 + denominator) // (denominator * 2)
    whole, frac = divmod(q, scale)
    return sign + (f"{whole:,}.{frac:0{places}d}" if places else f"{whole:,}")


def finite_decimal(q: Fraction) -> bool:
    """Whether ``q`` has a finite decimal: its denominator has no prime factor but 2 and 5."""
    d = q.denominator
    return d == 2 ** _multiplicity(d, 2) * 5 ** _multiplicity(d, 5)


def decimal(q: Fraction) -> str:
    """A fraction with a finite decimal (a byte count over 2^30, say) as that decimal:
    ``79.5``, ``0.0009765625``, ``80``."""
    if not finite_decimal(q):
        raise ValueError(f"{q} has no finite decimal")
    places = max(_multiplicity(q.denominator, 2), _multiplicity(q.denominator, 5))
    whole, frac = divmod(abs(q.numerator) * 10**places // q.denominator, 10**places)
    digits = f"{whole}.{frac:0{places}d}".rstrip("0").rstrip(".") if places else f"{whole}"
    return ("-" if q < 0 else "") + digits


def _multiplicity(n: int, p: int) -> int:
    """How many times the prime ``p`` divides ``n``."""
    count = 0
    while n % p == 0:
        n, count = n // p, count + 1
    return count


def mib(nbytes: int) -> str:
    """``nbytes`` in MiB with two decimals: ``8,192.00``."""
    return fixed(nbytes, MiB, 2)


_UNITS = tuple((unit, 1024 ** power) for power, unit in reversed(list(enumerate(
    ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB"), start=1))))
"""The binary units, largest first: a step no GPU can hold (seq_len 10^12) reads in YiB."""


def human(nbytes: int) -> str:
    """The largest binary unit that keeps the figure, as shown, at least 1: ``7.50 GiB``,
    ``3.00 TiB``, ``512 B``. A figure that rounds up to the next unit is shown in it (1,048,575 B is
    ``1.00 MiB``, not ``1,024.00 KiB``); bytes below 1 KiB stay exact. A negative figure
    (a difference) is shown as its magnitude, signed."""
    magnitude = abs(nbytes)
    for unit, size in _UNITS:
        # ``fixed(magnitude, size, 2)`` is at least 1.00 from 199/200 of the unit on
        if 200 * magnitude >= 199 * size and (size > KiB or magnitude >= KiB):
            return f"{fixed(nbytes, size, 2)} {unit}"
    return f"{nbytes} B"


RATIO_PLACES = 6
"""Decimals of a ratio in the machine formats (CSV, JSON): more than any table shows."""


def ratio_number(numerator: int, denominator: int, places: int = RATIO_PLACES) -> float | None:
    """``numerator / denominator`` for CSV and JSON: a plain number, rounded half up to
    ``places`` decimals exactly (as ``fixed``), with no separator or unit; None (empty,
    null) where the denominator is 0 and the ratio means nothing."""
    if denominator == 0:
        return None
    return float(fixed(numerator, denominator, places).replace(",", ""))


def share(part: int, whole: int) -> str:
    """``part / whole`` as a percentage with one decimal."""
    return f"{fixed(part * 100, whole, 1)}%" if whole else "-"
