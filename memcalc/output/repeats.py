"""Rows that repeat: the tensors a loop makes once per iteration, shown as one row a kind.

A chunked implementation keeps tensors per chunk that differ only by the chunk's number in
their name (``S0``, ``S1``, ...): at a million rows, 15,625 of each. The tables of what is
alive at a peak show each such kind as one row, ``S0..S15624 (15,625)``, with the sum of
their bytes; CSV and JSON keep one row per tensor. Rendering only: no figure changes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

_NUMBER = re.compile(r"\d+")
FEW = 3  # a kind with fewer members stays one row per tensor


@dataclass(frozen=True)
class Repeated:
    """Tensors of one kind: the same op, role, dtype, shape and block, names that differ
    only in their numbers. Reads like a component (the table's columns apply) whose bytes
    are the members' sum."""

    members: tuple  # the components, in the order they were allocated

    @property
    def name(self) -> str:
        """``S0..S127 (128)``; ``layers.{0..31}.mlp.weight (32)`` when the one number that
        varies is inside the name (a model's layers: the first and last names in full
        would say the rest twice); ``4 x mul (user.py:7)`` when the names are all the same
        (a traced loop's tensors are named by their op and source line)."""
        first, last, n = self.members[0].name, self.members[-1].name, len(self.members)
        if first == last:
            return f"{n:,} x {first}"
        inside = _one_number_inside(first, last)
        return f"{inside} ({n:,})" if inside else f"{first}..{last} ({n:,})"

    @cached_property  # a table reads it per column: summed once
    def bytes(self) -> int:
        return sum(c.bytes for c in self.members)

    @cached_property
    def allocated(self) -> int:
        return sum(c.allocated for c in self.members)

    @property
    def formula(self) -> str:
        return f"{len(self.members):,} x ({self.members[0].formula})"

    # what the members share
    op = property(lambda self: self.members[0].op)
    role = property(lambda self: self.members[0].role)
    dtype = property(lambda self: self.members[0].dtype)
    shape = property(lambda self: self.members[0].shape)
    source = property(lambda self: self.members[0].source)


def _one_number_inside(first: str, last: str) -> str | None:
    """``layers.{0..31}.mlp`` for ``layers.0.mlp`` and ``layers.31.mlp``: where the names
    share their text and all their numbers but one, which text follows; else None."""
    texts, numbers = _NUMBER.split(first), _NUMBER.findall(first)
    if texts != _NUMBER.split(last):
        return None
    varying = [i for i, (a, b) in enumerate(zip(numbers, _NUMBER.findall(last))) if a != b]
    if len(varying) != 1 or not texts[varying[0] + 1]:
        return None
    i = varying[0]
    numbers[i] = f"{{{numbers[i]}..{_NUMBER.findall(last)[i]}}}"
    return "".join(t + n for t, n in zip(texts, numbers + [""]))


def _kind(component) -> tuple:
    """What a tensor shares with the others of its kind: its name with the numbers
    blanked, its op, role, dtype, shape, bytes, block and source."""
    c = component
    return _NUMBER.sub("#", c.name), c.op, c.role, c.dtype, c.shape, c.bytes, c.allocated, \
        c.source


def collapse(components) -> list:
    """The rows of a table of ``components``: each kind of at least ``FEW`` tensors whose
    names differ in their numbers, or of two or more of one name (a traced backward's two
    ``mul (MulBackward0)``, which no row could tell apart), as one ``Repeated`` row where its
    first member was; the rest as they are."""
    kinds = [_kind(c) for c in components]
    members: dict[tuple, list] = {}
    for kind, c in zip(kinds, components):
        members.setdefault(kind, []).append(c)
    rows = []
    for kind, c in zip(kinds, components):
        group = members[kind]
        same = all(m.name == group[0].name for m in group)
        if len(group) < (2 if same else FEW):
            rows.append(c)
        elif group[0] is c:
            rows.append(Repeated(tuple(group)))
    return rows
