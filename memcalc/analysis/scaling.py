"""Scaling tables: every figure over a grid of shapes, in the layouts people use in
write-ups.

``sweep`` evaluates the product of the given sequence lengths, head dims, batches and
heads for each implementation and dtype through ``memcalc.analysis.vectorized`` (exact, numpy), marks
each configuration that does not fit the budget (``memcalc.analysis.budget.fit``), and returns a
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
from math import prod
from typing import Iterable, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, computed_field

from memcalc.analysis.budget import Budget, fit
from memcalc.output.result import Result
from memcalc.config import Config, first_taken
from memcalc.errors import refusal
from memcalc.engine.status import say
from memcalc.output.render import Column, Table, record_table, shown
from memcalc.engine.units import fixed, human, mib, ratio_number, share
from memcalc.engine.work import check_rows

_FROZEN = ConfigDict(frozen=True, extra="forbid")
TABLE_ROWS = 200
"""The most rows a sweep's table shows (``Sweep.shown_lengths``)."""
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
    cp: int = 1  # context-parallel ranks (figures: the busiest rank's)

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
        return self.impl, self.dtype, self.batch, self.heads, self.head_dim, self.cp


def growth(peak: int, first: int) -> Fraction:
    """A peak over its series' first, exactly (0 where the first is 0: a program that
    allocates nothing)."""
    return Fraction(peak, first) if first else Fraction(0)


def growth_number(peak: int, first: int) -> float | None:
    """The growth in CSV and JSON: a number (``memcalc.engine.units.ratio_number``), None where
    the first peak is 0."""
    return ratio_number(peak, first)


def _growth(r: SweepRow) -> str:
    g = r.growth
    return f"x{fixed(g.numerator, g.denominator, 2)}"


MEANS = {  # what a sweep's column (or a pivot's figure) is
    "peak": "max_memory_allocated over the step",
    "saved": "memory_allocated after the forward less before, less the output",
    "reserved": "max_memory_reserved",
    "forward": "max_memory_allocated over the forward",
    "backward": "max_memory_allocated over the backward",
    "x first": "peak over the peak at the first length, the other sizes the same",
    "N^2 share": "blocks of the tensors whose size grows as seq_len x kv_len, at the peak",
    "OOM?": "replaying the step with capacity = budget raises (reserved memory)",
}
CSV_KEYS = ("impl", "dtype", "batch", "heads", "kv_heads", "seq_len", "head_dim", "causal",
            "peak_bytes", "saved_bytes", "forward_peak_bytes", "backward_peak_bytes",
            "reserved_peak_bytes", "quadratic_bytes", "growth", "fits", "status",
            "reason")  # and cp, when swept


class Skipped(BaseModel):
    """Configurations of a sweep an implementation refuses (or breaks on): one dtype's
    whole series, or the sizes named in ``sizes`` (``head_dim 512`` for FlashAttention)."""

    model_config = _FROZEN
    impl: str
    dtype: str
    sizes: dict[str, int] = {}  # empty: every configuration of the series
    reason: str

    def who(self) -> str:
        """``sdpa-flash fp16``, ``sdpa-flash fp16 at head_dim 512``."""
        at = ", ".join(f"{k} {v}" for k, v in self.sizes.items())
        return f"{self.impl} {self.dtype}" + (f" at {at}" if at else "")

    def to_dict(self) -> dict:
        return {"impl": self.impl, "dtype": self.dtype, **self.sizes, "reason": self.reason}


