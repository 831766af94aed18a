"""Limits that hold inside long computations: program builds and replays.

Two limits, each optional: a deadline on the clock (``memcalc oom --time-limit``, a
command's ``--time-limit``) and a limit of work (``memcalc oom --work-limit``): allocator
events replayed, counted, the same on any machine under any load. A loop's builder (per
iteration) and the replay (per batch of events) count their steps through ``tick``, which
looks at the clock every ``CHECK_EVERY`` steps, so that a deadline holds even when one
program has millions of events (a chunked loop at a large length); the replay's steps are
the work, compared with the work limit at every call. A build is not work: small programs
are built once and kept (``memcalc.impls.registry``), so its steps would count or not by
what ran before in the process.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from contextvars import ContextVar

CHECK_EVERY = 4096  # steps between two looks at the clock
DEFAULT_WORK_LIMIT = 20_000_000
"""The work a search may do by default (``memcalc oom --work-limit``, ``memcalc.oom``'s
``work_limit``), in allocator events replayed (``work_done``): about a minute of replay
(``predict`` of the chunked loop at 1,048,576 rows replays 2,231,296 events in 6.8 s of
CPU time, 330,000 a second), what the default time limit of 60 s was. A step of fixed
length answers in a few hundred thousand (naive at 80 GiB: 73,728; Llama-3-8B traced,
``docs/guides/training.md``: 724,992); a chunked loop at tens of GiB, whose replays near
the threshold take millions each, stops with its bounds."""
_DEADLINE: ContextVar[float | None] = ContextVar("deadline", default=None)
_WORK: ContextVar[int | None] = ContextVar("work", default=None)  # the count to stop past
_steps = 0  # every step counted, for the clock
_work = 0  # the replay's steps: the work


class TimeUp(Exception):
    """A build or replay ran past the deadline of ``deadline()``."""


class WorkUp(TimeUp):
    """A build or replay ran past the work limit of ``deadline()``: a ``TimeUp`` too, so
    that whatever stops at a deadline stops at either."""


def work_done() -> int:
    """The events replayed so far in this process: where a work limit is measured from."""
    return _work


@contextmanager
def deadline(at: float | None, work_at: int | None = None):
    """Builds and replays inside stop with ``TimeUp`` once ``time.perf_counter()`` passes
    ``at``, or with ``WorkUp`` once the work done (``work_done()``) passes ``work_at`` (None:
    no limit of its own), or at an enclosing limit, whichever comes first."""
    outer, outer_work = _DEADLINE.get(), _WORK.get()  # a command's --time-limit still holds
    token = _DEADLINE.set(_earlier(at, outer))
    work_token = _WORK.set(_earlier(work_at, outer_work))
    try:
        yield
    finally:
        _WORK.reset(work_token)
        _DEADLINE.reset(token)


def _earlier(a, b):
    """The first of two limits, either None (none)."""
    return b if a is None else a if b is None else min(a, b)


def tick(steps: int = 1, work: bool = True) -> None:
    """``steps`` steps of a long computation (``work``: of a replay, else of a build): a
    replay's raise ``WorkUp`` once the work done passes the work limit (at the same event on
    any machine), and every ``CHECK_EVERY`` steps ``TimeUp`` if the deadline has passed. (A
    replay counts its events in batches: a call per event was a tenth of a long replay.)"""
    global _steps, _work
    before, _steps = _steps, _steps + steps
    if work:
        _work += steps
        limit = _WORK.get()
        if limit is not None and _work > limit:
            raise WorkUp("ran past the work limit")
    if before // CHECK_EVERY != _steps // CHECK_EVERY:
        limit = _DEADLINE.get()
        if limit is not None and time.perf_counter() > limit:
            raise TimeUp("ran past the time limit")
