"""Out-of-memory thresholds of every implementation asked for, in one budget: the report.

``memcalc.solver`` finds each threshold, ``memcalc.closed_form`` says why; this module
runs them over the implementations and renders the table.
"""

from __future__ import annotations

from typing import Callable, Iterable

from pydantic import BaseModel, ConfigDict

from memcalc.breakdown import Result
from memcalc.budget import Budget, Fit
from memcalc.closed_form import SYMBOL
from memcalc.config import Config
from memcalc.errors import one_line
from memcalc.impls import get_impl, impl_names
from memcalc.render import Column, csv_table, markdown_table
from memcalc.scaling import _bold_title, compact_table
from memcalc.solver import SolveField, Solved, Unsolved, max_fitting
from memcalc.units import GiB, _fixed, mib

_FROZEN = ConfigDict(frozen=True, extra="forbid")


def gib(nbytes: int) -> str:
    """``nbytes`` in GiB with two decimals."""
    return _fixed(nbytes, GiB, 2)


class Skipped(BaseModel):
    model_config = _FROZEN
    impl: str
    reason: str


def _cell_fit(f: Fit | None, key: str) -> str:
    return "-" if f is None else mib(getattr(f, key))


def _cell_gib(f: Fit | None, key: str) -> str:
    return "-" if f is None else gib(getattr(f, key))


def _columns(field: str, wide: bool = False) -> list[Column]:
    """The table's columns; ``wide`` (Markdown) adds the peak at N+1 and the polynomial."""
    s = SYMBOL[field]
    cols = [
        Column("implementation", lambda r: r.impl),
        Column(f"max {s}", lambda r: r.max_value, "right"),
        Column("first 2^k OOM", lambda r: r.first_failing_power_of_two, "right"),
        Column(f"peak at {s}, GiB", lambda r: _cell_gib(r.at_max, "peak_bytes"), "right"),
        Column(f"reserved at {s}, GiB", lambda r: _cell_gib(r.at_max, "reserved_peak_bytes"), "right"),
        Column(f"reserved at {s}+1, GiB", lambda r: _cell_gib(r.at_next, "reserved_peak_bytes"), "right"),
    ]
    if wide:  # Markdown: MiB as the seeds wrote them, and the polynomial
        cols[3:] = [
            Column(f"peak at {s}, MiB", lambda r: _cell_fit(r.at_max, "peak_bytes"), "right"),
            Column(f"reserved at {s}, MiB", lambda r: _cell_fit(r.at_max, "reserved_peak_bytes"), "right"),
            Column(f"peak at {s}+1, MiB", lambda r: _cell_fit(r.at_next, "peak_bytes"), "right"),
            Column(f"reserved at {s}+1, MiB", lambda r: _cell_fit(r.at_next, "reserved_peak_bytes"), "right"),
            Column(f"raw bytes alive at the peak at {s}", _formula),
        ]
    return cols


def _formula(r) -> str:
    return r.approximation.text() if r.approximation else "-"


def _byte_columns(field: str) -> list[Column]:
    return [
        Column("impl", lambda r: r.impl),
        Column(f"max_{field}", lambda r: r.max_value),
        Column("first_failing_power_of_two", lambda r: r.first_failing_power_of_two),
        Column("peak_bytes_at_max", lambda r: r.peak_bytes_at_max if r.at_max else ""),
        Column("reserved_peak_bytes_at_max", lambda r: r.at_max.reserved_peak_bytes if r.at_max else ""),
        Column("peak_bytes_at_next", lambda r: r.peak_bytes_at_next),
        Column("reserved_peak_bytes_at_next", lambda r: r.at_next.reserved_peak_bytes),
        Column("a", lambda r: str(r.approximation.a) if r.approximation else ""),
        Column("b", lambda r: str(r.approximation.b) if r.approximation else ""),
        Column("c", lambda r: str(r.approximation.c) if r.approximation else ""),
    ]


def _fixed_options(config: Config, field: str) -> str:
    s = config.shape
    parts = {"seq_len": f"N={s.seq_len}", "batch": f"B={s.batch}", "heads": f"H={s.heads}",
             "head_dim": f"d={s.head_dim}"}
    parts.pop(field)
    flags = (" causal" if config.causal else "") + (" forward-only" if config.protocol.forward_only else "")
    return " ".join(parts.values()) + f" {config.dtype.value}{flags}"


