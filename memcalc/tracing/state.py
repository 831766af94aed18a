"""What a traced function keeps resident: an ``nn.Module``'s parameters and buffers, and a
plain function's module-level tensors and modules, whether made at import or at
construction (nanoGPT's causal ``bias`` buffer is made in ``__init__``, often at import).

They exist before the step, so they count in every figure from the start, in their own
roles (``parameter``, ``buffer``; a module-level ``nn.Parameter`` is a parameter). Modules
found on the CPU are moved to the meta device, tied weights kept tied, so that the step can
run there; CPU tensors that are not in a module are the user's data on the host and are not
device memory.
"""

from __future__ import annotations

from typing import Callable

from memcalc.errors import one_line
from memcalc.tensors import Role
from memcalc.tracing.errors import TraceError

Resident = tuple[str, object, Role]  # (name, tensor, role)


def instantiate(cls, spec: str):
    """``cls()`` built on the meta device (its parameters and buffers never materialize)."""
    import torch

    try:
        with torch.device("meta"):
            return cls()
    except Exception as error:  # noqa: BLE001 - the user's constructor may raise anything
        raise TraceError(f"--trace {spec}: {cls.__name__}() failed on the meta device: "
                         f"{type(error).__name__}: {one_line(error)} (the module must be "
                         "constructible without arguments)") from None


def resident(fn: Callable) -> tuple[Resident, ...]:
    """The tensors ``fn`` keeps resident: a module's own state, or for a plain function the
    meta tensors and modules among its module's globals (each storage once)."""
    import torch

    if isinstance(fn, torch.nn.Module):
        return _dedupe(_module_state("", _on_meta(fn)))
    found: list[Resident] = []
    for name, value in getattr(fn, "__globals__", {}).items():
        if isinstance(value, torch.nn.Module):
            found += _module_state(f"{name}.", _on_meta(value))
        elif isinstance(value, torch.Tensor) and value.device.type == "meta":
            # a module-level nn.Parameter is a parameter: its grad is cleared between steps
            role = Role.parameter if isinstance(value, torch.nn.Parameter) else Role.buffer
            found.append((name, value, role))
    return _dedupe(found)


def _on_meta(module):
    """The module with its state on the meta device (moved there when it is not). Moved by
    swapping each tensor in place (``torch.__future__.set_swap_module_params_on_conversion``):
    a plain ``module.to("meta")`` makes a new parameter per module that holds it
    (``Module._apply``: a CPU tensor cannot take a meta one's data), which unties tied
    weights, and the trace would then count one weight, and one grad, per module."""
    import torch

    tensors = list(module.parameters()) + list(module.buffers())
    if any(t.device.type != "meta" for t in tensors):
        swapping = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            module.to("meta")
        finally:
            torch.__future__.set_swap_module_params_on_conversion(swapping)
    return module


def _module_state(prefix: str, module) -> list[Resident]:
    return ([(f"{prefix}{n}", p, Role.parameter) for n, p in module.named_parameters()]
            + [(f"{prefix}{n}", b, Role.buffer) for n, b in module.named_buffers()])


def _dedupe(found: list[Resident]) -> tuple[Resident, ...]:
    """Each storage once (tied weights, a module reachable under two names)."""
    seen, kept = set(), []
    for name, t, role in found:
        key = t.untyped_storage()._cdata
        if key not in seen:
            seen.add(key)
            kept.append((name, t, role))
    return tuple(kept)
