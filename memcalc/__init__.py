"""memcalc: how much GPU memory one attention training step takes, to the byte.

The functions here take the same options as the ``memcalc`` command (``seq_len`` is the
CLI's ``--seq``) and return result objects that render themselves in a terminal (rich)
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

from typing import Callable

# The submodule ``memcalc.breakdown`` shares its name with the function below. Importing
# it first, then defining the function, leaves the name bound to the function (a later
# import of a loaded submodule does not rebind it).
import memcalc.breakdown  # noqa: E402,F401  (light: pydantic models only)

__version__ = "0.1.0"


def make_config(**options):
    """The ``Config`` for these options, validated (``memcalc.config.make_config``).

    >>> memcalc.make_config(seq_len=4096, dtype="bf16").shape.seq_len
    4096
    """
    from memcalc.config import make_config as make

    return make(**options)


def breakdown(**options):
    """What one forward and backward step allocates: a ``Breakdown``.

    >>> b = memcalc.breakdown(impl="naive", seq_len=16384)
    >>> b.saved_bytes  # exp_x and p (2 x 8 x 16384^2 x 4 B), row sum and int64 argmax
    17181442048
    >>> [c.name for c in b.components][:2]
    ['exp_x', 'dp']
    """
    from memcalc.timeline import predict

    return predict(make_config(**options))


def trace(fn: Callable, **options):
    """The breakdown of your own ``fn(q, k, v)``, traced on the meta device (needs torch).

    >>> import math, torch
    >>> def attn(q, k, v):
    ...     return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), -1) @ v
    >>> memcalc.trace(attn, seq_len=1024, batch=1).saved_bytes  # p: 1024 x 1024 x 4 B
    4194304
    """
    from memcalc.tracing import register_function, trace as run

    name = register_function(fn, getattr(fn, "__qualname__", "function"))
    return run(fn, make_config(**{**options, "impl": name}))


def validate(backend: str = "emulated", impls: list[str] | None = None, grid=None):
    """Check predictions against the emulated trace or a live GPU: a ``Report``.

    >>> report = memcalc.validate(impls=["naive-weights"])
    >>> report.mismatches
    0
    """
    from memcalc.validation import validate as run

    return run(backend=backend, impls=impls, grid=grid)
