"""Eager and compiled steps side by side, and the compiled step at several activation
memory budgets: ``memcalc trace --compile eager,default`` and ``--compile-budget``.

``Variants`` is a result (``memcalc.output.result.Result``): a row per variant with its
figures, whether it fits the budget, and its peak against the first row's. The budget is
``torch._functorch.config.activation_memory_budget``: the partitioner then saves at most that
fraction of what it would save at 1.0, recomputing the rest in the backward
(``torch/_functorch/partitioners.py``); the physical peak need not fall with it.
"""

from __future__ import annotations

from memcalc.analysis.breakdown import Breakdown
from memcalc.analysis.budget import Budget
from memcalc.engine.component import Record
from memcalc.engine.units import human
from memcalc.output.render import Column, Table, record_table
from memcalc.output.result import Result
from memcalc.tracing.tracer import user_place


class Variant(Record):
    """One way of running the step: ``mode`` (eager or default) and, compiled, the
    activation memory budget (None: torch's default)."""

    mode: str
    activation_budget: float | None = None
    breakdown: Breakdown
    fits: bool | None  # as its trace judged it (judging again would trace it again)

    @property
    def label(self) -> str:
        return step_label(self.mode, self.activation_budget)


def step_label(mode: str | None, activation_budget: float | None) -> str:
    """A step by how it was compiled: ``eager``, ``compiled``, ``compiled, budget 0.5``."""
    if mode == "eager":
        return "eager"
    return "compiled" if activation_budget is None else \
        f"compiled, budget {activation_budget:g}"


def parse_modes(text: str | None, budgets: tuple[float, ...]) -> tuple[tuple[str, float | None], ...]:
    """The variants ``--compile`` and ``--compile-budget`` ask for, in order."""
    modes = [m.strip() for m in (text or "default").split(",")]
    return tuple((mode, budget) for mode in modes
                 for budget in ((budgets or (None,)) if mode == "default" else (None,)))


def parse_budgets(text: str | None, option: str = "--compile-budget") -> tuple[float, ...]:
    """``0,0.25,0.5``: fractions from 0 to 1, one line naming the option otherwise."""
    if text is None:
        return ()
    budgets = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            value = -1.0
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{option} {text}: each budget a fraction from 0 to 1 "
                             f"(torch's activation_memory_budget), e.g. 0,0.5,1; got {part!r}")
        budgets.append(value)
    return tuple(budgets)


RECORD_KEYS = ("variant", "mode", "activation_budget", "saved_bytes", "forward_peak_bytes",
               "backward_peak_bytes", "peak_bytes", "reserved_peak_bytes", "recomputed_bytes",
               "fits", "peak_vs_first_bytes")


