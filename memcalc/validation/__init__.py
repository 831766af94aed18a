"""Validation: the model against the emulated trace (anywhere) or a live GPU run.

Importing this package does not import torch; the backends do, when called.

May import: everything but ``plots``, ``cli`` and ``commands``.
"""

from __future__ import annotations

from pathlib import Path

from memcalc.config import Config
from memcalc.analysis.predict import predict
from memcalc.validation.compare import Check, Report, figures_of
from memcalc.validation.grid import default_grid, load_grid


def validate(backend: str = "emulated", impls: list[str] | None = None,
             grid: str | Path | None = None, configs: list[Config] | None = None,
             out: str | Path | None = None, max_seconds: float | None = None,
             cases: tuple[str, ...] | None = None, progress=None) -> Report:
    """Check every configuration of ``grid`` (default: the shipped grid), or ``configs``,
    against ``backend``: ``emulated`` (meta device, tolerance 0) or ``cuda`` (live: the
    model, the emulated trace and the live run side by side, plus the cases beyond the grid
    named in ``cases``, default all of ``cases.KINDS``; written to ``out`` after each
    case, resumed from it, stopped after ``max_seconds``). ``progress(items, total,
    description)`` wraps the emulated loop (``memcalc.output.progress``)."""
    shipped = configs is None and grid is None and impls is None
    if configs is None:
        configs = (load_grid(grid) if grid else default_grid()).expand(impls)
        if not configs and backend == "emulated" and impls:
            raise ValueError(f"--impl: the grid has no configuration of {', '.join(impls)}"
                             + _why_none(impls))
    if backend == "cuda":
        return _live(configs, impls, out, max_seconds, cases)
    if backend != "emulated":
        raise ValueError(f"unknown backend {backend!r}; known: emulated, cuda")
    from memcalc.validation import emulated as runner

    kinds = cases or ("grid",)
    configs = list(configs) if "grid" in kinds else []
    if progress is not None and configs:
        configs = progress(configs, len(configs), f"validate ({backend})")
    checks = tuple(runner.check(c) for c in configs)
    if "cp" in kinds:
        from memcalc.validation.context_parallel import checks as cp_checks

        checks += cp_checks(progress)
    if shipped and "grid" in kinds:  # the model code's fitted programs (oom --trace) too
        from memcalc.validation import fsdp, training
        from memcalc.validation.modelcode import fitted_checks

        checks += fitted_checks()
        checks += fitted_checks(training.training_code(), training.register(), "training")
        checks += fitted_checks(fsdp.fsdp_code(), fsdp.register(), "fsdp")
    return Report(backend=backend, environment=runner.environment(), checks=checks)


def _why_none(impls: list[str]) -> str:
    """Why a grid may hold none of ``impls``: kernels modelled from CUDA sources have no
    meta-device trace to check them against; said only when some are such kernels."""
    from memcalc.impls import get_impl

    untraced = [n for n in impls if not get_impl(n).traced]
    if not untraced:
        return ""
    return (f" ({', '.join(untraced)}: modelled from CUDA sources, no meta-device trace; "
            f"--backend cuda checks them)")


def _live(configs: list[Config], impls, out, max_seconds, kinds) -> Report:
    """The live run: CUDA checked first (one line if absent), then the device's used memory
    read before this process creates a CUDA context, then the session."""
    from memcalc.validation import cases, cuda, session
    from memcalc.validation.calibration import used_before_context

    torch = cuda._torch()
    used_before = used_before_context()
    gpu = cuda.LiveGpu(torch)

    def build(env, calibration):
        target = min(cases.OOM_CAPACITY, calibration.largest_allocation_bytes // 2)
        capacity = cuda.exact_capacity(target, calibration.total_memory_bytes)
        return cases.all_cases(kinds or cases.KINDS, configs, env, capacity, impls)

    return session.run(gpu, build, used_before, out, max_seconds)


def validate_target(fn, config: Config, calling, backend: str = "emulated",
                    gpu=None) -> Report:
    """One traced target's step (``memcalc validate --trace``; ``config.impl`` registered
    for ``fn`` called as ``calling``): the program ``oom --trace`` solves, fitted over
    lengths, against a direct trace (``emulated``) and, with ``backend="cuda"``, against
    the step run on the GPU under the protocol (``gpu``: a ``cuda.LiveGpu``, this
    machine's by default; none: a ``CudaUnavailable`` that says so in one line)."""
    from memcalc.validation.cases import Case, run_case

    if backend == "cuda":
        from memcalc.validation import cuda

        gpu = gpu or cuda.LiveGpu(cuda._torch())
        env = gpu.environment()
        case = Case("trace", cuda.live_config(config, env), fn, calling=calling)
        return Report(backend="cuda", environment=env, checks=(run_case(case, gpu),))
    from memcalc.validation import emulated

    case = Case("trace", config, fn, calling=calling)
    predicted, detail = case.model()
    traced, outcome, why = case.emulated()
    check = Check(config=config, predicted=predicted, measured=traced, outcome=outcome,
                  detail=why, case="trace", model_detail=detail)
    return Report(backend="emulated", environment=emulated.environment(), checks=(check,))


__all__ = ["Check", "Report", "figures_of", "predict", "validate", "validate_target"]


def write_report(report: Report, out: str | Path) -> Path:
    """Write the JSON report to ``out``, or into the directory ``out`` as
    ``<device>-<torch>.json`` (the layout of ``validation/results/``)."""
    from memcalc.validation.session import report_path

    path = report_path(out, report.environment)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report.model_dump_json(indent=2) + "\n")
    return path
