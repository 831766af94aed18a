"""Ctrl-C during a trace, held until the next op.

Python raises ``KeyboardInterrupt`` wherever the main thread is when the signal's handler
runs. In a trace that is often a weakref callback (the tracer's note that a storage died),
where Python prints "Exception ignored" and goes on (the whole output followed, exit 0), or
the middle of an import the user's file makes (numpy half-initialized, then a
``RecursionError`` blamed on the user's module). While ``held()`` is active the signal only
sets a flag, and the tracer raises ``KeyboardInterrupt`` at its next op (``check``), where
it unwinds as any exception does; what is still pending when the block ends is raised there.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

_PENDING: list[bool] = []  # a Ctrl-C not yet raised


def check() -> None:
    """Raise the pending Ctrl-C, if any (the tracer's checkpoint, at every op)."""
    if _PENDING:
        _PENDING.clear()
        raise KeyboardInterrupt


@contextmanager
def held() -> Iterator[None]:
    """Inside, Ctrl-C is held for ``check``; outside the main thread (where signal handlers
    cannot be set), nothing changes. Nested, the outermost holds."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is _hold:
        yield
        return
    previous = signal.signal(signal.SIGINT, _hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    check()


def _hold(signum, frame) -> None:
    _PENDING.append(True)
