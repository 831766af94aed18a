"""Budget calibration of a live device: what the CUDA context takes and how much one
allocation can get, so GPU presets and the default reserve can be set from measurements.

Read in this order, at the start of a live run: the device's used memory before this
process creates a CUDA context (NVML, or nvidia-smi in MiB: ``cudaMemGetInfo`` itself would
create the context), ``torch.cuda.mem_get_info()`` right after creating it,
``get_device_properties().total_memory``, and the largest ``torch.empty`` that succeeds,
found by bisection in steps of 2 MiB (the caching allocator rounds requests above 10 MiB up
to 2 MiB, ``kRoundLarge`` in ``c10/cuda/CUDACachingAllocator.cpp``). At the end of the run,
``mem_get_info()`` again with the cache emptied: the libraries loaded on first use (cuBLAS,
cuDNN, kernel modules) are then counted too.
"""

from __future__ import annotations

import os
import subprocess
from typing import Callable

from pydantic import computed_field

from memcalc.output.result import Result
from memcalc.engine.units import human

MiB = 1 << 20
STEP = 2 * MiB  # kRoundLarge


class Calibration(Result):
    """One live run's budget measurements, in bytes."""
    device: str
    total_memory_bytes: int  # get_device_properties(0).total_memory
    used_before_context_bytes: int | None  # None: neither NVML nor nvidia-smi answered
    used_before_source: str  # nvml | nvidia-smi (MiB) | unavailable
    free_after_context_bytes: int  # mem_get_info()[0] right after the context exists
    mem_get_info_total_bytes: int  # mem_get_info()[1]: what older allocators scale the
    # memory fraction by (newer ones take total_memory); the OOM cases assume they agree
    largest_allocation_bytes: int  # the largest single torch.empty that succeeded
    free_after_run_bytes: int | None = None  # mem_get_info()[0] at the end, cache emptied

    @computed_field
    @property
    def context_bytes(self) -> int | None:
        """What creating this process's CUDA context took (to NVML's or nvidia-smi's
        resolution): used after it less used before it."""
        if self.used_before_context_bytes is None:
            return None
        used_after = self.total_memory_bytes - self.free_after_context_bytes
        return used_after - self.used_before_context_bytes

    @computed_field
    @property
    def unavailable_at_start_bytes(self) -> int:
        """Device memory the allocator could not have at start: context and other processes
        (memcalc's ``--reserve``, default 512 MiB, stands for this)."""
        return self.total_memory_bytes - self.free_after_context_bytes

    @computed_field
    @property
    def unavailable_after_run_bytes(self) -> int | None:
        """The same after the run, libraries loaded on first use included."""
        if self.free_after_run_bytes is None:
            return None
        return self.total_memory_bytes - self.free_after_run_bytes

    def describe(self) -> str:
        context = "unknown" if self.context_bytes is None else f"{self.context_bytes:,} B"
        after = ("not read" if self.unavailable_after_run_bytes is None
                 else f"{self.unavailable_after_run_bytes:,} B")
        return (f"calibration of {self.device}: total {self.total_memory_bytes:,} B "
                f"({human(self.total_memory_bytes)}); CUDA context {context} "
                f"({self.used_before_source}); unavailable at start "
                f"{self.unavailable_at_start_bytes:,} B, after the run {after}; largest "
                f"single allocation {self.largest_allocation_bytes:,} B "
                f"({human(self.largest_allocation_bytes)})")


def used_before_context() -> tuple[int | None, str]:
    """The visible device's used memory, read without creating a CUDA context: NVML in
    bytes (``nvidia-ml-py``), else nvidia-smi in MiB, else unknown."""
    index = _physical_index()
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used), "nvml"
    except Exception:  # noqa: BLE001 - no NVML binding or no driver: try nvidia-smi
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,"
                              "nounits", "-i", str(index)], capture_output=True, text=True,
                             timeout=30, check=True).stdout
        return int(out.split()[0]) * MiB, "nvidia-smi (MiB)"
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None, "unavailable"


def _physical_index() -> int:
    """Device 0 of this process as NVML numbers it (the first of CUDA_VISIBLE_DEVICES)."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


def largest_allocation(allocate: Callable[[int], object], oom_error: type, free_bytes: int,
                       empty_cache: Callable[[], None]) -> int:
    """The largest multiple of 2 MiB that ``allocate`` gets in one piece: bisection between
    0 (nothing, which succeeds) and just above ``free_bytes`` (which cannot)."""
    lo, hi = 0, free_bytes // STEP + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            block = allocate(mid * STEP)
        except oom_error:
            hi = mid
        else:
            del block
            lo = mid
        empty_cache()
    return lo * STEP


def calibrate(cuda, allocate: Callable[[int], object], used_before: tuple[int | None, str]
              ) -> Calibration:
    """Measure the device behind ``cuda`` (``torch.cuda`` or a stand-in) once its context
    exists; ``used_before`` was read before it did (``used_before_context``)."""
    free, total = cuda.mem_get_info()
    props = cuda.get_device_properties(0)
    largest = largest_allocation(allocate, cuda.OutOfMemoryError, free, cuda.empty_cache)
    return Calibration(device=props.name, total_memory_bytes=props.total_memory,
                       used_before_context_bytes=used_before[0],
                       used_before_source=used_before[1], free_after_context_bytes=free,
                       mem_get_info_total_bytes=total, largest_allocation_bytes=largest)
