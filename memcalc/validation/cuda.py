"""The live backend: the protocol on a real GPU, read from ``torch.cuda``'s counters.

Each configuration starts from an empty allocator, as the model does: before it, every
tensor is gone, the cuBLAS workspaces are cleared (``torch._C._cuda_clearCublasWorkspaces``)
and the cache emptied, so the warm-up step creates the workspaces at the same points as in
the model. Configurations are re-targeted to the device that runs them (its memory and
compute capability, and the ``CUBLAS_WORKSPACE_CONFIG`` of the environment). An
``OutOfMemoryError`` is recorded as an OOM data point and the sweep goes on.

``torch``, ``torch.cuda`` and the probe can be injected (``LiveGpu``), so the logic is tested
on a machine without a GPU (``tests/test_validate_cuda.py``, ``tests/test_validate_session.py``).
"""

from __future__ import annotations

import gc
import os
from contextlib import contextmanager, nullcontext
from typing import Callable

from memcalc.config import Config, Device
from memcalc.validation.calibration import Calibration, calibrate
from memcalc.engine.inputs import QKV, Input
from memcalc.tracing.optimizers import Loop
from memcalc.tracing.protocol import Measured, make_inputs, run_protocol
from memcalc.tracing.state import trained


class CudaUnavailable(ValueError):
    """No CUDA device: the live backend cannot run here."""


def _torch():
    try:
        import torch
    except ImportError:
        raise CudaUnavailable("--backend cuda: torch is not installed") from None

    if not torch.cuda.is_available():
        raise CudaUnavailable(
            f"--backend cuda: CUDA is not available (torch {torch.__version__}); "
            "use --backend emulated on this machine")
    return torch


class CudaProbe:
    """``harness.Probe`` over ``torch.cuda`` (or anything with the same functions)."""

    def __init__(self, cuda):
        self.cuda = cuda

    def allocated(self) -> int:
        self.cuda.synchronize()
        return self.cuda.memory_allocated()

    def max_allocated(self) -> int:
        self.cuda.synchronize()
        return self.cuda.max_memory_allocated()

    def max_reserved(self) -> int:
        return self.cuda.max_memory_reserved()

    def reset_peak(self, phase: str = "") -> None:
        self.cuda.synchronize()
        self.cuda.reset_peak_memory_stats()

    def block_bytes(self, tensor) -> int:
        """Size of the allocator block holding ``tensor``, from ``memory_snapshot()``:
        a block's address is its segment's plus the sizes of the blocks before it."""
        ptr = tensor.untyped_storage().data_ptr()
        for segment in self.cuda.memory_snapshot():
            address = segment["address"]
            for block in segment["blocks"]:
                if address == ptr and block["state"] == "active_allocated":
                    return block["size"]
                address += block["size"]
        raise LookupError(f"no allocator block at {ptr:#x}")


def environment(torch=None, cuda=None) -> dict[str, str]:
    """What the numbers depend on: device, compute capability, memory, torch and CUDA,
    and the two variables that change the allocator's and cuBLAS's behaviour."""
    torch = torch or _torch()
    props = (cuda or torch.cuda).get_device_properties(0)
    return {
        "device": props.name,
        "compute_capability": f"{props.major}.{props.minor}",
        "total_memory": str(props.total_memory),
        "sm_count": str(props.multi_processor_count),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""),
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "PYTORCH_ALLOC_CONF": os.environ.get("PYTORCH_ALLOC_CONF", ""),
        # model code's parameter grads are reset before the measured step (``measure``);
        # a report without this key kept them (memcalc.validation.recorded)
        "parameter_grads": "reset",
    }


def live_config(config: Config, env: dict[str, str]) -> Config:
    """``config`` on the device that runs it, with the environment's workspace config and
    caching allocator settings (``PYTORCH_ALLOC_CONF``, read before its older name, as
    torch reads them)."""
    major, minor = (int(x) for x in env["compute_capability"].split("."))
    sms = int(env["sm_count"]) if env.get("sm_count") else None
    device = Device(gpu=None, memory_bytes=int(env["total_memory"]),
                    compute_capability=(major, minor), sm_count=sms)
    alloc_conf = env.get("PYTORCH_ALLOC_CONF") or env.get("PYTORCH_CUDA_ALLOC_CONF") or None
    protocol = config.protocol.model_validate({
        **config.protocol.model_dump(), "alloc_conf": alloc_conf,
        "cublas_workspace_config": env["CUBLAS_WORKSPACE_CONFIG"] or None})
    return config.replace(device=device, protocol=protocol)


def measure(config: Config, torch=None, probe=None, device: str = "cuda",
            fn: Callable | None = None, inputs: tuple[Input, ...] = QKV,
            loop: Loop = Loop()) -> Measured:
    """One protocol run of ``config``'s reference code (or ``fn``, called with ``inputs``,
    in the training ``loop``) from an empty allocator. Model code's parameters and buffers
    not on ``device`` (a module an example built on the meta device) run as empty copies
    on it (``memcalc.tracing.state.on_device``), the user's objects left as they were; the
    grads of those that need grad are reset before the measured step, as
    ``zero_grad(set_to_none=True)`` does and the tracer does. (The first live run, on an
    H200, kept them from the warm-up: its model-code figures hold every parameter's grad.)"""
    from memcalc.tracing.state import on_device
    from memcalc.validation.reference import reference_fn

    torch = torch or _torch()
    probe = probe or CudaProbe(torch.cuda)
    fn = fn or reference_fn(config)
    with on_device(getattr(fn, "fn", fn), device, getattr(fn, "param_dtype", None)) as state, \
            loop.running():
        parameters = trained(state)
        out_like = _output_like(torch, config, device, fn, inputs)
        _release(torch)
        inputs = make_inputs(torch, config.dims, device, inputs, out_like)
        try:
            return run_protocol(torch, fn, probe, inputs, config.protocol.forward_only,
                                tuple(t for _, t in parameters), loop.training(parameters))
        finally:
            del inputs
            _release(torch)


