"""What CUDA kernels read of the device (``cudaDeviceProp``): the SM count, the compute
capability, and from it the resident threads per SM. Fused kernels' split heuristics and
the reduction kernel's split across blocks (``memcalc.impls.reductions``) depend on them.

``gpu_of`` reads ``d.sm_count`` / ``d.compute_capability`` when ``Dims`` has them (a GPU
preset or a device given in full) and assumes an H100 SXM (132 SMs, 9.0) otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from memcalc.engine.program import Dims


@dataclass(frozen=True)
class Gpu:
    """What the fused kernels read from ``cudaDeviceProp``: SM count, compute capability."""

    sm_count: int
    compute_capability: tuple[int, int]


H100_SXM = Gpu(132, (9, 0))
A100 = Gpu(108, (8, 0))


def gpu_of(d: Dims) -> Gpu:
    """The device of ``d``: its ``sm_count`` and ``compute_capability`` fields when
    ``Dims`` has them, else an H100 SXM (see the module docstring)."""
    sms = getattr(d, "sm_count", None) or H100_SXM.sm_count
    cc = getattr(d, "compute_capability", None) or H100_SXM.compute_capability
    return Gpu(sms, tuple(cc))


# resident threads per SM by compute capability (CUDA C++ Programming Guide, "Technical
# Specifications per Compute Capability"): what ``maxThreadsPerMultiProcessor`` reports;
# a capability not listed is taken as Hopper's
MAX_THREADS_PER_SM = {(7, 0): 2048, (7, 2): 2048, (7, 5): 1024, (8, 0): 2048, (8, 6): 1536,
                      (8, 7): 2048, (8, 9): 1536, (9, 0): 2048, (10, 0): 2048, (12, 0): 1536}


def max_threads_per_sm(gpu: Gpu) -> int:
    return MAX_THREADS_PER_SM.get(tuple(gpu.compute_capability), 2048)
