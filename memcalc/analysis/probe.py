"""The solver's probe: ``fits`` at values of one field, each a replay under the budget's
capacity, cached and counted, stopped at the search's limits (its work, counted in events,
and optionally the clock); and what a replay at a value will cost (its events, from the
programs at 2,048 and 4,096), so that a search only starts replays it can finish.

The work limit makes an answer a function of the question alone: the events a replay
counts (``memcalc.engine.deadline.tick``) are the same on any machine under any load, so a
search stops at the same replay, knowing the same bounds, wherever it runs; a time limit,
the user's own cap, ends it where the clock says.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from fractions import Fraction

from memcalc.analysis.budget import Fit, fit, replay_within
from memcalc.analysis.closed_form import Quadratic
from memcalc.analysis.predict import predict
from memcalc.analysis.solved import Interrupted, Unsolved
from memcalc.config import Config
from memcalc.engine.deadline import TimeUp, WorkUp, deadline, work_done
from memcalc.engine.status import listening, say
from memcalc.errors import one_line
from memcalc.impls import get_impl


# a loop's replay is expected to end in time only from the pace of one at least 1/REACH as
# long: its time per event grows with the length (linear-causal-chunked: 2.8 us at 16,384
# rows, 4.3 us at 3 million, 5.7 us capped), and a 10-million-row replay judged from
# 16,384 rows took twice its time, past the limit
REACH = 4


STRETCH = 0.8  # the share of the time left a climb's step is planned to take


class Probe:
    """``fits`` at values of one field, cached, counting full predictions (replays);
    ``time_limit`` seconds and ``work_limit`` events (None: none) for the whole search."""

    def __init__(self, config: Config, field: str, budget_bytes: int,
                 time_limit: float | None = None, work_limit: int | None = None):
        self.config, self.field, self.budget = config, field, budget_bytes
        self.accepted = get_impl(config.impl).rule(config.dims, field)  # the values probed
        self.first_accepted: int | None = None  # the first value the check let through
        self.known: dict[int, tuple[bool, int]] = {}
        self.full: dict[int, Fit] = {}
        self.breakdowns: dict = {}
        self.evaluations = 0
        self.started = time.perf_counter()
        self.deadline = None if time_limit is None else self.started + time_limit
        self.time_limit, self.work_limit = time_limit, work_limit
        self.work_at = None if work_limit is None else work_done() + work_limit
        self.limited = self.deadline is not None or self.work_at is not None
        self.ran_out: str | None = None  # which limit stopped the search: "time" or "work"
        self.estimate: int | None = None  # the latest closed-form guess, for Unsolved
        self.model: Quadratic | None = None  # the closed form the estimate solves
        self.per_event = 0.0  # the slowest replay so far, in seconds per event
        self.work_per_event = 0.0  # the most steps counted per event of a replay so far
        self.timed = 0  # the longest value replayed and timed
        self._events: tuple[int, int] | None = None  # events at 256, and per 256 more

    def __call__(self, x: int) -> bool:
        """``fits`` at ``x``: one replay under the capacity."""
        if x not in self.known:
            self.say(f"trying {self.field}={x:,}")
            with self._limited(x), self._checked(x):
                self.known[x] = replay_within(self.config.replace(**{self.field: x}),
                                              self.budget)
            self.evaluations += 1
        return self.known[x][0]

    @contextmanager
    def _checked(self, x: int):
        """A step at ``x``, an accepted value: when the implementation's check refuses it
        after letting another value through, a rule across sizes that no ``Accepted``
        declares (causal FlashAttention: seq_len == kv_len) forbids the search; one line
        says so with both values, instead of the check's line about a value never given."""
        try:
            yield
        except ValueError as error:
            if self.first_accepted is None:
                raise  # the options as given: the check's own line
            raise ValueError(f"{one_line(error)}; solving {self.field} from "
                             f"{self.first_accepted:,}, {self.config.impl} refuses "
                             f"{x:,}") from None
        if self.first_accepted is None:
            self.first_accepted = x

    def snap(self, x: int) -> int:
        """The accepted value at or below ``x``, or the smallest accepted one: where a
        search may probe (a kernel refuses the others)."""
        return self.accepted.floor(x) or self.accepted.step

    @contextmanager
    def _limited(self, x: int, timed: bool = True):
        """A replay at ``x`` (or ``x``'s worth of events) that stops at the deadline: not
        started when it is expected to end after it, stopped inside otherwise. ``timed``:
        the replay's seconds and steps per event steer the next ones."""
        start, work = time.perf_counter(), work_done()
        try:
            self.ran_out = self._short_of(x, single=timed)
            if self.ran_out is not None:
                raise self.unsolved()
            with deadline(self.deadline, self.work_at):
                yield
        except TimeUp as stop:
            self.ran_out = "work" if isinstance(stop, WorkUp) else "time"
            raise self.unsolved() from None
        if self.limited and timed:
            events = self.events_at(x)
            self.per_event = max(self.per_event, (time.perf_counter() - start) / events)
            self.work_per_event = max(self.work_per_event, (work_done() - work) / events)
            self.timed = max(self.timed, x)

    def say(self, doing: str) -> None:
        """Tell an open status line (``memcalc.output.progress``) what the search does now, with
        the bounds known so far and the events and seconds spent."""
        if not listening():
            return
        lo, hi = self.bounds()
        known = [f"fits at {lo:,}"] if lo else []
        if hi is not None and hi > lo:  # near a threshold, fitting is not monotone
            known.append(f"not at {hi:,}")
        if self.work_at is not None:
            known.append(f"{self.work_limit - (self.work_at - work_done()):,} of "
                         f"{self.work_limit:,} events")
        if self.deadline is not None:
            spent = self.time_limit - (self.deadline - time.perf_counter())
            known.append(f"{spent:.0f} of {self.time_limit:g} s")
        say("; ".join([f"{self.config.impl}: {doing}", *known]))

    def verdicts(self) -> dict[int, bool]:
        """``fits`` at every value replayed so far (capped replays and judged predictions)."""
        fits = {x: f for x, (f, _) in self.known.items()}
        return fits | {x: r.fits for x, r in self.full.items()}  # unbounded predictions, judged

    def bounds(self) -> tuple[int, int | None]:
        """The largest value replayed that fits (0: none), the smallest that does not."""
        fits = self.verdicts()
        lo = max((x for x, f in fits.items() if f), default=0)
        hi = min((x for x, f in fits.items() if not f), default=None)
        return lo, hi

    def unsolved(self) -> Unsolved:
        """What is known: the bounds, the closed-form estimate unless it was replayed, and
        the ceiling of an exact closed form where it says more than the bounds, and the
        limit that stopped the search (the work limit when neither stopped it yet and the
        search has no time limit)."""
        replayed = self.estimate in self.known or self.estimate in self.full
        lo, hi = self.bounds()
        estimate = None if replayed else self.estimate
        ceiling = self.ceiling()
        if ceiling is not None and (ceiling <= max(lo, estimate or 0) or hi and hi <= ceiling):
            ceiling = None
        work = self.ran_out == "work" or (self.ran_out is None and self.deadline is None)
        return Unsolved(lo, hi, None if work else self.time_limit, estimate, ceiling,
                        events=self.work_limit if work else None)

    def proven(self, lo: int) -> bool:
        """Whether ``lo`` (the largest value replayed that fits, or 0) is an exact answer:
        the next accepted value was replayed and does not fit, or there is none."""
        after = self.accepted.after(lo)
        return after is None or self.verdicts().get(after) is False

    def interrupted(self) -> Interrupted:
        """What is known when Ctrl-C stops the search, and after how long."""
        known = self.unsolved()
        return Interrupted(Unsolved(known.lo, known.hi, None, known.estimate, known.ceiling,
                                    stopped_after=time.perf_counter() - self.started))

    def ceiling(self) -> int | None:
        """The largest value at which the exact closed form of the bytes alive at the peak
        stays within the budget: past it, those bytes alone exceed it, and allocated memory
        (never less) cannot fit. The estimate scales the closed form by the reserved
        memory of a replay, which the allocator's release-and-retry can undercut near the
        budget (linear-causal-chunked at 80 GiB: estimated 10,247,644 from 2,097,152 rows;
        58 minutes of replays find 11,587,487 fitting and 11,587,611 not; the ceiling is
        12,499,320)."""
        if self.model is None or not self.model.exact:
            return None
        root = self.model.root(Fraction(self.budget))
        return None if root is None else int(root)

    def affordable(self, x: int, single: bool = True, share: float = 1.0) -> bool:
        """Whether a replay at ``x`` (``single``: one replay of that length; else ``x``'s
        worth of events) is expected to end within ``share`` of the work and the time
        left (``_short_of``)."""
        return self._short_of(x, single, share) is None

    def _short_of(self, x: int, single: bool = True, share: float = 1.0) -> str | None:
        """Which limit a replay at ``x`` is expected to run past: ``"work"`` when the most
        steps per event so far times the events at ``x`` exceed ``share`` of the work
        left, ``"time"`` when the slowest time per event does for the time left; for a
        loop, either past ``REACH`` times the longest replay timed (the time limit's, if
        any). None when it is expected to end within both."""
        if not self.limited:
            return None
        if single and self.timed and x > REACH * self.timed and self.grows():
            return "work" if self.deadline is None else "time"
        events = self.events_at(x)
        if self.work_at is not None and \
                self.work_per_event * events > share * (self.work_at - work_done()):
            return "work"
        if self.deadline is not None and \
                self.per_event * events > share * (self.deadline - time.perf_counter()):
            return "time"
        return None

    def reachable(self, lo: int, top: int) -> int:
        """The largest value in ``(lo, top]`` whose replay is expected to take at most
        ``STRETCH`` of the work and time left (a replay's pace varies by a tenth or more here), or
        ``lo`` when none is."""
        hi = top + 1
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            if self.affordable(mid, share=STRETCH):
                lo = mid
            else:
                hi = mid
        return lo

    def events_at(self, x: int) -> int:
        """The events of the program at ``x``, extrapolated from the programs at 2,048 and
        4,096 (``events_growth``: a chunked loop's grow with the length; building it at
        ``x`` would take about as long as replaying it)."""
        if self._events is None:
            try:
                small, large = events_growth(self.config, self.field)
            except ValueError:  # sizes the implementation rejects: take it as constant
                small = large = program_events(self.config)
            self._events = (small, large - small)
        small, per_2048 = self._events
        return max(1, small + per_2048 * (x - PROBED[1]) // PROBED[1])

    def grows(self) -> bool:
        """Whether the program's events grow with the field (a loop over chunks)."""
        return self.events_at(PROBED[2]) > self.events_at(PROBED[1])

    def size(self, x: int) -> int:
        """What steers the search: the reserved peak (fits) or reserved + the failed
        segment (does not), of the capped replay, or of the prediction judged at ``x``."""
        if x not in self.known and x in self.full:
            return self.full[x].reserved_bytes
        self(x)
        return self.known[x][1]

    def fit(self, x: int) -> Fit:
        """``fit`` with its figures (an unbounded prediction, plus the capped one if needed)."""
        if x not in self.full:
            c = self.config.replace(**{self.field: x})
            self.say(f"trying {self.field}={x:,}")
            with self._limited(x), self._checked(x):
                b = predict(c)
                self.full[x] = fit(c, self.budget, b)
            self.evaluations += 1
            self.breakdowns[x] = b
        return self.full[x]


def program_events(config: Config) -> int:
    """How many events ``config``'s program has (allocations, frees, marks)."""
    p = get_impl(config.impl).program(config.dims)
    return len(p.forward) + len(p.backward)


def accepted_start(config: Config, field: str) -> Config:
    """``config`` with ``field`` moved to an accepted value at or below it (or the smallest
    one): where a search starts (the value given is only a starting point)."""
    rule = get_impl(config.impl).rule(config.dims, field)
    return config.replace(**{field: rule.floor(getattr(config.shape, field)) or rule.step})


PROBED = (1024, 2048, 4096)
"""Where a program's events are counted to tell a loop: a loop's grow at every doubling."""


def events_growth(config: Config, field: str) -> tuple[int, int]:
    """The program's events at ``field`` = 2,048 and at 4,096 when they grow at every
    doubling from 1,024 (a loop over chunks); else its most events there, twice: constant
    (FlashAttention's change with its split count at short lengths: 15, 12, 12). Where
    the implementation refuses these values (the fused kernels' head dims), its events at
    the accepted start, twice."""
    rule = get_impl(config.impl).rule(config.dims, field)
    if not all(rule.accepts(n) for n in PROBED):
        events = program_events(accepted_start(config, field))
        return events, events
    counts = [program_events(config.replace(**{field: n})) for n in PROBED]
    if counts[0] < counts[1] < counts[2]:
        return counts[1], counts[2]
    return max(counts), max(counts)
