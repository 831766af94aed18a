"""``memcalc compare``: every implementation side by side, against ``naive``.

A memory comparison table, counted exactly: for each implementation, the N x M
tensors it keeps for backward, its saved bytes and phase peaks, the saving against the
baseline (bytes and factor) and the largest seq_len that fits a device budget.
"""

from __future__ import annotations

from pydantic import computed_field

from memcalc.analysis.breakdown import FIGURES, Breakdown
from memcalc.output.result import Result
from memcalc.analysis.budget import Budget
from memcalc.config import Config
from memcalc.engine.status import say
from memcalc.analysis.quadratic import quadratic_saved
from memcalc.output.render import Column, Table, record_table
from memcalc.analysis.predict import shared_predictions
from memcalc.engine.units import human, ratio_number


def ratio(a: int, b: int) -> str:
    """``a / b`` with two decimals, from integers: ``2.00x``."""
    if b == 0:
        return "-"
    q = (a * 200 + b) // (2 * b)
    return f"{q // 100}.{q % 100:02d}x"


class Row(Result):
    """One implementation: its breakdown and its largest fitting seq_len, or why there is
    none (``note``: the implementation rejects the options, or the solver skipped it)."""

    impl: str
    breakdown: Breakdown | None = None
    max_seq_len: int | None = None
    note: str = ""

    def headline(self) -> str:
        """``flash2: peak 32.50 MiB, max seq_len 20,287,488``, or why it has none."""
        if self.breakdown is None:
            return f"{self.impl}: no figures: {self.note}"
        solved = f"max seq_len {self.max_seq_len:,}" if self.max_seq_len is not None else \
            "max seq_len not solved"
        return f"{self.impl}: peak {human(self.breakdown.peak_bytes)}, {solved}"

    @property
    def status(self) -> str:
        """``solved``; ``unsolved`` (figures, no largest seq_len); ``skipped`` (no figures:
        the implementation refuses the options, and oom skips it for the same reason)."""
        if self.breakdown is None:
            return "skipped"
        return "unsolved" if self.max_seq_len is None else "solved"


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

    def _columns(self) -> list[Column]:
        """The table's columns; on a narrow terminal the phase peaks and the N x M count go
        first, the peak, the saving and the threshold stay."""
        base = self.baseline_peak_bytes

        def fig(name):
            return lambda r: human(getattr(r.breakdown, name)) if r.breakdown else "-"

        return [
            Column("implementation", lambda r: r.impl),
            Column("N x M saved", lambda r: quadratic_saved(r.breakdown) if r.breakdown else "-",
                   "right", drop=5),
            Column("saved", fig("saved_bytes"), "right", drop=3),
            Column("forward peak", fig("forward_peak_bytes"), "right", drop=4),
            Column("backward peak", fig("backward_peak_bytes"), "right", drop=4),
            Column("peak", fig("peak_bytes"), "right"),
            Column("reserved peak", fig("reserved_peak_bytes"), "right", drop=3),
            Column("fits", lambda r: {True: "yes", False: "NO", None: "-"}[self._fits(r)],
                   "right"),
            Column(f"saves vs {self.baseline}", lambda r: human(base - r.breakdown.peak_bytes)
                   if r.breakdown and base is not None else "-", "right", drop=2),
            Column("factor", lambda r: ratio(base, r.breakdown.peak_bytes)
                   if r.breakdown and base is not None else "-", "right", drop=1),
            Column("max seq_len", lambda r: r.max_seq_len if r.max_seq_len is not None
                   else ("n/a" if not r.breakdown else "not solved"), "right"),
        ]

    def _fits(self, r: Row) -> bool | None:
        """Whether ``r``'s step fits the budget at this length (None without figures)."""
        return r.breakdown.fit(self.budget).fits if r.breakdown else None

    def _saving(self, r: Row) -> tuple[int | None, float | None]:
        """``r``'s saving against the baseline's peak, in bytes and as the factor baseline
        peak / peak (None without figures)."""
        base = self.baseline_peak_bytes
        if r.breakdown is None or base is None:
            return None, None
        peak = r.breakdown.peak_bytes
        return base - peak, ratio_number(base, peak)

    def _title(self) -> str:
        c = next((r.breakdown.config for r in self.rows if r.breakdown), None)
        shape = c.label() if c else ""
        return f"{shape}; max seq_len within {self.budget.describe()}"

    def _baseline_note(self) -> str:
        """What the baseline is: ``naive`` is the custom softmax of the benchmark, not
        ``torch.softmax`` attention (that is ``naive-softmax``)."""
        from memcalc.impls import get_impl

        other = "naive-softmax" if self.baseline == "naive" else "naive"
        said = (f"saves vs {self.baseline}, factor: peak against the baseline {self.baseline} "
                f"({get_impl(self.baseline).summary})")
        if not any(r.impl == other for r in self.rows):  # --baseline names a compared one
            return said
        return f"{said}; --baseline {other} compares against {get_impl(other).summary}"

    def tables(self) -> list[Table]:
        return [Table(self._title(), self._columns(), self.rows)]

    def csv_table(self) -> Table:
        """``records()``, one column per key: bytes, the factor as a number, empty cells
        where a row has no figure, and its ``status`` and ``reason``."""
        return record_table(RECORD_KEYS, self.records())

    def footnotes(self) -> list[str]:
        """Why a row has no figures (n/a) or no threshold (not solved); the baseline;
        the caveats."""
        from memcalc.output.results import caveats, picked_notes

        rows = [r.note if r.note.startswith(f"{r.impl}:") else
                f"{r.impl}: {'not solved: ' * (r.status == 'unsolved')}{r.note}"
                for r in self.rows if r.note]
        shown = [r.impl for r in self.rows if r.breakdown]
        picked = picked_notes(*(r.breakdown.config for r in self.rows if r.breakdown))
        return rows + picked + [self._baseline_note(), *caveats(shown)]

    def headline(self) -> str:
        best = min((r for r in self.rows if r.breakdown), key=lambda r: r.breakdown.peak_bytes,
                   default=None)
        low = f"; lowest peak {best.impl} {human(best.breakdown.peak_bytes)}" if best else ""
        return f"{len(self.rows)} implementations against {self.baseline}{low}"

    def records(self) -> list[dict]:
        """One dict per implementation."""
        return self.to_dict()["rows"]

    def to_dict(self) -> dict:
        """The baseline, the budget and one record per implementation (``records()``)."""
        return {"baseline": self.baseline, "budget_bytes": self.budget.budget_bytes,
                "rows": [self._record(r) for r in self.rows]}

    def _record(self, r: Row) -> dict:
        """``RECORD_KEYS`` of one row: None for a figure it lacks, with the reason."""
        b = r.breakdown
        figures = b.figures() if b else dict.fromkeys(FIGURES)
        saving, factor = self._saving(r)
        return {"impl": r.impl, "status": r.status,
                "quadratic_saved": quadratic_saved(b) if b else None, **figures,
                "fits": self._fits(r), "saving_bytes": saving, "factor": factor,
                "max_seq_len": r.max_seq_len, "reason": r.note or None}


