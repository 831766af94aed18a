"""The CUDA dispatch layer of ``memcalc trace``: run what a GPU runs, not what the meta
device runs, wherever their kernels allocate differently.

Each rule is a small registered function citing the PyTorch source it follows:

* torch-function rules (a ``TorchFunctionMode``) see the Python call before ATen's
  composite kernels split it, where CUDA and meta take different branches:
  ``scaled_dot_product_attention`` (backend choice), ``softmax``/``log_softmax`` with
  ``dtype=float32`` on fp16 (``half_to_float``), training ``dropout`` (fused);
* aten ops are the tracer's (``memcalc/tracing/tracer.py``): ``_safe_softmax``'s CUDA
  composite and the math backend's in-place mask add, on every path (validation too).

A fused SDPA kernel's allocations are not written here: they are the programs of
``memcalc/impls/sdpa_flash.py`` and ``sdpa_efficient.py`` (and ``cudnn.py``), built from the
call's ``Dims`` and replayed into the tracer's ledger by ``kernels.py``. Whatever cannot be
known on meta is collected in ``notes`` and shown with the result.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from memcalc.gpus import GPU
from memcalc.impls import sdpa_cudnn as cudnn
from memcalc.impls.sdpa_efficient import MEM_EFF_ALIGNMENT
from memcalc.impls import sdpa_select
from memcalc.tracing import flash_attn_ops, foreach, kernels
from memcalc.tracing.errors import NotModelled, RefusedOnGpu
from memcalc.impls.sdpa_select import EFFICIENT, MATH, Call, Flags, Release


@dataclass(frozen=True)
class Rule:
    """A registered CUDA-path rule: what it emulates and the PyTorch file it follows."""

    name: str
    source: str
    summary: str


RULES: dict[str, Rule] = {}
_FUNCTION_RULES: dict[Callable, Callable] = {}


def rule(name: str, source: str, summary: str, funcs: tuple = ()):
    """Register a rule; ``funcs``: the torch functions whose calls it handles."""

    def wrap(handler: Callable) -> Callable:
        RULES[name] = Rule(name, source, summary)
        for f in funcs:
            _FUNCTION_RULES[f] = handler
        return handler

    return wrap


@dataclass
class CudaPaths:
    """The device a trace emulates and what the trace learnt on the way (``notes``)."""

    gpu: GPU
    release: Release = Release()
    workspace: cudnn.Workspace = cudnn.Workspace()
    tracer: object = None  # the emulated backend's Tracer, set when tracing starts
    notes: dict[str, None] = field(default_factory=dict)  # ordered set of lines
    kernels: dict[str, None] = field(default_factory=dict)  # fused SDPA backends run
    cp: object = None  # context_parallel.Ranks: this trace is one rank's of several
    collectives: int = 0  # process-group collectives the step ran (c10d's, functional ones)

    @property
    def cc(self) -> tuple[int, int]:
        return tuple(self.gpu.compute_capability)

    def note(self, line: str) -> None:
        self.notes[line] = None

    @contextmanager
    def mode(self):
        """The rules' torch-function mode, with CUDA's autocast over it (``autocast.py``:
        it casts before the rules see a call, as autocast runs before SDPA's backend
        choice on a GPU)."""
        from memcalc.tracing.autocast import Autocast, enabled_on_meta
        from memcalc.tracing.tracer import torch_release

        autocast = Autocast(self.tracer, torch_release())
        with Mode(self), enabled_on_meta(autocast), autocast, self.ranks():
            yield

    def ranks(self):
        """Under context parallelism, the fake process group this rank runs in."""
        if self.cp is None:
            return nullcontext()
        from memcalc.tracing.context_parallel import fake_group

        return fake_group(self.cp)

    def kernel(self, func):
        """What runs in place of ``func``'s meta kernel, which allocates only its outputs:
        a fused attention op's model (``kernels.OPS``, the flash-attn packages' ops
        ``flash_attn_ops.OPS``: every tensor its CUDA kernel makes, the outputs returned) or
        a foreach kernel's (``foreach.OPS``), else None."""
        return KERNELS.get(func.name())

    def observe(self, func, args=(), kwargs=None) -> None:
        """What the trace cannot see inside ``func`` (``observe``), and the checks a GPU
        makes before running it (``check_dtypes``); the tracer calls this before each op."""
        observe(self, func)
        check_dtypes(func, args, kwargs or {})


# the ops whose CUDA kernels allocate what their meta kernels do not, and what runs for them
# (by qualified name: ``aten::_foreach_norm.Scalar``, ``flash_attn::_flash_attn_forward``)
KERNELS = {**{op.name(): run for op, run in {**kernels.OPS, **foreach.OPS}.items()},
           **flash_attn_ops.OPS}


