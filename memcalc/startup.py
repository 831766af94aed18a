"""Ctrl-C while the ``memcalc`` command starts: held until ``memcalc.cli.main`` answers it
with its one line (``memcalc: interrupted``, status 130), whenever in start-up it came.

A ``KeyboardInterrupt`` can be raised at any bytecode of an import, and one raised while
pydantic_core (a Rust extension, built with PyO3) imports the ``datetime`` C API becomes
``pyo3_runtime.PanicException: failed to import datetime C API`` with a traceback (PyO3's
``PyDateTime_IMPORT`` failing is a panic, and the panic is not a ``KeyboardInterrupt``).
So the package's first lines block SIGINT in this thread (``hold``, POSIX only: elsewhere
the package's ``except KeyboardInterrupt`` guards are all there is) and ``release`` unblocks
it where an interrupt can be answered: the command's ``main``, inside its ``try``, or, for
other code importing memcalc, the end of the package's import, which raises it there as a
plain ``KeyboardInterrupt``. Threads started while it is held (numpy's BLAS pool) keep it
blocked, so the signal comes to this thread. This module imports only ``signal`` and
``sys``, both loaded by then.
"""

from __future__ import annotations

import signal
import sys

_HELD: list[bool] = []  # one entry while held: whether hold() blocked SIGINT itself


def the_command() -> bool:
    """Whether this process is the ``memcalc`` command (``memcalc ...`` or ``python -m
    memcalc.cli ...``), not other code importing the package."""
    import os

    argv = getattr(sys, "orig_argv", sys.argv)
    script = os.path.basename(sys.argv[0]) if sys.argv else ""
    module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""
    return script in ("memcalc", "memcalc.exe") or module in ("memcalc", "memcalc.cli")


def hold() -> None:
    """Block SIGINT in this thread until ``release`` (no-op where it cannot be blocked, or
    where the caller had blocked it: it stays as the caller left it)."""
    if _HELD or not hasattr(signal, "pthread_sigmask"):
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    _HELD.append(signal.SIGINT not in before)


def release() -> None:
    """Unblock SIGINT if ``hold`` blocked it; one that came meanwhile is raised here, as a
    ``KeyboardInterrupt`` (``pthread_sigmask`` runs the handlers of signals it unblocks)."""
    if _HELD and _HELD.pop():
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def interrupted() -> None:
    """Ctrl-C while the command starts, before ``memcalc.cli.main`` can catch it (where
    ``hold`` cannot block it): its one line and status, as main's; imported by other code,
    the interrupt goes on."""
    if not the_command():
        raise KeyboardInterrupt
    print("memcalc: interrupted", file=sys.stderr)
    raise SystemExit(130)
