"""Validation grids: a named product of options plus explicit extra configurations."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from memcalc.config import Config, Device, DType, Protocol, Shape
from memcalc.errors import one_line

_FROZEN = ConfigDict(frozen=True, extra="forbid")


# a product's values: at least one (an empty list would silently expand to nothing); sizes
# positive, and whole numbers as written (``true`` is not a batch of 1)
Sizes = Annotated[list[Annotated[int, Field(ge=1, strict=True)]], Field(min_length=1)]
Flags = Annotated[list[Annotated[bool, Field(strict=True)]], Field(min_length=1)]
Names = Annotated[list[str], Field(min_length=1)]


class Product(BaseModel):
    """Every combination of these values is one configuration."""

    model_config = _FROZEN
    impl: Names
    causal: Flags = [False]
    dtype: Annotated[list[DType], Field(min_length=1)] = [DType.fp32]
    batch: Sizes = [2]
    heads: Sizes = [1]
    seq_len: Sizes = [256]
    head_dim: Sizes = [16]
    gpu: Names = ["h100-80gb"]
    loss: Names = ["grad"]
    forward_only: Flags = [False]
    kv_heads: list[Annotated[int, Field(ge=1, strict=True)] | None] = Field([None], min_length=1)
    deterministic: Flags = [False]

    def configs(self) -> list[Config]:
        keys = list(type(self).model_fields)
        rows = itertools.product(*(getattr(self, k) for k in keys))
        return [_config(**dict(zip(keys, row))) for row in rows]


def _config(impl, causal, dtype, batch, heads, seq_len, head_dim, gpu, loss,
            forward_only, kv_heads, deterministic) -> Config:
    return Config(impl=impl, causal=causal, dtype=dtype,
                  shape=Shape(batch=batch, heads=heads, seq_len=seq_len, head_dim=head_dim,
                              kv_heads=kv_heads),
                  device=Device(gpu=gpu), protocol=Protocol(loss=loss, forward_only=forward_only,
                                                            deterministic=deterministic))


class Grid(BaseModel):
    """A grid file: products and explicit configurations, in that order."""

    model_config = _FROZEN
    name: str
    products: list[Product] = []
    configs: list[Config] = []

    @model_validator(mode="after")
    def _not_empty(self) -> "Grid":
        if not self.products and not self.configs:
            raise ValueError("a grid needs at least one product or configuration "
                             "(products, configs)")
        return self

    def expand(self, impls: list[str] | None = None) -> list[Config]:
        """All configurations, optionally only those of the named implementations."""
        every = [c for p in self.products for c in p.configs()] + list(self.configs)
        return [c for c in every if impls is None or c.impl in impls]


def load_grid(path: str | Path) -> Grid:
    """Read and validate a grid file; a ValueError naming the file and field otherwise."""
    try:
        grid = Grid.model_validate(json.loads(Path(path).read_text()))
        grid.expand()  # every configuration validates now, not halfway through a run
        return grid
    except ValueError as error:  # JSONDecodeError and ValidationError are ValueErrors
        raise ValueError(f"--grid {path}: {one_line(error)}") from None
    except OSError as error:  # no such file, a folder, no permission
        raise ValueError(f"--grid {path}: {error.strerror or one_line(error)}") from None


def default_grid() -> Grid:
    """The grid that ships with memcalc: every file of ``memcalc/data/grids/``, one per
    implementation family, in name order."""
    folder = Path(__file__).resolve().parents[1] / "data" / "grids"
    grids = [load_grid(p) for p in sorted(folder.glob("*.json"))]
    return Grid(name="default", products=[p for g in grids for p in g.products],
                configs=[c for g in grids for c in g.configs])
