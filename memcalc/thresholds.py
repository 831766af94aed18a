"""Out-of-memory thresholds: the largest ``seq_len`` (or batch, or head_dim) whose step fits.

"Fits" is ``memcalc.budget.fits``: replaying the step with ``capacity = budget`` raises no
``OutOfMemory`` (reserved memory, with PyTorch's release-cached-segments-and-retry). For
each implementation ``max_fitting`` returns ``N`` with ``fits(N)`` and not ``fits(N + 1)``,
both replayed in full, with the figures at both.

Fitting is *not* monotone near a threshold, because reserved memory is not: between
neighbouring lengths it moves by a few 2 MiB segments (which tensors end up sharing a
cached block, whether a remainder is split), and release-and-retry rescues some lengths.
So several thresholds can lie within a fraction of a percent. For the seeds' naive step
at 80 GiB, 19,509 fits, 19,510 does not, 19,511 fits and nothing from 19,512 on does (all
checked); for linear-causal 1,916,928 fails inside a fitting range that goes on to
1,936,384. A bisection from 1 (``bisect_max``) stops at the first threshold it meets;
``max_fitting`` starts from the closed-form estimate of the top of the fitting range and
returns the threshold nearest to it, in practice the largest, without proving that no
larger value fits.

How it gets there in about ten replays rather than a scan: the tensors alive at the peak
have sizes that are polynomials in the solved field, so their raw bytes are ``Q(x) = a x^2
+ b x + c`` (interpolated through three programs, checked at a fourth point); the reserved
memory is ``Q`` times the allocator's overhead ``rho``, which hardly moves near the
threshold. A few Newton-like steps on ``rho Q(x) = budget`` (``rho`` re-measured at each
point) give an estimate; a bracket ``fits(lo)``, not ``fits(hi)`` grows around it by
doubling steps (from the size of the last correction) and is bisected down to adjacent
values. ``Q`` is also what the report shows, "so the user sees why".
"""

from __future__ import annotations

import math
import time
from fractions import Fraction
from typing import Callable, Iterable, Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field

from memcalc.budget import Budget, Fit, fit, replay_within
from memcalc.breakdown import Result
from memcalc.config import Config
from memcalc.render import Column, csv_table, markdown_table
from memcalc.scaling import _bold_title, compact_table
from memcalc.units import GiB, _fixed, mib


def gib(nbytes: int) -> str:
    """``nbytes`` in GiB with two decimals."""
    return _fixed(nbytes, GiB, 2)

_FROZEN = ConfigDict(frozen=True, extra="forbid")
SolveField = Literal["seq_len", "batch", "head_dim"]
SYMBOL = {"seq_len": "N", "batch": "B", "head_dim": "d"}
LIMIT = 1 << 62  # no answer above this: the sizes would not be addressable anyway


def at(config: Config, field: str, value: int) -> Config:
    """``config`` with the shape field ``field`` set to ``value`` (``kv_len`` follows
    ``seq_len`` unless it was given)."""
    return config.model_copy(update={"shape": config.shape.model_copy(update={field: value})})


# --- the closed form ---------------------------------------------------------------------

def _fraction_text(q: Fraction) -> str:
    return f"{q.numerator:,}" if q.denominator == 1 else f"{q.numerator:,}/{q.denominator:,}"


class Quadratic(BaseModel):
    """``a x^2 + b x + c``: the raw bytes of the tensors alive at the peak (requested sizes,
    before the allocator rounds them to blocks), as a function of the solved field. Exact
    (``exact``) when the quadratic through ``x``, ``2x`` and ``4x`` also holds at ``3x``; else
    that quadratic is a fit (sizes with ``ceil`` in them, such as rows padded to 32)."""

    model_config = _FROZEN
    symbol: str
    a: Fraction
    b: Fraction
    c: Fraction
    exact: bool
    at: int = Field(description="where the live set was taken (x; fitted at x, 2x, 4x)")
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

    def text(self) -> str:
        x = self.symbol
        terms = [(self.a, f"*{x}^2"), (self.b, f"*{x}"), (self.c, "")]
        parts = [f"{_fraction_text(abs(q))}{s}" for q, s in terms if q]
        signs = ["-" if q < 0 else "+" for q, _ in terms if q]
        if not parts:
            return "0"
        out = ("-" if signs[0] == "-" else "") + parts[0]
        for sign, part in zip(signs[1:], parts[1:]):
            out += f" {sign} {part}"
        return out + ("" if self.exact else " (fit)")

    def to_dict(self) -> dict:
        return {"a": str(self.a), "b": str(self.b), "c": str(self.c), "exact": self.exact,
                "at": self.at, "text": self.text(), "components": list(self.components)}