class Variants(Result):
    """The rows, and the budget each was judged against when it was traced."""

    rows: tuple[Variant, ...]
    budget: Budget

    def _vs_first(self, row: Variant) -> int:
        """``row``'s peak less the first row's: negative where it needs less."""
        return row.breakdown.peak_bytes - self.rows[0].breakdown.peak_bytes

    def _columns(self) -> list[Column]:
        def fig(name):
            return lambda r: human(getattr(r.breakdown, name))

        first = self.rows[0].label
        return [Column("step", lambda r: r.label),
                Column("saved", fig("saved_bytes"), "right", drop=2),
                Column("recomputed", lambda r: "-" if r.breakdown.recomputed is None else
                       human(r.breakdown.recomputed_bytes), "right", drop=3),
                Column("forward peak", fig("forward_peak_bytes"), "right", drop=4),
                Column("backward peak", fig("backward_peak_bytes"), "right", drop=4),
                Column("peak", fig("peak_bytes"), "right"),
                Column("reserved peak", fig("reserved_peak_bytes"), "right", drop=1),
                Column("fits", lambda r: {True: "yes", False: "NO", None: "-"}[r.fits],
                       "right"),
                Column(f"peak vs {first}", lambda r: _signed(self._vs_first(r)), "right",
                       drop=1)]

    def tables(self) -> list[Table]:
        label = self.rows[0].breakdown.config.label()
        tables = [Table(f"{label}; fits within {self.budget.describe()}", self._columns(),
                        self.rows),
                  _shares_table("alive at each step's peak, by role", "role", self.rows,
                                [_by_role(r.breakdown) for r in self.rows]),
                  _shares_table("saved for the backward, by line of your code", "line",
                                self.rows, [_by_line(r.breakdown.saved) for r in self.rows],
                                _codes(self.rows), difference=True)]
        recomputing = [r for r in self.rows if r.breakdown.recomputed]
        if recomputing:
            tables.append(_shares_table(
                "recomputed in the backward, by line of your code", "line", recomputing,
                [_by_line(r.breakdown.recomputed) for r in recomputing], _codes(self.rows)))
        return tables

    def footnotes(self) -> list[str]:
        lines = []
        if any(r.activation_budget is not None for r in self.rows):
            lines.append("budget: torch._functorch.config.activation_memory_budget, the "
                         "fraction of the default's saved activations the partitioner may "
                         "keep (the rest recomputed in the backward)")
        return lines

    def headline(self) -> str:
        low = min(self.rows, key=lambda r: r.breakdown.peak_bytes)
        return f"{len(self.rows)} steps; lowest peak {low.label} {human(low.breakdown.peak_bytes)}"

    def records(self) -> list[dict]:
        return self.to_dict()["rows"]

    def to_dict(self) -> dict:
        return {"budget_bytes": self.budget.budget_bytes, "rows": [
            {"variant": r.label, "mode": r.mode, "activation_budget": r.activation_budget,
             **{k: getattr(r.breakdown, k) for k in RECORD_KEYS[3:8]},
             "recomputed_bytes": r.breakdown.recomputed_bytes,
             "fits": r.fits, "at_peak_by_role": _by_role(r.breakdown),
             "saved_by_line": _by_line(r.breakdown.saved),
             "recomputed_by_line": _by_line(r.breakdown.recomputed or ()),
             "peak_vs_first_bytes": self._vs_first(r)} for r in self.rows]}

    def csv_table(self) -> Table:
        return record_table(RECORD_KEYS, self.records())


def _shares_table(title: str, key: str, rows: list[Variant], shares: list[dict[str, int]],
                  codes: dict[str, str] | None = None, difference: bool = False) -> Table:
    """Bytes by ``key`` (a role, a line of the user's code), a column per step, largest
    first; with ``difference``, the last step's less the first's."""
    keys = sorted({k for share in shares for k in share},
                  key=lambda k: (-max(share.get(k, 0) for share in shares), k))
    columns = [Column(key, lambda k: k or "elsewhere")]
    if codes is not None:
        columns.append(Column("code", lambda k: codes.get(k, ""), wrap=True, drop=3))
    columns += [Column(r.label, (lambda share: lambda k: human(share.get(k, 0)))(share),
                       "right", drop=2 if 0 < i < len(rows) - 1 else 0)
                for i, (r, share) in enumerate(zip(rows, shares))]
    if difference and len(rows) > 1:
        first, last = shares[0], shares[-1]
        columns.append(Column(f"{rows[-1].label} vs {rows[0].label}",
                              lambda k: _signed(last.get(k, 0) - first.get(k, 0)), "right",
                              drop=1))
    return Table(title, columns, keys)


def _by_line(components) -> dict[str, int]:
    """Bytes of ``components`` by the user's line that made them (``""``: none)."""
    totals: dict[str, int] = {}
    for c in components:
        place = user_place(c.name)
        totals[place] = totals.get(place, 0) + c.allocated
    return totals


def _codes(rows: list[Variant]) -> dict[str, str]:
    """The code on each user's line the steps' saved and recomputed tensors name."""
    return {user_place(c.name): c.source for r in rows
            for c in (*r.breakdown.saved, *(r.breakdown.recomputed or ())) if c.source}


def _by_role(b: Breakdown) -> dict[str, int]:
    """Bytes allocated at ``b``'s peak, by role."""
    totals: dict[str, int] = {}
    for c in b.components:
        totals[c.role.value] = totals.get(c.role.value, 0) + c.allocated
    return totals


def _signed(nbytes: int) -> str:
    """``-1.50 GiB``, ``+512 B``, ``0 B``."""
    return ("-" if nbytes < 0 else "+" if nbytes > 0 else "") + human(abs(nbytes))
