"""Predicted against measured, figure by figure, with a declared tolerance.

On the live backend each configuration has three columns: the model (memcalc's prediction),
the emulated trace of the same code on the installed torch (meta device, allocator model),
and the live run. A difference is attributed by where it appears: model vs emulated is a
difference of torch releases (the model encodes one release's backward formulas), emulated
vs live one of the allocator, a workspace or a kernel (what the meta device cannot see).
"""

from __future__ import annotations

from typing import Literal

from pydantic import computed_field

from memcalc.analysis.breakdown import FIGURES, OPTIMIZER_PEAK, figure_names
from memcalc.output.result import Result
from memcalc.config import Config
from memcalc.output.render import Column, Table, record_table
from memcalc.validation.calibration import Calibration

Outcome = Literal["measured", "oom", "error", "absent"]

# causes of a difference, by the columns it appears between
RELEASE = "torch release"  # model != emulated: the installed torch's formulas differ
WORKSPACE = "workspace"  # emulated != live by a whole number of cuBLAS workspaces
ALLOCATOR = "allocator"  # only the reserved peak differs: segments, not tensors
KERNEL = "allocator or kernel"  # any other emulated != live: block sizes, kernel temporaries
UNTRACED = "no emulated trace"  # model != live and nothing in between to tell why
FITTED = "fitted program"  # a traced step's program (oom --trace's) != its direct trace
# cases whose model is the program fitted over lengths and whose emulated column is a
# direct trace (training steps, a target validated with --trace)
FITTED_KINDS = ("training", "trace")


def case_key(case: str, config: Config, capacity: int | None) -> str:
    """What identifies one run in a results file (a rerun skips the keys it finds)."""
    return f"{case}|{capacity}|{config.model_dump_json()}"



def figures_of(result) -> dict[str, int]:
    """The compared figures of a ``Breakdown`` (or anything with those attributes):
    ``FIGURES``, and a training step's optimizer peak (``figure_names``)."""
    return {k: getattr(result, k) for k in figure_names(result)}

class Check(Result):
    """One configuration: the model's figures and the backend's, or why there are none.
    ``predicted`` is the model (None: it does not cover this case, ``model_detail`` says
    why), ``measured`` the backend's run (the emulated trace, or the live GPU)."""
    config: Config
    predicted: dict[str, int] | None
    measured: dict[str, int] | None = None
    tolerance: int = 0
    outcome: Outcome = "measured"
    detail: str = ""
    case: str = "grid"  # grid | fused | usercode | modelcode | training | trace | oom-threshold
    model_detail: str = ""
    # live backend only (None elsewhere): the meta-device trace on the installed torch
    emulated: dict[str, int] | None = None
    emulated_outcome: Outcome | None = None
    emulated_detail: str = ""
    # OOM threshold cases: the allocator's cap and the model's verdict under it
    capacity_bytes: int | None = None
    expected: Literal["fits", "oom"] | None = None
    # live: bytes an op held beyond its outputs while it ran (kernel workspaces), by op
    scratch: dict[str, int] = {}

    @property
    def key(self) -> str:
        return case_key(self.case, self.config, self.capacity_bytes)

    @computed_field
    @property
    def differences(self) -> dict[str, int]:
        """measured - predicted, in bytes, per figure."""
        if self.measured is None or self.predicted is None:
            return {}
        return {k: self.measured[k] - self.predicted[k] for k in self.measured
                if k in self.predicted}

    @computed_field
    @property
    def attribution(self) -> dict[str, str]:
        """Live backend: the cause of each differing figure (``fits`` for a wrong OOM
        verdict), from the column where the difference appears."""
        if self.emulated_outcome is None:
            return {}
        causes = {k: self._cause(k) for k, d in self.differences.items() if d}
        if self.expected is not None and self.live_verdict != self.expected:
            causes["fits"] = self._verdict_cause()
        return causes

    def _cause(self, figure: str) -> str:
        if self.emulated is None:
            return UNTRACED
        first = FITTED if self.case in FITTED_KINDS else RELEASE
        parts = [first] if self.predicted[figure] != self.emulated[figure] else []
        gap = self.measured[figure] - self.emulated[figure]
        if gap:
            parts.append(self._live_cause(figure, gap))
        return " + ".join(parts)

    def _live_cause(self, figure: str, gap: int) -> str:
        """Emulated vs live: a whole number of workspaces is the workspace rule, any other
        allocated difference a block size or a kernel; the reserved peak follows the
        allocated figures' causes, and differing alone it is the allocator's segments."""
        if figure == "reserved_peak_bytes":
            gaps = {k: self.measured[k] - self.emulated[k] for k in self.measured
                    if k != figure and k in self.emulated}
            causes = sorted({self._live_cause(k, g) for k, g in gaps.items() if g})
            return " / ".join(causes) or ALLOCATOR
        return WORKSPACE if gap % self.config.workspace_bytes == 0 else KERNEL

    def _verdict_cause(self) -> str:
        emulated = {"measured": "fits", "oom": "oom"}.get(self.emulated_outcome)
        if emulated is None:
            return UNTRACED
        parts = [RELEASE] if emulated != self.expected else []
        return " + ".join(parts + ([KERNEL] if emulated != self.live_verdict else []))

    @property
    def live_verdict(self) -> str | None:
        return {"measured": "fits", "oom": "oom"}.get(self.outcome)

    @computed_field
    @property
    def ok(self) -> bool:
        """Within tolerance on every figure; an OOM is not a mismatch, an error is. An
        OOM threshold case is ok when the run fits or fails as the model said; a case
        the model does not cover is a record, ok unless the run failed."""
        if self.expected is not None:
            return self.live_verdict == self.expected
        if self.outcome == "oom":
            return True
        if self.predicted is None:
            return self.outcome == "measured"
        return self.outcome == "measured" and all(
            abs(d) <= self.tolerance for d in self.differences.values())

    def verdict(self) -> str:
        if self.outcome == "error" or not self.ok:
            return "MISMATCH" if self.outcome != "error" else "error"
        if self.expected is not None:
            return f"ok ({self.expected})"
        return "recorded" if self.predicted is None else (
            "oom" if self.outcome == "oom" else "ok")


