"""The memory budget of a device, and the one definition of a step that fits in it.

Budget: ``memory_bytes`` (a GPU preset's memory PyTorch can use -- the "total capacity" of
PyTorch's out-of-memory message where a public report quotes it, else nvidia-smi's
``memory.total``, ``memcalc/data/gpus.json`` -- or ``--gpu-gb``) minus ``reserve_bytes``,
what the caching allocator may reserve for itself.

Default reserve, 512 MiB: a PyTorch process's CUDA context (driver state, the kernel
images of the libraries it loaded) takes device memory that ``torch.cuda`` never counts.
With lazy module loading (CUDA >= 11.7, the default since) it is about 300-500 MiB on
current GPUs: ~300 MB in pytorch/pytorch#107667 (ptrblck, 2023: "before CUDA 11.7 ... >1000
MB"), 300-400 MB in #20532, 200-700 MB by machine in #28113. ``total_memory`` as torch
reports it is also a few hundred MiB below ``nvidia-smi``'s total on some boards. 512 MiB
covers the context of a process that runs one attention step; pass ``--reserve`` for other
processes on the same GPU, a larger context (eager module loading), or ``0`` for the
allocator's own view.

Fits: a step fits when replaying it with ``capacity = budget`` raises no ``OutOfMemory``:
every ``cudaMalloc`` of a new segment must keep the reserved memory within the budget,
after PyTorch has released the cached free segments and retried
(``memcalc.engine.allocator.CachingAllocator``). That is about reserved memory, not only the
allocated peak (DESIGN.md section 2). ``fit`` is the only definition; ``oom``, ``sweep``,
``breakdown`` and the vectorized classifier (which only decides the cases where this
replay cannot differ from the unbounded one) all rely on it.
"""

from __future__ import annotations

import re
from fractions import Fraction

from pydantic import BaseModel, ConfigDict, Field, computed_field, model_validator

from memcalc.engine.allocator import KiB, MiB, OutOfMemory
from memcalc.analysis.breakdown import Breakdown, register_judge
from memcalc.config import Config, Device
from memcalc.engine.units import GiB, decimal, finite_decimal, human

DEFAULT_RESERVE_BYTES = 512 * MiB
GB = GiB
"""What a GB is, in ``--gpu-gb`` and in every size: 2^30 bytes. GPUs are sold in binary
gigabytes (an "80GB" A100 shows 81920 MiB = 80 x 2^30 B) and PyTorch prints GiB, so memcalc
has one meaning for each unit: KB, MB, GB are KiB, MiB, GiB, and output says GiB."""

_FROZEN = ConfigDict(frozen=True, extra="forbid")
_UNITS = {"": 1, "b": 1, "kib": KiB, "mib": MiB, "gib": GiB, "tib": 1024 * GiB,
          "k": KiB, "m": MiB, "g": GiB, "t": 1024 * GiB,
          "kb": KiB, "mb": MiB, "gb": GB, "tb": 1024 * GB}  # memory units: powers of 2
_SIZE_HELP = ("a size like 512MiB, 1.5GiB or 0 (units B, KiB, MiB, GiB, TiB; KB, MB, GB, TB "
              "are the same powers of 2; a bare number is bytes)")
_SIZE = re.compile(r"^\s*(\d+(?:_\d+)*(?:\.\d+)?(?:[eE][+-]?\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, option: str = "--reserve") -> int:
    """A byte count from ``"512MiB"``, ``"1.5GiB"``, ``"0"``, ``"300"`` (a bare number is
    bytes, as an ``int`` is) or ``"1GB"`` (the same as ``"1GiB"``: ``GB``); the number may be
    written as the sizes are (``1_024``, ``1e3``); exact, so the result must be whole bytes."""
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(f"{option}: {text!r} is not {_SIZE_HELP}")
    value = Fraction(m.group(1).replace("_", "")) * _UNITS[unit]
    if value.denominator != 1:
        raise ValueError(f"{option}: {text!r} is not a whole number of bytes")
    return int(value)


def size_note(text: str) -> str:
    """How a size was read when its unit could be taken for a power of 10:
    ``1GB = 1 GiB``; else ``""``."""
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else ""
    if unit in ("kb", "mb", "gb", "tb"):
        return f"{m.group(1)} {unit.upper()} = {m.group(1)} {unit[0].upper()}iB"
    return ""


def parse_gb(text: str, option: str = "--gpu-gb") -> Fraction:
    """``--gpu-gb X``: X binary gigabytes (2^30 B each), exactly (``"79.5"``, ``"79.11"``)."""
    try:
        value = Fraction(str(text).strip())
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"{option}: {text!r} is not a number of GiB (2^30 B each)") from None
    if not finite_decimal(value):
        raise ValueError(f"{option}: {text!r} is not a decimal number of GiB (2^30 B each)")
    if value * GB < 1:
        raise ValueError(f"{option}: the device memory must be at least one byte (got {text!r})")
    return value


def _size(nbytes: int) -> str:
    """``536,870,912 B (512.00 MiB)``: a size in a message, exact and readable."""
    return f"{nbytes:,} B ({human(nbytes)})" if nbytes >= KiB else f"{nbytes:,} B"


