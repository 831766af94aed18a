"""What the engine reports of an allocation: a ``Component`` (a tensor or a workspace and the
block the allocator gave it), on the base every reported model shares (``Record``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, computed_field, model_validator

from memcalc.engine.program import ITEMSIZE, Role

FROZEN = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


class Record(BaseModel):
    """Base of the models memcalc reports: frozen, and their JSON reads back although it
    carries the computed fields (they are recomputed, never taken from the input)."""

    model_config = FROZEN

    @model_validator(mode="before")
    @classmethod
    def _drop_computed(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if k not in cls.model_computed_fields}
        return data

    def records(self) -> list[dict]:
        """The result's rows as plain dicts (one per component, configuration, ...)."""
        return [self.to_dict()]

    def headline(self) -> str:
        """One short line: the ``repr`` and ``print(result)``."""
        return type(self).__name__

    def __repr__(self) -> str:
        return f"<{type(self).__name__}: {self.headline()}>"

    def __str__(self) -> str:
        return self.headline()

    def to_dict(self) -> dict:
        return self.model_dump(mode="json", by_alias=True)


class Component(Record):
    """One allocation: a tensor (or a workspace) and the block the allocator gave it."""
    name: str
    role: Role
    op: str
    shape: tuple[int, ...]
    dtype: str
    # one name in Python, JSON, CSV and the tables' headings: ``bytes`` the tensor asks
    # for, ``allocated`` the block the allocator gives it (every figure sums these)
    bytes: int = Field(description="what the tensor asks for: its elements x element size")
    allocated: int = Field(description="the block the caching allocator gives it")
    source: str = ""

    @computed_field
    @property
    def formula(self) -> str:
        """The raw size spelled out, ``8 x 16384 x 16384 x 4 B``."""
        if self.role is Role.workspace or (self.dtype == "uint8" and len(self.shape) == 1):
            return f"{self.bytes:,} B"  # a buffer of bytes
        dims = " x ".join(str(n) for n in self.shape) or "1"
        if self.dtype not in ITEMSIZE:
            return f"{dims} ({self.bytes:,} B)"
        return f"{dims} x {ITEMSIZE[self.dtype]} B"

    def headline(self) -> str:
        """``q (input, randn): 8 x 1 x 1024 x 16 x 4 B = 524,288 B, allocated 524,288 B``."""
        asked = "" if self.role is Role.workspace else f" = {self.bytes:,} B"
        return (f"{self.name} ({self.role.value}, {self.op}): {self.formula}{asked}, "
                f"allocated {self.allocated:,} B")
