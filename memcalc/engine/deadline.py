"""A time limit that holds inside long computations: program builds and replays.

``memcalc oom --time-limit`` must answer within its limit even when one program has
millions of events (a chunked loop at a large length); a loop's builder (per iteration)
and the replay (per batch of events) count their steps through ``tick``, which looks at
the clock every ``CHECK_EVERY`` steps.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from contextvars import ContextVar

CHECK_EVERY = 4096  # steps between two looks at the clock
_DEADLINE: ContextVar[float | None] = ContextVar("deadline", default=None)
_steps = 0


class TimeUp(Exception):
    """A build or replay ran past the deadline of ``deadline()``."""


@contextmanager
def deadline(at: float | None):
    """Builds and replays inside stop with ``TimeUp`` once ``time.perf_counter()`` passes
    ``at`` (None: no limit of its own), or an enclosing deadline, whichever comes first."""
    outer = _DEADLINE.get()  # an enclosing deadline (a command's --time-limit) still holds
    token = _DEADLINE.set(at if outer is None else outer if at is None else min(at, outer))
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def tick(steps: int = 1) -> None:
    """``steps`` steps of a long computation: every ``CHECK_EVERY`` steps, raise ``TimeUp``
    if the deadline has passed. (A replay counts its events in batches: a call per event
    was a tenth of a long replay.)"""
    global _steps
    before, _steps = _steps, _steps + steps
    if before // CHECK_EVERY != _steps // CHECK_EVERY:
        limit = _DEADLINE.get()
        if limit is not None and time.perf_counter() > limit:
            raise TimeUp("ran past the time limit")
