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


def _budget(config, gpu_gb=None, reserve=None):
    """The device budget: the preset's memory (or ``gpu_gb`` x 2^30 B) less ``reserve``
    (bytes, or a size string such as ``"1GiB"``; default 512 MiB)."""
    from memcalc.budget import Budget, parse_gb, parse_size

    memory = parse_gb(str(gpu_gb)) if gpu_gb is not None else None
    reserve_bytes = parse_size(str(reserve)) if isinstance(reserve, str) else reserve
    return Budget.of(config.device, reserve_bytes, memory)


def _names(values, field: str, known: list[str]) -> list[str]:
    """A list of names, each known; a ValueError naming ``field`` otherwise."""
    if isinstance(values, str) or not all(isinstance(v, str) for v in values):
        raise ValueError(f"{field}: a list of names, e.g. [{known[0]!r}] (got {values!r})")
    unknown = [v for v in values if v not in known]
    if unknown:
        raise ValueError(f"{field}: unknown {unknown[0]!r}; known: {', '.join(known)}")
    return list(values)


def _sizes(values, field: str) -> tuple[int, ...]:
    """A non-empty list of positive integers below 2^62; a ValueError naming ``field``."""
    ok = not isinstance(values, (str, int)) and len(values) > 0 and all(
        isinstance(v, int) and not isinstance(v, bool) and 0 < v < 2**62 for v in values)
    if not ok:
        raise ValueError(f"{field}: a non-empty list of integers from 1 to 2^62 - 1 "
                         f"(got {values!r})")
    return tuple(values)


def _impl_names() -> list[str]:
    from memcalc.impls import impl_names

    return impl_names()


def oom(*, gpu_gb=None, reserve=None, impls=None, solve: str = "seq_len", **options):
    """The largest seq_len (or ``solve="batch"``, ``"head_dim"``) whose step fits, per
    implementation: an ``OomReport``.

    >>> report = memcalc.oom(gpu_gb=80, impls=["naive"])
    >>> r = report.results[0]
    >>> (r.max_value, r.at_max.fits, r.at_next.fits)  # fits at N, not at N + 1
    (19511, True, False)
    """
    from memcalc.thresholds import solve as run

    if solve not in ("seq_len", "batch", "head_dim"):
        raise ValueError(f"solve: seq_len, batch or head_dim (got {solve!r})")
    if impls is not None:
        impls = _names(impls, "impls", _impl_names())
    config = make_config(**options)
    return run(config, _budget(config, gpu_gb, reserve), solve, impls)


def sweep(*, seq_lens=(256, 1024, 4096, 8192, 16384), head_dims=(), batches=(),
          head_counts=(), impls=(), dtypes=(), gpu_gb=None, reserve=None, **options):
    """The seeds' scaling table: every combination, exact, with OOM marks: a ``Sweep``.
    The lists are ``seq_lens``, ``head_dims``, ``batches``, ``head_counts``, ``impls`` and
    ``dtypes``; the other options (``heads=4``, ``batch=2``, ...) fix the rest.

    >>> table = memcalc.sweep(seq_lens=(8192, 16384))
    >>> table.rows[1].peak_bytes  # 6 x 8 x 16384^2 x 4 + rows + 2 workspaces + 7 (8, N, 16)
    51658620928
    """
    from memcalc.config import DType
    from memcalc.scaling import sweep as run

    seq_lens = _sizes(seq_lens, "seq_lens (seq_len)")
    head_dims, batches, head_counts = (_sizes(v, f) if len(v) else () for v, f in (
        (head_dims, "head_dims"), (batches, "batches"), (head_counts, "head_counts")))
    impls = _names(impls, "impls", _impl_names()) if len(impls) else ()
    dtypes = _names(dtypes, "dtypes (dtype)", [t.value for t in DType]) if len(dtypes) else ()
    config = make_config(**options)
    return run(config, _budget(config, gpu_gb, reserve), seq_lens, head_dims, batches,
               head_counts, impls, dtypes)


def compare(*, gpu_gb=None, reserve=None, impls=None, baseline: str = "naive", **options):
    """Every implementation side by side against ``baseline``: a ``Comparison``.

    >>> rows = memcalc.compare(seq_len=4096, impls=["naive", "naive-softmax"]).rows
    >>> [(r.impl, r.breakdown.saved_bytes) for r in rows]  # 8 x 4096^2 x 4 B = 536,870,912
    [('naive', 1074135040), ('naive-softmax', 536870912)]

    (naive: ``exp_x`` and ``p``, plus the row sum 8 x 4096 x 4 B and the int64 argmax
    8 x 4096 x 8 B: 2 x 536,870,912 + 131,072 + 262,144.)
    """
    from memcalc.comparison import compare as run

    known = _impl_names()
    if impls is not None:
        impls = _names(impls, "impls (impl)", known)
    _names([baseline], "baseline", known)
    config = make_config(**options)
    return run(config, _budget(config, gpu_gb, reserve), impls, baseline)


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
