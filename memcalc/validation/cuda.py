"""The live backend: the protocol on a real GPU, read from ``torch.cuda``'s counters.

Each configuration starts from an empty allocator, as the model does: before it, every
tensor is gone, the cuBLAS workspaces are cleared (``torch._C._cuda_clearCublasWorkspaces``)
and the cache emptied, so the warm-up step creates the workspaces at the same points as in
the model. Configurations are re-targeted to the device that runs them (its memory and
compute capability, and the ``CUBLAS_WORKSPACE_CONFIG`` of the environment). An
``OutOfMemoryError`` is recorded as an OOM data point and the sweep goes on.

``torch`` and the probe can be injected, so the logic is tested on a machine without a GPU
(``tests/test_validate_cuda.py``).
"""

from __future__ import annotations

import gc
import os

from memcalc.breakdown import FIGURES
from memcalc.config import Config, Device
from memcalc.timeline import predict
from memcalc.validation.compare import Check
from memcalc.validation.harness import Measured, make_inputs, run_protocol
from memcalc.validation.reference import reference_fn


class CudaUnavailable(ValueError):
    """No CUDA device: the live backend cannot run here."""


def _torch():
    import torch

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

    def reset_peak(self) -> None:
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


def environment(torch=None) -> dict[str, str]:
    """What the numbers depend on: device, compute capability, memory, torch and CUDA."""
    torch = torch or _torch()
    props = torch.cuda.get_device_properties(0)
    return {
        "device": props.name,
        "compute_capability": f"{props.major}.{props.minor}",
        "total_memory": str(props.total_memory),
        "sm_count": str(props.multi_processor_count),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""),
    }


def live_config(config: Config, env: dict[str, str]) -> Config:
    """``config`` on the device that runs it, with the environment's workspace config."""
    major, minor = (int(x) for x in env["compute_capability"].split("."))
    sms = int(env["sm_count"]) if env.get("sm_count") else None
    device = Device(gpu=None, memory_bytes=int(env["total_memory"]),
                    compute_capability=(major, minor), sm_count=sms)
    protocol = config.protocol.model_copy(
        update={"cublas_workspace_config": env["CUBLAS_WORKSPACE_CONFIG"] or None})
    return config.model_copy(update={"device": device, "protocol": protocol})


def measure(config: Config, torch=None, probe=None, device: str = "cuda", fn=None) -> Measured:
    """One protocol run of ``config``'s reference code (or ``fn``) from an empty allocator."""
    torch = torch or _torch()
    probe = probe or CudaProbe(torch.cuda)
    fn = fn or reference_fn(config)
    proto = config.protocol
    _release(torch)
    s = config.shape
    inputs = make_inputs(torch, (s.batch, s.heads, s.seq_len, s.head_dim),
                         (s.batch, s.key_heads, s.keys, s.head_dim),
                         getattr(torch, config.dtype.torch_name), device,
                         need_grad=not proto.forward_only,
                         grad_out=proto.loss == "grad" and not proto.forward_only)
    try:
        return run_protocol(torch, fn, probe, inputs, proto.forward_only)
    finally:
        del inputs
        _release(torch)


def check(config: Config, torch=None, probe=None, device: str = "cuda", fn=None,
          env: dict[str, str] | None = None) -> Check:
    """Model against the live run for one configuration; an OOM is an outcome, not a failure."""
    torch = torch or _torch()
    config = live_config(config, env or environment(torch))
    figures = predict(config).figures()
    try:
        m = measure(config, torch, probe, device, fn)
    except torch.cuda.OutOfMemoryError as error:
        _release(torch)
        return Check(config=config, predicted=figures, outcome="oom",
                     detail=str(error).splitlines()[0])
    measured = {k: getattr(m, k) for k in FIGURES}
    return Check(config=config, predicted=figures, measured=measured)


def _release(torch) -> None:
    """Drop every cached block and workspace so the next run starts as the model does."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