def live_polynomial(config: Config, field: str, breakdown=None) -> Quadratic | None:
    """The raw bytes of what is alive at ``config``'s peak, as a quadratic in ``field``
    (None when the program's tensors change names with the field)."""
    from memcalc.impls import get_impl
    from memcalc.tensors import Dims, Role, Tensor
    from memcalc.timeline import predict
    from memcalc.vectorized import _input_events, _tensor_nbytes

    b = breakdown if breakdown is not None else predict(config)
    x0 = getattr(config.shape, field)
    impl = get_impl(config.impl)
    live = b.components

    def raw(x: int) -> int | None:
        c = at(config, field, x)
        d = Dims.of(c)
        program = impl.build(d)
        sizes: dict[str, int] = {}
        for t in (*_input_events(d, c.protocol.loss, c.protocol.forward_only),
                  *program.forward, *program.backward):
            if isinstance(t, Tensor):
                sizes.setdefault(t.name, _tensor_nbytes(t))
        total = 0
        for comp in live:
            if comp.role is Role.workspace:
                total += comp.nbytes
            elif comp.name in sizes:
                total += sizes[comp.name]
            else:
                return None
        return total

    try:
        points = [(x, raw(x)) for x in (x0, 2 * x0, 4 * x0)]
        check_x = 3 * x0
        check = raw(check_x)
    except Exception:  # noqa: BLE001 - a size the builder rejects: no closed form
        return None
    if any(v is None for _, v in points):
        return None
    (x1, y1), (x2, y2), (x3, y3) = points
    # Newton's divided differences, exact
    d1, d2 = Fraction(y2 - y1, x2 - x1), Fraction(y3 - y2, x3 - x2)
    a = (d2 - d1) / (x3 - x1)
    bb = d1 - a * (x1 + x2)
    c = y1 - a * x1 * x1 - bb * x1
    q = Quadratic(symbol=SYMBOL.get(field, field), a=a, b=bb, c=c, exact=False, at=x0,
                  components=tuple(comp.name for comp in live))
    return q.model_copy(update={"exact": check is not None and q(check_x) == check})


# --- solving -----------------------------------------------------------------------------

class Solved(BaseModel):
    """One implementation's threshold: ``max_value`` fits, ``max_value + 1`` does not."""

    model_config = _FROZEN
    impl: str
    field: SolveField
    max_value: int = Field(description="largest value that fits (0: not even 1)")
    first_failing_power_of_two: int
    at_max: Fit | None = Field(description="the step at max_value (None when 0)")
    at_next: Fit
    approximation: Quadratic | None
    evaluations: int = Field(description="full predictions the solver made")

    @computed_field
    @property
    def peak_bytes_at_max(self) -> int | None:
        return self.at_max.peak_bytes if self.at_max else None

    @computed_field
    @property
    def peak_bytes_at_next(self) -> int:
        return self.at_next.peak_bytes

    def to_dict(self) -> dict:
        key = f"max_{self.field}"
        return {
            "impl": self.impl, key: self.max_value,
            "first_failing_power_of_two": self.first_failing_power_of_two,
            "peak_bytes_at_max": self.peak_bytes_at_max,
            "peak_bytes_at_next": self.peak_bytes_at_next,
            "reserved_peak_bytes_at_max": self.at_max.reserved_peak_bytes if self.at_max else None,
            "reserved_peak_bytes_at_next": self.at_next.reserved_peak_bytes,
            "fit_at_max": self.at_max.describe() if self.at_max else None,
            "fit_at_next": self.at_next.describe(),
            "approximation": self.approximation.to_dict() if self.approximation else None,
            "evaluations": self.evaluations,
        }


class Unsolved(Exception):
    """The solver ran out of time; what it knows so far."""

    def __init__(self, lo: int, hi: int | None, seconds: float):
        self.lo, self.hi = lo, hi
        bound = f"fits at {lo}" + (f", not at {hi}" if hi else "")
        super().__init__(f"no exact answer within {seconds:g} s ({bound})")


