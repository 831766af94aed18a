"""The work a request implies, judged before it is done.

A replay holds its whole program: at ``seq_len`` 10^8 a chunked loop has a hundred million
events, more memory than the machine has, and building them ran until Python's
``MemoryError`` (or the kernel's OOM killer). A sweep holds every configuration's figures.
Both sizes are known before any work: a program's events grow with its length as they do
between two short lengths (``estimated_events``), and a sweep has one row per
configuration. Past ``memory_limit`` (default 8 GiB; ``--memory-limit`` raises it) the
request is refused with one line saying what it would take and how to ask for it anyway.

The costs per event and per row are measured on this project's reference machine (the
commands are beside them); they size the refusal, they are not figures memcalc reports.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

from memcalc.engine.units import GiB, human

EVENT_BYTES = 440
"""Process memory per program event while it is built and replayed: ``memcalc breakdown
--impl linear-causal-chunked --seq 1000000`` has 1,062,497 events and a maximum resident
set of 501 MB (``/usr/bin/time -f %M``) against 36 MB for a 30-event step: 465 MB / 1.06
million = 438 B."""

EVENT_MICROSECONDS = 4
"""Seconds per event, in millionths, of the same run: 4.26 s against 0.21 s."""

ROW_BYTES = 1_700
"""Process memory per configuration of a sweep: ``memcalc sweep --seq 1:1000000:1 --impl
flash2 --csv`` peaks at 1.66 GB resident for a million rows."""

DEFAULT_MEMORY_LIMIT = 8 * GiB
SMALL = 65_536
"""Lengths at or below which a program is built without an estimate: a chunked loop has a
few events per chunk of 64 rows, some 30 MB of them at this length."""

_LIMIT: ContextVar[int | None] = ContextVar("memory_limit", default=DEFAULT_MEMORY_LIMIT)


class TooMuchWork(ValueError):
    """A request whose estimated memory is over the limit: one line, ``memory_limit: ...``
    (the CLI names its option, ``--memory-limit``)."""


@contextmanager
def memory_limit(nbytes: int | None):
    """Refuse, inside, what would take more than ``nbytes`` of memory (None: no limit)."""
    if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int)
                               or nbytes < 1):
        raise ValueError(f"memory_limit: a positive number of bytes, or None (got {nbytes!r})")
    token = _LIMIT.set(nbytes)
    try:
        yield
    finally:
        _LIMIT.reset(token)


def estimated_events(length: int, events_at) -> int:
    """A program's events at ``length`` (the longer of its seq_len and kv_len) from its
    events at 2,048 and 4,096 (``events_at(n)``, both lengths scaled to ``n``): a loop
    over chunks adds as many per 2,048 rows at any length; a program without one has as
    many at every length."""
    small, large = events_at(2048), events_at(4096)
    return large + max(0, large - small) * (length - 4096) // 2048


def check_program(what: str, length: int, events_at) -> None:
    """Refuse to build a program of ``length`` whose events would take more memory than
    the limit (``what``: ``impl: at seq_len N``, for the message)."""
    limit = _LIMIT.get()
    if limit is None or length <= SMALL:
        return
    try:
        events = estimated_events(length, events_at)
    except Exception:  # noqa: BLE001 - refused or broken at the short lengths: not judged
        return
    _check(limit, events * EVENT_BYTES,
           f"{what}, about {events:,} events to build and replay",
           f" (and some {_duration(events * EVENT_MICROSECONDS)})")


def check_rows(rows: int) -> None:
    """Refuse a sweep of ``rows`` configurations that would take more than the limit."""
    limit = _LIMIT.get()
    if limit is not None:
        _check(limit, rows * ROW_BYTES, f"a sweep of {rows:,} configurations")


def _check(limit: int, nbytes: int, what: str, also: str = "") -> None:
    if nbytes > limit:
        asked = -(-nbytes // GiB)  # whole GiB, rounded up
        raise TooMuchWork(f"memory_limit: {what} would take about {human(nbytes)} of this "
                          f"machine's memory{also}, over the limit of {human(limit)}; raise "
                          f"the limit to {asked}GiB to run it anyway")


def _duration(microseconds: int) -> str:
    seconds = microseconds // 10**6
    return f"{seconds} s" if seconds < 120 else f"{seconds // 60} min"
