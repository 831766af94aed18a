"""Which values of one size an implementation accepts, declared once as data.

A fused kernel refuses some sizes: FlashAttention takes head dims up to 256, the
memory-efficient kernel only multiples of 8 (4 in fp32). An implementation declares such a
rule as an ``Accepted`` (``memcalc.impls.registry.Impl.accepted``); its own check refuses what the
rule excludes (``refuse``), and the solver (``memcalc.analysis.solver``) probes only the values it
accepts and reports when the rule, not memory, bounds the answer. The two read the same
object, so they cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

from memcalc.errors import FLAGS


@dataclass(frozen=True)
class Accepted:
    """The values of the configuration field ``field`` (``"head_dim"``) an implementation
    accepts: the positive multiples of ``step`` up to ``most`` (None: no bound). ``kernel``
    names who refuses the others; ``step_source`` and ``most_source`` say where each bound
    is read from."""

    field: str
    step: int = 1
    most: int | None = None
    kernel: str = ""
    step_source: str = ""
    most_source: str = ""

    def accepts(self, x: int) -> bool:
        """Whether ``x`` is one of the accepted values."""
        return x >= 1 and x % self.step == 0 and (self.most is None or x <= self.most)

    def floor(self, x: int) -> int:
        """The largest accepted value at or below ``x`` (0: none is)."""
        top = x if self.most is None else min(x, self.most)
        return max(0, top - top % self.step)

    def after(self, x: int) -> int | None:
        """The smallest accepted value above ``x`` (None: ``x`` is at or past ``most``)."""
        nxt = x - x % self.step + self.step
        return nxt if self.most is None or nxt <= self.most else None

    def refuse(self, impl: str, x: int) -> None:
        """Raise the one-line ValueError for a value the rule excludes (the check's)."""
        option = FLAGS.get(self.field, self.field)
        if x % self.step:
            raise ValueError(f"{option}: {impl}: {self.field} {x} is not a multiple of "
                             f"{self.step}: {self.kernel} takes no other ({self.step_source})")
        if self.most is not None and x > self.most:
            raise ValueError(f"{option}: {impl}: {self.field} {x} > {self.most}: {self.limit()}")

    def limit(self) -> str:
        """What ``most`` is, in words: ``the largest head_dim FlashAttention supports (...)``."""
        return f"the largest {self.field} {self.kernel} supports ({self.most_source})"

    def steps(self) -> str:
        """The step in words, for the report: ``the memory-efficient kernel takes head_dim
        in multiples of 8 only (...)`` (empty when every value up to ``most`` is taken)."""
        if self.step == 1:
            return ""
        return (f"{self.kernel} takes {self.field} in multiples of {self.step} only "
                f"({self.step_source})")

    def to_dict(self) -> dict:
        """``accepted_step`` and ``accepted_most``: the rule as the JSON and CSV give it."""
        return {"accepted_step": self.step, "accepted_most": self.most}


def every(field: str) -> Accepted:
    """The rule of an implementation that declares none for ``field``: every value."""
    return Accepted(field)


def context_parallel(cp: int, field: str = "seq_len", impl: str = "",
                     method: str = "allgather") -> Accepted:
    """Under ``cp`` context-parallel ranks, the sequence lengths PyTorch's load-balanced
    sharding takes: multiples of 2 x cp (``memcalc.impls.ring``); over the memory-efficient
    kernel, of 64 x cp, since the ring merges its logsumexp, padded to 32 rows, with the
    output of a step on half the rank's rows. DeepSpeed-Ulysses (``method="ulysses"``):
    multiples of cp, each rank's N / P rows (``memcalc.impls.ulysses``)."""
    if method == "ulysses":
        return Accepted(field, step=cp, kernel=f"DeepSpeed-Ulysses over {cp} ranks",
                        step_source="each rank holds N / P rows: deepspeed/sequence/layer.py")
    if impl == "sdpa-efficient":
        return Accepted(field, step=64 * cp, kernel=f"context parallelism over {cp} ranks "
                        f"with the memory-efficient kernel", step_source="its logsumexp of "
                        "ceil32(rows) rows broadcast against the output's (_SDPAMerger)")
    return Accepted(field, step=2 * cp, kernel=f"context parallelism over {cp} ranks",
                    step_source="each rank holds two chunks of N / 2P rows: "
                                "torch/distributed/tensor/experimental/_context_parallel")