class _Probe:
    """``fits`` at values of one field, cached, counting full predictions (replays)."""

    def __init__(self, config: Config, field: str, budget_bytes: int,
                 time_limit: float | None = None):
        self.config, self.field, self.budget = config, field, budget_bytes
        self.known: dict[int, tuple[bool, int]] = {}
        self.full: dict[int, Fit] = {}
        self.breakdowns: dict = {}
        self.evaluations = 0
        self.deadline = None if time_limit is None else time.perf_counter() + time_limit
        self.time_limit = time_limit

    def __call__(self, x: int) -> bool:
        """``fits`` at ``x``: one replay under the capacity."""
        if x not in self.known:
            if self.deadline is not None and time.perf_counter() > self.deadline:
                lo = max((k for k, (f, _) in self.known.items() if f), default=0)
                hi = min((k for k, (f, _) in self.known.items() if not f), default=None)
                raise Unsolved(lo, hi, self.time_limit)
            self.known[x] = replay_within(at(self.config, self.field, x), self.budget)
            self.evaluations += 1
        return self.known[x][0]

    def size(self, x: int) -> int:
        """What steers the search: the reserved peak (fits) or reserved + the failed
        segment (does not)."""
        self(x)
        return self.known[x][1]

    def fit(self, x: int) -> Fit:
        """``fit`` with its figures (an unbounded prediction, plus the capped one if needed)."""
        if x not in self.full:
            from memcalc.timeline import predict

            c = at(self.config, self.field, x)
            b = predict(c)
            self.evaluations += 1
            self.full[x] = fit(c, self.budget, b)
            self.breakdowns[x] = b
        return self.full[x]


def _guess(probe: _Probe, x: int, q: Quadratic | None) -> int | None:
    """The root of ``rho Q(x) = budget``, ``rho`` = measured size / raw bytes at ``x``."""
    if q is None:
        return None
    raw = q(x)
    if raw <= 0:
        return None
    rho = Fraction(probe.size(x)) / raw
    root = q.root(Fraction(probe.budget) / rho)
    return None if root is None or root < 1 else min(int(root), LIMIT)


def _gallop(probe: _Probe, x: int, step: int) -> tuple[int, int]:
    """A bracket ``(lo, hi)`` around ``x``: ``fits(lo)`` (or ``lo == 0``), not ``fits(hi)``,
    with steps doubling away from ``x``."""
    if probe(x):
        lo = x
        while True:
            hi = lo + step
            if hi >= LIMIT:
                raise ValueError(f"{probe.config.impl}: still fits at {probe.field} = {lo}")
            if not probe(hi):
                return lo, hi
            lo, step = hi, step * 2
    hi = x
    while True:
        lo = max(0, hi - step)
        if lo == 0 or probe(lo):
            return lo, hi
        hi, step = lo, step * 2


def _narrow(probe: _Probe, lo: int, hi: int) -> int:
    """Bisect ``(lo, hi)`` down to adjacent values (the steering sizes are step functions
    of the field near a threshold: interpolating on them does not beat halving)."""
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return lo