def _label(check: Check) -> str:
    """``naive: B=2 H=1 N=256 d=16 fp32 on h100-80gb`` (``Config.label``), and the capacity
    an OOM case is run under."""
    c = check.config
    cap = f" cap={check.capacity_bytes}" if check.capacity_bytes else ""
    rank = f", {check.detail}" if check.case.startswith("cp rank") else ""
    return f"{c.impl}: {c.label()}{rank} on {c.device.gpu or 'live'}{cap}"


def _worst(check: Check) -> str:
    if check.outcome != "measured":
        return check.outcome
    return str(max(check.differences.values(), key=abs, default=0))


def _peak(figures: dict[str, int] | None, outcome: str | None = "measured"):
    return figures["peak_bytes"] if figures else (outcome or "-")


REPORT_COLUMNS = [
    Column("configuration", _label, wrap=True),
    Column("peak predicted", lambda c: _peak(c.predicted, "-"), "right", drop=2),
    Column("peak measured", lambda c: (c.measured or {}).get("peak_bytes", "-"), "right", drop=1),
    Column("largest difference (B)", _worst, "right"),
    Column("verdict", lambda c: "ok" if c.ok else "MISMATCH"),
]

LIVE_COLUMNS = [
    Column("case", lambda c: c.case, drop=3),
    Column("configuration", _label, wrap=True),
    Column("model peak", lambda c: _peak(c.predicted, "-"), "right", drop=2),
    Column("emulated peak", lambda c: _peak(c.emulated, c.emulated_outcome), "right", drop=1),
    Column("live peak", lambda c: _peak(c.measured, c.outcome), "right"),
    Column("live - model (B)", _worst, "right"),
    Column("attribution", lambda c: "; ".join(f"{k.removesuffix('_bytes')}: {v}"
                                              for k, v in c.attribution.items()),
           wrap=True, drop=4),
    Column("verdict", Check.verdict),
]


