"""Predicted against measured, figure by figure, with a declared tolerance."""

from __future__ import annotations

from pydantic import computed_field

from memcalc.breakdown import FIGURES, Result
from memcalc.config import Config
from memcalc.render import Column, Table



def figures_of(result) -> dict[str, int]:
    """The compared figures of a ``Breakdown`` (or anything with those attributes)."""
    return {k: getattr(result, k) for k in FIGURES}

class Check(Result):
    """One configuration: the model's figures and the backend's, or why there are none."""
    config: Config
    predicted: dict[str, int]
    measured: dict[str, int] | None = None
    tolerance: int = 0
    outcome: str = "measured"  # measured | oom | error
    detail: str = ""

    @computed_field
    @property
    def differences(self) -> dict[str, int]:
        """measured - predicted, in bytes, per figure."""
        if self.measured is None:
            return {}
        return {k: self.measured[k] - self.predicted[k] for k in FIGURES if k in self.measured}

    @computed_field
    @property
    def ok(self) -> bool:
        """Within tolerance on every figure; an OOM is not a mismatch, an error is."""
        if self.outcome == "oom":
            return True
        return self.outcome == "measured" and all(
            abs(d) <= self.tolerance for d in self.differences.values())


def _label(check: Check) -> str:
    c = check.config
    s = c.shape
    causal = " causal" if c.causal else ""
    loss = " sum-loss" if c.protocol.loss == "sum" else ""
    return (f"{c.impl}{causal}{loss} B={s.batch} H={s.heads} N={s.seq_len} d={s.head_dim} "
            f"{c.dtype.value} {c.device.gpu}")


def _worst(check: Check) -> str:
    if check.outcome != "measured":
        return check.outcome
    return str(max(check.differences.values(), key=abs, default=0))


REPORT_COLUMNS = [
    Column("configuration", _label, wrap=True),
    Column("peak predicted", lambda c: c.predicted["peak_bytes"], "right", drop=2),
    Column("peak measured", lambda c: (c.measured or {}).get("peak_bytes", "-"), "right", drop=1),
    Column("largest difference (B)", _worst, "right"),
    Column("verdict", lambda c: "ok" if c.ok else "MISMATCH"),
]


class Report(Result):
    """A validation run: the backend, its environment and one check per configuration."""
    backend: str
    environment: dict[str, str]
    checks: tuple[Check, ...]

    @computed_field
    @property
    def mismatches(self) -> int:
        return sum(not c.ok for c in self.checks)

    @property
    def ok(self) -> bool:
        return self.mismatches == 0

    def summary(self) -> str:
        figures = len(self.checks) * len(FIGURES)
        return (f"{self.backend}: {len(self.checks)} configurations, {figures} figures, "
                f"{self.mismatches} mismatches")

    def _shown(self) -> list[Check]:
        """Mismatches first, then up to 20 others: the whole grid is in the JSON."""
        bad = [c for c in self.checks if not c.ok]
        return bad + [c for c in self.checks if c.ok][: max(0, 20 - len(bad))]

    def tables(self) -> list[Table]:
        env = ", ".join(f"{k}={v}" for k, v in self.environment.items())
        return [Table(f"{self.summary()}\n{env}", REPORT_COLUMNS, self._shown())]

    def csv_table(self) -> Table:
        return Table(None, REPORT_COLUMNS, self.checks)

    def footnotes(self) -> list[str]:
        from memcalc.render_results import caveats

        shown = len(self._shown())
        more = [f"({len(self.checks) - shown} more configurations in --json and --csv)"] \
            if shown < len(self.checks) else []
        return more + [self.summary()] + (caveats([]) if self.backend != "cuda" else [])

    def headline(self) -> str:
        return self.summary()

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")

    def records(self) -> list[dict]:
        """One dict per configuration: its impl, sizes, verdict and figure differences."""
        return [{"impl": c.config.impl, "seq_len": c.config.shape.seq_len,
                 "dtype": c.config.dtype.value, "causal": c.config.causal, "ok": c.ok,
                 "outcome": c.outcome, **{f"diff_{k}": v for k, v in c.differences.items()}}
                for c in self.checks]
