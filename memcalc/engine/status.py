"""What the library is doing now, for a status line a command may open: ``say`` sets what
is being done (a search: the value it replays, the bounds so far, the clock), ``detail``
the step inside it (a replay's phase). The library never prints: both do nothing unless
someone ``listen``s (``memcalc.output.progress.status`` draws the line on a terminal).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator


class _Line:
    """The status line's text: what is being done, and the step inside it."""

    def __init__(self, show: Callable[[str], None]):
        self.show, self.doing, self.step = show, "", ""

    def draw(self) -> None:
        self.show(" - ".join(part for part in (self.doing, self.step) if part))


_LINE: ContextVar[_Line | None] = ContextVar("status_line", default=None)


def listening() -> bool:
    """Whether a status line is open (so a caller can skip composing its text)."""
    return _LINE.get() is not None


def say(text: str) -> None:
    """What is being done now, on an open status line (else nothing)."""
    line = _LINE.get()
    if line is not None:
        line.doing, line.step = text, ""
        line.draw()


def detail(text: str) -> None:
    """The step inside it (a replay's phase), after what ``say`` said."""
    line = _LINE.get()
    if line is not None:
        line.step = text
        line.draw()


@contextmanager
def listen(show: Callable[[str], None]) -> Iterator[None]:
    """Inside, each change of the status line's text is passed to ``show``."""
    token = _LINE.set(_Line(show))
    try:
        yield
    finally:
        _LINE.reset(token)
