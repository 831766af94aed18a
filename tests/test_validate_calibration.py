"""Budget calibration without a GPU: the bisection for the largest allocation and the
figures derived from the readings."""

import pytest

from memcalc.validation import calibration
from memcalc.validation.calibration import Calibration, largest_allocation

MiB = 1 << 20
GiB = 1 << 30


class Oom(Exception):
    pass


def allocator(limit):
    """``allocate(n)`` that fails above ``limit`` bytes, counting its calls."""
    calls = []

    def allocate(n):
        calls.append(n)
        if n > limit:
            raise Oom
        return bytearray(0)

    return allocate, calls


@pytest.mark.parametrize("limit", [79 * GiB + 3 * MiB, 79 * GiB + 2 * MiB, 10 * MiB, 0])
def test_largest_allocation_bisects_to_2_mib(limit):
    allocate, calls = allocator(limit)
    largest = largest_allocation(allocate, Oom, 80 * GiB, lambda: None)
    assert largest == limit - limit % (2 * MiB)  # the largest 2 MiB multiple <= limit
    assert len(calls) <= 16  # log2(80 GiB / 2 MiB + 1) = 15.3 halvings


def test_largest_allocation_can_be_all_that_is_free():
    allocate, _ = allocator(80 * GiB)  # nothing else holds memory: all of it in one piece
    assert largest_allocation(allocate, Oom, 80 * GiB, lambda: None) == 80 * GiB


def test_calibration_figures():
    c = Calibration(device="Fake", total_memory_bytes=80 * GiB,
                    used_before_context_bytes=100 * MiB, used_before_source="nvml",
                    free_after_context_bytes=80 * GiB - 600 * MiB,
                    mem_get_info_total_bytes=80 * GiB,
                    largest_allocation_bytes=79 * GiB, free_after_run_bytes=80 * GiB - 1 * GiB)
    assert c.unavailable_at_start_bytes == 600 * MiB
    assert c.context_bytes == 600 * MiB - 100 * MiB  # used after less used before
    assert c.unavailable_after_run_bytes == 1 * GiB
    assert "CUDA context 524,288,000 B (nvml)" in c.describe()  # 500 x 2^20


def test_calibrate_reads_the_device():
    class Cuda:
        OutOfMemoryError = Oom

        def mem_get_info(self):
            return 70 * GiB, 80 * GiB

        def get_device_properties(self, index):
            return type("P", (), {"name": "Fake", "total_memory": 80 * GiB})()

        def empty_cache(self):
            pass

    allocate, _ = allocator(69 * GiB + 5 * MiB)
    c = calibration.calibrate(Cuda(), allocate, (None, "unavailable"))
    assert (c.free_after_context_bytes, c.largest_allocation_bytes) == (70 * GiB, 69 * GiB + 4 * MiB)
    assert c.mem_get_info_total_bytes == 80 * GiB
    assert c.context_bytes is None and c.unavailable_at_start_bytes == 10 * GiB


def test_used_before_context_without_nvml_or_nvidia_smi(monkeypatch):
    import subprocess
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails

    def missing(*args, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(subprocess, "run", missing)
    assert calibration.used_before_context() == (None, "unavailable")


def test_used_before_context_from_nvidia_smi(monkeypatch):
    import subprocess
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    seen = []

    def smi(args, **kwargs):
        seen.append(args)
        return subprocess.CompletedProcess(args, 0, stdout="517\n")

    monkeypatch.setattr(subprocess, "run", smi)
    assert calibration.used_before_context() == (517 * MiB, "nvidia-smi (MiB)")
    assert seen[0][-2:] == ["-i", "3"]
