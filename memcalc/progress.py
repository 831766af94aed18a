"""Progress bars for the long commands (``validate``, ``sweep``), on stderr and only when
stderr is a terminal: pipes, files and the tests see nothing."""

from __future__ import annotations

import sys
from typing import Iterable, TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], total: int, description: str) -> Iterable[T]:
    """``items``, with a transient rich progress bar on stderr when it is a terminal."""
    if not sys.stderr.isatty():
        return items
    from rich.console import Console
    from rich.progress import track

    return track(items, description=description, total=total, transient=True,
                 console=Console(stderr=True))
