"""The optimizer of a traced training step (``--optimizer``): torch's own, built over the
traced target's parameters on the meta device, with the implementation CUDA would pick.

torch chooses per parameter list (``torch/optim/optimizer.py``,
``_default_to_fused_or_foreach``): the foreach path when every parameter is a plain tensor
on a foreach device (CUDA is one, meta is not), the fused kernel only when asked. So on
the meta device the choice a GPU would make is asked for by name: ``adamw`` is
``AdamW(foreach=True)``, ``adamw:fused`` ``AdamW(fused=True)``, ``adamw:forloop``
``AdamW(foreach=False)``. What each allocates is then torch's own code, run by the tracer:
the state made lazily in the first ``step()`` (``zeros_like`` per parameter), and the
foreach path's ``_foreach_sqrt`` of the second moments, one parameter-sized temporary per
parameter until the update ends (``_multi_tensor_adam``, ``torch/optim/adam.py``).

Imports no torch until an optimizer is built: the CLI parses the option without it.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

# name -> (torch.optim class, keyword arguments: torch's defaults but SGD's momentum, which
# the option promises, and its learning rate, which SGD requires)
KINDS = {"adamw": ("AdamW", {}), "adam": ("Adam", {}),
         "sgd": ("SGD", {"lr": 0.01, "momentum": 0.9})}
IMPLS = ("foreach", "fused", "forloop")


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer as ``--optimizer`` names it: ``kind`` (adamw, adam, sgd with momentum)
    and ``impl`` (foreach, as torch picks on CUDA; fused; forloop)."""

    kind: str
    impl: str = "foreach"

    def text(self) -> str:
        """``adamw`` or ``adamw:fused``: the spec as the option takes it."""
        return self.kind if self.impl == "foreach" else f"{self.kind}:{self.impl}"

    def describe(self) -> str:
        """``torch.optim.AdamW(foreach=True)``: what the trace runs."""
        name, extra = KINDS[self.kind]
        args = [f"{k}={v}" for k, v in extra.items()]
        args.append({"foreach": "foreach=True", "fused": "fused=True",
                     "forloop": "foreach=False"}[self.impl])
        return f"torch.optim.{name}({', '.join(args)})"

    @property
    def step_on_device(self) -> bool:
        """Whether ``state["step"]`` is a device tensor: for the fused kernels (a float32
        0-d tensor per parameter, ``_init_group``); else a CPU scalar, no device memory."""
        return self.impl == "fused"


def parse_optimizer(text: str | None, field: str = "--optimizer") -> OptimizerSpec | None:
    """``adamw``, ``adam:fused``, ``sgd:forloop`` as an ``OptimizerSpec``; None for none;
    anything else a ValueError naming ``field`` and what it takes."""
    if text is None:
        return None
    kind, _, impl = str(text).strip().lower().partition(":")
    allowed = ("adamw, adam or sgd (momentum 0.9), optionally :foreach (torch's default on "
               "CUDA), :fused or :forloop")
    if kind not in KINDS:
        from memcalc.errors import did_you_mean

        raise ValueError(f"{field}: unknown optimizer {kind!r}"
                         f"{did_you_mean(kind, list(KINDS))}; known: {allowed}")
    if impl and impl not in IMPLS:
        from memcalc.errors import did_you_mean

        raise ValueError(f"{field}: unknown implementation {impl!r} of {kind}"
                         f"{did_you_mean(impl, list(IMPLS))}; known: {allowed}")
    return OptimizerSpec(kind, impl or "foreach")


def build(spec: OptimizerSpec, parameters):
    """``spec``'s torch optimizer over ``parameters`` (meta tensors), as CUDA would run it."""
    import torch

    name, extra = KINDS[spec.kind]
    choice = {"fused": {"fused": True}, "foreach": {"foreach": True},
              "forloop": {"foreach": False}}[spec.impl]
    return getattr(torch.optim, name)(list(parameters), **extra, **choice)


@contextmanager
def fused_on_meta() -> Iterator[None]:
    """Let the fused kernels run on the meta device while the block runs: the only check
    that refuses them there is the device list of ``_device_dtype_check_for_fused``
    (``torch/optim/optimizer.py``: "`fused=True` requires all the params to be floating
    point Tensors of supported devices"), read through the module-level
    ``_get_fused_kernels_supported_devices``; it gets "meta" added, and is put back after.
    The kernels themselves (``_fused_adamw_``, ``_fused_adam_``, ``_fused_sgd_``) have meta
    kernels that allocate nothing, as on CUDA: they update in place."""
    import torch.optim.optimizer as optimizer

    original = optimizer._get_fused_kernels_supported_devices
    optimizer._get_fused_kernels_supported_devices = lambda: [*original(), "meta"]
    try:
        yield
    finally:
        optimizer._get_fused_kernels_supported_devices = original


