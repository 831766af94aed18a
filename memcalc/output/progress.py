"""Progress for the long commands, on stderr and only when stderr is a terminal: pipes,
files and the tests see nothing.

* ``progress``: a bar over a loop of known length (``validate``, ``sweep``);
* ``status``: one line the library updates while it works on something whose length it
  cannot count ahead (an OOM search that replays a chunked loop at millions of rows for a
  minute), with what the library says it is doing (``memcalc.engine.status``).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterable, Iterator, TypeVar

from memcalc.engine.status import listen, say

T = TypeVar("T")


def progress(items: Iterable[T], total: int, description: str) -> Iterable[T]:
    """``items``, with a transient rich progress bar on stderr when it is a terminal."""
    if not sys.stderr.isatty():
        return items
    from rich.console import Console
    from rich.progress import track

    return track(items, description=description, total=total, transient=True,
                 console=Console(stderr=True))


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
