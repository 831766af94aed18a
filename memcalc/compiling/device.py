"""The GPU inductor compiles for, on a machine without one.

Inductor and triton ask the CUDA runtime about the device while they lower a graph: the
compute capability (which kernels and layouts exist), the SM count (how a reduction is
split, hence the size of its partial buffers: ``Reduction.num_splits`` in
``torch/_inductor/ir.py``), shared memory (kernel configurations), and triton's target.
``device(gpu)`` answers them from memcalc's preset while a trace compiles, and puts torch's
own answers back after. The answers that size buffers come from the preset's data; the
others (shared memory, registers) only change kernel configurations, which allocate nothing.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from types import SimpleNamespace

import torch

from memcalc.gpus import GPU
from memcalc.tracing.errors import NotModelled

# shared memory per block (opt-in) and per SM by compute capability: NVIDIA's CUDA C++
# programming guide, "Technical Specifications per Compute Capability"
_SHARED_MEMORY = {(7, 5): (65536, 65536), (8, 0): (166912, 167936), (8, 6): (101376, 102400),
                  (8, 9): (101376, 102400), (9, 0): (232448, 233472),
                  (10, 0): (232448, 233472), (12, 0): (101376, 102400)}


def properties(gpu: GPU) -> SimpleNamespace:
    """What ``torch.cuda.get_device_properties`` would say of ``gpu``."""
    if gpu.sm_count is None:
        raise NotModelled(f"--compile: the GPU preset {gpu.name} has no SM count, which sizes "
                          f"inductor's split reductions; give one in the preset")
    cc = tuple(gpu.compute_capability)
    optin, per_sm = _SHARED_MEMORY.get(cc, (49152, 65536))
    return SimpleNamespace(
        name=gpu.label, major=cc[0], minor=cc[1], total_memory=gpu.memory_bytes,
        multi_processor_count=gpu.sm_count, warp_size=32, max_threads_per_block=1024,
        max_threads_per_multi_processor=2048, regs_per_multiprocessor=65536,
        shared_memory_per_block=49152, shared_memory_per_block_optin=optin,
        shared_memory_per_multiprocessor=per_sm, L2_cache_size=50 * 2**20,
        gcnArchName="", uuid="memcalc", is_integrated=False, is_multi_gpu_board=False)


class _NoGuard:
    """``torch.cuda._DeviceGuard``, which the wrapper enters around its kernels: nothing
    to switch to."""

    def __init__(self, index):
        self.index = index

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _patched(stack: ExitStack, owner, names: dict) -> None:
    """Set ``owner``'s attributes to ``names`` until ``stack`` closes."""
    saved = {name: owner.__dict__[name] for name in names if name in owner.__dict__}
    for name, value in names.items():
        setattr(owner, name, value)

    def restore():
        for name in names:
            if name in saved:
                setattr(owner, name, saved[name])
            else:
                delattr(owner, name)
    stack.callback(restore)


def _cuda_answers(props) -> dict:
    """``torch.cuda``'s functions inductor calls, answered for ``props``."""
    cc = (props.major, props.minor)
    return {"get_device_properties": lambda *a, **k: props,
            "get_device_capability": lambda *a, **k: cc,
            "get_device_name": lambda *a, **k: props.name,
            "current_device": lambda: 0, "device_count": lambda: 1,
            "set_device": lambda *a: None, "_lazy_init": lambda: None,
            "is_initialized": lambda: True, "is_current_stream_capturing": lambda: False,
            # AOTAutograd saves and restores the RNG state around tracing
            # (``preserve_rng_state``, torch/_dynamo/utils.py); no kernel runs in between
            "get_rng_state": lambda *a, **k: torch.zeros(16, dtype=torch.uint8),
            "set_rng_state": lambda *a, **k: None, "_DeviceGuard": _NoGuard,
            # the runtime's answer, whatever device_count says: with
            # PYTORCH_NVML_BASED_CUDA_CHECK=1 (deepspeed sets it on import) is_available asks
            # device_count, and dynamo, told True, calls the CUDA runtime itself
            "is_available": lambda: False}


def _interface_answers(props) -> dict:
    """dynamo's ``CudaInterface`` (torch/_dynamo/device_interface.py) binds torch.cuda's
    functions when it is imported, so it is answered itself."""
    cc = props.major * 10 + props.minor
    answers = {"get_device_properties": props, "current_device": 0, "device_count": 1,
               "get_compute_capability": cc, "is_bf16_supported": props.major >= 8,
               "set_device": None, "exchange_device": 0, "maybe_exchange_device": 0,
               "get_raw_stream": 0, "synchronize": None, "is_available": True}
    return {name: staticmethod(lambda *a, _v=value, **k: _v) for name, value in answers.items()}


@contextmanager
def _triton_target(cc: tuple[int, int]):
    """triton's active driver answering with ``cc``'s target (``triton/runtime/driver.py``);
    none is active on a machine without a GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    class Driver:
        def get_current_target(self):
            return GPUTarget("cuda", cc[0] * 10 + cc[1], 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, *args):
            return 0

        def get_active_torch_device(self):
            return torch.device("cuda", 0)

    before = driver._active
    driver.set_active(Driver())
    try:
        yield
    finally:
        driver._active = before


def _forget_device_answers() -> None:
    """Drop what torch has cached of the device (``has_triton`` and its kin in
    ``torch/utils/_triton.py``, ``functools.cache``d): asked once without a GPU (a
    ``torch.compile`` run before the trace), they say there is no triton for good, and
    asked inside ``device``, they would say there is one after it."""
    import torch.utils._triton as triton_utils

    for value in vars(triton_utils).values():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()


@contextmanager
def device(gpu: GPU):
    """Inside, inductor and triton see ``gpu`` as CUDA device 0."""
    from torch._dynamo.device_interface import CudaInterface

    props = properties(gpu)
    with ExitStack() as stack:
        _forget_device_answers()
        stack.callback(_forget_device_answers)
        _patched(stack, torch.cuda, _cuda_answers(props))
        _patched(stack, CudaInterface, _interface_answers(props))
        stack.enter_context(_triton_target((props.major, props.minor)))
        yield props


@contextmanager
def runtime():
    """Inside, the device switches inductor's wrappers make (``torch.cuda._DeviceGuard``,
    ``set_device``) do nothing: the wrappers run on meta, in the backward too."""
    with ExitStack() as stack:
        _patched(stack, torch.cuda, {"_DeviceGuard": _NoGuard, "set_device": lambda *a: None})
        yield