def max_fitting(config: Config, budget_bytes: int, field: SolveField = "seq_len",
                start: int | None = None, time_limit: float | None = None) -> Solved:
    """A value ``N`` of ``field`` with ``fits(N)`` and not ``fits(N + 1)`` for
    ``budget_bytes``, searched from the closed-form estimate of the top of the fitting range
    (so in practice the largest: see the module docstring), with the figures at ``N`` and
    ``N + 1``. ``Unsolved`` after ``time_limit`` seconds."""
    probe = _Probe(config, field, budget_bytes, time_limit)
    x = start or getattr(config.shape, field)
    probe.fit(x)
    q = live_polynomial(at(config, field, x), field, probe.breakdowns[x])
    previous, step = x, max(1, x // 64)  # no model: 1/64 of the start
    for _ in range(3):  # Newton-like steps on rho Q(x) = budget
        guess = _guess(probe, x, q)
        if guess is None:
            break
        if guess == x:  # converged: the model is good to a few segments of rounding
            step = max(1, x >> 14)
            break
        previous, x = x, guess
        step = max(1, abs(x - previous) // 8)
    lo, hi = _gallop(probe, x, step)
    return _solved(probe, _narrow(probe, lo, hi), field)


def bisect_max(config: Config, budget_bytes: int, field: SolveField = "seq_len",
               time_limit: float | None = None) -> Solved:
    """The reference solver: double from 1 until a step does not fit, then bisect, every
    step a full prediction (what ``benchmarks/`` compares ``max_fitting`` with)."""
    probe = _Probe(config, field, budget_bytes, time_limit)
    lo, hi = 0, 1
    while probe.fit(hi).fits:
        lo, hi = hi, hi * 2
        if hi >= LIMIT:
            raise ValueError(f"{config.impl}: still fits at {field} = {lo}")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if probe.fit(mid).fits:
            lo = mid
        else:
            hi = mid
    return _solved(probe, lo, field, approximate=False)


def _solved(probe: _Probe, n: int, field: str, approximate: bool = True) -> Solved:
    config = probe.config
    at_next = probe.fit(n + 1)
    at_max = probe.fit(n) if n >= 1 else None
    if at_next.fits or (at_max is not None and not at_max.fits):
        raise AssertionError(f"{config.impl}: the bracket at {n} is not a threshold")
    power = 1 << max(0, n).bit_length()  # the smallest power of two above n
    while probe(power):  # only if fitting is not monotone
        power *= 2
    q = None
    if approximate and n >= 1:
        q = live_polynomial(at(config, field, n), field, probe.breakdowns.get(n))
    return Solved(impl=config.impl, field=field, max_value=n,
                  first_failing_power_of_two=power, at_max=at_max, at_next=at_next,
                  approximation=q, evaluations=probe.evaluations)


# --- all implementations -----------------------------------------------------------------

class Skipped(BaseModel):
    model_config = _FROZEN
    impl: str
    reason: str


def _cell_fit(f: Fit | None, key: str) -> str:
    return "-" if f is None else mib(getattr(f, key))


def _cell_gib(f: Fit | None, key: str) -> str:
    return "-" if f is None else gib(getattr(f, key))


def _columns(field: str, wide: bool = False) -> list[Column]:
    """The table's columns; ``wide`` (Markdown) adds the peak at N+1 and the polynomial."""
    s = SYMBOL[field]
    cols = [
        Column("implementation", lambda r: r.impl),
        Column(f"max {s}", lambda r: r.max_value, "right"),
        Column("first 2^k OOM", lambda r: r.first_failing_power_of_two, "right"),
        Column(f"peak at {s}, GiB", lambda r: _cell_gib(r.at_max, "peak_bytes"), "right"),
        Column(f"reserved at {s}, GiB", lambda r: _cell_gib(r.at_max, "reserved_peak_bytes"), "right"),
        Column(f"reserved at {s}+1, GiB", lambda r: _cell_gib(r.at_next, "reserved_peak_bytes"), "right"),
    ]
    if wide:  # Markdown: MiB as the seeds wrote them, and the polynomial
        cols[3:] = [
            Column(f"peak at {s}, MiB", lambda r: _cell_fit(r.at_max, "peak_bytes"), "right"),
            Column(f"reserved at {s}, MiB", lambda r: _cell_fit(r.at_max, "reserved_peak_bytes"), "right"),
            Column(f"peak at {s}+1, MiB", lambda r: _cell_fit(r.at_next, "peak_bytes"), "right"),
            Column(f"reserved at {s}+1, MiB", lambda r: _cell_fit(r.at_next, "reserved_peak_bytes"), "right"),
            Column(f"raw bytes alive at the peak at {s}", _formula),
        ]
    return cols


def _formula(r) -> str:
    return r.approximation.text() if r.approximation else "-"


def _byte_columns(field: str) -> list[Column]:
    return [
        Column("impl", lambda r: r.impl),
        Column(f"max_{field}", lambda r: r.max_value),
        Column("first_failing_power_of_two", lambda r: r.first_failing_power_of_two),
        Column("peak_bytes_at_max", lambda r: r.peak_bytes_at_max if r.at_max else ""),
        Column("reserved_peak_bytes_at_max", lambda r: r.at_max.reserved_peak_bytes if r.at_max else ""),
        Column("peak_bytes_at_next", lambda r: r.peak_bytes_at_next),
        Column("reserved_peak_bytes_at_next", lambda r: r.at_next.reserved_peak_bytes),
        Column("a", lambda r: str(r.approximation.a) if r.approximation else ""),
        Column("b", lambda r: str(r.approximation.b) if r.approximation else ""),
        Column("c", lambda r: str(r.approximation.c) if r.approximation else ""),
    ]


def _fixed_options(config: Config, field: str) -> str:
    s = config.shape
    parts = {"seq_len": f"N={s.seq_len}", "batch": f"B={s.batch}", "heads": f"H={s.heads}",
             "head_dim": f"d={s.head_dim}"}
    parts.pop(field)
    flags = (" causal" if config.causal else "") + (" forward-only" if config.protocol.forward_only else "")
    return " ".join(parts.values()) + f" {config.dtype.value}{flags}"


class OomReport(Result):
    """The threshold of every implementation asked for, in one budget."""

    model_config = _FROZEN
    budget: Budget
    field: SolveField
    base: Config
    results: tuple[Solved, ...]
    skipped: tuple[Skipped, ...] = ()

    def title(self) -> str:
        return (f"largest {self.field} that fits, {_fixed_options(self.base, self.field)}\n"
                f"{self.budget.describe()}")

    def notes(self, formulas: bool = True) -> str:
        s = SYMBOL[self.field]
        lines = [f"fits: replaying the step with capacity = budget raises no OOM (reserved "
                 f"memory, after releasing cached segments); each row fits at {s}, not at {s}+1. "
                 f"Near a threshold fitting is not monotone (reserved memory moves by 2 MiB "
                 f"segments between neighbours): the search starts from the closed-form estimate "
                 f"of the top of the fitting range."]
        if formulas:
            lines += ["why, the raw bytes of the tensors alive at the peak (before rounding to "
                      "blocks; exact unless marked fit):"]
            lines += [f"  {r.impl}: {_formula(r)}" for r in self.results]
        lines += [f"{k.impl}: skipped, {k.reason}" for k in self.skipped]
        return "\n".join(lines)

    def __rich__(self):
        from rich.console import Group

        return Group(compact_table(self.title(), _columns(self.field), self.results), self.notes())

    def _repr_html_(self) -> str:
        from memcalc.render import html

        return html(self)

    def to_markdown(self) -> str:
        return (_bold_title(self.title()) + markdown_table(_columns(self.field, True), self.results)
                + "\n" + self.notes(formulas=False) + "\n")

    def to_csv(self) -> str:
        return csv_table(_byte_columns(self.field), self.results)

    def records(self) -> list[dict]:
        """One dict per solved implementation."""
        return self.to_dict()["results"]

    def to_dict(self) -> dict:
        return {"budget_bytes": self.budget.budget_bytes, "solve": self.field,
                "budget": self.budget.model_dump(mode="json"),
                "results": [r.to_dict() for r in self.results],
                "skipped": [k.model_dump() for k in self.skipped],
                "config": self.base.model_dump(mode="json")}


MAX_EVENTS = 4000
"""Without ``impls``, ``solve`` skips implementations whose program has more events than
this at the starting point, or more events as the solved field grows (chunked loops):
their exact replays near a threshold take seconds to hours. Name them to solve them."""


def _events(config: Config) -> int:
    from memcalc.impls import get_impl
    from memcalc.tensors import Dims

    p = get_impl(config.impl).build(Dims.of(config))
    return len(p.forward) + len(p.backward)


def _too_big(config: Config, field: str) -> str | None:
    """Why solving ``config``'s implementation would be slow, or None."""
    small, large = _events(at(config, field, 256)), _events(at(config, field, 512))
    if large > small:
        return (f"its program's events grow with {field} ({small:,} at 256, {large:,} at 512), "
                f"so exact replays near the threshold take too long; name it with --impl "
                f"(and --time-limit) to try")
    x = getattr(config.shape, field)
    events = _events(config)
    if events > MAX_EVENTS:
        return (f"its program has {events:,} events at {field} = {x} (replays are slow); "
                f"name it with --impl (and --time-limit) to solve it")
    return None


def solve(base: Config, budget: Budget, field: SolveField = "seq_len",
          impls: Iterable[str] | None = None, time_limit: float | None = None,
          solver: Callable[..., Solved] = max_fitting) -> OomReport:
    """The threshold of each implementation (every registered one by default) for
    ``base``'s other options. Without ``impls``, implementations that reject the options
    (fp32 for a kernel that has none, say) or whose replays are too slow (``MAX_EVENTS``)
    are listed as skipped with the reason; named ones are solved or raise. ``time_limit``:
    seconds per implementation."""
    from memcalc.impls import impl_names

    named = list(impls) if impls else None
    results, skipped = [], []
    for name in named or impl_names():
        try:
            config = Config(**{**base.model_dump(), "impl": name})
            reason = None if named else _too_big(config, field)
            if reason is None:
                results.append(solver(config, budget.budget_bytes, field, time_limit=time_limit))
                continue
        except Unsolved as error:
            reason = f"{error}; raise --time-limit"
        except ValueError as error:  # pydantic's ValidationError is one
            if named:
                raise
            reason = _first_line(error)
        except Exception as error:  # noqa: BLE001 - one broken model must not hide the others
            if named:
                raise
            reason = f"the model raised {type(error).__name__}: {_first_line(error)}"
        skipped.append(Skipped(impl=name, reason=reason))
    return OomReport(budget=budget, field=field, base=base, results=tuple(results),
                     skipped=tuple(skipped))


def _first_line(error: Exception) -> str:
    from memcalc.errors import one_line

    return one_line(error)
