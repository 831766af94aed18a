"""GPU presets, kept as data in ``memcalc/data/gpus.json`` and validated on load."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources

from pydantic import BaseModel, ConfigDict, Field


class GPU(BaseModel):
    """A device: its total memory and the compute capability that sets cuBLAS defaults."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    label: str
    memory_bytes: int = Field(ge=1)
    compute_capability: tuple[int, int]
    source: str
    sm_count: int | None = Field(None, ge=1, description="streaming multiprocessors")


@cache
def gpu_presets() -> dict[str, GPU]:
    """Every preset by name, validated."""
    raw = json.loads(resources.files("memcalc").joinpath("data/gpus.json").read_text())
    return {k: GPU(name=k, **v) for k, v in raw.items() if not k.startswith("_")}


def gpu_preset(name: str) -> GPU:
    """The preset called ``name``; a ValueError listing the known ones otherwise."""
    from memcalc.names import did_you_mean

    presets = gpu_presets()
    if name not in presets:
        key = str(name).strip().lower().replace("_", "-").replace(" ", "-")
        if key in presets:  # "H100-80GB", "h100_80gb"
            return presets[key]
        raise ValueError(f"unknown GPU {name!r}{did_you_mean(name, sorted(presets))}; "
                         f"known: {', '.join(sorted(presets))}")
    return presets[name]