class Mode(TorchFunctionMode):
    """Hands the calls a rule handles to the rule; every other call runs as is."""

    def __init__(self, paths: CudaPaths):
        super().__init__()
        self.paths = paths

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        from memcalc.tracing.tracer import call_within

        handler = _FUNCTION_RULES.get(func)
        if handler is not None and self.paths.tracer is not None:
            return handler(self.paths, func, args, kwargs)
        return call_within(self, func, types, args, kwargs)


def active_paths(name: str) -> CudaPaths:
    """The CUDA rules of the trace running now, for a stand-in (``flash_attn.py``,
    ``flex.py``) to hand its call to: found on the torch-function mode stack itself, since a
    mode above them (CUDA's autocast) hands a Python function on with
    ``redispatch_function``, which skips every mode for that call; one line outside a trace."""
    from torch.overrides import _get_current_function_mode_stack

    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, Mode) and mode.paths.tracer is not None:
            return mode.paths
    raise NotModelled(f"{name}: memcalc's stand-in runs only inside a trace on the GPU's code "
                      f"paths (memcalc trace without --meta-paths)")


def _arg(args, kwargs, index: int, name: str, default=None):
    """Argument ``name`` given at position ``index`` or by keyword."""
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


# --- scaled_dot_product_attention --------------------------------------------------------

def call_of(q, k, v, mask, dropout: float, is_causal: bool, enable_gqa: bool) -> Call:
    """``sdp_params`` read off the call's tensors."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return Call(tuple(q.shape), tuple(k.shape), tuple(v.shape), str(q.dtype).removeprefix("torch."),
                tuple(mask.shape) if mask is not None else None,
                bool(mask is not None and mask.requires_grad), float(dropout), bool(is_causal),
                bool(enable_gqa), needs_grad,
                tuple(t.stride(-1) if t.dim() else 1 for t in (q, k, v)),
                tuple(t.storage_offset() for t in (q, k, v)), q.element_size())


def flags() -> Flags:
    """``torch.backends.cuda.*_sdp_enabled()``: what ``sdpa_kernel`` in the user's code set."""
    b = torch.backends.cuda
    deterministic = (torch.are_deterministic_algorithms_enabled()
                     and not torch.is_deterministic_algorithms_warn_only_enabled())
    return Flags(b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled(),
                 b.cudnn_sdp_enabled(), deterministic)


@rule("sdpa", "aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (select_sdp_backend), "
      "attention.cpp", "F.scaled_dot_product_attention takes the backend a GPU would take; "
      "fused backends allocate what memcalc's sdpa-flash / sdpa-efficient models declare",
      funcs=(F.scaled_dot_product_attention,))
def sdpa(paths: CudaPaths, func, args, kwargs):
    """Select the backend as ``sdp_utils.cpp`` does, note it, run it."""
    from memcalc.tracing.tracer import _where

    q, k, v = args[:3]
    mask = _arg(args, kwargs, 3, "attn_mask")
    dropout = _arg(args, kwargs, 4, "dropout_p", 0.0)
    causal = _arg(args, kwargs, 5, "is_causal", False)
    gqa = kwargs.get("enable_gqa", False)
    call = call_of(q, k, v, mask, dropout, causal, gqa)
    choice = sdpa_select.select(call, paths.cc, flags(), paths.release)
    paths.note(f"scaled_dot_product_attention at {_where()[0]} {tuple(q.shape)} {call.dtype}"
               f"{' causal' if causal else ''}, torch {paths.release.text()}'s rules: "
               f"{choice.reason()}")
    ring = paths.cp is not None and paths.cp.method != "ulysses"  # Ulysses attends locally
    if choice.backend == MATH and ring:
        raise NotModelled("--cp: the math backend under context parallelism is not modelled "
                          "(torch's ring attention calls the fused kernels; the math path "
                          "runs as DTensor ops on the sharded q, k, v, and causal raises in "
                          "torch 2.13: aten.add.Tensor got mixed torch.Tensor and DTensor)")
    if choice.backend == MATH:
        paths.tracer.mask_adds += bool(mask is not None or causal)  # made in place
        if dropout > 0 and call.requires_grad:
            paths.note("dropout inside the math backend: fused on a GPU (native_dropout, bool "
                       "mask), traced unfused on meta (a noise tensor of the scores' dtype): "
                       "overstated by the difference, not modelled")
        return func(*args, **kwargs)
    if mask is not None:
        mask = fused_mask(mask, q, k, choice.backend)
    if ring:
        from memcalc.tracing import context_parallel

        paths.kernels[choice.backend] = None
        return context_parallel.run(paths, choice.backend, q, k, v, call)
    return kernels.run(choice.backend, q, k, v, call, mask, kwargs.get("scale"))


