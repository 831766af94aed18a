"""Scaling tables: every figure over a grid of shapes, in the layouts people use in
write-ups.

``sweep`` evaluates the product of the given sequence lengths, head dims, batches and
heads for each implementation and dtype through ``memcalc.vectorized`` (exact, numpy), marks
each configuration that does not fit the budget (``memcalc.budget.fit``), and returns a
``Sweep`` that renders itself two ways:

* long (seed 000's "MEMORY SCALING WITH SEQUENCE LENGTH"): one row per configuration with
  the peak, what is saved for backward, the reserved peak, the growth of the peak against
  the first row of its series (same implementation and shape but ``seq_len``), the share of
  the peak held by N x M tensors ("seq_len^2 components") and the OOM mark;
* pivot (seed 002's "Memory Before Backward (MB)": rows ``seq_len``, columns ``head_dim``),
  one table per implementation and the other axes, for one figure.
"""

from __future__ import annotations

from fractions import Fraction
from itertools import product
from typing import Iterable, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, computed_field

from memcalc.budget import Budget, fit
from memcalc.breakdown import Result
from memcalc.config import Config
from memcalc.render import Column, Table
from memcalc.units import fixed, human, mib, ratio_number, share

_FROZEN = ConfigDict(frozen=True, extra="forbid")
Figure = Literal["peak", "saved", "reserved", "forward", "backward"]
FIGURE_KEY = {"peak": "peak_bytes", "saved": "saved_bytes", "reserved": "reserved_peak_bytes",
              "forward": "forward_peak_bytes", "backward": "backward_peak_bytes"}
FIGURE_TITLE = {"peak": "Peak, max_memory_allocated", "saved": "Saved for backward",
                "reserved": "Reserved peak, max_memory_reserved", "forward": "Forward peak",
                "backward": "Backward peak"}


class SweepRow(BaseModel):
    """One configuration of the grid and its figures (bytes)."""

    model_config = _FROZEN
    impl: str
    dtype: str
    batch: int
    heads: int
    seq_len: int
    head_dim: int
    saved_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    reserved_peak_bytes: int
    quadratic_bytes: int
    fits: bool
    first_peak_bytes: int  # the peak of the first row of this row's series

    @computed_field
    @property
    def peak_bytes(self) -> int:
        return max(self.forward_peak_bytes, self.backward_peak_bytes)

    @property
    def growth(self) -> Fraction:
        """This row's peak over the first row's of its series."""
        return growth(self.peak_bytes, self.first_peak_bytes)

    @property
    def series(self) -> tuple:
        return self.impl, self.dtype, self.batch, self.heads, self.head_dim


def growth(peak: int, first: int) -> Fraction:
    """A peak over its series' first, exactly (0 where the first is 0: a program that
    allocates nothing)."""
    return Fraction(peak, first) if first else Fraction(0)


def growth_number(peak: int, first: int) -> float | None:
    """The growth in CSV and JSON: a number (``memcalc.units.ratio_number``), None where
    the first peak is 0."""
    return ratio_number(peak, first)


def _growth(r: SweepRow) -> str:
    g = r.growth
    return f"x{fixed(g.numerator, g.denominator, 2)}"