RECORD_KEYS = ("impl", "status", "quadratic_saved", *FIGURES, "fits", "saving_bytes", "factor",
               "max_seq_len", "reason")
"""A comparison's CSV columns, the keys of each of its JSON ``rows``: ``fits``, whether the
step fits the budget at this length; ``saving_bytes`` is the baseline's peak less the row's,
``factor`` the baseline's peak over the row's."""


def compare(base: Config, budget: Budget, impls: list[str] | None = None,
            baseline: str | None = None, solve: bool = True) -> Comparison:
    """Every implementation (or ``impls``) at ``base``'s sizes; with ``solve``, also the
    largest seq_len that fits ``budget`` (``memcalc.analysis.thresholds.solve``, which skips, with
    the reason, what it cannot solve quickly). ``baseline``: what the savings are against
    (``choose_baseline`` when None)."""
    from memcalc.impls import impl_names

    names = impls or [n for n in impl_names() if not n.startswith("trace:")]
    with shared_predictions():  # the rows and the searches' first probes are the same steps
        thresholds = _thresholds(base, budget) if solve else {}
        rows = tuple(_row(base, n, thresholds.get(n, (None, ""))) for n in names)
    return Comparison(rows=rows, baseline=choose_baseline(rows, baseline), budget=budget)


def choose_baseline(rows: tuple[Row, ...], asked: str | None) -> str:
    """The baseline: ``asked``, which must have figures; else naive if it is compared and
    has them, else the first row that has them. ``ValueError`` naming ``--baseline`` (or
    why no row has figures)."""
    with_figures = [r.impl for r in rows if r.breakdown is not None]
    if asked is not None:
        row = next((r for r in rows if r.impl == asked), None)
        if row is None:
            raise ValueError(f"--baseline: {asked!r} is not among the compared "
                             f"implementations ({', '.join(r.impl for r in rows)}); add it")
        if row.breakdown is None:
            raise ValueError(f"--baseline: {asked} has no figures for these options: {row.note}")
        return asked
    if not with_figures:
        raise ValueError("no implementation has figures for these options: "
                         + "; ".join(f"{r.impl}: {r.note}" for r in rows))
    return "naive" if "naive" in with_figures else with_figures[0]


def _thresholds(base: Config, budget: Budget) -> dict[str, tuple[int | None, str]]:
    from memcalc.analysis.thresholds import solve

    report = solve(base, budget)
    solved = {r.impl: (r.max_value, "") for r in report.results}
    return solved | {s.impl: (None, s.reason) for s in (*report.unsolved, *report.skipped)}


def _row(base: Config, impl: str, threshold: tuple[int | None, str]) -> Row:
    from memcalc.analysis.predict import predict

    say(f"replaying {impl}")
    try:
        b = predict(Config.model_validate({**base.model_dump(), "impl": impl}))
    except ValueError as error:  # the implementation rejects these options
        from memcalc.errors import refusal

        return Row(impl=impl, note=refusal(error, impl))
    return Row(impl=impl, breakdown=b, max_seq_len=threshold[0], note=threshold[1])
