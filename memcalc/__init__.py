"""memcalc: how much GPU memory one attention training step takes, to the byte.

The functions here (``memcalc.api``) take the same options as the ``memcalc`` command
(``seq_len`` is the CLI's ``--seq``) and return result objects that render themselves in a terminal (rich)
and in Jupyter (HTML). Nothing here imports torch unless a function needs it (``trace``,
``validate``).

>>> import memcalc
>>> b = memcalc.breakdown(impl="naive-softmax", seq_len=1024, batch=1)
>>> b.saved_bytes  # the softmax weights p: 1 x 1 x 1024 x 1024 x 4 B
4194304
>>> b.peak_phase
'backward'
"""

from __future__ import annotations


def _the_command() -> bool:
    """Whether this process is the ``memcalc`` command (``memcalc ...`` or ``python -m
    memcalc.cli ...``), not other code importing the package."""
    import os
    import sys

    argv = getattr(sys, "orig_argv", sys.argv)
    script = os.path.basename(sys.argv[0]) if sys.argv else ""
    module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""
    return script in ("memcalc", "memcalc.exe") or module in ("memcalc", "memcalc.cli")


def _interrupted() -> None:
    """Ctrl-C while the command starts, before ``memcalc.cli.main`` can catch it: its one
    line and status, as main's; imported by other code, the interrupt goes on."""
    if not _the_command():
        raise KeyboardInterrupt
    import sys

    print("memcalc: interrupted", file=sys.stderr)
    raise SystemExit(130)


try:
    from memcalc.api import (breakdown, compare, make_config, oom, sweep,  # noqa: F401
                             trace, validate)
    from memcalc.engine.work import memory_limit  # noqa: F401  (memcalc.memory_limit(None))
except KeyboardInterrupt:
    _interrupted()

__version__ = "0.1.0"
__all__ = ["breakdown", "compare", "make_config", "memory_limit", "oom", "sweep", "trace",
           "validate"]


try:
    import memcalc.analysis.budget  # noqa: F401  (registers how a Breakdown judges its fit)
    from memcalc.api import sign as _sign

    _sign()
except KeyboardInterrupt:
    _interrupted()