class Sweep(Result):
    """A grid of configurations and their figures; ``pivot`` picks the seed-002 layout."""

    model_config = _FROZEN
    budget: Budget
    base: Config
    axes: dict[str, tuple]  # the values of each axis, as given
    columns: dict[str, tuple]  # SweepRow's fields, one tuple each, one entry per configuration
    skipped: tuple[tuple[str, str], ...] = ()  # (impl or impl/dtype, reason)
    pivot: Figure | None = None
    unit: Literal["MiB", "bytes"] = "MiB"

    @computed_field
    @property
    def budget_bytes(self) -> int:
        return self.budget.budget_bytes

    @property
    def rows(self) -> tuple[SweepRow, ...]:
        """One ``SweepRow`` per configuration, built from the columns when asked for (a
        grid of a million configurations is kept as columns)."""
        names = tuple(self.columns)
        return tuple(SweepRow.model_construct(**dict(zip(names, values)))
                     for values in zip(*self.columns.values()))

    def __len__(self) -> int:
        return len(self.columns["seq_len"])

    def _cell(self, nbytes: int) -> str | int:
        return nbytes if self.unit == "bytes" else mib(nbytes)

    def _varying(self) -> list[str]:
        return [k for k in ("impl", "dtype", "batch", "heads", "head_dim") if len(self.axes[k]) > 1]

    def long_columns(self) -> list[Column]:
        u = "bytes" if self.unit == "bytes" else "MiB"
        shown = self._varying()
        cols = [Column(k, (lambda k: lambda r: getattr(r, k))(k)) for k in shown if k != "head_dim"]
        cols += [Column("seq_len", lambda r: r.seq_len, "right")]
        if "head_dim" in shown:
            cols += [Column("head_dim", lambda r: r.head_dim, "right")]
        return cols + [
            Column(f"peak ({u})", lambda r: self._cell(r.peak_bytes), "right"),
            Column(f"saved ({u})", lambda r: self._cell(r.saved_bytes), "right", drop=2),
            Column(f"reserved ({u})", lambda r: self._cell(r.reserved_peak_bytes), "right",
                   drop=1),
            Column("x first", _growth, "right", drop=3),
            Column("N^2 share", lambda r: share(r.quadratic_bytes, r.peak_bytes), "right",
                   drop=4),
            Column("OOM?", lambda r: "fits" if r.fits else "OOM"),
        ]

    def fixed(self) -> str:
        """What the sweep holds fixed, as every title shows a configuration:
        ``naive: B=8 H=1 d=16 fp32`` (the implementation when only one), then the options."""
        varied = self._varying() + ["seq_len"]
        one = {k: v[0] for k, v in self.axes.items() if k not in varied}
        config = self.base.replace(**one)
        return ("" if "impl" in varied else f"{config.impl}: ") + config.label(leave_out=varied)

    def title(self) -> str:
        return f"memory scaling with sequence length: {self.fixed()}\n{self.budget.describe()}"

    def footnotes(self) -> list[str]:
        lines = ["peak: max_memory_allocated over the step; saved: memory_allocated after the "
                 "forward less before, less the output; reserved: max_memory_reserved; x first: "
                 "peak over the first row's with the same shape but seq_len; N^2 share: blocks "
                 "of the tensors whose size grows as seq_len x kv_len, at the peak; OOM?: "
                 "replaying the step with capacity = budget raises (reserved memory)."]
        from memcalc.render_results import caveats

        skipped = {who for who, _ in self.skipped}
        shown = [i for i in self.axes["impl"]
                 if any(f"{i} {d}" not in skipped for d in self.axes["dtype"])]
        return lines + [f"{who}: skipped, {why}" for who, why in self.skipped] + caveats(shown)

    # pivot layout
    def pivot_tables(self, figure: Figure) -> list[tuple[str, list[Column], list]]:
        """One (title, columns, rows) per series group: rows seq_len, columns head_dim."""
        key = FIGURE_KEY[figure]
        u = "bytes" if self.unit == "bytes" else "MiB"
        groups: dict[tuple, dict[int, dict[int, SweepRow]]] = {}
        for r in self.rows:
            g = groups.setdefault((r.impl, r.dtype, r.batch, r.heads), {})
            g.setdefault(r.seq_len, {})[r.head_dim] = r
        out = []
        dims = [d for d in self.axes["head_dim"]]
        for (impl, dtype, batch, heads), table in groups.items():
            def cell(row, d, key=key):
                r = row[1].get(d)
                if r is None:
                    return "-"
                value = self._cell(getattr(r, key))
                return value if r.fits else f"{value} OOM"
            cols = [Column("seq_len \\ head_dim", lambda row: row[0], "right")]
            cols += [Column(str(d), (lambda d: lambda row: cell(row, d))(d), "right") for d in dims]
            config = self.base.replace(impl=impl, dtype=dtype, batch=batch, heads=heads)
            label = config.label(leave_out=("seq_len", "head_dim"))
            title = f"{FIGURE_TITLE[figure]} ({u}): {impl}: {label}"
            out.append((title, cols, sorted(table.items())))
        return out

    # rendering: the protocol of memcalc.render
    def tables(self) -> list[Table]:
        if self.pivot:
            return [Table(t, c, rows) for t, c, rows in self.pivot_tables(self.pivot)]
        return [Table(self.title(), self.long_columns(), self.rows)]

    def csv_table(self) -> Table:
        """Every row, every figure in bytes (the layout does not apply)."""
        cols = [Column(k, (lambda k: lambda r: getattr(r, k))(k)) for k in
                ("impl", "dtype", "batch", "heads", "seq_len", "head_dim", "peak_bytes",
                 "saved_bytes", "forward_peak_bytes", "backward_peak_bytes",
                 "reserved_peak_bytes", "quadratic_bytes")]
        cols += [Column("growth", lambda r: growth_number(r.peak_bytes, r.first_peak_bytes)),
                 Column("fits", lambda r: r.fits)]
        return Table(None, cols, self.rows)

    def headline(self) -> str:
        fitting, n = sum(self.columns["fits"]), len(self)
        impls = ", ".join(self.axes["impl"])
        return (f"{n} configuration{'s' * (n != 1)} ({impls}), {fitting} fit "
                f"{human(self.budget.budget_bytes)}")

    def records(self) -> list[dict]:
        """One dict per row (configuration), as in the JSON."""
        return self.to_dict()["rows"]

    def to_dict(self) -> dict:
        c = self.columns
        peaks = [max(f, b) for f, b in zip(c["forward_peak_bytes"], c["backward_peak_bytes"])]
        names = [k for k in c if k != "first_peak_bytes"]
        rows = [{**dict(zip(names, values)), "peak_bytes": peak,
                 "growth": growth_number(peak, first)}
                for values, peak, first in zip(zip(*(c[k] for k in names)), peaks,
                                               c["first_peak_bytes"])]
        return {"budget_bytes": self.budget.budget_bytes,
                "budget": self.budget.model_dump(mode="json"),
                "axes": {k: list(v) for k, v in self.axes.items()}, "rows": rows,
                "skipped": [{"impl": w, "reason": r} for w, r in self.skipped],
                "config": self.base.model_dump(mode="json")}


