"""Byte formatting with integer arithmetic only: binary units, named as such."""

from __future__ import annotations

from memcalc.allocator import KiB, MiB

GiB = 1024 * MiB


def _fixed(numerator: int, denominator: int, places: int) -> str:
    """``numerator / denominator`` rounded half up to ``places`` decimals, exactly."""
    scale = 10**places
    q = (numerator * scale * 2 + denominator) // (denominator * 2)
    whole, frac = divmod(q, scale)
    return f"{whole:,}.{frac:0{places}d}" if places else f"{whole:,}"


def mib(nbytes: int) -> str:
    """``nbytes`` in MiB with two decimals: ``8,192.00``."""
    return _fixed(nbytes, MiB, 2)


def human(nbytes: int) -> str:
    """The largest binary unit that keeps the figure >= 1: ``7.50 GiB``, ``512 B``."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= size:
            return f"{_fixed(nbytes, size, 2)} {unit}"
    return f"{nbytes} B"


def share(part: int, whole: int) -> str:
    """``part / whole`` as a percentage with one decimal."""
    return f"{_fixed(part * 100, whole, 1)}%" if whole else "-"