class Sweep(Result):
    """A grid of configurations and their figures; ``pivot`` picks the seed-002 layout."""

    model_config = _FROZEN
    budget: Budget
    base: Config
    axes: dict[str, tuple]  # the values of each axis, as given
    columns: dict[str, tuple]  # SweepRow's fields, one tuple each, one entry per configuration
    skipped: tuple[Skipped, ...] = ()
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
        return self._rows(range(len(self)))

    def _rows(self, indices: Iterable[int]) -> tuple[SweepRow, ...]:
        names, columns = tuple(self.columns), tuple(self.columns.values())
        return tuple(SweepRow.model_construct(**dict(zip(names, (c[i] for c in columns))))
                     for i in indices)

    def shown_lengths(self) -> tuple[int, ...]:
        """The lengths the tables show: all of them, unless the table would pass
        ``TABLE_ROWS`` rows (nobody reads 100,000, and rendering them took ten times the
        sweep): then evenly spaced ones, the first and the last, and both sides of every
        change from fitting to not (each series' OOM threshold). CSV and JSON have all."""
        lengths = self.axes["seq_len"]
        series = len(self) // len(lengths) or 1
        if len(self) <= TABLE_ROWS:
            return lengths
        step = -(-len(lengths) * series // TABLE_ROWS)  # ceil: at most TABLE_ROWS rows
        chosen = set(lengths[::step]) | {lengths[-1]} | self._thresholds(step)
        return tuple(n for n in lengths if n in chosen)

    def _thresholds(self, step: int) -> set[int]:
        """The lengths on either side of each change of ``fits`` within a series, up to as
        many as the evenly spaced ones."""
        seq, fits, found = self.columns["seq_len"], self.columns["fits"], set()
        first = {self.axes["seq_len"][0]}
        for i in range(1, len(seq)):
            if fits[i] != fits[i - 1] and seq[i] not in first:
                found |= {seq[i - 1], seq[i]}
                if len(found) * step >= len(self.axes["seq_len"]):
                    break
        return found

    def _table_rows(self) -> tuple[SweepRow, ...]:
        shown = self.shown_lengths()
        if len(shown) == len(self.axes["seq_len"]):
            return self.rows
        keep = set(shown)
        return self._rows(i for i, n in enumerate(self.columns["seq_len"]) if n in keep)

    def _thinned_note(self) -> list[str]:
        """What a thinned table leaves out, and where every row is."""
        shown, lengths = self.shown_lengths(), self.axes["seq_len"]
        if len(shown) == len(lengths):
            return []
        return [f"{len(shown):,} of {len(lengths):,} lengths shown (evenly spaced, the first "
                f"and last, each side of an OOM threshold): --csv or --json print all "
                f"{len(self):,} rows"]

    def __len__(self) -> int:
        return len(self.columns["seq_len"])

    def _cell(self, nbytes: int) -> str | int:
        return nbytes if self.unit == "bytes" else mib(nbytes)

    def _varying(self) -> list[str]:
        return [k for k in ("impl", "dtype", "cp", "batch", "heads", "head_dim")
                if len(self.axes.get(k, ())) > 1]

    def long_columns(self) -> list[Column]:
        u = "bytes" if self.unit == "bytes" else "MiB"
        shown = self._varying()
        cols = [Column(k, (lambda k: lambda r: getattr(r, k))(k)) for k in shown if k != "head_dim"]
        cols += [Column("seq_len", lambda r: r.seq_len, "right")]
        if "head_dim" in shown:
            cols += [Column("head_dim", lambda r: r.head_dim, "right")]
        return cols + [
            Column(f"peak ({u})", lambda r: self._cell(r.peak_bytes), "right",
                   means=MEANS["peak"], term="peak"),
            Column(f"saved ({u})", lambda r: self._cell(r.saved_bytes), "right", drop=2,
                   means=MEANS["saved"], term="saved"),
            Column(f"reserved ({u})", lambda r: self._cell(r.reserved_peak_bytes), "right",
                   drop=1, means=MEANS["reserved"], term="reserved"),
            Column("x first", _growth, "right", drop=3, means=MEANS["x first"]),
            Column("N^2 share", lambda r: share(r.quadratic_bytes, r.peak_bytes), "right",
                   drop=4, means=MEANS["N^2 share"]),
            Column("OOM?", lambda r: "fits" if r.fits else "OOM", means=MEANS["OOM?"]),
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
        """What a pivot's figure and its OOM mark mean (the long table's columns say it in
        their legend, for those shown), the skips, the caveats."""
        said = {self.pivot: MEANS[self.pivot], "OOM": MEANS["OOM?"]} if self.pivot else {}
        lines = ["; ".join(f"{k}: {v}" for k, v in said.items()) + "."] if said else []
        from memcalc.output.results import caveats

        shown = list(dict.fromkeys(self.columns["impl"]))
        skips = [f"{s.who()}: skipped, {s.reason}" for s in self.skipped]
        return lines + self._picked(shown) + skips + caveats(shown)

    def _picked(self, impls: list[str]) -> list[str]:
        """How the implementations that pick their kernel (``sdpa``) picked it, at the
        lengths the tables show."""
        from memcalc.impls import get_impl
        from memcalc.output.results import picked_notes

        if not any(get_impl(name).runs for name in impls):
            return []
        kept, fields = set(self.shown_lengths()), ("impl", "dtype", "batch", "heads",
                                                   "seq_len", "head_dim", "cp")
        picks = {tuple(self.columns[k][i] for k in fields) for i in range(len(self))
                 if self.columns["seq_len"][i] in kept and get_impl(self.columns["impl"][i]).runs}
        return picked_notes(*(self.base.replace(**dict(zip(fields, p))) for p in sorted(picks)))

    # pivot layout
    def pivot_tables(self, figure: Figure) -> list[tuple[str, list[Column], list]]:
        """One (title, columns, rows) per series group: rows seq_len, columns head_dim."""
        key = FIGURE_KEY[figure]
        u = "bytes" if self.unit == "bytes" else "MiB"
        groups: dict[tuple, dict[int, dict[int, SweepRow]]] = {}
        for r in self._table_rows():
            g = groups.setdefault((r.impl, r.dtype, r.batch, r.heads, r.cp), {})
            g.setdefault(r.seq_len, {})[r.head_dim] = r
        out = []
        dims = [d for d in self.axes["head_dim"]]
        kept = set(self.shown_lengths())
        for (impl, dtype, batch, heads, cp), table in groups.items():
            table = {n: row for n, row in table.items() if n in kept}
            def cell(row, d, key=key):
                r = row[1].get(d)
                if r is None:
                    return "-"
                value = self._cell(getattr(r, key))
                return value if r.fits else f"{shown(value)} OOM"
            cols = [Column("seq_len \\ head_dim", lambda row: row[0], "right", phrase=True)]
            cols += [Column(str(d), (lambda d: lambda row: cell(row, d))(d), "right") for d in dims]
            config = self.base.replace(impl=impl, dtype=dtype, batch=batch, heads=heads, cp=cp)
            label = config.label(leave_out=("seq_len", "head_dim"))
            title = f"{FIGURE_TITLE[figure]} ({u}): {impl}: {label}"
            out.append((title, cols, sorted(table.items())))
        return out

    # rendering: the protocol of memcalc.output.render
    def tables(self) -> list[Table]:
        note = self._thinned_note()
        if self.pivot:
            return [Table(t, c, rows, note) for t, c, rows in self.pivot_tables(self.pivot)]
        return [Table(self.title(), self.long_columns(), self._table_rows(), note)]

    def csv_table(self) -> Table:
        """Every row, every figure in bytes (the layout does not apply), then a row for
        each refusal (``skipped``: its sizes, no figures, the reason)."""
        return record_table(self._csv_keys(), self.records())

    def headline(self) -> str:
        fitting, n = sum(self.columns["fits"]), len(self)
        impls = ", ".join(self.axes["impl"])
        return (f"{n:,} configuration{'s' * (n != 1)} ({impls}), {fitting:,} fit "
                f"{human(self.budget.budget_bytes)}")

    def records(self) -> list[dict]:
        """One flat dict per configuration (``CSV_KEYS``: the JSON's row and its ``status``,
        ``computed``), then one per refusal (its sizes, ``skipped``, the ``reason``): the
        CSV's rows and ``to_dataframe``'s."""
        rows = [{**r, "status": "computed"} for r in self.to_dict()["rows"]]
        rows += [{**s.to_dict(), "status": "skipped"} for s in self.skipped]
        return [{k: row.get(k) for k in self._csv_keys()} for row in rows]

    def _csv_keys(self) -> tuple[str, ...]:
        """``CSV_KEYS``, and ``cp`` when the sweep is over context-parallel ranks."""
        return CSV_KEYS + (("cp",) if "cp" in self.axes else ())

    def to_dict(self) -> dict:
        c = self.columns
        peaks = [max(f, b) for f, b in zip(c["forward_peak_bytes"], c["backward_peak_bytes"])]
        names = [k for k in c if k != "first_peak_bytes" and (k != "cp" or "cp" in self.axes)]
        kv = self.base.shape.kv_heads  # held fixed by the sweep (None: each row's heads)
        rows = [{**(row := dict(zip(names, values))), "kv_heads": kv or row["heads"],
                 "causal": self.base.causal, "peak_bytes": peak,
                 "growth": growth_number(peak, first)}
                for values, peak, first in zip(zip(*(c[k] for k in names)), peaks,
                                               c["first_peak_bytes"])]
        return {"budget_bytes": self.budget.budget_bytes,
                "budget": self.budget.model_dump(mode="json"),
                "axes": {k: list(v) for k, v in self.axes.items()}, "rows": rows,
                "skipped": [s.to_dict() for s in self.skipped],
                "config": self.base.model_dump(mode="json")}


def sweep(base: Config, budget: Budget, seq_len: Iterable[int], head_dim: Iterable[int] = (),
          batch: Iterable[int] = (), heads: Iterable[int] = (), impls: Iterable[str] = (),
          dtypes: Iterable[str] = (), pivot: Figure | None = None,
          unit: Literal["MiB", "bytes"] = "MiB", progress=None, cps: Iterable[int] = ()) -> Sweep:
    """Every combination of the given values (``base``'s where none are given) for each
    implementation, dtype and number of context-parallel ranks (``cps``), exact, with the
    OOM mark for ``budget``. An implementation
    that rejects a dtype, or some of the sizes, is listed under ``skipped`` with them; its
    other configurations stay.
    ``progress(items, total, description)`` wraps the loop over implementations and dtypes
    (``memcalc.output.progress``)."""
    s = base.shape
    axes = {"impl": tuple(impls) or (base.impl,), "dtype": tuple(dtypes) or (base.dtype.value,),
            **({"cp": tuple(cps)} if tuple(cps) not in ((), (1,)) else {}),
            "batch": tuple(batch) or (s.batch,), "heads": tuple(heads) or (s.heads,),
            "head_dim": tuple(head_dim) or (s.head_dim,)}
    if hasattr(seq_len, "__len__"):  # a range of a hundred million: refused before it is made
        check_rows(len(seq_len) * prod(map(len, axes.values())))
    axes["seq_len"] = tuple(seq_len)
    check_rows(prod(map(len, axes.values())))
    for k, values in axes.items():
        if not values:
            raise ValueError(f"{k}: no values")
    columns: dict[str, list] = {k: [] for k in SweepRow.model_fields}
    skipped: list[Skipped] = []
    errors: list[Exception] = []
    ranks = axes.get("cp", (base.cp,))
    series = list(product(axes["impl"], axes["dtype"], *([ranks] if len(ranks) > 1 else [])))
    if progress is not None and len(series) > 1:
        series = progress(series, len(series), "sweep")
    for impl, dtype, *cp in series:
        cp = cp[0] if cp else ranks[0]
        say(f"{impl} {dtype}: the figures of each configuration")
        try:
            config = _series_base(base, impl, dtype, axes, cp)
            runs = _evaluated(config, axes)
        except Exception as error:  # noqa: BLE001 - refused (or broken) wherever it is tried
            runs = [([], error)]
        for points, outcome in runs:
            if isinstance(outcome, Exception):
                errors.append(outcome)
                sizes = {**({"cp": cp} if len(ranks) > 1 else {}), **_varying(points, axes)}
                skipped.append(Skipped(impl=impl, dtype=dtype, sizes=sizes,
                                       reason=refusal(outcome, impl)))
                continue
            arrays = tuple(np.array(v, dtype=np.int64) for v in zip(*points))
            lengths = sum(1 for p in points if p[:3] == points[0][:3])
            say(f"{impl} {dtype}: which configurations fit")
            _add_series(columns, config, outcome, arrays, lengths, budget)
    if not columns["impl"]:  # an empty table: refused
        if len(errors) == 1:
            raise errors[0]
        raise ValueError("no implementation has figures for these options: "
                         + "; ".join(f"{s.who()}: {s.reason}" for s in skipped))
    return Sweep(budget=budget, base=base, axes=axes,
                 columns={k: tuple(v) for k, v in columns.items()}, skipped=tuple(skipped),
                 pivot=pivot, unit=unit)


def merged(sweeps: list[Sweep]) -> Sweep:
    """Sweeps over one grid (one per compiled step of a target: ``--compile-budget``) as
    one, their series in order; the first's base configuration."""
    first = sweeps[0]
    return first.model_copy(update={
        "axes": {**first.axes, "impl": tuple(i for s in sweeps for i in s.axes["impl"])},
        "columns": {k: tuple(v for s in sweeps for v in s.columns[k]) for k in first.columns},
        "skipped": tuple(k for s in sweeps for k in s.skipped)})


GRID = ("batch", "heads", "head_dim", "seq_len")  # the order of a sweep's configurations


def _series_base(base: Config, impl: str, dtype: str, axes: dict, cp: int = 1) -> Config:
    """``base`` as ``impl`` in ``dtype``, at the first point of the grid it takes (the grid
    sets every configuration's sizes, but the figures are evaluated from a configuration
    the implementation takes: ``base``'s own sizes may be refused, a head dim of 512 for
    FlashAttention); the first refusal when it takes none of the first 64."""
    from memcalc.analysis.vectorized import evaluate

    def taken(point: tuple) -> Config:
        sizes = dict(zip(GRID, point))
        config = base.replace(impl=impl, dtype=dtype, cp=cp, **sizes)
        evaluate(config, **{k: np.array([v], dtype=np.int64) for k, v in sizes.items()})
        return config

    # a model that rejects (or breaks on) a point: any exception is its refusal
    return first_taken(product(*(axes[k] for k in GRID)), taken, refused=Exception)


def _evaluated(config: Config, axes: dict) -> list[tuple[list[tuple], object]]:
    """``config``'s figures over the grid of ``axes``, as runs of ``(points, figures)``,
    a point being ``(batch, heads, head_dim, seq_len)``: the whole grid at once. Where the
    implementation refuses it (or breaks on it), each shape (batch, heads, head_dim) apart,
    and a refused shape's lengths one by one, so that a refusal (the exception in place of
    the figures) is of the sizes that cause it; a series refused in every shape is one
    refusal."""
    from memcalc.analysis.vectorized import evaluate

    def run(points: list[tuple]) -> tuple[list[tuple], object]:
        sizes = {k: np.array(v, dtype=np.int64) for k, v in zip(GRID, zip(*points))}
        try:
            return points, evaluate(config, **sizes)
        except Exception as error:  # noqa: BLE001 - a model that rejects (or breaks on) these
            return points, error

    shapes = list(product(axes["batch"], axes["heads"], axes["head_dim"]))
    whole = run([(*shape, n) for shape in shapes for n in axes["seq_len"]])
    if not isinstance(whole[1], Exception) or len(whole[0]) == 1:
        return [whole]
    runs = [run([(*shape, n) for n in axes["seq_len"]]) for shape in shapes]
    if all(isinstance(outcome, Exception) for _, outcome in runs):
        runs = [r for points, _ in runs for r in _one_by_one(run, points)]
        if all(isinstance(outcome, Exception) for _, outcome in runs):
            return [whole]
        return runs
    return [r for points, outcome in runs
            for r in (_one_by_one(run, points) if isinstance(outcome, Exception)
                      else [(points, outcome)])]


def _one_by_one(run, points: list[tuple]) -> list[tuple[list[tuple], object]]:
    """The points a run refused, each apart: those accepted evaluated again together (one
    series, so that growth is measured from its first length), then each refusal."""
    if len(points) == 1:
        return [run(points)]
    alone = [run([p]) for p in points]
    accepted = [p for (p,), outcome in alone if not isinstance(outcome, Exception)]
    if not accepted:  # refused at every length: one refusal, of the shape
        return [run(points)]
    return [run(accepted)] + [r for r in alone if isinstance(r[1], Exception)]


def _varying(points: list[tuple], axes: dict) -> dict[str, int]:
    """The sizes all ``points`` share, of the axes the sweep varies: what a refusal is of."""
    return {k: points[0][i] for i, k in enumerate(GRID)
            if points and len(axes[k]) > 1 and all(p[i] == points[0][i] for p in points)}


def _add_series(columns: dict[str, list], config: Config, figures, shape_axes, lengths: int,
                budget: Budget) -> None:
    """Append one implementation and dtype's configurations to ``columns``, column by column.
    The grid is ordered batch, heads, head_dim, then seq_len: each run of ``lengths``
    configurations is one series, whose first peak the growth is measured against."""
    from memcalc.analysis.vectorized import classify

    verdict = classify(figures, budget.budget_bytes)
    fits = verdict == 1
    for i in np.flatnonzero(verdict == -1):  # the capped replay decides these
        shape = dict(zip(("batch", "heads", "head_dim", "seq_len"),
                         (int(a[i]) for a in shape_axes)))
        fits[i] = fit(config.replace(**shape), budget.budget_bytes).fits
    n = len(fits)
    columns["impl"] += [config.impl] * n
    columns["dtype"] += [config.dtype.value] * n
    columns["cp"] += [config.cp] * n
    for name, values in zip(("batch", "heads", "head_dim", "seq_len"), shape_axes):
        columns[name] += values.tolist()
    for name in ("saved_bytes", "forward_peak_bytes", "backward_peak_bytes",
                 "reserved_peak_bytes", "quadratic_bytes"):
        columns[name] += getattr(figures, name).tolist()
    columns["fits"] += fits.tolist()
    columns["first_peak_bytes"] += np.repeat(figures.peak_bytes[::lengths], lengths).tolist()
