"""The closed form of a step's memory: the raw bytes alive at the peak as ``a x^2 + b x + c``.

The tensors alive at the peak have sizes that are polynomials in one shape field; the
quadratic through three programs (checked at a fourth) is what the OOM report shows the
user ("so the user sees why"), and what the solver's first guesses come from.
"""

from __future__ import annotations

import math
from fractions import Fraction

from pydantic import BaseModel, ConfigDict, Field

from memcalc.config import Config
from memcalc.engine.deadline import TimeUp
from memcalc.engine.program import Role
from memcalc.analysis.predict import predict, tensor_sizes
from memcalc.engine.units import fixed

_FROZEN = ConfigDict(frozen=True, extra="forbid")
SYMBOL = {"seq_len": "N", "batch": "B", "head_dim": "d"}


def _coefficient(q: Fraction, places: int | None) -> str:
    """A coefficient's magnitude: the integer; else its fraction, or with ``places``, its
    decimal rounded to that many places (exactly, half up), kept a fraction where that
    rounding would lose it (a BlockMask's 1/1,024 N^2 is gigabytes at a million rows)."""
    if q.denominator == 1:
        return f"{q.numerator:,}"
    rounded = fixed(q.numerator, q.denominator, places) if places is not None else ""
    if places is None or not rounded.strip("0.,"):
        return f"{q.numerator:,}/{q.denominator:,}"
    return rounded


class Quadratic(BaseModel):
    """``a x^2 + b x + c``: the raw bytes of the tensors alive at the peak (requested sizes,
    before the allocator rounds them to blocks), as a function of the solved field. Exact
    (``exact``) when the quadratic through ``x``, ``2x`` and ``4x`` (``x/4``, ``x/2`` and
    ``x``: ``below``) also holds at ``3x`` (``3x/4``); else that quadratic is a fit (sizes
    with ``ceil`` in them, such as rows padded to 32)."""

    model_config = _FROZEN
    symbol: str
    a: Fraction
    b: Fraction
    c: Fraction
    exact: bool
    at: int = Field(description="where the live set was taken (x; fitted at x, 2x, 4x, or "
                                "at x/4, x/2, x)")
    points: tuple[int, int, int] = Field(description="the values it was fitted through")
    components: tuple[str, ...]

    def __call__(self, x: int) -> Fraction:
        return self.a * x * x + self.b * x + self.c

    def root(self, target: Fraction) -> Fraction | None:
        """The positive ``x`` where the quadratic reaches ``target`` (None if it never does)."""
        a, b, c = self.a, self.b, self.c - target
        if a == 0:
            return -c / b if b > 0 else None
        disc = b * b - 4 * a * c
        if disc < 0:
            return None
        return (-b + Fraction(math.isqrt(int(disc)))) / (2 * a) if a > 0 else None

    def text(self, places: int | None = None) -> str:
        """``a*x^2 + b*x + c`` without its zero terms: exact coefficients (integers or
        fractions, `` (fit)`` after an inexact form), or each rounded to ``places`` decimals
        (a fraction where rounding would make it zero)."""
        x = self.symbol
        terms = [(q, _coefficient(abs(q), places), s)
                 for q, s in ((self.a, f"*{x}^2"), (self.b, f"*{x}"), (self.c, "")) if q]
        terms = [(q, text, s) for q, text, s in terms if text.strip("0.,")]
        if not terms:
            return "0"
        out = ""
        for i, (q, text, s) in enumerate(terms):
            sign = "-" if q < 0 else "+"
            out += (("-" if sign == "-" else "") if i == 0 else f" {sign} ") + text + s
        return out + ("" if self.exact or places is not None else " (fit)")

    def coefficients(self) -> dict[str, int]:
        """``a``, ``b``, ``c`` as integers over one ``denominator``, exactly: the bytes are
        ``(a x^2 + b x + c) / denominator``. An exact closed form sums sizes that are
        products of the dimensions, so its coefficients are integers (denominator 1); a
        fit's (sizes with ``ceil`` in them) are fractions (``-212/46,875*N^2 + ...``)."""
        d = math.lcm(*(q.denominator for q in (self.a, self.b, self.c)))
        return {"a": int(self.a * d), "b": int(self.b * d), "c": int(self.c * d),
                "denominator": d}

    def to_dict(self) -> dict:
        return {**self.coefficients(), "exact": self.exact, "at": self.at,
                "points": list(self.points), "text": self.text(),
                "components": list(self.components)}


