"""A live validation run that fits in short time slots.

It calibrates the device's budget first (before anything else touches the GPU), builds
the cases (``cases.py``), and runs them in order until ``max_seconds`` have passed. After
each case the whole report is rewritten (atomically) to ``<gpu>-<torch>.json``; a rerun
with the same output finds the cases already there, skips them and goes on, so a long
validation is a sequence of ten-minute runs. Each run appends its own calibration.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

from memcalc.validation.compare import Check, Report


def report_path(out: str | Path, environment: dict[str, str]) -> Path:
    """``out`` itself, or inside the directory ``out``: ``<device>-<torch>.json`` (device
    name and torch version in lower case, other characters as ``-``)."""
    path = Path(out)
    if not (path.is_dir() or str(out).endswith("/")):
        return path
    device = environment.get("device", "unknown")
    slug = "".join(ch if ch.isalnum() else "-" for ch in device.lower()).strip("-")
    torch_version = environment.get("torch", "unknown").replace("+", "-")
    return path / f"{slug}-{torch_version}.json"


def load_previous(path: Path, environment: dict[str, str]) -> Report | None:
    """The report a previous run left at ``path``, if any; it must come from the same
    environment (a ValueError naming the file otherwise)."""
    if not path.exists():
        return None
    from memcalc.validation.modelcode import register as register_models
    from memcalc.validation.training import register as register_training
    from memcalc.validation.usercode import register

    register()  # its cases name the user-code implementations
    register_models()  # and the model code's
    register_training()  # and the training steps'
    try:
        report = Report.model_validate_json(path.read_text())
    except ValueError as error:
        from memcalc.errors import one_line

        raise ValueError(f"--out {path}: not a validation report ({one_line(error)})") from None
    changed = sorted(k for k in set(report.environment) | set(environment)
                     if report.environment.get(k) != environment.get(k))
    if changed:
        raise ValueError(f"--out {path}: recorded in another environment ({', '.join(changed)} "
                         "differ); move it away or give another --out")
    return report


class _Writer:
    """Rewrites the report after each case; each check is serialized once."""

    def __init__(self, path: Path | None, previous: Report | None):
        self.path = path
        self.checks: list[Check] = list(previous.checks) if previous else []
        self.texts = [c.model_dump_json() for c in self.checks]

    def add(self, check: Check) -> None:
        self.checks.append(check)
        self.texts.append(check.model_dump_json())

    def write(self, report: Report) -> None:
        if self.path is None:
            return
        head = report.model_dump(mode="json", exclude={"checks"})
        text = json.dumps({**head, "checks": "@"}, indent=2)
        text = text.replace('"checks": "@"', '"checks": [\n' + ",\n".join(self.texts) + "\n]")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(self.path.name + ".tmp")
        temporary.write_text(text + "\n")
        os.replace(temporary, self.path)


def run(gpu, build_cases: Callable, used_before: tuple[int | None, str],
        out: str | Path | None = None, max_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic) -> Report:
    """Calibrate ``gpu`` (``cuda.LiveGpu``), then run ``build_cases(env, calibration)``'s
    cases not yet in the report at ``out`` until ``max_seconds`` have passed."""
    from memcalc.validation.cases import run_case

    start = clock()
    env = gpu.environment()
    path = report_path(out, env) if out is not None else None
    previous = load_previous(path, env) if path is not None else None
    calibration = gpu.calibrate(used_before)
    calibrations = (previous.calibrations if previous else ()) + (calibration,)
    writer = _Writer(path, previous)
    done = {c.key for c in writer.checks}
    todo = [c for c in build_cases(env, calibration) if c.key not in done]
    report = lambda complete: Report(backend="cuda", environment=env,  # noqa: E731
                                     checks=tuple(writer.checks), calibrations=calibrations,
                                     complete=complete)
    for case in todo:
        if max_seconds is not None and clock() - start >= max_seconds:
            writer.write(report(False))
            return report(False)
        writer.add(run_case(case, gpu))
        writer.write(report(False))
    free = gpu.free_bytes()
    calibrations = calibrations[:-1] + (
        calibration.model_copy(update={"free_after_run_bytes": free}),)
    writer.write(report(True))
    return report(True)
