"""The model of today against a live run recorded before: no GPU needed.

A live report (``memcalc validate --backend cuda --out``) keeps, for every case, the
configuration and the five figures the GPU measured. ``recheck`` computes the model's
figures for each again, with the rules of the torch release that ran it (the SDPA
selection, the cuBLASLt workspace), and lists where they differ:

    python -m memcalc.validation.recorded validation/results/nvidia-h200-2.11.0-cu130.json

Model code recorded before ``parameter_grads`` appeared in a report's environment ran with
the module's parameter grads kept from the warm-up step (``memcalc.validation.cuda``,
``measure``): those cases are listed as not comparable.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from memcalc.config import Config

KEPT_GRADS = "model code: the recorded run kept the parameters' grads (harness before the fix)"
TRACED = ("usercode", "modelcode", "training", "compiled")  # cases whose model is the tracer


def recheck(report: dict) -> list[tuple[str, str, dict | str]]:
    """``(kind, implementation, differences)`` for every measured case of ``report`` whose
    figures the model does not give back (differences: live minus model, by figure; or why
    the case cannot be compared)."""
    from memcalc.analysis.budget import fit
    from memcalc.analysis.predict import predict

    env = report["environment"]
    traced = {(c.kind, c.config.model_dump_json()): c for c in _user_cases(report)}
    found = []
    for check in report["checks"]:
        kind = check["case"]
        if check["outcome"] == "oom":  # an OOM threshold's N + 1: the model must not fit it
            config = Config.model_validate(check["config"])
            if fit(config, check["capacity_bytes"]).fits:
                found.append((kind, config.impl, "fits where the GPU ran out of memory"))
            continue
        if check["outcome"] != "measured":
            continue
        if kind == "modelcode" and "parameter_grads" not in env:
            found.append((kind, check["config"]["impl"], KEPT_GRADS))
            continue
        if kind in TRACED:
            case = traced[(kind, Config.model_validate(check["config"]).model_dump_json())]
            model = _traced_figures(case, env)
        else:
            model = predict(Config.model_validate(check["config"])).figures()
        live = check["measured"]
        differences = {k: live[k] - model[k] for k in live if live[k] != model[k]}
        if differences:
            found.append((kind, check["config"]["impl"], differences))
    return found


def _user_cases(report: dict) -> list:
    """The user- and model-code cases of the report's device, which register their names."""
    from memcalc.validation.cases import all_cases

    kinds = tuple({c["case"] for c in report["checks"]} & set(TRACED))
    return all_cases(kinds, [], report["environment"], 0) if kinds else []


def _traced_figures(case, env: dict) -> dict:
    """The tracer's figures of ``case`` under the rules of the release that ran it; a
    compiled case compiled by the installed torch's compiler (inductor's choices are its
    release's: a run recorded on another is compared with this one's)."""
    from memcalc.tracing import Calling, TraceOptions, prepared, trace
    from memcalc.impls.sdpa_select import Release

    options = TraceOptions(release=Release.of(env["torch"]))
    with case.compiling():
        fn = prepared(case.fn, case.config.impl) if case.calling else case.fn
        return trace(fn, case.config, options, calling=case.calling or Calling()).figures()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        raise ValueError("give one report: python -m memcalc.validation.recorded REPORT.json")
    report = json.loads(Path(argv[0]).read_text())
    found = recheck(report)
    for kind, impl, differences in found:
        print(f"{kind:10} {impl:32} {differences}")
    compared = sum(c["outcome"] in ("measured", "oom") for c in report["checks"])
    print(f"{compared} cases measured or out of memory, {len(found)} not given back by the "
          "model")
    return 1 if found else 0


if __name__ == "__main__":
    from memcalc.errors import run_main

    run_main(main, sys.argv[1:])