def live_polynomial(config: Config, field: str, breakdown=None,
                    below: bool = False, snap=None, aligned: bool = True) -> Quadratic | None:
    """The raw bytes of what is alive at ``config``'s peak, as a quadratic in ``field``
    (None when the program's tensors change names with the field). A program whose number
    of tensors grows with the field (a loop over chunks) is replayed at each point: its
    live set at ``x`` does not tell which of them are alive at ``2x``. ``below``: fitted
    at ``x/4``, ``x/2`` and ``x`` (for a loop at a large ``x``: replays of 1.5x rows in
    all, instead of 9x at 2x, 3x and 4x, each larger than the one at ``x``). ``snap``: moves
    each point to a value the implementation accepts (the memory-efficient kernel's head
    dims are multiples of 4 or 8; ``memcalc.impls.accepted``). ``aligned``: a fit made
    again at multiples of ``ALIGN`` (``_aligned``) where the first is not exact, and shown
    if exact there (the search's first guesses skip it: four more lengths to build)."""
    b = breakdown if breakdown is not None else predict(config)
    x0 = getattr(config.shape, field)
    live = b.components
    at_x0 = tensor_sizes(config, b.rank)  # under --cp: the busiest rank's, shown
    declared = len(at_x0)

    # which declaration of its name each live tensor is: the one of its size at x0
    which = {id(c): at_x0[c.name].index(c.bytes) for c in live
             if c.name in at_x0 and c.bytes in at_x0[c.name]}

    def raw(x: int) -> int | None:
        sizes = at_x0 if x == x0 else tensor_sizes(config.replace(**{field: x}), b.rank)
        if len(sizes) != declared:  # a loop: more tensors at x, not larger ones; replay it
            return sum(comp.bytes for comp in predict(config.replace(**{field: x})).components)
        total = 0
        for comp in live:
            if comp.role is Role.workspace:
                total += comp.bytes
            elif id(comp) in which and len(sizes[comp.name]) > which[id(comp)]:
                total += sizes[comp.name][which[id(comp)]]
            else:
                return None
        return total

    xs, check_x = ((x0 // 4, x0 // 2, x0), 3 * x0 // 4) if below else ((x0, 2 * x0, 4 * x0), 3 * x0)
    q = _fitted(raw, xs, check_x, snap)
    if aligned and q is not None and not q[1]:  # a fit (a ceil): again where there is none
        again = _fitted_in_time(raw, _aligned(xs[0]), snap)
        if again is not None and again[1]:  # exact on multiples of ALIGN, a fit at x0
            q = (again[0], False, again[2])
    if q is None:
        return None
    (a, bb, c), exact, points = q
    return Quadratic(symbol=SYMBOL.get(field, field), a=a, b=bb, c=c, exact=exact, at=x0,
                     points=points, components=tuple(comp.name for comp in live))


ALIGN = 1024
"""The multiple of rows a fit is moved to: kernels pad rows to multiples of a power of two
no larger (flash's ``softmax_d`` and FlexAttention's blocks to 128, the memory-efficient
kernel's logsumexp to 32), so that on multiples of it their sizes have no ceil: a linear
kernel's fit is linear, not a quadratic through the padding's noise (``344/2,752,281*N^2``
for SDPA's flash kernel at 106,176 rows)."""


def _aligned(x: int) -> tuple[int, int, int]:
    """``x``, ``2x``, ``4x`` moved down to multiples of ``ALIGN`` (of the largest power of
    two up to ``x`` when it is smaller): every point still within 2x of the original."""
    step = min(ALIGN, 1 << (max(x, 1).bit_length() - 1))
    x = x // step * step
    return x, 2 * x, 4 * x


def _fitted_in_time(raw, xs: tuple[int, int, int], snap):
    """``_fitted`` at ``xs`` (checked at ``3 * xs[0]``), or None when the time left runs
    out first: the first fit stands."""
    try:
        return _fitted(raw, xs, 3 * xs[0], snap)
    except TimeUp:
        return None


def _fitted(raw, xs: tuple[int, int, int], check_x: int, snap):
    """The coefficients of the quadratic through ``raw`` at ``xs``, whether it holds at
    ``check_x`` as well (exact), and the points (moved by ``snap``); None without one (too
    few distinct points, a size the builder rejects, a tensor missing). Memory's N^2 term
    is a sum of sizes, none negative: a negative one is the noise of padded sizes, and the
    fit is the line through the outermost points instead (never ``-512/751,472,569*N^2``
    on a linear kernel)."""
    if snap is not None:
        xs, check_x = tuple(snap(x) for x in xs), snap(check_x)
    if len({*xs, check_x}) < 4 or xs[0] < 1:
        return None
    try:
        points = [(x, raw(x)) for x in xs]
        check = raw(check_x)
    except TimeUp:
        raise
    except Exception:  # noqa: BLE001 - a size the builder rejects: no closed form
        return None
    if any(v is None for _, v in points):
        return None
    (x1, y1), (x2, y2), (x3, y3) = points
    # Newton's divided differences, exact
    d1, d2 = Fraction(y2 - y1, x2 - x1), Fraction(y3 - y2, x3 - x2)
    a = (d2 - d1) / (x3 - x1)
    if a < 0:
        a, d1 = Fraction(0), Fraction(y3 - y1, x3 - x1)
    bb = d1 - a * (x1 + x2)
    c = y1 - a * x1 * x1 - bb * x1
    exact = check is not None and a * check_x ** 2 + bb * check_x + c == check \
        and all(a * x * x + bb * x + c == y for x, y in points)
    return (a, bb, c), exact, xs