class Budget(BaseModel):
    """What the caching allocator may reserve: the device's memory less a reserve."""

    model_config = _FROZEN
    device: str = Field(description="what the memory figure is, for the output")
    memory_bytes: int = Field(ge=1, description="total device memory")
    reserve_bytes: int = Field(DEFAULT_RESERVE_BYTES, ge=0,
                               description="CUDA context and anything else not for the allocator")
    memory_source: str = ""
    memory_kind: str = Field("", description="what memory_bytes is, for the budget line")
    reserve_source: str = Field("", description="how --reserve was given, when in decimal units")

    @model_validator(mode="after")
    def _check(self) -> "Budget":
        if self.reserve_bytes >= self.memory_bytes:
            raise ValueError(f"--reserve: a reserve of {_size(self.reserve_bytes)} leaves nothing "
                             f"of the device's {_size(self.memory_bytes)}; allowed: less than "
                             f"the device's memory")
        return self

    @computed_field
    @property
    def budget_bytes(self) -> int:
        return self.memory_bytes - self.reserve_bytes

    @classmethod
    def given(cls, device: Device, gpu_gb=None, reserve=None) -> "Budget":
        """The budget as the CLI and the API take it: ``gpu_gb`` GB of 2^30 B (a number or
        its text, instead of the preset's memory), ``reserve`` bytes or a size text such as
        ``"1GiB"`` (default 512 MiB)."""
        text = isinstance(reserve, str)
        reserve_bytes = parse_size(reserve) if text else reserve
        note = size_note(reserve) if text else ""
        gb = parse_gb(str(gpu_gb)) if gpu_gb is not None else None
        return cls.of(device, reserve_bytes, memory_gb=gb, reserve_source=note)

    @classmethod
    def of(cls, device: Device, reserve_bytes: int | None = None, *,
           memory_gb: Fraction | int | None = None, reserve_source: str = "") -> "Budget":
        """The budget of ``device``: its preset's memory, or ``memory_gb`` x 2^30 B rounded
        down to a whole byte (PyTorch's messages round GiB to two places: "79.11 GiB")."""
        from memcalc.gpus import MEMORY_KINDS

        spec = device.spec
        reserve = DEFAULT_RESERVE_BYTES if reserve_bytes is None else reserve_bytes
        if memory_gb is not None:
            exact = memory_gb * GB
            shown = decimal(memory_gb)  # exact: the decimal the user wrote, or its fraction's
            memory = exact.numerator // exact.denominator
            if reserve_bytes is None and memory <= reserve:
                raise ValueError(f"--gpu-gb: {shown} GiB ({memory:,} B) is all taken by the "
                                 f"default --reserve for the CUDA context, {_size(reserve)}; "
                                 f"allowed: more than that, or a smaller --reserve")
            rounded = "" if exact.denominator == 1 else ", rounded down to a whole byte"
            return cls(device=f"{shown} GiB ({'--gpu-gb' + rounded}; cuBLAS workspaces of "
                              f"{spec.name}, compute capability {spec.compute_capability[0]}."
                              f"{spec.compute_capability[1]})",
                       memory_bytes=memory, reserve_bytes=reserve,
                       memory_source=f"--gpu-gb {shown}: {shown} x 2^30 B{rounded}",
                       reserve_source=reserve_source)
        return cls(device=spec.label, memory_bytes=spec.memory_bytes, reserve_bytes=reserve,
                   memory_source=f"{spec.name}: {spec.source}",
                   memory_kind=MEMORY_KINDS[spec.memory_kind],
                   reserve_source=reserve_source)

    def describe(self) -> str:
        """``budget = memory - reserve``, spelled out."""
        kind = f" ({self.memory_kind})" if self.memory_kind else ""
        given = f"{self.reserve_source}, " if self.reserve_source else ""
        return (f"budget {self.budget_bytes:,} B ({human(self.budget_bytes)}) = {self.device} "
                f"{self.memory_bytes:,} B{kind} - reserve {self.reserve_bytes:,} B "
                f"({given}{human(self.reserve_bytes)}, CUDA context)")

    def __str__(self) -> str:
        return self.describe()


