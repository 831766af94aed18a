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


try:
    from memcalc import errors as _errors

    _errors.hold()  # Ctrl-C from here on: answered by memcalc.cli.main, or at the end
    try:
        from memcalc.api import (breakdown, compare, make_config, oom, sweep,  # noqa: F401
                                 trace, validate)
        from memcalc.config import Mesh, Step  # noqa: F401  (trace(mesh=..., step=...))
        from memcalc.engine.work import memory_limit  # noqa: F401  (memcalc.memory_limit(None))
        import memcalc.analysis.budget  # noqa: F401  (registers how a Breakdown judges its fit)
        from memcalc.api import sign as _sign

        _sign()
    finally:
        if not _errors.the_command():  # imported by other code: its interrupt, now
            _errors.release()
except KeyboardInterrupt:  # where SIGINT cannot be held, or before it was
    from memcalc.errors import interrupted

    interrupted()

__version__ = "0.1.0"
__all__ = ["Mesh", "Step", "breakdown", "compare", "make_config", "memory_limit", "oom", "sweep",
           "trace", "validate"]
