"""Result models: what one step allocates, frozen, with every total computed from parts.

A ``Breakdown`` stores the live sets (the tensors alive at the forward and backward
peaks, and those saved for backward) and the reserved peak; every other figure is a
property summed from them, so no figure is stored twice. The three sums over live sets are
kept once made (a long loop's peak holds 100,000 tensors, and a table reads them a dozen
times); a copy with other fields makes them again.
"""

from __future__ import annotations

from functools import cached_property
from typing import Literal

from pydantic import PrivateAttr, computed_field

from memcalc.config import Config
from memcalc.engine.component import Component
from memcalc.engine.program import Role
from memcalc.output.result import Result

# the figures every backend reports and every comparison checks
FIGURES = ("saved_bytes", "forward_peak_bytes", "backward_peak_bytes", "peak_bytes",
           "reserved_peak_bytes")
OPTIMIZER_PEAK = "optimizer_peak_bytes"  # and a training loop's step, where it has one


def figure_names(result) -> tuple[str, ...]:
    """The figures of ``result`` (a ``Breakdown``, a protocol's ``Measured``) to report and
    compare: ``FIGURES``, and the optimizer's peak where the step had one."""
    return FIGURES + ((OPTIMIZER_PEAK,) if getattr(result, OPTIMIZER_PEAK, None) is not None
                      else ())


# How a step is judged against a budget: ``memcalc.analysis.budget`` (which builds on this module)
# registers its ``judge(breakdown, budget) -> (Budget, Fit)`` here when it is imported, and
# ``import memcalc`` imports it; so this module never imports the replay that makes it.
_JUDGE: list = []


def register_judge(judge) -> None:
    """``memcalc.analysis.budget``'s judge of a step in a budget (``Breakdown.fit``)."""
    _JUDGE[:] = [judge]


_SUMS = ("saved_bytes", "forward_peak_bytes", "backward_peak_bytes",
         "optimizer_peak_bytes")  # cached per instance


def _total(components: tuple[Component, ...]) -> int:
    return sum(c.allocated for c in components)


