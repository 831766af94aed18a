"""Validation: the model against the emulated trace (anywhere) or a live GPU run.

Importing this package does not import torch; the backends do, when called.
"""

from __future__ import annotations

from pathlib import Path

from memcalc.config import Config
from memcalc.timeline import predict
from memcalc.validate.compare import FIGURES, Check, Report
from memcalc.validate.grid import default_grid_path, load_grid


def validate(backend: str = "emulated", impls: list[str] | None = None,
             grid: str | Path | None = None, configs: list[Config] | None = None) -> Report:
    """Check every configuration of ``grid`` (default: the shipped grid), or ``configs``,
    against ``backend``: ``emulated`` (meta device, tolerance 0) or ``cuda`` (live)."""
    if configs is None:
        configs = load_grid(grid or default_grid_path()).expand(impls)
    if backend == "emulated":
        from memcalc.validate import emulated as runner
    elif backend == "cuda":
        from memcalc.validate import cuda as runner
    else:
        raise ValueError(f"unknown backend {backend!r}; known: emulated, cuda")
    checks = tuple(runner.check(c) for c in configs)
    return Report(backend=backend, environment=runner.environment(), checks=checks)


def figures_of(result) -> dict[str, int]:
    """The compared figures of a ``Breakdown`` (or anything with those attributes)."""
    return {k: getattr(result, k) for k in FIGURES}


__all__ = ["Check", "Report", "figures_of", "predict", "validate"]
