"""What a search for the largest size that fits answers (``memcalc.analysis.solver``):
``Solved`` (adjacent bounds, with the figures at both), or ``Unsolved`` (the bounds known
when its time ran out), or ``Interrupted`` (Ctrl-C, with what it knew).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field

from memcalc.analysis.budget import Fit
from memcalc.analysis.closed_form import Quadratic
from memcalc.impls.accepted import Accepted

_FROZEN = ConfigDict(frozen=True, extra="forbid")


SolveField = Literal["seq_len", "batch", "head_dim"]


class Solved(BaseModel):
    """One implementation's threshold: ``max_value`` fits, ``next_value`` (``max_value +
    1``, or the next value the implementation accepts: ``accepted``) does not; no
    ``next_value`` when ``max_value`` is the largest value it accepts (its ``limit``). A
    search its time limit cut short after proving both (``max_fitting``) may lack the
    figures it had no time to replay in full: None."""

    model_config = _FROZEN
    impl: str
    field: SolveField
    max_value: int = Field(description="largest accepted value that fits (0: none)")
    next_value: int | None = Field(description="the next accepted value, which does not fit "
                                               "(None: max_value is the largest accepted)")
    first_failing_power_of_two: int | None = Field(
        description="the smallest accepted power of two above max_value that does not fit "
                    "(None: none is accepted, or not replayed in time)")
    at_max: Fit | None = Field(description="the step at max_value (None when 0, or not "
                                           "replayed in full in time)")
    at_next: Fit | None = Field(description="the step at next_value (None without one, or "
                                            "not replayed in full in time)")
    accepted: Accepted = Field(description="the values of field the implementation accepts")
    approximation: Quadratic | None
    evaluations: int = Field(description="full predictions the solver made")
    note: str | None = Field(None, description="how the answer was found and confirmed, "
                                               "where it needs saying (traced code)")
    holes: tuple[int, ...] = Field((), description="values a little below max_value that do "
                                                   "not fit (a fragile answer)")

    @computed_field
    @property
    def peak_bytes_at_max(self) -> int | None:
        return self.at_max.peak_bytes if self.at_max else None

    @computed_field
    @property
    def peak_bytes_at_next(self) -> int | None:
        return self.at_next.peak_bytes if self.at_next else None

    @computed_field
    @property
    def spare_bytes_at_max(self) -> int | None:
        """The budget less what the step reserves at ``max_value`` (under the budget)."""
        return self.at_max.budget_bytes - self.at_max.reserved_bytes if self.at_max else None

    @computed_field
    @property
    def limit(self) -> str | None:
        """Why nothing above ``max_value`` is tried: the implementation's largest accepted
        value, in words; None when memory bounds the answer."""
        return self.accepted.limit() if self.next_value is None else None

    def __getattr__(self, name: str):
        """Each key of ``to_dict`` (the JSON's, the CSV's and the DataFrame's) is an
        attribute too, so one name serves everywhere: ``max_seq_len`` (``max_value`` of a
        search over ``seq_len``), ``next_seq_len``, ``needed_bytes_at_next``, ..."""
        if not name.startswith("_") and "field" in self.__dict__:
            record = self.to_dict()
            if name in record:
                return record[name]
        return super().__getattr__(name)

    def __str__(self) -> str:
        """``flash2: max seq_len 20,516,864 (20,516,865 does not fit)``."""
        after = (f"{self.next_value:,} does not fit" if self.next_value is not None
                 else self.limit)
        return f"{self.impl}: max {self.field} {self.max_value:,} ({after})"

    def to_dict(self) -> dict:
        at_max, at_next = self.at_max, self.at_next
        return {
            "impl": self.impl, f"max_{self.field}": self.max_value,
            f"next_{self.field}": self.next_value, "limit": self.limit,
            **self.accepted.to_dict(),
            "first_failing_power_of_two": self.first_failing_power_of_two,
            "peak_bytes_at_max": self.peak_bytes_at_max,
            "peak_bytes_at_next": self.peak_bytes_at_next,
            "spare_bytes_at_max": self.spare_bytes_at_max,
            "reserved_bytes_at_max": at_max.reserved_bytes if at_max else None,
            "needed_bytes_at_next": at_next.reserved_bytes if at_next else None,
            "reserved_peak_bytes_at_max": at_max.reserved_peak_bytes if at_max else None,
            "reserved_peak_bytes_at_next": at_next.reserved_peak_bytes if at_next else None,
            "fit_at_max": at_max.describe() if at_max else None,
            "fit_at_next": at_next.describe() if at_next else None,
            "approximation": self.approximation.to_dict() if self.approximation else None,
            "evaluations": self.evaluations, "note": self.note, "holes": list(self.holes),
        }


class Unsolved(Exception):
    """The solver ran out of time (``seconds``) or work (``events``); what it knows so
    far: ``lo`` fits (0: nothing known to), ``hi`` does not (None: nothing known not to),
    the closed-form ``estimate`` not replayed, and the ``ceiling`` past which nothing
    fits."""

    def __init__(self, lo: int, hi: int | None, seconds: float | None,
                 estimate: int | None = None, ceiling: int | None = None,
                 stopped_after: float | None = None, events: int | None = None):
        self.lo, self.hi, self.estimate, self.ceiling = lo, hi, estimate, ceiling
        self.events = events  # the work limit that stopped it, if that one did
        known = ([f"fits at {lo:,}"] if lo else []) + ([f"not at {hi:,}"] if hi else [])
        bound = ", ".join(known) or ("nothing replayed in time" if events is None
                                     else "nothing replayed within it")
        if estimate is not None:
            bound += f"; the closed-form estimate, not replayed: {estimate:,}"
        if ceiling is not None:
            bound += (f"; at most {ceiling:,}, past which the tensors alive at the peak alone "
                      f"exceed the budget")
        within = f" within {seconds:g} s" if seconds is not None else ""
        if events is not None:
            within = f" within the work limit of {events:,} events"
        if stopped_after is not None:
            within = f": interrupted after {stopped_after:.0f} s"
        super().__init__(f"no exact answer{within} ({bound})")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a search: still a ``KeyboardInterrupt``, with what the search knew
    (``known``, an ``Unsolved``; ``solved`` when it had proven adjacent bounds): a command
    can show it before it stops."""

    def __init__(self, known: Unsolved, solved: "Solved | None" = None):
        super().__init__(str(known))
        self.known, self.solved = known, solved
