"""The solver: the largest ``seq_len`` (or batch, or head_dim) whose step fits a budget.

"Fits" is ``memcalc.budget.fits``: replaying the step with ``capacity = budget`` raises no
``OutOfMemory`` (reserved memory, with PyTorch's release-cached-segments-and-retry). For
each implementation ``max_fitting`` returns ``N`` with ``fits(N)`` and not ``fits(N + 1)``,
both replayed in full, with the figures at both.

Fitting is *not* monotone near a threshold, because reserved memory is not: between
neighbouring lengths it moves by a few 2 MiB segments (which tensors end up sharing a
cached block, whether a remainder is split), and release-and-retry rescues some lengths.
So several thresholds can lie within a fraction of a percent. For the default naive step
at 80 GiB, 19,509 fits, 19,510 does not, 19,511 fits and nothing from 19,512 on does (all
checked); for linear-causal 1,916,928 fails inside a fitting range that goes on to
1,936,384. A bisection from 1 (``bisect_max``) stops at the first threshold it meets;
``max_fitting`` starts from the closed-form estimate of the top of the fitting range and
returns the threshold nearest to it, or above it when a value it has replayed on the way
(the first power of two that does not fit is looked for, for the report) fits further up:
in practice the largest, without proving that no larger value fits.

How it gets there in a dozen to a few dozen replays rather than a scan: the tensors alive at
the peak have sizes that are polynomials in the solved field, so their raw bytes are
``Q(x) = a x^2 + b x + c`` (interpolated through three programs, checked at a fourth point); the
reserved memory is ``Q`` times the allocator's overhead ``rho``, which hardly moves near the
threshold. A few Newton-like steps on ``rho Q(x) = budget`` (``rho`` re-measured at each
point) give an estimate; a bracket ``fits(lo)``, not ``fits(hi)`` grows around it by
doubling steps (from the size of the last correction) and is bisected down to adjacent
values. ``Q`` is also what the report shows, "so the user sees why".

Only values the implementation accepts are probed (``memcalc.accepted``: FlashAttention's
head dims up to 256, the memory-efficient kernel's multiples of 8): every guess is moved to
one, the bracket steps and the bisection move over them, and "N + 1" is the next accepted
value, or none when ``N`` is the largest one accepted: then the kernel's limit, not memory,
bounds the answer (``Solved.limit``).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from fractions import Fraction
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field

from memcalc.accepted import Accepted
from memcalc.budget import Fit, fit, replay_within
from memcalc.closed_form import Quadratic, live_polynomial
from memcalc.config import SIZE_LIMIT, Config, Shape
from memcalc.deadline import TimeUp, deadline
from memcalc.errors import one_line
from memcalc.impls import get_impl
from memcalc.progress import listening, say
from memcalc.timeline import predict

_FROZEN = ConfigDict(frozen=True, extra="forbid")
SolveField = Literal["seq_len", "batch", "head_dim"]
LIMIT = SIZE_LIMIT  # no answer at or above it: no size is (memcalc.config.Shape)
# a loop's replay is expected to end in time only from the pace of one at least 1/REACH as
# long: its time per event grows with the length (linear-causal-chunked: 2.8 us at 16,384
# rows, 4.3 us at 3 million, 5.7 us capped), and a 10-million-row replay judged from
# 16,384 rows took twice its time, past the limit
REACH = 4
STRETCH = 0.8  # the share of the time left a climb's step is planned to take
NEAR = 8  # past a threshold at n, n + 2 .. n + NEAR are tried (fitting goes on by parity)


class Solved(BaseModel):
    """One implementation's threshold: ``max_value`` fits, ``next_value`` (``max_value +
    1``, or the next value the implementation accepts: ``accepted``) does not; no
    ``next_value`` when ``max_value`` is the largest value it accepts (its ``limit``). A
    search its time limit cut short after proving both (``max_fitting``) may lack the
    figures it had no time to replay in full: None."""

    model_config = _FROZEN
    impl: str
    field: SolveField
    max_value: int = Field(description="largest accepted value that fits (0: none)")
    next_value: int | None = Field(description="the next accepted value, which does not fit "
                                               "(None: max_value is the largest accepted)")
    first_failing_power_of_two: int | None = Field(
        description="the smallest accepted power of two above max_value that does not fit "
                    "(None: none is accepted, or not replayed in time)")
    at_max: Fit | None = Field(description="the step at max_value (None when 0, or not "
                                           "replayed in full in time)")
    at_next: Fit | None = Field(description="the step at next_value (None without one, or "
                                            "not replayed in full in time)")
    accepted: Accepted = Field(description="the values of field the implementation accepts")
    approximation: Quadratic | None
    evaluations: int = Field(description="full predictions the solver made")

    @computed_field
    @property
    def peak_bytes_at_max(self) -> int | None:
        return self.at_max.peak_bytes if self.at_max else None

    @computed_field
    @property
    def peak_bytes_at_next(self) -> int | None:
        return self.at_next.peak_bytes if self.at_next else None

    @computed_field
    @property
    def spare_bytes_at_max(self) -> int | None:
        """The budget less what the step reserves at ``max_value`` (under the budget)."""
        return self.at_max.budget_bytes - self.at_max.reserved_bytes if self.at_max else None

    @computed_field
    @property
    def limit(self) -> str | None:
        """Why nothing above ``max_value`` is tried: the implementation's largest accepted
        value, in words; None when memory bounds the answer."""
        return self.accepted.limit() if self.next_value is None else None

    def __getattr__(self, name: str):
        """Each key of ``to_dict`` (the JSON's, the CSV's and the DataFrame's) is an
        attribute too, so one name serves everywhere: ``max_seq_len`` (``max_value`` of a
        search over ``seq_len``), ``next_seq_len``, ``needed_bytes_at_next``, ..."""
        if not name.startswith("_") and "field" in self.__dict__:
            record = self.to_dict()
            if name in record:
                return record[name]
        return super().__getattr__(name)

    def __str__(self) -> str:
        """``flash2: max seq_len 20,516,864 (20,516,865 does not fit)``."""
        after = (f"{self.next_value:,} does not fit" if self.next_value is not None
                 else self.limit)
        return f"{self.impl}: max {self.field} {self.max_value:,} ({after})"

    def to_dict(self) -> dict:
        at_max, at_next = self.at_max, self.at_next
        return {
            "impl": self.impl, f"max_{self.field}": self.max_value,
            f"next_{self.field}": self.next_value, "limit": self.limit,
            **self.accepted.to_dict(),
            "first_failing_power_of_two": self.first_failing_power_of_two,
            "peak_bytes_at_max": self.peak_bytes_at_max,
            "peak_bytes_at_next": self.peak_bytes_at_next,
            "spare_bytes_at_max": self.spare_bytes_at_max,
            "reserved_bytes_at_max": at_max.reserved_bytes if at_max else None,
            "needed_bytes_at_next": at_next.reserved_bytes if at_next else None,
            "reserved_peak_bytes_at_max": at_max.reserved_peak_bytes if at_max else None,
            "reserved_peak_bytes_at_next": at_next.reserved_peak_bytes if at_next else None,
            "fit_at_max": at_max.describe() if at_max else None,
            "fit_at_next": at_next.describe() if at_next else None,
            "approximation": self.approximation.to_dict() if self.approximation else None,
            "evaluations": self.evaluations,
        }


class Unsolved(Exception):
    """The solver ran out of time; what it knows so far: ``lo`` fits (0: nothing known
    to), ``hi`` does not (None: nothing known not to), the closed-form ``estimate`` not
    replayed, and the ``ceiling`` past which nothing fits."""

    def __init__(self, lo: int, hi: int | None, seconds: float | None,
                 estimate: int | None = None, ceiling: int | None = None,
                 stopped_after: float | None = None):
        self.lo, self.hi, self.estimate, self.ceiling = lo, hi, estimate, ceiling
        known = ([f"fits at {lo:,}"] if lo else []) + ([f"not at {hi:,}"] if hi else [])
        bound = ", ".join(known) or "nothing replayed in time"
        if estimate is not None:
            bound += f"; the closed-form estimate, not replayed: {estimate:,}"
        if ceiling is not None:
            bound += (f"; at most {ceiling:,}, past which the tensors alive at the peak alone "
                      f"exceed the budget")
        within = f" within {seconds:g} s" if seconds is not None else ""
        if stopped_after is not None:
            within = f": interrupted after {stopped_after:.0f} s"
        super().__init__(f"no exact answer{within} ({bound})")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a search: still a ``KeyboardInterrupt``, with what the search knew
    (``known``, an ``Unsolved``; ``solved`` when it had proven adjacent bounds): a command
    can show it before it stops."""

    def __init__(self, known: Unsolved, solved: "Solved | None" = None):
        super().__init__(str(known))
        self.known, self.solved = known, solved


class _Probe:
    """``fits`` at values of one field, cached, counting full predictions (replays)."""

    def __init__(self, config: Config, field: str, budget_bytes: int,
                 time_limit: float | None = None):
        self.config, self.field, self.budget = config, field, budget_bytes
        self.accepted = get_impl(config.impl).rule(config.dims, field)  # the values probed
        self.first_accepted: int | None = None  # the first value the check let through
        self.known: dict[int, tuple[bool, int]] = {}
        self.full: dict[int, Fit] = {}
        self.breakdowns: dict = {}
        self.evaluations = 0
        self.started = time.perf_counter()
        self.deadline = None if time_limit is None else self.started + time_limit
        self.time_limit = time_limit
        self.estimate: int | None = None  # the latest closed-form guess, for Unsolved
        self.model: Quadratic | None = None  # the closed form the estimate solves
        self.per_event = 0.0  # the slowest replay so far, in seconds per event
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
        the replay's seconds per event steer the next ones."""
        start = time.perf_counter()
        try:
            if not self.affordable(x, single=timed):
                raise TimeUp
            with deadline(self.deadline):
                yield
        except TimeUp:
            raise self.unsolved() from None
        if self.deadline is not None and timed:
            seconds = time.perf_counter() - start
            self.per_event = max(self.per_event, seconds / self.events_at(x))
            self.timed = max(self.timed, x)

    def say(self, doing: str) -> None:
        """Tell an open status line (``memcalc.progress``) what the search does now, with
        the bounds known so far and the seconds spent."""
        if not listening():
            return
        lo, hi = self.bounds()
        known = [f"fits at {lo:,}"] if lo else []
        if hi is not None and hi > lo:  # near a threshold, fitting is not monotone
            known.append(f"not at {hi:,}")
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
        the ceiling of an exact closed form where it says more than the bounds."""
        replayed = self.estimate in self.known or self.estimate in self.full
        lo, hi = self.bounds()
        estimate = None if replayed else self.estimate
        ceiling = self.ceiling()
        if ceiling is not None and (ceiling <= max(lo, estimate or 0) or hi and hi <= ceiling):
            ceiling = None
        return Unsolved(lo, hi, self.time_limit, estimate, ceiling)

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
        worth of events) is expected to end before the deadline, within ``share`` of the
        time left: the slowest time per event so far times the events at ``x``; for a
        loop, within ``REACH`` times the longest replay timed."""
        if self.deadline is None:
            return True
        if single and self.timed and x > REACH * self.timed and self.grows():
            return False
        left = self.deadline - time.perf_counter()
        return self.per_event * self.events_at(x) <= share * left

    def reachable(self, lo: int, top: int) -> int:
        """The largest value in ``(lo, top]`` whose replay is expected to take at most
        ``STRETCH`` of the time left (a replay's pace varies by a tenth or more here), or
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


def _guess(probe: _Probe, x: int, q: Quadratic | None) -> int | None:
    """The root of ``rho Q(x) = budget``, ``rho`` = measured size / raw bytes at ``x``."""
    if q is None:
        return None
    raw = q(x)
    if raw <= 0:
        return None
    rho = Fraction(probe.size(x)) / raw
    root = q.root(Fraction(probe.budget) / rho)
    return None if root is None or root < 1 else probe.snap(min(int(root), LIMIT - 1))


def _gallop(probe: _Probe, x: int, step: int) -> tuple[int, int | None]:
    """A bracket ``(lo, hi)`` around ``x``, an accepted value: ``fits(lo)`` (or ``lo ==
    0``), not ``fits(hi)``, with steps (multiples of the accepted step) doubling away from
    ``x``; ``hi`` None when ``lo`` fits and is the largest value accepted."""
    grid = probe.accepted.step
    step = max(grid, step - step % grid)
    if probe(x):
        return _gallop_up(probe, x, step)
    hi = x
    while True:
        lo = max(0, hi - step)
        if lo == 0 or probe(lo):
            return lo, hi
        hi, step = lo, step * 2


def _gallop_up(probe: _Probe, lo: int, step: int) -> tuple[int, int | None]:
    """From ``lo``, which fits: steps doubling up to one that does not, or to the largest
    accepted value, which fits (``hi`` None)."""
    while True:
        hi = probe.accepted.floor(lo + step)
        if hi <= lo:  # lo is the implementation's limit: nothing above it to try
            return lo, None
        if hi >= LIMIT:
            raise ValueError(f"{probe.config.impl}: still fits at {probe.field} = {lo}")
        if not probe(hi):
            return lo, hi
        lo, step = hi, step * 2


def _aligned_above(probe: _Probe, n: int) -> list[int]:
    """The next few values above ``n`` and the first multiple of each power of two above
    it, up to the ceiling (past which nothing fits): fitting goes on past a threshold by
    parity (linear-causal's batch at 16 GiB: 181 fits, 182 does not, 183 does) and where
    sizes align, tensors sharing cached blocks exactly (linear in bf16 at 80 GiB: head_dim
    40,021 fits, 40,022 does not, 40,032 and 40,960 do). None for a loop, whose replays
    take seconds."""
    top = probe.ceiling()
    if top is None or top <= n or probe.grows():
        return []
    found = {x for x in range(n + 2, min(n + NEAR, top) + 1) if probe.accepted.accepts(x)}
    power = 2
    while power <= top:
        x = n - n % power + power
        if x <= top and probe.accepted.accepts(x):
            found.add(x)
        power *= 2
    return sorted(found)


def _midpoint(accepted: Accepted, lo: int, hi: int) -> int | None:
    """The accepted value halfway between ``lo`` and ``hi`` (0 or accepted values), or None
    when they are neighbours: nothing accepted lies between them."""
    gap = (hi - lo) // accepted.step
    return lo + gap // 2 * accepted.step if gap > 1 else None


def _narrow(probe: _Probe, lo: int, hi: int) -> int:
    """Bisect ``(lo, hi)`` down to neighbouring accepted values (the steering sizes are
    step functions of the field near a threshold: interpolating on them does not beat
    halving)."""
    while (mid := _midpoint(probe.accepted, lo, hi)) is not None:
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
    ``N + 1`` (over accepted values only: ``N + 1`` is the next one, if any). ``Unsolved``
    after ``time_limit`` seconds, unless by then the largest value replayed that fits is
    such an ``N`` (the next accepted value replayed, not fitting: adjacent bounds): that
    answer, exact, with the figures it had time to replay (``_cut_short``)."""
    probe = _Probe(config, field, budget_bytes, time_limit)
    x = probe.snap(start or _start(config, field))
    try:
        try:
            return _search(probe, x, field)
        except Unsolved:
            known = _climb(probe)
        if not probe.proven(known.lo):
            raise known
        return _cut_short(probe, known.lo, field)
    except KeyboardInterrupt:
        stop = probe.interrupted()
        if probe.proven(stop.known.lo):
            stop.solved = _cut_short(probe, stop.known.lo, field)
        raise stop from None


def _start(config: Config, field: str) -> int:
    """Where a search starts: the field's default, not the configuration's value, so that
    a question has one answer whichever length compare or oom was given (near a threshold
    fitting is not monotone, and the search reports the threshold nearest where its
    estimate led it); the configuration's value when the implementation refuses the
    default with the other sizes (causal linear attention with a --kv-len)."""
    default = Shape.model_fields[field].default
    try:
        program_events(accepted_start(config.replace(**{field: default}), field))
    except ValueError:
        return getattr(config.shape, field)
    return default


def _search(probe: _Probe, x: int, field: str) -> Solved:
    """``max_fitting`` from ``x``: Newton-like steps on the closed form, a bracket, a bisection."""
    config = probe.config
    probe.fit(x)
    probe.say(f"closed form from {field}={x:,}")
    with probe._limited(9 * x, timed=False):  # a loop's closed form replays 2x, 3x and 4x
        q = probe.model = live_polynomial(config.replace(**{field: x}), field,
                                          probe.breakdowns[x])
    previous, step = x, max(1, x // 64)  # no model: 1/64 of the start
    for _ in range(3):  # Newton-like steps on rho Q(x) = budget
        _approach(probe, x)  # a step replays at x
        guess = probe.estimate = _guess(probe, x, q)
        if guess is None:
            break
        if guess == x:  # converged: the model is good to a few segments of rounding
            step = max(1, x >> 14)
            break
        previous, x = x, guess
        step = max(1, abs(x - previous) // 8)
    _approach(probe, x)
    lo, hi = _gallop(probe, x, step)
    return _solved(probe, _topmost(probe, lo if hi is None else _narrow(probe, lo, hi), step),
                   field)


def _topmost(probe: _Probe, n: int, step: int) -> int:
    """A threshold at or above every value the search has seen fit, from the threshold
    ``n``: the first power of two above it that does not fit (the report shows it) is
    looked for, and from the largest value known to fit above ``n``, if any, the search
    steps up and bisects again. Fitting is not monotone: for naive in fp16 at 80 GiB the
    estimate led to head_dim 28,880 (28,881 does not fit) while 32,768 fits, by release-
    and-retry, and so does every value up to 34,344."""
    while True:
        _first_failing_power(probe, n)
        for x in _aligned_above(probe, n):
            probe(x)
        above = [x for x, fits in probe.verdicts().items() if fits and x > n]
        if not above:
            return n
        lo, hi = _gallop_up(probe, max(above), step)
        n = lo if hi is None else _narrow(probe, lo, hi)


def _approach(probe: _Probe, x: int) -> None:
    """Before a time-limited search replays a loop at ``x``: predictions at lengths growing
    ``REACH``-fold up to it, since a replay's pace is known only near the lengths timed
    (each also a lower bound when it fits). Without them a loop's estimate, millions of
    rows from a start of 16,384, could never be replayed, whatever the time limit."""
    if probe.deadline is None or not probe.grows():
        return
    while probe.timed and REACH * probe.timed < x:
        step = REACH * probe.timed
        probe.fit(step)
        if probe.timed < step:  # not timed (already known): no pace learnt, stop
            return


def _closed_form(probe: _Probe, n: int, field: str) -> Quadratic | None:
    """The closed form at the answer, shown with it; None when the time left cannot build
    it: the answer stands without it. A loop's is replayed at n/4, n/2 and 3n/4 (at 2n, 3n
    and 4n, the chunked loop at 80 GiB would replay 90 million rows, with 4x the memory)."""
    loop = probe.grows()
    most = probe.accepted.most
    below = loop or (most is not None and 4 * n > most)  # 2n..4n: sizes the kernel refuses
    try:
        probe.say(f"closed form at {field}={n:,}")
        with probe._limited(3 * n // 2 if loop else 9 * n, timed=False):
            return live_polynomial(probe.config.replace(**{field: n}), field,
                                   probe.breakdowns.get(n), below=below, snap=probe.snap)
    except Unsolved:
        return None


def _climb(probe: _Probe) -> Unsolved:
    """What a search cut off by its time limit knows, improved with the time left: from the
    largest value that fits, step up as far as a replay is expected to end in time (up to
    ``REACH`` times, and not past the estimate while below it), or halve the gap to one
    that does not fit. A chunked loop's estimate can be millions of rows, minutes of
    replay; its lower bound grows in seconds. A step is a prediction judged by ``fit``:
    below the budget it proves a fit without a second, capped replay."""
    try:
        for _ in range(128):  # steps up, then halvings; the time limit ends them first
            lo, hi = probe.bounds()
            if lo == 0:
                break
            x = probe.accepted.floor(probe.reachable(lo, _step_top(probe, lo, hi)))
            if x <= lo:
                break
            probe.fit(x)
    except Unsolved:
        pass
    _estimate_again(probe)
    return probe.unsolved()


def _step_top(probe: _Probe, lo: int, hi: int | None) -> int:
    """Where a climb's next step may go from ``lo``: halfway to ``hi``; without one,
    ``REACH`` times ``lo``, but not past an estimate above ``lo``."""
    if hi is not None:
        return lo + (hi - lo) // 2
    top = min(REACH * lo, LIMIT - 1)
    if probe.estimate is not None and lo < probe.estimate:
        top = min(top, probe.estimate)
    return top


def _estimate_again(probe: _Probe) -> None:
    """After a climb, the estimate from the largest value that fits, once that is a tenth
    of the estimate or more. The closed form is scaled by the ratio of reserved to raw
    bytes measured at one value, and a loop's ratio settles only when it has run for a
    while: linear-causal-chunked at 80 GiB is estimated at 9,871,642 from 16,384 rows,
    10,956,627 from 131,072, 10,294,289 from 1,048,576 and 10,247,644 from 2,097,152 (the
    capped replays fit further, to 11.58M: ``ceiling``)."""
    lo, _ = probe.bounds()
    replayed = lo in probe.known or lo in probe.full
    if probe.model is None or probe.estimate is None or not replayed:
        return
    if 10 * lo >= probe.estimate:
        probe.estimate = _guess(probe, lo, probe.model) or probe.estimate


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


def bisect_max(config: Config, budget_bytes: int, field: SolveField = "seq_len",
               time_limit: float | None = None) -> Solved:
    """The reference solver: double from the smallest accepted value until a step does
    not fit (or up to the largest accepted), then bisect, every step a full prediction
    (what ``benchmarks/`` compares ``max_fitting`` with)."""
    probe = _Probe(config, field, budget_bytes, time_limit)
    lo, hi = 0, probe.accepted.step
    while probe.fit(hi).fits:
        lo, hi = hi, probe.accepted.floor(2 * hi)
        if hi <= lo:  # the largest accepted value fits
            return _solved(probe, lo, field, approximate=False)
        if hi >= LIMIT:
            raise ValueError(f"{config.impl}: still fits at {field} = {lo}")
    while (mid := _midpoint(probe.accepted, lo, hi)) is not None:
        if probe.fit(mid).fits:
            lo = mid
        else:
            hi = mid
    return _solved(probe, lo, field, approximate=False)


def _cut_short(probe: _Probe, n: int, field: str) -> Solved:
    """The answer of a search its time limit stopped once it had replayed ``n`` fitting
    and the next accepted value not (adjacent bounds: exact), with what it had replayed in
    time: the figures at both (in full, or None), the first accepted power of two above
    ``n`` known to fail (None if not replayed), and the closed form it started from."""
    following = probe.accepted.after(n)
    return Solved(impl=probe.config.impl, field=field, max_value=n, next_value=following,
                  first_failing_power_of_two=_first_failing_power(probe, n, replay=False),
                  at_max=probe.full.get(n) if n >= 1 else None,
                  at_next=probe.full.get(following) if following is not None else None,
                  accepted=probe.accepted, approximation=probe.model,
                  evaluations=probe.evaluations)


def _solved(probe: _Probe, n: int, field: str, approximate: bool = True) -> Solved:
    """The answer ``n`` with the figures at it and at the next accepted value (none past
    the implementation's largest), checked to be a threshold."""
    config, following = probe.config, probe.accepted.after(n)
    at_next = probe.fit(following) if following is not None else None
    at_max = probe.fit(n) if n >= 1 else None
    if (at_next is not None and at_next.fits) or (at_max is not None and not at_max.fits):
        raise AssertionError(f"{config.impl}: the bracket at {n} is not a threshold")
    power = _first_failing_power(probe, n)
    at = n or following  # nothing fits: the closed form at the smallest value, which fails
    q = _closed_form(probe, at, field) if approximate and at else None
    return Solved(impl=config.impl, field=field, max_value=n, next_value=following,
                  first_failing_power_of_two=power, at_max=at_max, at_next=at_next,
                  accepted=probe.accepted, approximation=q, evaluations=probe.evaluations)


def _first_failing_power(probe: _Probe, n: int, replay: bool = True) -> int | None:
    """The smallest power of two above ``n`` that the implementation accepts and that does
    not fit (above ``n`` only if fitting is not monotone); None when none is accepted, or,
    without ``replay``, when the first one the search did not replay comes before it."""
    verdicts, power = probe.verdicts(), 1 << max(0, n).bit_length()
    while power < LIMIT and (probe.accepted.most is None or power <= probe.accepted.most):
        if probe.accepted.accepts(power):
            fits = probe(power) if replay else verdicts.get(power)
            if not fits:
                return power if fits is False else None
        power *= 2
    return None