class Breakdown(Result):
    """Memory of one training step, as ``torch.cuda`` would report it (DESIGN.md s.1)."""
    config: Config
    forward_live: tuple[Component, ...]
    backward_live: tuple[Component, ...]
    saved: tuple[Component, ...]
    # a traced training step's optimizer.step() and zero_grad(): alive at their peak (none:
    # the step has no optimizer)
    optimizer_live: tuple[Component, ...] = ()
    # a compiled step's: what its measured backward allocated to recompute forward values
    # the partitioner did not save (None: no compiled code ran)
    recomputed: tuple[Component, ...] | None = None
    reserved_peak_bytes: int
    rank: int | None = None  # under context parallelism: the busiest rank, shown
    rank_peaks: tuple[int, ...] = ()  # and every rank's max_memory_allocated
    rank_reserved: tuple[int, ...] = ()  # and max_memory_reserved
    _budget: object = PrivateAttr(None)  # the Budget ``fits`` uses, when given

    @computed_field
    @cached_property
    def saved_bytes(self) -> int:
        """Blocks the forward leaves alive for backward, less the output."""
        return _total(self.saved)

    @computed_field
    @cached_property
    def forward_peak_bytes(self) -> int:
        return _total(self.forward_live)

    @computed_field
    @cached_property
    def backward_peak_bytes(self) -> int:
        return _total(self.backward_live)

    @computed_field
    @cached_property
    def optimizer_peak_bytes(self) -> int | None:
        """The peak of ``optimizer.step()`` and ``zero_grad()``; None without an optimizer."""
        return _total(self.optimizer_live) if self.optimizer_live else None

    @computed_field
    @property
    def recomputed_bytes(self) -> int | None:
        """Blocks a compiled backward allocated for recomputed forward values, summed over
        the backward (each buffer once, whenever it lived); None: no compiled code ran."""
        return None if self.recomputed is None else _total(self.recomputed)

    @computed_field
    @property
    def peak_bytes(self) -> int:
        """``max_memory_allocated`` over the whole step."""
        return max(self.forward_peak_bytes, self.backward_peak_bytes,
                   self.optimizer_peak_bytes or 0)

    @computed_field
    @property
    def peak_phase(self) -> Literal["forward", "backward", "optimizer"]:
        """The phase whose peak is the step's: the first of forward, backward, optimizer
        to reach it."""
        peaks = {"forward": self.forward_peak_bytes, "backward": self.backward_peak_bytes,
                 "optimizer": self.optimizer_peak_bytes or 0}
        return next(phase for phase, peak in peaks.items() if peak == self.peak_bytes)

    @property
    def kernel(self) -> str | None:
        """What an implementation that picks its kernel ran as (``sdpa``: ``sdpa-cudnn``);
        None for the others."""
        from memcalc.impls import get_impl

        try:
            runs = get_impl(self.config.impl).runs
        except ValueError:  # a traced function's name, not the registry's
            return None
        return runs(self.config.dims) if runs else None

    @computed_field
    @property
    def workspace_bytes(self) -> int:
        """cuBLAS workspaces alive at the peak (one per thread that ran a matmul)."""
        return _total(tuple(c for c in self._peak_live if c.role is Role.workspace))

    @property
    def components(self) -> tuple[Component, ...]:
        """Everything alive at the peak, largest first."""
        return tuple(sorted(self._peak_live, key=lambda c: -c.allocated))

    @property
    def _peak_live(self) -> tuple[Component, ...]:
        return {"forward": self.forward_live, "backward": self.backward_live,
                "optimizer": self.optimizer_live}[self.peak_phase]

    def figures(self) -> dict[str, int]:
        """The phase figures by name, for comparisons and tables (``figure_names``)."""
        return {k: getattr(self, k) for k in figure_names(self)}

    def to_dict(self) -> dict:
        """JSON-ready: the figures at the top level, ``components`` alive at the peak
        (``records``), ``saved`` (``bytes`` requested, ``allocated`` the block) and the
        config."""
        figures = {k: getattr(self, k) for k in ("saved_bytes", "forward_peak_bytes",
                   "backward_peak_bytes", "optimizer_peak_bytes", "peak_bytes",
                   "reserved_peak_bytes", "workspace_bytes")}
        if self.recomputed is not None:  # a compiled step's
            figures["recomputed_bytes"] = self.recomputed_bytes
            figures["recomputed"] = [c.to_dict() for c in self.recomputed]
        judged = self.fit().verdict(self.budget) if self.has_budget else {}
        ranks = {} if self.rank is None else {  # under --cp: the rank shown, and every rank's
            "rank": self.rank, "rank_peak_bytes": list(self.rank_peaks),
            "rank_reserved_peak_bytes": list(self.rank_reserved)}
        kernel = {"kernel": self.kernel} if self.kernel else {}  # sdpa: the one it picked
        return {**figures, "peak_phase": self.peak_phase, **kernel, **ranks, "components": self.records(),
                "saved": [c.to_dict() for c in self.saved],
                "config": self.config.model_dump(mode="json"), **judged}

    def records(self) -> list[dict]:
        """One dict per component alive at the peak, largest first: its fields (``bytes``
        requested, ``allocated`` the block), who made it (``made_by``, as the table's
        column) and its ``share`` of the peak (a fraction, ``memcalc.engine.units.ratio_number``).
        The CSV's rows."""
        from memcalc.output.legend import made_by
        from memcalc.engine.units import ratio_number

        peak = self.peak_bytes
        return [{**c.to_dict(), "made_by": made_by(c),
                 "share": ratio_number(c.allocated, peak)} for c in self.components]

    @property
    def fits(self) -> bool:
        """Whether the step fits its device's default budget (the preset's memory less the
        512 MiB context reserve), or the budget it was computed for
        (``memcalc.breakdown(..., gpu_gb=, reserve=)``): ``memcalc.analysis.budget.fit``."""
        return self.fit().fits

    def fit(self, budget=None):
        """The ``Fit`` of this step in ``budget`` (a ``Budget``, or bytes; default: the one
        it was computed for, or its device's default budget)."""
        if budget is None:
            return self._judged[1]
        return _JUDGE[0](self, budget)[1]

    @property
    def budget(self):
        """The ``Budget`` ``fits`` is judged against."""
        return self._judged[0]

    @property
    def has_budget(self) -> bool:
        """Whether it was judged in a budget given for it (``with_budget``), which its
        rendering then shows."""
        return self._budget is not None

    @cached_property
    def _judged(self) -> tuple:
        """``(Budget, Fit)`` in the budget it was computed for, or its device's default:
        judged once (a step over the budget is replayed again under it)."""
        return _JUDGE[0](self, self._budget)

    def model_copy(self, *, update=None, deep: bool = False) -> "Breakdown":
        """A copy; with ``update``, its sums are made again from its own live sets."""
        copy = super().model_copy(update=update, deep=deep)
        if update:
            for name in (*_SUMS, "_judged"):
                copy.__dict__.pop(name, None)
        return copy

    def with_budget(self, budget) -> "Breakdown":
        """This breakdown, judged against ``budget`` by ``fits`` (a copy), which its
        rendering and JSON then show (``memcalc breakdown``'s budget and fit lines)."""
        copy = self.model_copy()
        copy.__dict__.pop("_judged", None)
        copy._budget = budget
        return copy

    def tables(self) -> list:
        from memcalc.output.results import breakdown_tables

        return breakdown_tables(self)

    def csv_table(self):
        """One row per tensor alive at the peak (the tables show a loop's tensors by kind),
        ``records()`` as columns."""
        from memcalc.output.results import components_csv

        return components_csv(self)

    def footnotes(self) -> list[str]:
        """The budget and the fit, when given (``with_budget``), then the caveats."""
        from memcalc.output.results import caveats, picked_notes, rank_note

        judged = [self.budget.describe(), self.fit().describe()] if self.has_budget else []
        return [*rank_note(self), *picked_notes(self.config), *judged,
                *caveats([self.config.impl])]

    def headline(self) -> str:
        from memcalc.output.results import breakdown_headline

        return breakdown_headline(self)