def fused_mask(mask, q, k, backend: str):
    """The attn_mask a fused kernel gets, made as ``attention.cpp`` (2.13) makes it before
    the call: a bool mask becomes ``where(mask, 0, -inf)`` in q's dtype, of the mask's own
    shape (``convert_boolean_attn_mask``: a 0-d -inf and, inside ``where``, a 0-d 0);
    for the memory-efficient kernel, a mask whose strides are not multiples of 8 is padded
    to the next multiple of 8 past its last dim and sliced back (``pad_bias<8>``, before the
    expand, so nothing is widened to the heads), then expanded to (B, H, N, M) as a view.
    The node saves it (``attn_bias``) until the backward; a mask that needs a grad gets
    the kernel's ``grad_bias`` (``sdpa_efficient.bias_gradient``), which autograd then sums
    back to the mask's own shape. Another dtype than q's on the efficient kernel is refused
    (cuDNN takes no mask that needs a grad: ``sdpa_select``)."""
    if mask.dtype == torch.bool:
        mask = torch.where(mask, 0.0, torch.scalar_tensor(float("-inf"), dtype=q.dtype,
                                                          device=mask.device))
    if backend != EFFICIENT:
        return mask  # cuDNN expands it inside the op: a view
    if mask.dtype != q.dtype:  # _efficient_attention_forward's check of the bias
        raise RefusedOnGpu("invalid dtype for bias - should match query's dtype")
    if not _aligned(mask):
        size = mask.shape[-1]
        pad = MEM_EFF_ALIGNMENT - size % MEM_EFF_ALIGNMENT
        mask = F.pad(mask, (0, pad))[..., :size]
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _aligned(mask) -> bool:
    """``aligned_tensor<8>``: every stride but the last a multiple of 8, the last 1."""
    strides = mask.stride()
    return strides[-1] == 1 and all(s % MEM_EFF_ALIGNMENT == 0 for s in strides[:-1])


# --- softmax with dtype=float32 on fp16 --------------------------------------------------

def _softmax_call(func, args, kwargs) -> tuple:
    """(input, dim, dtype) of any spelling of softmax / log_softmax."""
    python_api = func in (F.softmax, F.log_softmax)
    dtype = _arg(args, kwargs, 3 if python_api else 2, "dtype")
    return args[0], _arg(args, kwargs, 1, "dim"), dtype


@rule("half-to-float-softmax", "aten/src/ATen/native/SoftMax.cpp (softmax / log_softmax: "
      "_softmax(input, dim, half_to_float=true) for Half input and dtype=Float on CUDA)",
      "softmax(x, dim, dtype=torch.float32) on fp16 runs one fused kernel: no float32 copy "
      "of the input (bf16 is converted first, as on meta)",
      funcs=(F.softmax, torch.softmax, torch.Tensor.softmax, torch.special.softmax,
             F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax,
             torch.special.log_softmax))
def half_to_float(paths: CudaPaths, func, args, kwargs):
    x, dim, dtype = _softmax_call(func, args, kwargs)
    if dim is None or x.dtype != torch.float16 or dtype != torch.float32:
        return func(*args, **kwargs)
    log = func in (F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax,
                   torch.special.log_softmax)
    op = torch.ops.aten._log_softmax if log else torch.ops.aten._softmax
    _noted(paths, f"{'log_softmax' if log else 'softmax'}(dtype=float32) on fp16", "fused "
           f"{'_log_softmax' if log else '_softmax'}(half_to_float=True): no float32 copy")
    return op(x, dim, True)


# --- dropout -----------------------------------------------------------------------------

@rule("fused-dropout", "aten/src/ATen/native/Dropout.cpp (dropout: native_dropout when "
      "is_fused_kernel_acceptable), aten/src/ATen/native/cuda/Dropout.cu (dropout_cuda: a "
      "bool mask, allocated before the output)",
      "training dropout (0 < p < 1) runs native_dropout and saves a bool mask instead of a "
      "noise tensor of the input's dtype",
      funcs=(F.dropout, torch.dropout))
def fused_dropout(paths: CudaPaths, func, args, kwargs):
    fused = fused_dropout_of(func, args, kwargs)
    if fused is None:
        return func(*args, **kwargs)  # identity, or dropout_ (never fused: Dropout.cpp)
    x, p = fused
    _noted(paths, f"dropout(p={p})", "fused native_dropout: a bool mask is saved")
    tracer = paths.tracer
    tracer.collect_frees()
    with tracer.quiet():
        out, mask = torch.ops.aten.native_dropout(x, p, True)
    # Dropout.cu (dropout_cuda) allocates the mask before the output; the meta kernel
    # returns them the other way round, and the order decides which cached block each takes
    tracer.track(mask, "native_dropout", "native_dropout")
    tracer.track(out, "native_dropout", "native_dropout")
    return out


