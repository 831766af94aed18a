"""An answer, confirmed: about traced code by direct traces, and for any implementation
looked at a little below (``with_holes``: where fitting is not monotone).

A traced step's program is fitted over lengths where it can be (``memcalc.tracing.fitted``)
and the solver replays that; the answer is then traced directly at the largest value that
fits and at the next one. Where both traces agree, their figures are the answer's; where
either disagrees (a fitted program off near the answer), the search runs again on direct
traces alone. Implementations declare a direct trace as ``Impl.exact``; others pass.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Callable

from memcalc.analysis.budget import Fit, fit
from memcalc.analysis.predict import predict
from memcalc.analysis.solved import Solved
from memcalc.config import Config
from memcalc.impls import get_impl
from memcalc.impls.registry import add


def confirmed(solved: Solved, config: Config, budget_bytes: int,
              search: Callable[[], Solved]) -> Solved:
    """``solved`` (of ``config``'s implementation, in ``budget_bytes``) with the figures of
    direct traces at its two values and a note of how it was found; ``search()`` solves
    again, on direct traces alone, where they disagree."""
    impl = get_impl(config.impl)
    if impl.exact is None:
        return solved
    how = impl.how(config.dims)
    values = [v for v in (solved.max_value, solved.next_value) if v]
    traced = {v: _traced_fit(config.replace(**{solved.field: v}), budget_bytes)
              for v in values}
    wrong = [v for v in values if traced[v].fits != (v == solved.max_value)]
    if not wrong:
        said = " and ".join(f"{v:,} ({'fits' if traced[v].fits else 'does not fit'})"
                            for v in values)
        return solved.model_copy(update={
            "at_max": traced.get(solved.max_value, solved.at_max),
            "at_next": traced.get(solved.next_value, solved.at_next),
            "note": f"{how}; confirmed by direct traces at {said}"})
    again = _on_direct_traces(impl, search)
    verdict = "fits" if traced[wrong[0]].fits else "does not fit"
    return again.model_copy(update={
        "note": f"{how}, which said {solved.max_value:,} but a direct trace at "
                f"{wrong[0]:,} {verdict}: solved again on direct traces alone"})


def _traced_fit(config: Config, budget_bytes: int) -> Fit:
    """``config``'s fit from a direct trace of its code (of each rank's, under ``--cp``)."""
    build = get_impl(config.impl).exact
    return fit(config, budget_bytes, predict(config, build=build),
               lambda capacity: predict(config, capacity, build=build))


def _on_direct_traces(impl, search: Callable[[], Solved]) -> Solved:
    """``search()`` with ``impl``'s programs all direct traces, its own put back after."""
    add(dataclasses.replace(impl, build=impl.exact), replace=True)
    try:
        return search()
    finally:
        add(impl, replace=True)


# how far below an answer the search looks for lengths that do not fit (fractions of it)
BELOW = (Fraction(999, 1000), Fraction(99, 100), Fraction(95, 100), Fraction(9, 10))


def with_holes(solved: Solved, config: Config, budget_bytes: int) -> Solved:
    """``solved`` with the values a little below its answer that do not fit, if any: near a
    threshold the reserved memory moves by whole segments, so the set of values that fit
    can have holes below the largest (``oom --cp 8`` on cuDNN: 4,194,304 fits, 4,190,000
    and 4,150,000 do not). A fragile answer, said so."""
    from memcalc.analysis.budget import fits

    rule = get_impl(config.impl).rule(config.dims, solved.field)
    below = sorted({rule.floor(int(solved.max_value * f)) for f in BELOW} - {0,
                                                                            solved.max_value})
    holes = tuple(v for v in below if not fits(config.replace(**{solved.field: v}),
                                               budget_bytes))
    return solved.model_copy(update={"holes": holes}) if holes else solved