class Fit(BaseModel):
    """Whether one step fits in a budget, and the figures that decide it."""

    model_config = _FROZEN
    budget_bytes: int
    peak_bytes: int = Field(description="max_memory_allocated on an unbounded device")
    reserved_peak_bytes: int = Field(description="max_memory_reserved on an unbounded device")
    oom_request_bytes: int | None = Field(None, description="the segment that failed")
    oom_reserved_bytes: int | None = Field(None, description="reserved when it failed")
    retried: bool = Field(False, description="fits only by releasing cached segments first")
    oom_rank: int | None = Field(None, description="under several ranks, the one that ran out")
    capped_reserved_peak_bytes: int | None = Field(
        None, description="max_memory_reserved of the replay capped at the budget (fits only)")

    @computed_field
    @property
    def reserved_bytes(self) -> int:
        """The reserved memory that decides fitting: when it fits, the peak of the replay
        under the budget (with release-and-retry, never above the budget); when it does
        not, what the failed request needed (reserved + the segment it asked for)."""
        if self.oom_request_bytes is not None:
            return self.oom_reserved_bytes + self.oom_request_bytes
        if self.capped_reserved_peak_bytes is not None:
            return self.capped_reserved_peak_bytes
        return self.reserved_peak_bytes

    @computed_field
    @property
    def fits(self) -> bool:
        return self.oom_request_bytes is None

    @computed_field
    @property
    def headroom_bytes(self) -> int:
        """Budget less the reserved peak on an unbounded device (negative: over it)."""
        return self.budget_bytes - self.reserved_peak_bytes

    def describe(self) -> str:
        if not self.fits:
            on = f" on rank {self.oom_rank}" if self.oom_rank is not None else ""
            return (f"OOM{on}: a {self.oom_request_bytes:,} B segment on top of "
                    f"{self.oom_reserved_bytes:,} B reserved exceeds the budget of "
                    f"{self.budget_bytes:,} B (unbounded, the step reserves "
                    f"{self.reserved_peak_bytes:,} B)")
        if self.retried:
            return (f"fits, after releasing cached segments: the step would reserve "
                    f"{self.reserved_peak_bytes:,} B unbounded, over the budget of "
                    f"{self.budget_bytes:,} B; the allocator's release-and-retry keeps it at "
                    f"{self.capped_reserved_peak_bytes:,} B")
        return (f"fits: reserved peak {self.reserved_peak_bytes:,} B <= budget "
                f"{self.budget_bytes:,} B ({human(self.headroom_bytes)} to spare)")

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")

    def verdict(self, budget: "Budget") -> dict:
        """What the JSON of a step judged in ``budget`` adds: ``budget_bytes``, ``fits``,
        then the budget and this fit in full."""
        return {"budget_bytes": budget.budget_bytes, "fits": self.fits,
                "budget": budget.model_dump(mode="json"), "fit": self.to_dict()}


def fit(config: Config, budget_bytes: int, breakdown: Breakdown | None = None,
        replay=None) -> Fit:
    """Whether ``config``'s step fits in ``budget_bytes`` (``fits``: the replay with
    ``capacity=budget_bytes`` raises no ``OutOfMemory``), with the figures that decide it.

    ``breakdown`` (``predict(config)``, computed if not given) saves work: when its reserved
    peak is within the budget, the capped replay never reaches the capacity, so it is the
    same replay and fits; otherwise the capped replay decides. ``replay(capacity)``: the
    capped replay when it is not ``predict``'s (a direct trace of the user's code)."""
    from memcalc.analysis.predict import predict

    replay = replay or (lambda capacity: predict(config, capacity=capacity))
    b = breakdown if breakdown is not None else predict(config)
    common = dict(budget_bytes=budget_bytes, peak_bytes=b.peak_bytes,
                  reserved_peak_bytes=b.reserved_peak_bytes)
    if b.reserved_peak_bytes <= budget_bytes:
        return Fit(**common, capped_reserved_peak_bytes=b.reserved_peak_bytes)
    try:
        capped = replay(budget_bytes)
    except OutOfMemory as oom:
        return Fit(**common, oom_request_bytes=oom.requested, oom_reserved_bytes=oom.reserved,
                   oom_rank=oom.rank)
    return Fit(**common, retried=True, capped_reserved_peak_bytes=capped.reserved_peak_bytes)


def fits(config: Config, budget_bytes: int) -> bool:
    """The definition: replaying ``config``'s step with ``capacity=budget_bytes`` raises no
    ``OutOfMemory``. One replay; ``fit`` gives the same answer with the figures."""
    return replay_within(config, budget_bytes)[0]


def replay_within(config: Config, budget_bytes: int) -> tuple[bool, int]:
    """``fits`` and a size to steer a search with: the reserved peak of the capped replay
    when it fits, the reserved memory plus the failed segment when it does not."""
    from memcalc.analysis.predict import predict

    try:
        b = predict(config, capacity=budget_bytes)
    except OutOfMemory as oom:
        return False, oom.reserved + oom.requested
    return True, b.reserved_peak_bytes


def check(config: Config, budget: Budget) -> Breakdown:
    """``predict(config)``, judged in ``budget``: what ``memcalc breakdown`` prints."""
    from memcalc.analysis.predict import predict

    return predict(config).with_budget(budget)


def judge(breakdown: Breakdown, budget: "Budget | int | None" = None) -> tuple[Budget, Fit]:
    """``breakdown``'s fit in ``budget`` (a ``Budget``, bytes, or None for its device's
    default budget), with the budget: what ``Breakdown.fit`` and ``.fits`` return."""
    if budget is None:
        budget = Budget.of(breakdown.config.device)
    elif isinstance(budget, int) and not isinstance(budget, bool):
        budget = Budget(device="given", memory_bytes=budget, reserve_bytes=0)
    elif not isinstance(budget, Budget):
        raise TypeError(f"fit(): a Budget or a number of bytes (got {budget!r}; "
                        f"memcalc.breakdown(..., gpu_gb=, reserve=) takes sizes)")
    return budget, fit(breakdown.config, budget.budget_bytes, breakdown)


register_judge(judge)
