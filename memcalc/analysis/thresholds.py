"""Out-of-memory thresholds of every implementation asked for, in one budget: the report.

``memcalc.analysis.solver`` finds each threshold, ``memcalc.analysis.closed_form`` says why; this module
runs them over the implementations and renders the table.
"""

from __future__ import annotations

from typing import Callable, Iterable

from pydantic import BaseModel, ConfigDict, Field

from memcalc.output.result import Result
from memcalc.analysis.budget import Budget, Fit
from memcalc.analysis.closed_form import SYMBOL
from memcalc.analysis.confirm import confirmed, with_holes
from memcalc.config import Config
from memcalc.errors import refusal
from memcalc.impls import impl_names
from memcalc.output.render import Column, Table, record_table
from memcalc.analysis.probe import PROBED, accepted_start, events_growth, program_events
from memcalc.analysis.solved import Interrupted, SolveField, Solved, Unsolved
from memcalc.analysis.solver import max_fitting
from memcalc.engine.units import GiB, fixed, human

_FROZEN = ConfigDict(frozen=True, extra="forbid")


def gib(nbytes: int) -> str:
    """``nbytes`` in GiB with two decimals."""
    return fixed(nbytes, GiB, 2)


def gib_up(nbytes: int) -> str:
    """``nbytes`` in GiB with two decimals, rounded up: what a step needs over the budget
    never reads as the budget (85,364,572,160 B, 2 MiB over 79.50 GiB, is 79.51)."""
    return fixed(-(-nbytes * 100 // GiB), 100, 2)


class Skipped(BaseModel):
    """An implementation not searched: it rejects the options, or its replays are slow."""

    model_config = _FROZEN
    impl: str
    reason: str


class Bounds(BaseModel):
    """A search stopped (time limit, Ctrl-C) before an exact answer: what it proved. None
    where it knows nothing of that kind."""

    model_config = _FROZEN
    impl: str
    fits_at: int | None = Field(description="the largest value replayed that fits")
    fails_at: int | None = Field(description="the smallest value replayed that does not")
    estimate: int | None = Field(description="the closed-form estimate, not replayed")
    ceiling: int | None = Field(description="past it, the tensors alive at the peak alone "
                                            "exceed the budget")
    reason: str

    @classmethod
    def of(cls, impl: str, known: Unsolved, reason: str) -> "Bounds":
        return cls(impl=impl, fits_at=known.lo or None, fails_at=known.hi,
                   estimate=known.estimate, ceiling=known.ceiling, reason=reason)


def _cell_gib(f: Fit | None, key: str, shown=gib) -> str:
    return "-" if f is None else shown(getattr(f, key))


def _dash(value):
    """A cell that may have no value: ``-``."""
    return "-" if value is None else value


def _missing_figures(r: Solved) -> bool:
    """Whether a time limit left ``r`` (solved) without some of its figures."""
    return ((r.at_next is None and r.next_value is not None)
            or (r.at_max is None and r.max_value > 0))


def _next_label(field: str, results) -> str:
    """What the last column is at: ``N+1``, or ``next d`` when an implementation accepts
    only some values (multiples of 8: the next one it accepts)."""
    s = SYMBOL[field]
    plus_one = all(r.next_value in (None, r.max_value + 1) for r in results)
    return f"{s}+1" if plus_one else f"next {s}"


def _columns(field: str, results) -> list[Column]:
    """The table's columns. ``reserved at N`` is the reserved peak of the replay under the
    budget (with the allocator's release-and-retry, so never above the budget); ``needs at
    N+1`` is what the failing replay asked for (reserved + the segment that failed), above
    it: the two figures that decide the threshold (``-`` when the implementation accepts
    no larger value: its limit, not memory, bounds the answer)."""
    s = SYMBOL[field]
    return [
        Column("implementation", lambda r: r.impl),
        Column(f"max {s}", lambda r: r.max_value, "right"),
        Column("first 2^k OOM", lambda r: _dash(r.first_failing_power_of_two), "right", drop=3),
        Column(f"allocated at {s}, GiB", lambda r: _cell_gib(r.at_max, "peak_bytes"), "right",
               drop=2),
        Column(f"reserved at {s}, GiB", lambda r: _cell_gib(r.at_max, "reserved_bytes"), "right"),
        Column(f"needs at {_next_label(field, results)}, GiB",
               lambda r: _cell_gib(r.at_next, "reserved_bytes", gib_up), "right", drop=1),
    ]


def _accepted_note(r: Solved) -> str | None:
    """What an implementation's rule on the solved field did to its answer: its limit
    bounds it (with the bytes to spare there), or only some values were tried; None when
    it accepts every value."""
    if r.limit is not None:
        spare = r.spare_bytes_at_max
        room = (f"fits with {spare:,} B ({human(spare)}) to spare: memory does not bound it"
                if r.at_max else "does not fit")
        return f"{r.impl}: {r.max_value:,}, {r.limit}; {room}"
    if r.next_value != r.max_value + 1:
        return (f"{r.impl}: {r.accepted.steps()}: {r.max_value:,} fits, {r.next_value:,}, "
                f"the next it takes, does not")
    return None


def _none_fits_note(r: Solved) -> str | None:
    """When not even the smallest value fits: what it needs against the budget."""
    if r.max_value or r.at_next is None:
        return None
    f = r.at_next
    return (f"{r.impl}: even {r.field} = {r.next_value:,} does not fit: it needs "
            f"{f.reserved_bytes:,} B ({human(f.reserved_bytes)}) against the budget of "
            f"{f.budget_bytes:,} B ({human(f.budget_bytes)})")


def _holes_note(r) -> str:
    """A fragile answer: the values just below it that do not fit."""
    s = SYMBOL[r.field]
    values = [f"{v:,}" for v in r.holes]
    listed = " and ".join([", ".join(values[:-1]), values[-1]] if len(values) > 1 else values)
    return (f"{r.impl}: fragile: {listed} {'do' if len(r.holes) > 1 else 'does'} not fit though "
            f"{s} = {r.max_value:,} does (the allocator's segments, not the tensors, decide "
            f"near the threshold): a length a little shorter is not safe either")


def _skipped_lines(skipped) -> list[str]:
    """A line per reason to skip: implementations refused for the same reason (but for their
    own name in it: ``--cp 8`` refuses 19 of them alike) share one."""
    import re

    groups: dict[str, list[str]] = {}
    for k in skipped:
        own = re.compile(rf"(?<![\w-]){re.escape(k.impl)}(?![\w-])")
        groups.setdefault(own.sub("{impl}", k.reason), []).append(k.impl)
    return [f"{impls[0]}: skipped, {reason.replace('{impl}', impls[0])}" if len(impls) == 1
            else f"{', '.join(impls)}: skipped, {reason.replace('{impl}', 'these')}"
            for reason, impls in groups.items()]


def _formula(r) -> str:
    """The closed form, readable: integer coefficients as they are (a fit names its points);
    fractional ones as decimals, labelled approximate (the exact fractions are in --json)."""
    q = r.approximation
    if q is None:
        return ("no closed form: the tensors alive at the peak are not the same ones at 2x, "
                "3x and 4x this length (a loop's, one a length), or the time limit left no "
                "time to replay them there")
    whole = all(c.denominator == 1 for c in (q.a, q.b, q.c))
    if whole and q.exact:
        return q.text()
    x = q.symbol
    through = ", ".join(f"{p:,}" for p in q.points)
    kind = "exact" if q.exact else f"fitted through {x}={through}"
    if whole:  # a fit with integer coefficients (where padding is none): nothing rounded
        return f"{q.text(places=0)} ({kind})"
    return (f"about {q.text(places=2)} ({kind}; coefficients rounded to 0.01, exact in --json "
            f"and --csv)")


SOLVED_KEYS = ("limit", "accepted_step", "accepted_most", "first_failing_power_of_two",
               "peak_bytes_at_max", "reserved_bytes_at_max", "spare_bytes_at_max",
               "needed_bytes_at_next", "peak_bytes_at_next")
CLOSED_FORM_KEYS = ("a", "b", "c", "denominator", "exact")  # Quadratic.to_dict's
BOUND_KEYS = ("fits_at", "fails_at", "estimate", "ceiling")


def record_keys(field: str) -> tuple[str, ...]:
    """The report's CSV columns, the keys of ``OomReport.records()``: every implementation
    with its ``status`` (solved, unsolved, skipped), the figures of a solved one (the next
    value it accepts, its rule on ``field``), the closed form's integer coefficients over
    their ``denominator``, the bounds of an unsolved one, and the ``reason`` for one
    without an answer."""
    return ("impl", "status", f"max_{field}", f"next_{field}", *SOLVED_KEYS,
            *CLOSED_FORM_KEYS, *BOUND_KEYS, "reason")


class OomReport(Result):
    """The threshold of every implementation asked for, in one budget."""

    model_config = _FROZEN
    budget: Budget
    field: SolveField
    base: Config
    results: tuple[Solved, ...]
    unsolved: tuple[Bounds, ...] = ()
    skipped: tuple[Skipped, ...] = ()

    def title(self) -> str:
        return (f"largest {self.field} that fits, {self.base.label(leave_out=self.field)}\n"
                f"{self.budget.describe()}")

    def tables(self) -> list[Table]:
        """The thresholds' table; none when nothing was solved (each skip says why)."""
        if not self.results:
            return []
        return [Table(self.title(), _columns(self.field, self.results), self.results)]

    def csv_table(self) -> Table:
        return record_table(record_keys(self.field), self.records())

    def footnotes(self) -> list[str]:
        from memcalc.output.results import caveats, picked_notes

        s, after = SYMBOL[self.field], _next_label(self.field, self.results)
        skips = [f"{k.impl}: not solved, {k.reason}" for k in self.unsolved]
        skips += _skipped_lines(self.skipped)
        skips += [f"{r.impl}: exact ({r.max_value:,} fits, {r.next_value:,} does not), but "
                  f"the time limit left no time to replay every figure in full (-: not known)"
                  for r in self.results if _missing_figures(r)]
        if not self.results:  # no table: its title is the first note
            return [*self.title().split("\n"), *skips, *caveats([])]
        lines = [f"fits: replaying the step with capacity = budget raises no OOM; reserved at "
                 f"{s}: the reserved peak of that replay (the allocator releases its cached free "
                 f"segments and retries before failing); needs at {after}: reserved + the segment "
                 f"that failed, over the budget. Near a threshold fitting is not monotone "
                 f"(reserved memory moves by 2 MiB segments between neighbours): the search "
                 f"starts from the closed-form estimate of the top of the fitting range.",
                 "why, the raw bytes of the tensors alive at the peak (before rounding to "
                 "blocks):"]
        lines += [f"  {r.impl}: {_formula(r)}" for r in self.results]
        rules = [note for r in self.results
                 for note in (_none_fits_note(r), _accepted_note(r)) if note]
        rules += [f"{r.impl}: {r.note}" for r in self.results if r.note]
        at = {r.impl: {self.field: max(r.max_value, 1)} for r in self.results}  # 0: none fits
        rules += picked_notes(*(self.base.replace(impl=r.impl, **at[r.impl])
                                for r in self.results))
        rules += [_holes_note(r) for r in self.results if r.holes]
        return lines + rules + skips + caveats([r.impl for r in self.results])

    def headline(self) -> str:
        s = SYMBOL[self.field]
        best = ", ".join(f"{r.impl} {s}={r.max_value:,}{' (its limit)' if r.limit else ''}"
                         for r in self.results[:3])
        more = f" (+{len(self.results) - 3} more)" if len(self.results) > 3 else ""
        if not self.results:  # none solved: say what is known of the first
            first = (self.unsolved or self.skipped)[0] if self.unsolved or self.skipped else None
            fits = f" (fits at {first.fits_at:,})" if self.unsolved and first.fits_at else ""
            best = (f"{first.impl} not solved{fits}" if self.unsolved
                    else f"{first.impl} skipped" if first else "nothing asked")
            rest = len(self.unsolved) + len(self.skipped) - 1
            more = f" (+{rest} more)" if rest > 0 else ""
        return f"largest {self.field} within {gib(self.budget.budget_bytes)} GiB: {best}{more}"

    def records(self) -> list[dict]:
        """One flat dict per implementation (``record_keys``): solved, then unsolved, then
        skipped; None where a row has no such figure. The CSV's rows."""
        rows = [{**r.to_dict(), **(r.approximation.coefficients() if r.approximation else {}),
                 "exact": r.approximation.exact if r.approximation else None,
                 "status": "solved"} for r in self.results]
        rows += [{**k.model_dump(), "status": "unsolved"} for k in self.unsolved]
        rows += [{**k.model_dump(), "status": "skipped"} for k in self.skipped]
        return [{key: row.get(key) for key in record_keys(self.field)} for row in rows]

    def to_dict(self) -> dict:
        """``results``: each solver's figures (``Solved.to_dict``); ``unsolved`` the
        bounds of each search stopped before an answer; ``skipped`` why each other was
        not searched."""
        return {"budget_bytes": self.budget.budget_bytes, "solve": self.field,
                "budget": self.budget.model_dump(mode="json"),
                "results": [r.to_dict() for r in self.results],
                "unsolved": [k.model_dump() for k in self.unsolved],
                "skipped": [k.model_dump() for k in self.skipped],
                "config": self.base.model_dump(mode="json")}


def merged(reports: list[OomReport]) -> OomReport:
    """Reports of one budget and field (one per compiled step of a target) as one, in
    order; the first's base configuration."""
    return reports[0].model_copy(update={
        part: tuple(row for r in reports for row in getattr(r, part))
        for part in ("results", "unsolved", "skipped")})


MAX_EVENTS = 4000
"""Without ``impls``, ``solve`` skips implementations whose program has more events than
this at the starting point, or more events as the solved field grows (chunked loops):
their exact replays near a threshold take seconds to hours. Name them to solve them."""


def _too_big(config: Config, field: str) -> str | None:
    """Why solving ``config``'s implementation would be slow, or None."""
    small, large = events_growth(config, field)
    if large > small:
        return (f"its program's events grow with {field} ({small:,} at {PROBED[1]:,}, "
                f"{large:,} at {PROBED[2]:,}), "
                f"so exact replays near the threshold take too long; solve it with memcalc "
                f"oom --impl {config.impl} (and --work-limit EVENTS)")
    x = getattr(config.shape, field)
    events = program_events(config)
    if events > MAX_EVENTS:
        return (f"its program has {events:,} events at {field} = {x} (replays are slow); "
                f"name it with --impl (and --work-limit) to solve it")
    return None


class PartialReport(KeyboardInterrupt):
    """Ctrl-C during ``solve``: still a ``KeyboardInterrupt``, with the report of what was
    solved, and what the interrupted search knew (``report``), for a command to show."""

    def __init__(self, report: OomReport):
        super().__init__("interrupted")
        self.report = report


def solve(base: Config, budget: Budget, field: SolveField = "seq_len",
          impls: Iterable[str] | None = None, time_limit: float | None = None,
          solver: Callable[..., Solved] = max_fitting,
          work_limit: int | None = None) -> OomReport:
    """The threshold of each implementation (every registered one by default) for
    ``base``'s other options. Implementations that reject the options (fp32 for a kernel
    that has none, say) are listed as skipped with the reason, and so, without ``impls``,
    are those whose replays are too slow (``MAX_EVENTS``); one implementation named alone
    is solved or raises. ``work_limit``: events replayed per implementation (the same
    answer on any machine), ``time_limit``: seconds per implementation (None: none)."""
    _check_limits(time_limit, work_limit)
    named = list(impls) if impls else None
    alone = named is not None and len(named) == 1  # its refusal is the answer: raise it
    results, unsolved, skipped = [], [], []

    def report() -> OomReport:
        return OomReport(budget=budget, field=field, base=base, results=tuple(results),
                         unsolved=tuple(unsolved), skipped=tuple(skipped))

    for name in named or impl_names():
        try:
            config = accepted_start(base.replace(impl=name), field)
            reason = None if named else _too_big(config, field)
            if reason is None:
                search = lambda c=config: solver(c, budget.budget_bytes, field,  # noqa: E731
                                                 time_limit=time_limit, work_limit=work_limit)
                solved = confirmed(search(), config, budget.budget_bytes, search)
                results.append(with_holes(solved, config, budget.budget_bytes))
                continue
        except Interrupted as stop:  # what the search had, proven or not
            if stop.solved is not None:
                results.append(stop.solved)
            else:
                unsolved.append(Bounds.of(name, stop.known, str(stop.known)))
            raise PartialReport(report()) from None
        except Unsolved as error:
            unsolved.append(Bounds.of(name, error, f"{error}; {_raise_it(error)}"))
            continue
        except Exception as error:  # noqa: BLE001 - one broken model must not hide the others
            if alone:
                raise
            reason = refusal(error, name)
        skipped.append(Skipped(impl=name, reason=reason))
    return report()


MOST_WORK = 10**18  # events: centuries of replay; the plans compare it as a float


def _check_limits(time_limit, work_limit) -> None:
    """One line naming the limit that is neither None nor a positive number of its unit."""
    if time_limit is not None and not (isinstance(time_limit, (int, float))
                                       and not isinstance(time_limit, bool)
                                       and 0 < time_limit < float("inf")):
        raise ValueError(f"time_limit: a positive number of seconds, or None (got "
                         f"{time_limit!r})")
    if work_limit is not None and not (isinstance(work_limit, int)
                                       and not isinstance(work_limit, bool)
                                       and 0 < work_limit <= MOST_WORK):
        raise ValueError(f"work_limit: a positive whole number of events up to 10^18, or "
                         f"None (got {work_limit!r})")


def _raise_it(stop: Unsolved) -> str:
    """How to let a search that ``stop`` ended go further: raise the limit that ended it."""
    if stop.events is not None:
        return "raise the work limit (--work-limit, work_limit=)"
    return "raise the time limit (--time-limit, time_limit=)"
