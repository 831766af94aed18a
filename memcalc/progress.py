"""Progress for the long commands, on stderr and only when stderr is a terminal: pipes,
files and the tests see nothing.

* ``progress``: a bar over a loop of known length (``validate``, ``sweep``);
* ``status``: one line the library updates while it works on something whose length it
  cannot count ahead (an OOM search that replays a chunked loop at millions of rows for a
  minute). ``say`` sets what is being done (a search: the value it replays, the bounds so
  far, the clock), ``detail`` the step inside it (a replay's phase). The library never
  prints: both do nothing unless a command opened a ``status`` (or ``listen``).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")


class _Line:
    """The status line's text: what is being done, and the step inside it."""

    def __init__(self, show: Callable[[str], None]):
        self.show, self.doing, self.step = show, "", ""

    def draw(self) -> None:
        self.show(" - ".join(part for part in (self.doing, self.step) if part))


_LINE: ContextVar[_Line | None] = ContextVar("status_line", default=None)


def progress(items: Iterable[T], total: int, description: str) -> Iterable[T]:
    """``items``, with a transient rich progress bar on stderr when it is a terminal."""
    if not sys.stderr.isatty():
        return items
    from rich.console import Console
    from rich.progress import track

    return track(items, description=description, total=total, transient=True,
                 console=Console(stderr=True))


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


@contextmanager
def status(first: str, stream=None) -> Iterator[None]:
    """A transient status line on ``stream`` (stderr) while the block runs, starting with
    ``first``; nothing when the stream is not a terminal."""
    stream = stream or sys.stderr
    if not stream.isatty():
        yield
        return
    from rich.console import Console
    from rich.text import Text

    console = Console(file=stream)

    def show(text: str) -> None:  # one line: cut to the terminal's width, less the spinner
        cut = Text(text)
        cut.truncate(console.width - 2, overflow="ellipsis")
        line.update(cut)

    with console.status(first) as line:
        with listen(show):
            say(first)
            yield
