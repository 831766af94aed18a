"""Which tensors are "N x M": the one definition, used by every table and the grid path.

A tensor is N x M when its size grows with the product of the query and key lengths: at
least three times larger when both double (a tensor linear in them only doubles). Reading
the growth of the program, not the shape, keeps ``phi(q)`` of shape ``(B, H, N, d)`` out
when ``d`` happens to equal ``N``.
"""

from __future__ import annotations

from functools import lru_cache

from memcalc.impls import get_impl
from memcalc.impls.registry import Impl
from memcalc.impls.ring import step_program
from memcalc.engine.program import Tensor

PROBE = 4096  # the length the growth is measured from (N = M = 4096, then 8192)


def quadratic_names(config) -> frozenset[str]:
    """Names of ``config``'s N x M tensors. Empty when the program's tensors change with
    the length (a loop over chunks): then nothing is counted as N x M."""
    d = config.dims
    return _names(get_impl(config.impl), d.replace(N=PROBE, M=PROBE))


@lru_cache(maxsize=256)
def _names(impl: Impl, d) -> frozenset[str]:
    """Keyed by the registered implementation, not its name: a function traced again is
    registered anew under the same name (``Impl.program`` keys its cache the same way)."""
    small, large = _tensors(impl, d), _tensors(impl, d.replace(N=2 * d.N, M=2 * d.M))
    if [t.name for t in small] != [t.name for t in large]:
        return frozenset()
    return frozenset(a.name for a, b in zip(small, large) if 0 < 3 * a.bytes <= b.bytes)


def _tensors(impl: Impl, d) -> list[Tensor]:
    """The step's tensors, what exists before it included (a BlockMask's block indices,
    ``(N/128, M/128)``, grow as N x M too); under ``--cp`` a rank's (DeepSpeed-Ulysses' math
    path holds every row's scores)."""
    program = step_program(impl, d)
    return [e for e in (*(program.inputs or ()), *program.forward, *program.backward)
            if isinstance(e, Tensor)]


def quadratic_saved(breakdown) -> int:
    """How many of the tensors saved for backward are N x M."""
    names = quadratic_names(breakdown.config)
    return sum(c.name in names for c in breakdown.saved)
