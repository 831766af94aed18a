"""The solver: the largest ``seq_len`` (or batch, or head_dim) whose step fits a budget.

"Fits" is ``memcalc.analysis.budget.fits``: replaying the step with ``capacity = budget`` raises no
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

Only values the implementation accepts are probed (``memcalc.impls.accepted``: FlashAttention's
head dims up to 256, the memory-efficient kernel's multiples of 8): every guess is moved to
one, the bracket steps and the bisection move over them, and "N + 1" is the next accepted
value, or none when ``N`` is the largest one accepted: then the kernel's limit, not memory,
bounds the answer (``Solved.limit``).
"""

from __future__ import annotations

from fractions import Fraction

from memcalc.analysis.closed_form import Quadratic, live_polynomial
from memcalc.analysis.probe import REACH, Probe, accepted_start, program_events
from memcalc.analysis.solved import SolveField, Solved, Unsolved
from memcalc.config import SIZE_LIMIT, Config, Shape
from memcalc.impls.accepted import Accepted

LIMIT = SIZE_LIMIT  # no answer at or above it: no size is (memcalc.config.Shape)
NEAR = 8  # past a threshold at n, n + 2 .. n + NEAR are tried (fitting goes on by parity)


def _guess(probe: Probe, x: int, q: Quadratic | None) -> int | None:
    """The root of ``rho Q(x) = budget``, ``rho`` = measured size / raw bytes at ``x``."""
    if q is None:
        return None
    raw = q(x)
    if raw <= 0:
        return None
    rho = Fraction(probe.size(x)) / raw
    root = q.root(Fraction(probe.budget) / rho)
    return None if root is None or root < 1 else probe.snap(min(int(root), LIMIT - 1))


def _gallop(probe: Probe, x: int, step: int) -> tuple[int, int | None]:
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


def _gallop_up(probe: Probe, lo: int, step: int) -> tuple[int, int | None]:
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


def _aligned_above(probe: Probe, n: int) -> list[int]:
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


def _narrow(probe: Probe, lo: int, hi: int) -> int:
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
                start: int | None = None, time_limit: float | None = None,
                work_limit: int | None = None) -> Solved:
    """A value ``N`` of ``field`` with ``fits(N)`` and not ``fits(N + 1)`` for
    ``budget_bytes``, searched from the closed-form estimate of the top of the fitting range
    (so in practice the largest: see the module docstring), with the figures at ``N`` and
    ``N + 1`` (over accepted values only: ``N + 1`` is the next one, if any). ``Unsolved``
    after ``work_limit`` events replayed or ``time_limit`` seconds (None: no such limit),
    unless by then the largest value replayed that fits is such an ``N`` (the next accepted
    value replayed, not fitting: adjacent bounds): that answer, exact, with the figures it
    had time to replay (``_cut_short``)."""
    probe = Probe(config, field, budget_bytes, time_limit, work_limit)
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


def _search(probe: Probe, x: int, field: str) -> Solved:
    """``max_fitting`` from ``x``: Newton-like steps on the closed form, a bracket, a bisection."""
    config = probe.config
    probe.fit(x)
    probe.say(f"closed form from {field}={x:,}")
    with probe._limited(9 * x, timed=False):  # a loop's closed form replays 2x, 3x and 4x
        q = probe.model = live_polynomial(config.replace(**{field: x}), field,
                                          probe.breakdowns[x], aligned=False)
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


def _topmost(probe: Probe, n: int, step: int) -> int:
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


def _approach(probe: Probe, x: int) -> None:
    """Before a limited search replays a loop at ``x``: predictions at lengths growing
    ``REACH``-fold up to it, since a replay's pace is known only near the lengths timed
    (each also a lower bound when it fits). Without them a loop's estimate, millions of
    rows from a start of 16,384, could never be replayed, whatever the limit."""
    if not probe.limited or not probe.grows():
        return
    while probe.timed and REACH * probe.timed < x:
        step = REACH * probe.timed
        probe.fit(step)
        if probe.timed < step:  # not timed (already known): no pace learnt, stop
            return


def _closed_form(probe: Probe, n: int, field: str) -> Quadratic | None:
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


def _climb(probe: Probe) -> Unsolved:
    """What a search cut off by its limit knows, improved with the work and time left: from
    the largest value that fits, step up as far as a replay is expected to end within them (up to
    ``REACH`` times, and not past the estimate while below it), or halve the gap to one
    that does not fit. A chunked loop's estimate can be millions of rows, minutes of
    replay; its lower bound grows in seconds. A step is a prediction judged by ``fit``:
    below the budget it proves a fit without a second, capped replay."""
    try:
        for _ in range(128):  # steps up, then halvings; the limits end them first
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


def _step_top(probe: Probe, lo: int, hi: int | None) -> int:
    """Where a climb's next step may go from ``lo``: halfway to ``hi``; without one,
    ``REACH`` times ``lo``, but not past an estimate above ``lo``."""
    if hi is not None:
        return lo + (hi - lo) // 2
    top = min(REACH * lo, LIMIT - 1)
    if probe.estimate is not None and lo < probe.estimate:
        top = min(top, probe.estimate)
    return top


def _estimate_again(probe: Probe) -> None:
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




def bisect_max(config: Config, budget_bytes: int, field: SolveField = "seq_len",
               time_limit: float | None = None, work_limit: int | None = None) -> Solved:
    """The reference solver: double from the smallest accepted value until a step does
    not fit (or up to the largest accepted), then bisect, every step a full prediction
    (what ``benchmarks/`` compares ``max_fitting`` with)."""
    probe = Probe(config, field, budget_bytes, time_limit, work_limit)
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


def _cut_short(probe: Probe, n: int, field: str) -> Solved:
    """The answer of a search its limit stopped once it had replayed ``n`` fitting
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


def _solved(probe: Probe, n: int, field: str, approximate: bool = True) -> Solved:
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


def _first_failing_power(probe: Probe, n: int, replay: bool = True) -> int | None:
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
