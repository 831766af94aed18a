"""Validation: the model against the emulated trace (anywhere) or a live GPU run.

Importing this package does not import torch; the backends do, when called.
"""

from __future__ import annotations

from pathlib import Path

from memcalc.config import Config
from memcalc.timeline import predict
from memcalc.validation.compare import FIGURES, Check, Report, figures_of
from memcalc.validation.grid import default_grid, load_grid


def validate(backend: str = "emulated", impls: list[str] | None = None,
             grid: str | Path | None = None, configs: list[Config] | None = None,
             progress=None) -> Report:
    """Check every configuration of ``grid`` (default: the shipped grid), or ``configs``,
    against ``backend``: ``emulated`` (meta device, tolerance 0) or ``cuda`` (live).
    ``progress(items, total, description)`` wraps the loop (``memcalc.progress``)."""
    if configs is None:
        configs = (load_grid(grid) if grid else default_grid()).expand(impls)
    if backend == "emulated":
        from memcalc.validation import emulated as runner
    elif backend == "cuda":
        from memcalc.validation import cuda as runner
    else:
        raise ValueError(f"unknown backend {backend!r}; known: emulated, cuda")
    configs = list(configs)
    if progress is not None:
        configs = progress(configs, len(configs), f"validate ({backend})")
    checks = tuple(runner.check(c) for c in configs)
    return Report(backend=backend, environment=runner.environment(), checks=checks)


__all__ = ["Check", "Report", "figures_of", "predict", "validate"]


def write_report(report: Report, out: str | Path) -> Path:
    """Write the JSON report to ``out``, or into the directory ``out`` as
    ``<device>-<torch>.json`` (the layout of ``validation/results/``)."""
    path = Path(out)
    if path.is_dir() or str(out).endswith("/"):
        device = report.environment.get("device", report.backend)
        slug = "".join(ch if ch.isalnum() else "-" for ch in device.lower()).strip("-")
        torch_version = report.environment.get("torch", "unknown").replace("+", "-")
        path = path / f"{slug}-{torch_version}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report.model_dump_json(indent=2) + "\n")
    return path