def sweep(base: Config, budget: Budget, seq_len: Iterable[int], head_dim: Iterable[int] = (),
          batch: Iterable[int] = (), heads: Iterable[int] = (), impls: Iterable[str] = (),
          dtypes: Iterable[str] = (), pivot: Figure | None = None,
          unit: Literal["MiB", "bytes"] = "MiB", progress=None) -> Sweep:
    """Every combination of the given values (``base``'s where none are given) for each
    implementation and dtype, exact, with the OOM mark for ``budget``. An implementation
    that rejects a dtype (or any configuration) is listed under ``skipped``.
    ``progress(items, total, description)`` wraps the loop over implementations and dtypes
    (``memcalc.progress``)."""
    from memcalc.vectorized import evaluate

    s = base.shape
    axes = {"impl": tuple(impls) or (base.impl,), "dtype": tuple(dtypes) or (base.dtype.value,),
            "batch": tuple(batch) or (s.batch,), "heads": tuple(heads) or (s.heads,),
            "head_dim": tuple(head_dim) or (s.head_dim,), "seq_len": tuple(seq_len)}
    for k, values in axes.items():
        if not values:
            raise ValueError(f"{k}: no values")
    columns: dict[str, list] = {k: [] for k in SweepRow.model_fields}
    skipped: list[tuple[str, str]] = []
    grid = list(product(axes["batch"], axes["heads"], axes["head_dim"], axes["seq_len"]))
    b_, h_, d_, n_ = (np.array(v, dtype=np.int64) for v in zip(*grid))
    series = list(product(axes["impl"], axes["dtype"]))
    if progress is not None and len(series) > 1:
        series = progress(series, len(series), "sweep")
    for impl, dtype in series:
        try:
            config = base.replace(impl=impl, dtype=dtype)
            figures = evaluate(config, batch=b_, heads=h_, head_dim=d_, seq_len=n_)
        except Exception as error:  # noqa: BLE001 - a model that rejects (or breaks on) these
            from memcalc.errors import refusal

            if len(axes["impl"]) * len(axes["dtype"]) == 1:
                raise
            skipped.append((f"{impl} {dtype}", refusal(error, impl)))
            continue
        _add_series(columns, config, figures, (b_, h_, d_, n_), len(axes["seq_len"]), budget)
    if len(skipped) == len(axes["impl"]) * len(axes["dtype"]):  # an empty table: refused
        raise ValueError("no implementation has figures for these options: "
                         + "; ".join(f"{who}: {why}" for who, why in skipped))
    return Sweep(budget=budget, base=base, axes=axes,
                 columns={k: tuple(v) for k, v in columns.items()}, skipped=tuple(skipped),
                 pivot=pivot, unit=unit)


def _add_series(columns: dict[str, list], config: Config, figures, shape_axes, lengths: int,
                budget: Budget) -> None:
    """Append one implementation and dtype's configurations to ``columns``, column by column.
    The grid is ordered batch, heads, head_dim, then seq_len: each run of ``lengths``
    configurations is one series, whose first peak the growth is measured against."""
    from memcalc.vectorized import classify

    verdict = classify(figures, budget.budget_bytes)
    fits = verdict == 1
    for i in np.flatnonzero(verdict == -1):  # the capped replay decides these
        shape = dict(zip(("batch", "heads", "head_dim", "seq_len"),
                         (int(a[i]) for a in shape_axes)))
        fits[i] = fit(config.replace(**shape), budget.budget_bytes).fits
    n = len(fits)
    columns["impl"] += [config.impl] * n
    columns["dtype"] += [config.dtype.value] * n
    for name, values in zip(("batch", "heads", "head_dim", "seq_len"), shape_axes):
        columns[name] += values.tolist()
    for name in ("saved_bytes", "forward_peak_bytes", "backward_peak_bytes",
                 "reserved_peak_bytes", "quadratic_bytes"):
        columns[name] += getattr(figures, name).tolist()
    columns["fits"] += fits.tolist()
    columns["first_peak_bytes"] += np.repeat(figures.peak_bytes[::lengths], lengths).tolist()