class OomReport(Result):
    """The threshold of every implementation asked for, in one budget."""

    model_config = _FROZEN
    budget: Budget
    field: SolveField
    base: Config
    results: tuple[Solved, ...]
    skipped: tuple[Skipped, ...] = ()

    def title(self) -> str:
        return (f"largest {self.field} that fits, {_fixed_options(self.base, self.field)}\n"
                f"{self.budget.describe()}")

    def notes(self, formulas: bool = True) -> str:
        s = SYMBOL[self.field]
        lines = [f"fits: replaying the step with capacity = budget raises no OOM (reserved "
                 f"memory, after releasing cached segments); each row fits at {s}, not at {s}+1. "
                 f"Near a threshold fitting is not monotone (reserved memory moves by 2 MiB "
                 f"segments between neighbours): the search starts from the closed-form estimate "
                 f"of the top of the fitting range."]
        if formulas:
            lines += ["why, the raw bytes of the tensors alive at the peak (before rounding to "
                      "blocks; exact unless marked fit):"]
            lines += [f"  {r.impl}: {_formula(r)}" for r in self.results]
        lines += [f"{k.impl}: skipped, {k.reason}" for k in self.skipped]
        return "\n".join(lines)

    def __rich__(self):
        from rich.console import Group

        return Group(compact_table(self.title(), _columns(self.field), self.results), self.notes())

    def _repr_html_(self) -> str:
        from memcalc.render import html

        return html(self)

    def to_markdown(self) -> str:
        return (_bold_title(self.title()) + markdown_table(_columns(self.field, True), self.results)
                + "\n" + self.notes(formulas=False) + "\n")

    def to_csv(self) -> str:
        return csv_table(_byte_columns(self.field), self.results)

    def records(self) -> list[dict]:
        """One dict per solved implementation."""
        return self.to_dict()["results"]

    def to_dict(self) -> dict:
        return {"budget_bytes": self.budget.budget_bytes, "solve": self.field,
                "budget": self.budget.model_dump(mode="json"),
                "results": [r.to_dict() for r in self.results],
                "skipped": [k.model_dump() for k in self.skipped],
                "config": self.base.model_dump(mode="json")}


MAX_EVENTS = 4000
"""Without ``impls``, ``solve`` skips implementations whose program has more events than
this at the starting point, or more events as the solved field grows (chunked loops):
their exact replays near a threshold take seconds to hours. Name them to solve them."""


def _events(config: Config) -> int:
    p = get_impl(config.impl).build(config.dims)
    return len(p.forward) + len(p.backward)


def _too_big(config: Config, field: str) -> str | None:
    """Why solving ``config``'s implementation would be slow, or None."""
    small, large = _events(config.replace(**{field: 256})), _events(config.replace(**{field: 512}))
    if large > small:
        return (f"its program's events grow with {field} ({small:,} at 256, {large:,} at 512), "
                f"so exact replays near the threshold take too long; name it with --impl "
                f"(and --time-limit) to try")
    x = getattr(config.shape, field)
    events = _events(config)
    if events > MAX_EVENTS:
        return (f"its program has {events:,} events at {field} = {x} (replays are slow); "
                f"name it with --impl (and --time-limit) to solve it")
    return None


def solve(base: Config, budget: Budget, field: SolveField = "seq_len",
          impls: Iterable[str] | None = None, time_limit: float | None = None,
          solver: Callable[..., Solved] = max_fitting) -> OomReport:
    """The threshold of each implementation (every registered one by default) for
    ``base``'s other options. Without ``impls``, implementations that reject the options
    (fp32 for a kernel that has none, say) or whose replays are too slow (``MAX_EVENTS``)
    are listed as skipped with the reason; named ones are solved or raise. ``time_limit``:
    seconds per implementation."""
    named = list(impls) if impls else None
    results, skipped = [], []
    for name in named or impl_names():
        try:
            config = Config(**{**base.model_dump(), "impl": name})
            reason = None if named else _too_big(config, field)
            if reason is None:
                results.append(solver(config, budget.budget_bytes, field, time_limit=time_limit))
                continue
        except Unsolved as error:
            reason = f"{error}; raise --time-limit"
        except ValueError as error:  # pydantic's ValidationError is one
            if named:
                raise
            reason = _first_line(error)
        except Exception as error:  # noqa: BLE001 - one broken model must not hide the others
            if named:
                raise
            reason = f"the model raised {type(error).__name__}: {_first_line(error)}"
        skipped.append(Skipped(impl=name, reason=reason))
    return OomReport(budget=budget, field=field, base=base, results=tuple(results),
                     skipped=tuple(skipped))


def _first_line(error: Exception) -> str:
    return one_line(error)
