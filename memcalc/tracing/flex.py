"""FlexAttention in a trace: ``flex_attention(q, k, v, block_mask=...)`` run as memcalc's model
of the compiled kernel (``memcalc/impls/flex.py``), as training runs it.

On the meta device flex_attention cannot compile: eagerly it takes a dense math path that
holds (B, H, N, M) float32 scores no GPU run of the compiled kernel has. So while a user's
file is imported for a trace (``stand_in``), ``from torch.nn.attention.flex_attention import
flex_attention`` gives a stand-in, and ``torch.compile`` of it is the stand-in itself; its
calls replay the model's events (``kernels.Kernel.replay``) in a node that saves q, k, v,
the output, the logsumexp and the BlockMask's tensors, as ``FlexAttentionAutogradOp`` does.
The BlockMask is the user's: ``create_block_mask`` runs as written (eagerly, it builds the
dense mask, which the trace follows).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

from memcalc.engine.program import Dims
from memcalc.impls import flex as model
from memcalc.tracing import compiled
from memcalc.tracing.errors import NotModelled
from memcalc.tracing.imports import on_import
from memcalc.tracing.cuda_paths import active_paths
from memcalc.tracing.kernels import Kernel, empty_like, launch, meta_copies, needs_grad, node, sized

BACKEND = "flex"


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None,
                   enable_gqa=False, return_lse=False, kernel_options=None, *,
                   return_aux=None):
    """``torch.nn.attention.flex_attention.flex_attention``, compiled, for a trace."""
    paths = active_paths("flex_attention")
    if return_aux is not None and return_aux.max_scores:
        raise NotModelled("flex_attention: return_aux max_scores is not modelled")
    d = dims_of(query, key, paths.gpu)
    if d.N < model.BLOCK:
        raise NotModelled(f"flex_attention: {d.N} query rows < {model.BLOCK} take the "
                          f"flex-decoding template, which is not modelled")
    paths.note(f"flex_attention {tuple(query.shape)} {d.dtype}: memcalc's flex model "
               f"(the compiled kernel, torch 2.13)")
    out = run(paths, query, key, value, d, block_mask)
    if not (return_lse or (return_aux is not None and return_aux.lse)):
        return out
    lse = natural_lse(d)
    if return_lse:  # the API before 2.9: (out, lse)
        return out, lse
    from torch.nn.attention.flex_attention import AuxOutput

    return out, AuxOutput(lse=lse)


def natural_lse(d: Dims) -> torch.Tensor:
    """The logsumexp asked for: the kernel's is in base 2, so ``_finalize_outputs`` returns
    ``lse * ln 2``, a (B, H, N) float32 tensor of its own (FA ``_finalize_outputs``). It
    carries no grad here: a loss through it (its backward's ``grad_lse``) is not modelled."""
    return torch.empty((d.B, d.H, d.N), dtype=torch.float32, device="meta")


def dims_of(q, k, gpu) -> Dims:
    """The model's sizes for a call on ``(B, H, N, D)`` tensors (the mask is the BlockMask's)."""
    return sized(tuple(q.shape), tuple(k.shape), str(q.dtype).removeprefix("torch."), False,
                 needs_grad(q, k), gpu)


@dataclass
class Run(Kernel):
    """One call: the model's forward and backward, the output and grads made with the
    strides the template gives them (q's, k's, v's fill order); ``default``: no block_mask
    was given, so the compiled graph builds its default one (``model.default_mask``)."""

    default: bool = False

    def forward(self) -> torch.Tensor:
        self.replay(model.forward(self.d, self.default), {"out": lambda: empty_like(self.q)},
                    not self.d.forward_only)
        return self.live.pop("out")

    def backward(self, grad_out: torch.Tensor) -> tuple:
        real = {n: (lambda t=t: empty_like(t)) for n, t in zip(("dq", "dk", "dv"),
                                                               (self.q, self.k, self.v))}
        self.replay(model.backward(self.d, self.default), real, True)
        self.kept.clear()
        return tuple(self.live.pop(n) for n in ("dq", "dk", "dv"))


# saves q, k, v, the output and the BlockMask's tensors (the logsumexp in ``kept``)
NODE = node("FlexAttentionAutogradOp")


def run(paths, q, k, v, d: Dims, block_mask) -> torch.Tensor:
    paths.kernels[BACKEND] = None
    call = Run(BACKEND, d, None, paths, *meta_copies(paths.tracer, (q, k, v)),
               default=block_mask is None)
    tensors = [] if block_mask is None else [t for t in block_mask.as_tuple()
                                             if isinstance(t, torch.Tensor)]
    return launch(call, NODE, not d.forward_only, q, k, v, *tensors)


def _compiled_block_mask(*args, **kwargs):
    """``create_block_mask`` compiled: on meta it would run eagerly, holding the dense mask
    the compiled builder never makes; its own buffers are not modelled: one line."""
    raise NotModelled("create_block_mask compiled (torch.compile, or _compile=True): its "
                      "kernel's buffers are not modelled, and the eager one a trace would run "
                      "holds a dense N x M mask the compiled one does not; build the mask "
                      "eagerly in the traced code to see what that costs")


FLEX = "torch.nn.attention.flex_attention"


@contextmanager
def stand_in():
    """Inside, ``torch.nn.attention.flex_attention.flex_attention`` is the stand-in, and
    ``torch.compile`` gives it back as it is (anything else it is given goes to
    ``compiled.compile_call``: refused, or left uncompiled);
    ``create_block_mask`` compiled is refused in one line. The module is patched when the
    user's code imports it, not before: from torch 2.15 it imports
    ``torch.fx.experimental.symbolic_shapes`` (and sympy) at its top, a second of start-up
    a trace of code without FlexAttention would pay (``torch/nn/attention/flex_attention.py``,
    line 23)."""
    real_compile = torch.compile

    def compile(model=None, **options):
        if model is None:  # @torch.compile(...) as a decorator factory
            return lambda fn: compile(fn, **options)
        if model is flex_attention:
            return model
        if getattr(model, "__name__", "") == "create_block_mask" and \
                getattr(model, "__module__", "") in (FLEX, __name__):
            return _compiled_block_mask
        if options.get("disable"):  # torch.compile(..., disable=True): model as it is
            return model
        return compiled.compile_call(model, **options)

    torch.compile = compile
    try:
        with ExitStack() as patches:
            with on_import(FLEX, lambda module: patches.enter_context(_patched(module))):
                yield
    finally:
        torch.compile = real_compile


@contextmanager
def _patched(module):
    """``module``'s ``flex_attention`` the stand-in and its ``create_block_mask`` refusing to
    be compiled, put back after."""
    real, real_mask = module.flex_attention, module.create_block_mask

    def create_block_mask(*args, _compile=False, **kwargs):
        if _compile:
            _compiled_block_mask()
        return real_mask(*args, **kwargs)

    module.flex_attention, module.create_block_mask = flex_attention, create_block_mask
    try:
        yield
    finally:
        module.flex_attention, module.create_block_mask = real, real_mask
