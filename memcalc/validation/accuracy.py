"""The accuracy page: every recorded GPU run (``validation/results/``) against today's model.

A live report (``memcalc validate --backend cuda --out``) is given back case by case by
``memcalc.validation.recorded.recheck``, with the rules of the torch release that ran it;
the page counts, per device and torch and per case kind, the cases run and those whose
five figures the model gives back exactly, and lists every other with why. The other
recorded runs (rank-by-rank context parallelism, FlexAttention, the allocator's own event
histories...) are kept in formats of their own, each given back by a test named here.

    python -m memcalc.validation.accuracy [validation/results]   (Markdown on stdout)
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

OTHERS = {  # file prefix: (what the file records, the test that gives it back)
    "cp-": ("context parallelism rank by rank (torch's ring attention, Ulysses)",
            "tests/test_validate_context_parallel.py"),
    "flex-": ("FlexAttention's compiled kernels, by block mask",
              "tests/test_impls_flex.py"),
    "history-": ("the caching allocator's own event history (every block, the reductions' "
                 "buffers)", "tests/test_reductions.py"),
    "nccl-": ("NCCL's stashed buffers of a collective", "tests/test_tracing_collectives.py"),
    "emulated-": ("the emulated grid on PyTorch's meta device (no GPU)",
                  "tests/test_validate_emulated.py"),
}


def live_reports(folder: Path) -> list[tuple[Path, dict]]:
    """The live (cuda) reports of ``folder``, by file name."""
    found = []
    for path in sorted(folder.glob("*.json")):
        report = json.loads(path.read_text())
        if isinstance(report, dict) and report.get("backend") == "cuda" and "checks" in report:
            found.append((path, report))
    return found


def tally(report: dict) -> tuple[list[tuple[str, int, int]], list[tuple[str, str, str]]]:
    """Per case kind ``(kind, cases run, given back)``, and each case not given back as
    ``(kind, implementation, why)``."""
    from memcalc.validation.recorded import recheck

    run = Counter(c["case"] for c in report["checks"] if c["outcome"] in ("measured", "oom"))
    missed = [(kind, impl, _why(found)) for kind, impl, found in recheck(report)]
    wrong = Counter(kind for kind, _, _ in missed)
    return [(kind, n, n - wrong[kind]) for kind, n in run.items()], missed


def _why(found) -> str:
    if isinstance(found, str):
        return found
    return "live minus model: " + ", ".join(f"{k} {v:+,} B" for k, v in found.items())


def page(folder: Path) -> str:
    """The accuracy page's generated part, Markdown."""
    live = live_reports(folder)
    return "\n".join(_live_table(live) + _other_table(folder, {p.name for p, _ in live})) + "\n"


def _live_table(live: list[tuple[Path, dict]]) -> list[str]:
    """Cases run and given back per device, torch and kind (the reports of a device and
    release added up), then the cases not given back, alike ones on one line."""
    runs: Counter = Counter()
    equal: Counter = Counter()
    missed: dict[tuple, list[str]] = {}
    for _, report in live:
        env = report["environment"]
        kinds, differ = tally(report)
        for kind, n, same in kinds:
            runs[env["device"], env["torch"], kind] += n
            equal[env["device"], env["torch"], kind] += same
        for kind, impl, why in differ:
            missed.setdefault((env["device"], kind, why), []).append(impl)
    lines = ["## Live runs, given back by today's model", "",
             "| device | torch | case kind | cases run | figures all equal |",
             "|---|---|---|---:|---:|"]
    lines += [f"| {d} | {t} | {k} | {n:,} | {equal[d, t, k]:,} |"
              for (d, t, k), n in sorted(runs.items())]
    lines += ["", "Each case compares five figures (saved for backward, the forward and backward "
              "peaks, `max_memory_allocated`, `max_memory_reserved`) with tolerance 0; an "
              "out-of-memory case, that the model does not fit the length the GPU could not.",
              "", "## What differed, and why", ""]
    lines += [f"- {device}, {kind}, {len(impls)} cases ({', '.join(dict.fromkeys(impls))}): {why}"
              for (device, kind, why), impls in missed.items()] or [
        "Nothing: every case is given back."]
    return lines


def _other_table(folder: Path, live: set[str]) -> list[str]:
    """The recorded runs in formats of their own (not ``live``, the live reports' file
    names), each with the test that gives it back."""
    lines = ["", "## The other recorded runs", "",
             "| file | what it records | given back by |", "|---|---|---|"]
    for path in sorted(folder.glob("*.json")):
        what = next((v for k, v in OTHERS.items() if path.name.startswith(k)), None)
        if path.name not in live and what:
            lines.append(f"| `{path.name}` | {what[0]} | `{what[1]}` |")
    return lines


if __name__ == "__main__":
    from memcalc.errors import run_main

    run_main(lambda folder: sys.stdout.write(page(Path(folder))) and 0,
             sys.argv[1] if len(sys.argv) > 1 else "validation/results")