@contextmanager
def foreach_on_meta() -> Iterator[None]:
    """Let ``clip_grad_norm_(..., foreach=True)`` take its foreach path on the meta device,
    as on CUDA, while the block runs: ``torch/nn/utils/clip_grad.py`` asks
    ``_device_has_foreach_support``, which names CUDA and not meta ("foreach=True was
    passed, but can't use the foreach API on meta tensors"); put back after."""
    from torch.nn.utils import clip_grad

    original = clip_grad._device_has_foreach_support
    clip_grad._device_has_foreach_support = lambda device: (device.type == "meta"
                                                            or original(device))
    try:
        yield
    finally:
        clip_grad._device_has_foreach_support = original


@dataclass(frozen=True)
class Loop:
    """A traced step as a training loop runs it: ``optimizer`` (None: none) stepped after
    ``accumulate`` forward and backward passes (``--grad-accum``), the grads clipped to a
    total norm of ``clip`` first (``--clip-grad-norm``; None: not clipped)."""

    optimizer: OptimizerSpec | None = None
    accumulate: int = 1
    clip: float | None = None

    def running(self):
        """What the trace runs under: the fused kernels and clipping's foreach path let
        onto the meta device."""
        from contextlib import ExitStack

        stack = ExitStack()
        if self.optimizer is not None and self.optimizer.impl == "fused":
            stack.enter_context(fused_on_meta())
        if self.clip is not None:
            stack.enter_context(foreach_on_meta())
        return stack

    def training(self, parameters: tuple, tracer=None):
        """The protocol's ``Training``: the optimizer built over ``parameters`` (``(name,
        tensor)`` pairs that need grad); in a trace (``tracer``), its state named there
        once made."""
        from memcalc.tracing.protocol import Training

        if self.optimizer is None:
            return Training(None, self.accumulate, self.clip)
        if not parameters:
            from memcalc.tracing.errors import TraceError

            raise TraceError(f"--optimizer {self.optimizer.text()}: the target has no "
                             f"parameters that need grad to optimize (an nn.Module, or a "
                             f"function using module-level modules)")
        optimizer = build(self.optimizer, (t for _, t in parameters))
        if tracer is not None:
            optimizer = NamedState(optimizer, parameters, tracer)
        return Training(optimizer, self.accumulate, self.clip)


class NamedState:
    """A torch optimizer whose state, made by its first ``step()``, the tracer names after
    the parameters (``c_attn.weight: exp_avg``) in the role ``optimizer state``."""

    def __init__(self, optimizer, parameters: tuple, tracer):
        self.optimizer, self.parameters, self.tracer = optimizer, parameters, tracer
        self.named = False

    def step(self) -> None:
        self.optimizer.step()
        if not self.named:
            self._name_state()
            self.named = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def _name_state(self) -> None:
        from memcalc.engine.program import Role

        for name, p in self.parameters:
            for key, value in self.optimizer.state.get(p, {}).items():
                if getattr(value, "device", None) is not None and value.device.type == "meta":
                    self.tracer.relabel(value, name=f"{name}: {key}", source="",
                                        role=Role.optimizer_state)


def loop_of(optimizer: str | None, grad_accum: int = 1,
            fields=("--optimizer", "--grad-accum", "--clip-grad-norm"),
            clip_grad_norm: float | None = None) -> Loop:
    """The ``Loop`` of ``--optimizer``, ``--grad-accum`` and ``--clip-grad-norm``
    (``fields`` name them as the caller spells them); a ValueError naming the field for a
    bad value."""
    spec = parse_optimizer(optimizer, fields[0])
    if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"{fields[1]}: forward and backward passes per optimizer step, a "
                         f"whole number of at least 1 (got {grad_accum!r})")
    if grad_accum > 1 and spec is None:
        raise ValueError(f"{fields[1]} {grad_accum}: grads accumulate for an optimizer step; "
                         f"give {fields[0]} (adamw, adam or sgd)")
    return Loop(spec, grad_accum, _max_norm(clip_grad_norm, spec, fields))


def _max_norm(value, spec: OptimizerSpec | None, fields) -> float | None:
    """``--clip-grad-norm``'s max_norm: a positive number, with an optimizer to step."""
    if value is None:
        return None
    try:
        norm = float(value)
    except (TypeError, ValueError):
        norm = float("nan")
    if isinstance(value, bool) or not norm > 0 or norm == float("inf"):
        raise ValueError(f"{fields[2]}: the largest total norm of the grads, a positive "
                         f"number such as 1.0 (got {value!r})")
    if spec is None:
        raise ValueError(f"{fields[2]} {value}: the grads are clipped before an optimizer "
                         f"step; give {fields[0]} (adamw, adam or sgd)")
    return norm
