"""``memcalc compare``: every implementation side by side, against ``naive``.

A memory comparison table, counted exactly: for each implementation, the N x M
tensors it keeps for backward, its saved bytes and phase peaks, the saving against the
baseline (bytes and factor) and the largest seq_len that fits a device budget.
"""

from __future__ import annotations

from pydantic import computed_field

from memcalc.breakdown import Breakdown, Result
from memcalc.budget import Budget
from memcalc.config import Config
from memcalc.progress import say
from memcalc.quadratic import quadratic_saved
from memcalc.render import Column, Table
from memcalc.timeline import shared_predictions
from memcalc.units import human


def ratio(a: int, b: int) -> str:
    """``a / b`` with two decimals, from integers: ``2.00x``."""
    if b == 0:
        return "-"
    q = (a * 200 + b) // (2 * b)
    return f"{q // 100}.{q % 100:02d}x"


class Row(Result):
    """One implementation: its breakdown and its largest fitting seq_len (or why none)."""

    impl: str
    breakdown: Breakdown | None = None
    max_seq_len: int | None = None
    note: str = ""


class Comparison(Result):
    """All rows, the baseline's name and the budget the thresholds are for."""

    rows: tuple[Row, ...]
    baseline: str
    budget: Budget

    @computed_field
    @property
    def baseline_peak_bytes(self) -> int | None:
        base = next((r for r in self.rows if r.impl == self.baseline and r.breakdown), None)
        return base.breakdown.peak_bytes if base else None

    def _columns(self, human_units: bool) -> list[Column]:
        """The columns; on a narrow terminal the phase peaks and the N x M count go first,
        the peak, the saving and the threshold stay."""
        size = human if human_units else (lambda x: x)
        base = self.baseline_peak_bytes

        def fig(name):
            return lambda r: size(getattr(r.breakdown, name)) if r.breakdown else "-"

        return [
            Column("implementation", lambda r: r.impl),
            Column("N x M saved", lambda r: quadratic_saved(r.breakdown) if r.breakdown else "-",
                   "right", drop=5),
            Column("saved", fig("saved_bytes"), "right", drop=3),
            Column("forward peak", fig("forward_peak_bytes"), "right", drop=4),
            Column("backward peak", fig("backward_peak_bytes"), "right", drop=4),
            Column("peak", fig("peak_bytes"), "right"),
            Column(f"saves vs {self.baseline}", lambda r: size(base - r.breakdown.peak_bytes)
                   if r.breakdown and base is not None else "-", "right", drop=2),
            Column("factor", lambda r: ratio(base, r.breakdown.peak_bytes)
                   if r.breakdown and base is not None else "-", "right", drop=1),
            Column("max seq_len", lambda r: r.max_seq_len if r.max_seq_len is not None
                   else ("n/a" if not r.breakdown else "not solved"), "right"),
        ]

    def _title(self) -> str:
        c = next((r.breakdown.config for r in self.rows if r.breakdown), None)
        shape = c.label() if c else ""
        return f"{shape}; max seq_len within {self.budget.describe()}"

    def _baseline_note(self) -> str:
        """What the baseline is: ``naive`` is the custom softmax of the benchmark, not
        ``torch.softmax`` attention (that is ``naive-softmax``)."""
        from memcalc.impls import get_impl

        other = "naive-softmax" if self.baseline == "naive" else "naive"
        return (f"saves vs {self.baseline}, factor: peak against the baseline {self.baseline} "
                f"({get_impl(self.baseline).summary}); --baseline {other} compares against "
                f"{get_impl(other).summary}")

    def tables(self) -> list[Table]:
        return [Table(self._title(), self._columns(True), self.rows)]

    def csv_table(self) -> Table:
        return Table(None, self._columns(False), self.rows)

    def footnotes(self) -> list[str]:
        """Why a row has no figures (n/a) or no threshold (not solved); the baseline;
        the caveats."""
        from memcalc.render_results import caveats

        rows = [r.note if r.note.startswith(f"{r.impl}:") else f"{r.impl}: {r.note}"
                for r in self.rows if r.note]
        shown = [r.impl for r in self.rows if r.breakdown]
        return rows + [self._baseline_note(), *caveats(shown)]

    def headline(self) -> str:
        best = min((r for r in self.rows if r.breakdown), key=lambda r: r.breakdown.peak_bytes,
                   default=None)
        low = f"; lowest peak {best.impl} {human(best.breakdown.peak_bytes)}" if best else ""
        return f"{len(self.rows)} implementations against {self.baseline}{low}"

    def records(self) -> list[dict]:
        """One dict per implementation."""
        return self.to_dict()["rows"]

    def to_dict(self) -> dict:
        def row(r: Row) -> dict:
            b = r.breakdown
            figures = b.figures() if b else {}
            return {"impl": r.impl, "quadratic_saved": quadratic_saved(b) if b else None,
                    **figures, "max_seq_len": r.max_seq_len, "note": r.note}
        return {"baseline": self.baseline, "budget_bytes": self.budget.budget_bytes,
                "rows": [row(r) for r in self.rows]}


def compare(base: Config, budget: Budget, impls: list[str] | None = None,
            baseline: str = "naive", solve: bool = True) -> Comparison:
    """Every implementation (or ``impls``) at ``base``'s sizes; with ``solve``, also the
    largest seq_len that fits ``budget`` (``memcalc.thresholds.solve``, which skips, with
    the reason, what it cannot solve quickly)."""
    from memcalc.impls import impl_names

    names = impls or [n for n in impl_names() if not n.startswith("trace:")]
    with shared_predictions():  # the rows and the searches' first probes are the same steps
        thresholds = _thresholds(base, budget) if solve else {}
        rows = tuple(_row(base, n, thresholds.get(n, (None, ""))) for n in names)
    return Comparison(rows=rows, baseline=baseline, budget=budget)


def _thresholds(base: Config, budget: Budget) -> dict[str, tuple[int | None, str]]:
    from memcalc.thresholds import solve

    report = solve(base, budget)
    solved = {r.impl: (r.max_value, "") for r in report.results}
    return solved | {s.impl: (None, f"not solved: {s.reason}") for s in report.skipped}


def _reason(error: ValueError) -> str:
    """The message of a rejection, without pydantic's framing."""
    from memcalc.errors import one_line

    return one_line(error)


def _row(base: Config, impl: str, threshold: tuple[int | None, str]) -> Row:
    from memcalc.timeline import predict

    say(f"replaying {impl}")
    try:
        b = predict(Config.model_validate({**base.model_dump(), "impl": impl}))
    except ValueError as error:  # the implementation rejects these options
        return Row(impl=impl, note=_reason(error))
    return Row(impl=impl, breakdown=b, max_seq_len=threshold[0], note=threshold[1])