def fused_dropout_of(func, args, kwargs) -> tuple | None:
    """``(x, p)`` of a dropout call CUDA runs as ``native_dropout`` (training, not in
    place, 0 < p < 1, not empty: ``is_fused_kernel_acceptable``), else None."""
    x = args[0]
    p = _arg(args, kwargs, 1, "p", 0.5)
    train = _arg(args, kwargs, 2, "training" if func is F.dropout else "train", True)
    inplace = func is F.dropout and _arg(args, kwargs, 3, "inplace", False)
    if not train or inplace or not 0 < p < 1 or x.numel() == 0:
        return None
    return x, p


def _noted(paths: CudaPaths, what: str, how: str) -> None:
    """Say which rule ran where."""
    from memcalc.tracing.tracer import _where

    paths.note(f"{what} at {_where()[0]}: {how}")


UNMODELLED = {
    "custom": "custom op {op}: its CUDA/Triton kernel's own allocations (workspace, "
              "temporaries) are not visible on the meta device; only its outputs are counted",
    "reduction": "{op}: a large CUDA reduction may allocate a staging buffer and semaphores "
                 "(aten/src/ATen/native/cuda/Reduce.cuh, global reduce); not modelled for "
                 "this op (sum's and mean's are)",
}
# reductions through Reduce.cuh whose accumulator width memcalc does not model yet; sum and
# mean are (memcalc.impls.reductions, the tracer's _reduction)
REDUCTIONS = frozenset({"amax", "amin", "max", "min", "argmax", "argmin", "norm",
                        "linalg_vector_norm", "var", "std", "var_mean", "std_mean", "prod",
                        "logsumexp", "all", "any"})


# cuBLAS's ops: their CUDA kernels check that the operands share a dtype
# (``aten/src/ATen/native/LinearAlgebra.cpp`` structured meta functions, shared with CPU),
# which the meta device's Python meta functions skip (torch/_meta_registrations.py: meta_mm)
BLAS = frozenset({"mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot",
                  "_addmm_activation"})


def check_dtypes(func, args, kwargs) -> None:
    """Raise what a GPU raises for a matmul of two dtypes (bf16 activations into float32
    weights without autocast: "mat1 and mat2 must have the same dtype"). The message is
    torch's own: the op run on empty CPU tensors of the same dtypes, whose checks are
    those of the CUDA kernel."""
    if func.overloadpacket.__name__ not in BLAS:
        return
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if len({t.dtype for t in tensors}) < 2:
        return
    empty = lambda a: (torch.empty((0,) * a.dim(), dtype=a.dtype)  # noqa: E731
                       if isinstance(a, torch.Tensor) else a)
    try:
        func(*map(empty, args), **{k: empty(v) for k, v in kwargs.items()})
    except RuntimeError as error:
        from memcalc.errors import one_line

        raise RefusedOnGpu(f"on a GPU this raises RuntimeError: {one_line(error)} (the meta "
                           f"device does not check; cast one operand, or run the step under "
                           f"autocast: --autocast bf16)") from None


# custom ops that are collectives allocating their output alone: DeepSpeed's all-to-all for
# Hugging Face models (deepspeed/sequence/layer.py, 0.19.8: torch.empty_like, then c10d's
# synchronous all_to_all_single into it)
COLLECTIVE_OPS = frozenset({"deepspeed::dim_zero_all_to_all"})


def observe(paths: CudaPaths, func) -> None:
    """Name what the trace cannot see inside ``func`` on a GPU."""
    namespace = func.namespace
    op = func.overloadpacket.__name__
    known = f"{namespace}::{op}" in COLLECTIVE_OPS
    paths.collectives += namespace in ("c10d", "_c10d_functional") or known
    # the collectives allocate no caching-allocator block inside (NCCL's buffers are its
    # own); the functional ones' stash: collectives.py; c10d's in-place ones, as
    # DeepSpeed-Ulysses calls them, are synchronous: the stash ends with the call
    # profiler:: marks a record_function range (the optimizer's step is one): no memory
    # fsdp:: are FSDP2's copies, whose CUDA implementations write into outputs made before
    # them and allocate nothing else (``_fsdp_collectives.py``: ``all_gather_copy_in`` a
    # ``_foreach_copy_`` into a narrow of the buffer, ``split_with_sizes_copy`` and
    # ``chunk_cat`` the ``out=`` variants)
    if namespace not in ("aten", "prim", "prims", "_c10d_functional", "c10d", "profiler",
                         "fsdp") and not known:
        paths.note(UNMODELLED["custom"].format(op=f"{namespace}::{op}"))
    elif op in REDUCTIONS:
        paths.note(UNMODELLED["reduction"].format(op=f"aten::{op}"))