class Report(Result):
    """A validation run: the backend, its environment and one check per configuration;
    a live run also records the device's budget calibration (one per run) and whether
    it got through every case or stopped at ``--max-seconds``."""
    backend: str
    environment: dict[str, str]
    checks: tuple[Check, ...]
    calibrations: tuple[Calibration, ...] = ()
    complete: bool = True

    @computed_field
    @property
    def mismatches(self) -> int:
        return sum(not c.ok for c in self.checks)

    @computed_field
    @property
    def causes(self) -> dict[str, int]:
        """How many configurations each cause of a difference appears in."""
        counts: dict[str, int] = {}
        for check in self.checks:
            for cause in sorted(set(check.attribution.values())):
                counts[cause] = counts.get(cause, 0) + 1
        return counts

    @property
    def ok(self) -> bool:
        return self.mismatches == 0

    def summary(self) -> str:
        figures = sum(len(c.differences) or len(FIGURES) for c in self.checks)
        text = (f"{self.backend}: {len(self.checks)} configurations, {figures} figures, "
                f"{self.mismatches} mismatches")
        if self.causes:
            text += "; differences by cause: " + ", ".join(
                f"{k} {v}" for k, v in self.causes.items())
        if not self.complete:
            text += "; stopped at --max-seconds: run again to resume"
        return text

    def _columns(self) -> list[Column]:
        return LIVE_COLUMNS if self.backend == "cuda" else REPORT_COLUMNS

    def _shown(self) -> list[Check]:
        """Up to 50 mismatches first, then up to 20 others: all are in the JSON."""
        bad = [c for c in self.checks if not c.ok][:50]
        return bad + [c for c in self.checks if c.ok][: max(0, 20 - len(bad))]

    def tables(self) -> list[Table]:
        env = ", ".join(f"{k}={v}" for k, v in self.environment.items())
        if len(self.checks) == 1 and self.checks[0].case == "trace":
            return [figure_table(self.checks[0], self.backend, f"{self.summary()}\n{env}")]
        return [Table(f"{self.summary()}\n{env}", self._columns(), self._shown())]

    def csv_table(self) -> Table:
        return record_table(RECORD_KEYS, self.records())

    def footnotes(self) -> list[str]:
        from memcalc.output.results import caveats

        shown = len(self._shown())
        more = [f"{shown} of {len(self.checks)} configurations shown (mismatches first); "
                "--json, --csv or --out give them all"] if shown < len(self.checks) else []
        calibrations = [c.describe() for c in self.calibrations]
        return (more + calibrations + [self.summary()]
                + (caveats([]) if self.backend != "cuda" else []))

    def headline(self) -> str:
        return self.summary()

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")

    def records(self) -> list[dict]:
        """One dict per configuration (``RECORD_KEYS``, the CSV's columns): the case, the
        configuration, the outcome and verdict, the peaks (None where not run), and per
        figure the difference (live or emulated less model) and its cause."""
        return [_record(c) for c in self.checks]


RECORD_KEYS = ("case", "configuration", "impl", "batch", "heads", "seq_len", "head_dim", "dtype",
               "causal", "gpu", "outcome", "verdict", "ok", "predicted_peak_bytes",
               "emulated_peak_bytes",
               "measured_peak_bytes", *(f"diff_{k}" for k in (*FIGURES, OPTIMIZER_PEAK)),
               *(f"cause_{k}" for k in (*FIGURES, OPTIMIZER_PEAK)))


def _record(c: Check) -> dict:
    """``Report.records``' row of one check."""
    peak = lambda figures: figures["peak_bytes"] if figures else None  # noqa: E731
    shape = c.config.shape
    row = {"case": c.case, "configuration": _label(c), "impl": c.config.impl,
           "batch": shape.batch, "heads": shape.heads, "seq_len": shape.seq_len,
           "head_dim": shape.head_dim, "dtype": c.config.dtype.value,
           "causal": c.config.causal, "gpu": c.config.device.gpu, "outcome": c.outcome,
           "verdict": c.verdict(),
           "ok": c.ok, "predicted_peak_bytes": peak(c.predicted),
           "emulated_peak_bytes": peak(c.emulated), "measured_peak_bytes": peak(c.measured),
           **{f"diff_{k}": v for k, v in c.differences.items()},
           **{f"cause_{k}": v for k, v in c.attribution.items()}}
    return {key: row.get(key) for key in RECORD_KEYS}


def figure_table(check: Check, backend: str, title: str) -> Table:
    """One traced target's check figure by figure (``memcalc validate --trace``): the
    program ``oom --trace`` solves, the direct trace and, live, the GPU's run, with the
    difference from the first and where it comes from."""
    from memcalc.output.results import FIGURE_LABELS

    live = backend == "cuda"
    traced = check.emulated if live else check.measured
    keys = [k for k in FIGURE_LABELS if k in (check.predicted or traced or {})]
    columns = [Column("figure", lambda k: FIGURE_LABELS[k]),
               Column("oom --trace's program", lambda k: _cell(check.predicted, k), "right"),
               Column("memcalc trace", lambda k: _cell(traced, k), "right", drop=1)]
    if live:
        columns.append(Column("this GPU", lambda k: _cell(check.measured, k), "right"))
    columns += [Column("difference (B)", lambda k: check.differences.get(k, "-"), "right"),
                Column("cause", lambda k: check.attribution.get(k, ""), wrap=True, drop=2)]
    notes = [f"{_label(check)}: {check.verdict()}"] + [
        f"{what}: {text}" for what, text in (("model", check.model_detail),
                                            ("run", check.detail),
                                            ("trace", check.emulated_detail)) if text]
    return Table(title, columns, keys, notes)


def _cell(figures: dict[str, int] | None, key: str):
    return figures.get(key, "-") if figures else "-"
