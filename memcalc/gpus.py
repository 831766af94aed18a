"""GPU presets, kept as data in ``memcalc/data/gpus.json`` and validated on load."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MEMORY_KINDS = {
    "torch": "the total capacity PyTorch reports",
    "nvidia-smi": "nvidia-smi's total; PyTorch may see ~0.5 GiB less",
    "given": "as given",
}


class GPU(BaseModel):
    """A device: the memory PyTorch can use and the compute capability that sets cuBLAS
    defaults. ``memory_kind`` says what ``memory_bytes`` is (``MEMORY_KINDS``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    label: str
    memory_bytes: int = Field(ge=1, description="memory PyTorch can use (see memory_kind)")
    compute_capability: tuple[int, int]
    source: str
    sm_count: int | None = Field(None, ge=1, description="streaming multiprocessors")
    memory_kind: Literal["torch", "nvidia-smi", "given"] = "given"
    smi_memory_bytes: int | None = Field(None, ge=1, description="nvidia-smi memory.total")
    smi_source: str = ""


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