def _output_like(torch, config: Config, device: str, fn: Callable,
                 inputs: tuple[Input, ...]) -> tuple | None:
    """``(shape, dtype)`` of model code's output, from a forward under ``no_grad`` on the
    device (released before the protocol starts): what ``grad_out`` must look like. None
    for ``q, k, v`` code, whose output is shaped like q."""
    if inputs is QKV or config.protocol.forward_only or config.protocol.loss != "grad":
        return None
    made = make_inputs(torch, config.dims.replace(forward_only=True), device, inputs)
    with torch.no_grad():
        out = fn(*made.leaves)
    like = tuple(out.shape), str(out.dtype).removeprefix("torch.")
    del out, made
    return like


def _release(torch) -> None:
    """Drop every cached block and workspace so the next run starts as the model does."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()


def exact_capacity(target: int, total: int) -> int:
    """The largest multiple of 2 MiB up to ``target`` that the allocator's memory fraction
    reproduces exactly: ``set_per_process_memory_fraction(f)`` caps reserved memory at
    ``static_cast<size_t>(f * total)`` (``setMemoryFraction`` in
    ``c10/cuda/CUDACachingAllocator.cpp``), a double product, so ``f = c / total`` gives
    back ``c`` or one byte less."""
    step = 2 << 20
    capacity = target - target % step
    while capacity > 0 and int(capacity / total * total) != capacity:
        capacity -= step
    return capacity


class _Uncounted:
    """A probe that reads nothing: for a run whose counters are not the protocol's."""

    def allocated(self) -> int:
        return 0

    max_allocated = max_reserved = allocated

    def reset_peak(self, phase: str = "") -> None:
        pass

    def block_bytes(self, tensor) -> int:
        return 0


class LiveGpu:
    """The device a live run measures on. ``torch``, ``cuda`` (``torch.cuda``), the
    device string and ``probe_for`` are injectable: ``probe_for(config, capacity)`` gives a
    context to run in and the probe to read (default: no context, ``CudaProbe``)."""

    def __init__(self, torch=None, cuda=None, device: str = "cuda",
                 probe_for: Callable | None = None):
        self.torch = torch or _torch()
        self.cuda = cuda or self.torch.cuda
        self.device = device
        self.probe_for = probe_for or (lambda config, capacity: (nullcontext(),
                                                                 CudaProbe(self.cuda)))
        self.oom_errors: tuple[type, ...] = (self.cuda.OutOfMemoryError,)

    def environment(self) -> dict[str, str]:
        return environment(self.torch, self.cuda)

    def calibrate(self, used_before: tuple[int | None, str]) -> Calibration:
        """The budget calibration; call before anything else touches the device."""
        def allocate(nbytes: int):
            return self.torch.empty(nbytes, dtype=self.torch.uint8, device=self.device)

        return calibrate(self.cuda, allocate, used_before)

    def free_bytes(self) -> int:
        """``mem_get_info()[0]`` with the cache and the cuBLAS workspaces released."""
        _release(self.torch)
        return self.cuda.mem_get_info()[0]

    def measure(self, config: Config, fn: Callable, capacity: int | None = None,
                inputs: tuple[Input, ...] = QKV, loop: Loop = Loop()) -> Measured:
        """One protocol run of ``fn`` called with ``inputs`` in the training ``loop``; with
        ``capacity``, reserved memory is capped at exactly that many bytes
        (``exact_capacity``) for the run, as the model's ``capacity`` does."""
        context, probe = self.probe_for(config, capacity)
        with context, self._capped(capacity):
            return measure(config, self.torch, probe, self.device, fn, inputs, loop)

    @contextmanager
    def _capped(self, capacity: int | None):
        if capacity is None:
            yield
            return
        total = self.cuda.get_device_properties(0).total_memory
        self.cuda.set_per_process_memory_fraction(capacity / total)
        try:
            yield
        finally:
            self.cuda.set_per_process_memory_fraction(1.0)

    def scratch(self, config: Config, fn: Callable, inputs: tuple[Input, ...] = QKV,
                loop: Loop = Loop()) -> dict[str, int]:
        """Run the protocol again with every aten op bracketed by the counters (see
        ``op_scratch``): what each kind of op held beyond its outputs."""
        context, _ = self.probe_for(config, None)
        with context:
            return op_scratch(self.torch, self.cuda,
                              lambda: measure(config, self.torch, _Uncounted(), self.device, fn,
                                              inputs, loop))


def op_scratch(torch, cuda, run: Callable[[], object]) -> dict[str, int]:
    """Bytes each op held beyond its outputs while it ran, the largest per op name: with the
    peak reset before the op, its peak less what is allocated after it. A workspace the
    kernel allocates and frees inside the call shows here (cuDNN attention takes one from
    the caching allocator, ``aten/src/ATen/native/cudnn/MHA.cpp``); what it frees before
    allocating its outputs is counted only beyond their size (a lower bound)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: dict[str, int] = {}

    class Bracket(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            cuda.synchronize()
            cuda.reset_peak_memory_stats()
            out = func(*args, **(kwargs or {}))
            cuda.synchronize()
            extra = cuda.max_memory_allocated() - cuda.memory_allocated()
            if extra > 0:
                name = func.overloadpacket.__name__
                seen[name] = max(seen.get(name, 0), extra)
            return out

    with Bracket():
        run()
    return seen
