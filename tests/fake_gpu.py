"""A GPU for tests without one: ``cuda.LiveGpu`` over the meta device, its counters read
from the allocator model (the emulated tracer as the probe), with knobs that make the
"live" figures differ from the emulated ones the way a real GPU could."""

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from memcalc.engine.allocator import OutOfMemory
from memcalc.validation import cuda
from memcalc.tracing.tracer import Tracer, TracerProbe

GiB = 1 << 30


@dataclass
class Props:
    name: str = "Fake GPU"
    total_memory: int = 80 * GiB
    major: int = 8
    minor: int = 0
    multi_processor_count: int = 108


class FakeCuda:
    """The parts of ``torch.cuda`` a live run touches; OOM is the allocator model's."""

    OutOfMemoryError = OutOfMemory

    def __init__(self, free=79 * GiB, largest=78 * GiB + 6 * (1 << 20)):
        self.props, self.free, self.largest = Props(), free, largest
        self.fractions = []

    def get_device_properties(self, index):
        return self.props

    def mem_get_info(self):
        return self.free, self.props.total_memory

    def set_per_process_memory_fraction(self, fraction):
        self.fractions.append(fraction)

    def empty_cache(self):
        pass

    def synchronize(self):
        pass


class ExtraReserved:
    """A probe that reports ``extra`` more reserved bytes than it reads."""

    def __init__(self, probe, extra):
        self.probe, self.extra = probe, extra

    def __getattr__(self, name):
        return getattr(self.probe, name)

    def max_reserved(self):
        return self.probe.max_reserved() + self.extra


@contextmanager
def _running(tracer, fn):
    """The tracer's dispatch mode and, on CUDA's paths, its torch-function rules, with what
    a GPU holds before the step: the state of ``fn``'s module, made before the tracer saw
    it (``memory_allocated`` counts it), adopted as the tracer adopts it."""
    from memcalc.tracing.state import on_device
    from memcalc.tracing.tracer import component, function_modes

    with tracer, function_modes(tracer) if tracer.paths is not None else nullcontext(), \
            on_device(getattr(fn, "fn", fn), "meta", getattr(fn, "param_dtype", None)) as state:
        for name, t, role in state:
            tracer.adopt(t, component(name, role, "resident", tuple(t.shape),
                                      str(t.dtype).removeprefix("torch."), 0), located=False)
        yield


class FakeGpu(cuda.LiveGpu):
    """``LiveGpu`` on the meta device. ``workspace_factor`` scales every cuBLAS workspace,
    ``forward_scratch`` keeps that many bytes alive through each forward (a kernel's
    temporary), ``extra_reserved`` adds to the reserved peak (allocator segments);
    ``cuda_paths``: its kernels are the CUDA ones the tracer follows (SDPA's backend,
    fused dropout), else the meta device's own."""

    def __init__(self, workspace_factor=1, forward_scratch=0, extra_reserved=0, cuda_=None,
                 cuda_paths=False):
        self.runs = []
        self.workspace_factor, self.forward_scratch = workspace_factor, forward_scratch
        self.extra_reserved, self.cuda_paths = extra_reserved, cuda_paths
        self.running = None  # the code the run measures
        super().__init__(torch=torch, cuda=cuda_ or FakeCuda(), device="meta",
                         probe_for=self._probe_for)

    def _probe_for(self, config, capacity):
        from memcalc.impls.device import gpu_of
        from memcalc.tracing import TraceOptions, paths_for

        paths = paths_for(config, TraceOptions()) if self.cuda_paths else None
        tracer = self.tracer = Tracer(config.workspace_bytes * self.workspace_factor, capacity,
                                      paths, gpu_of(config.dims))
        probe = TracerProbe(tracer)
        return _running(tracer, self.running), (ExtraReserved(probe, self.extra_reserved)
                                                if self.extra_reserved else probe)

    def calibrate(self, used_before):
        def allocate(nbytes):
            if nbytes > self.cuda.largest:
                raise OutOfMemory(nbytes, 0, self.cuda.largest)
            return object()

        from memcalc.validation.calibration import calibrate

        return calibrate(self.cuda, allocate, used_before)

    def measure(self, config, fn, capacity=None, inputs=None, *loop):
        from unittest import mock

        from memcalc.engine.inputs import QKV

        self.runs.append(config)
        self.running = fn
        with mock.patch.object(cuda, "_release", self._release):
            return super().measure(config, self._with_scratch(fn), capacity, inputs or QKV,
                                   *loop)

    def _release(self, torch):
        """``cuda._release`` on this GPU: the cuBLAS workspaces freed
        (``_cuda_clearCublasWorkspaces``: the next cuBLAS call makes its thread's again) and
        the cached segments released (``empty_cache``), as between the harness's forward
        for the output's shape and the protocol."""
        ledger = self.tracer.ledger
        for key in [k for k in ledger.live if isinstance(k, tuple) and
                    str(k[0]).endswith("_workspace")]:
            ledger.free(key)
        ledger.allocator.empty_cache()

    def _with_scratch(self, fn):
        if not self.forward_scratch:
            return fn

        def attn(q, k, v):
            scratch = torch.empty(self.forward_scratch, dtype=torch.uint8, device=q.device)
            out = fn(q, k, v)
            del scratch
            return out

        return attn

    def free_bytes(self):
        return self.cuda.free - 600 * (1 << 20)
