"""The tracer: the protocol on PyTorch's meta device, memory from the model of the caching
allocator (``memcalc trace``, and the emulated backend of ``memcalc validate``).

A ``TorchDispatchMode`` sees every aten op below autograd. Each op's outputs that own a
storage not seen before are handed to the ``Ledger`` (the same one the analytical model
replays through); a weak reference to the storage's Python object, which torch keeps as
long as the storage, tells when it dies (a Python ``del``, autograd releasing a saved
tensor, a grad reset), and its block is freed before the next op runs. The cuBLAS workspace of a thread is allocated right after the outputs of that
thread's first cuBLAS op (``getCurrentCUDABlasHandle`` runs inside the blas call, after
the output exists: ``aten/src/ATen/cuda/CublasHandlePool.cpp``). On CUDA, backward ops run
on the autograd engine's device thread (``torch/csrc/autograd/engine.cpp``), which gets its
own handle and workspace; the tracer knows it is in backward from ``_current_graph_task_id``.

Nothing is materialized: memory does not depend on seq_len, and time only through the ops
a loop runs (linear in them: a chunked loop at 65,536 rows traces in about 20 s).
"""

from __future__ import annotations

import inspect
import linecache
import os
import re
import sys
import threading
import weakref
from contextlib import contextmanager
from typing import Callable, NamedTuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from memcalc.analysis.breakdown import Breakdown
from memcalc.engine.component import Component
from memcalc.config import Config
from memcalc.engine.program import ITEMSIZE, Role, Tensor
from memcalc.engine.allocator import DEFAULT_SETTINGS, Settings
from memcalc.engine.replay import Ledger
from memcalc.engine.inputs import QKV, Input
from memcalc.impls.embedding import EmbeddingBackward
from memcalc.impls.reductions import Reduction, accumulator_bytes
from memcalc.impls.device import Gpu, gpu_of
from memcalc.tracing import compiled, interrupt
from memcalc.tracing.collectives import Collectives
from memcalc.tracing.deferred import deferred
from memcalc.tracing.fsdp_copies import COPIES as FSDP_COPIES
from memcalc.tracing.optimizers import Loop
from memcalc.tracing.protocol import Measured, make_inputs, run_protocol
from memcalc.tracing.shadows import Shadows
from memcalc.tracing.state import trained

# addmm with a bias vector runs through cuBLASLt (``isInputCompliesAddmmCudaLt``, Blas.cpp),
# which through torch 2.11 takes a workspace of its own per handle and stream, after the
# cuBLAS one (``getCUDABlasLtWorkspace``, CublasHandlePool.cpp; ``CUBLASLT_WORKSPACE_SIZE``
# default 1024 KiB: 1,048,576 B measured on an H200 with torch 2.11). From 2.12 it shares
# the cuBLAS workspace by default (pytorch/pytorch#168175 and #175879, merged after 2.11
# branched; torch 2.13's ``torch.backends.cuda`` documents the unified default).
LT_OPS = frozenset({"addmm", "_addmm_activation"})
LT_WORKSPACE_BYTES = 1 << 20
LT_UNIFIED_SINCE = (2, 12)


def _lt_addmm(out, bias, mat1, mat2, *rest, beta=1, alpha=1, **kwargs) -> bool:
    """``isInputCompliesAddmmCudaLt`` (torch 2.11, Blas.cpp): beta 1, a contiguous bias
    vector as long as the result's rows, a contiguous 2-D result, a floating dtype, and
    every matrix dimension above 1."""
    return (beta == 1 and bias.dim() == 1 and bias.is_contiguous()
            and bias.shape[0] == mat2.shape[1] and out.dim() == 2 and out.is_contiguous()
            and mat1.dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16)
            and min(*mat1.shape, *mat2.shape) > 1)


# ops that call cuBLAS on CUDA (aten/src/ATen/native/cuda/Blas.cpp)
CUBLAS_OPS = frozenset(
    {"mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "_addmm_activation"}
)
# folders end in a separator: torchtitan, torchvision and torch_checkpointing sit beside
# torch in site-packages, and their files are the user's
_TORCH_DIR = os.path.join(os.path.dirname(torch.__file__), "")
_OPTIM_DIR = os.path.join(_TORCH_DIR, "optim", "")
_MEMCALC_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")
_REFERENCE_DIR = os.path.join(_MEMCALC_DIR, "validation", "reference", "")
_HARNESS = os.path.join(_MEMCALC_DIR, "tracing", "protocol.py")


def _is_user_code(path: str) -> bool:
    """Frames outside torch and memcalc are the user's; memcalc's reference code counts
    as user code (it is what a user would write)."""
    if path.startswith(_TORCH_DIR):
        return False
    return not path.startswith(_MEMCALC_DIR) or path.startswith(_REFERENCE_DIR)


def torch_release() -> tuple[int, int]:
    """The installed torch's ``(major, minor)``: ``2.13.0+cpu`` is ``(2, 13)``."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _safe_softmax_eq(x, dim, dtype=None):
    """``_safe_softmax`` in torch 2.5 (``aten/src/ATen/native/transformers/attention.cpp``):
    the softmax, a ``-inf`` scalar, the ``== -inf`` mask, the fully-masked-row mask, a zero
    scalar and an out-of-place ``where``, the result."""
    out = torch.softmax(x, dim, dtype=dtype)
    neg_inf = torch.scalar_tensor(float("-inf"), dtype=out.dtype, device=out.device)
    masked = x.eq(neg_inf)
    masked_rows = torch.all(masked, dim, keepdim=True)
    zero = torch.scalar_tensor(0.0, dtype=out.dtype, device=out.device)
    return torch.where(masked_rows, zero, out)


def _safe_softmax_where_out(x, dim, dtype=None):
    """``_safe_softmax`` from torch 2.6 on (pytorch/pytorch#139613): ``isneginf`` instead of
    the scalar and ``eq``, and ``where_out`` writing into the softmax's own storage (no
    second N x M result)."""
    out = torch.softmax(x, dim, dtype=dtype)
    masked = x.isneginf()
    masked_rows = torch.all(masked, dim, keepdim=True)
    zero = torch.scalar_tensor(0.0, dtype=out.dtype, device=out.device)
    return torch.where(masked_rows, zero, out, out=out)


# ``_safe_softmax`` is a CompositeExplicitAutograd kernel with no CUDA kernel, so on a GPU its
# inner ops allocate, while its meta kernel allocates only the result: the tracer runs the
# composite of the installed release (it exists from torch 2.5 on; torch 2.4's sdpa has no
# such op). ``memcalc/impls/sdpa_math.py`` models the newest; tests/test_validate_emulated.py
# checks both against the ops the installed torch's own kernel runs (torch.profiler).
SAFE_SOFTMAX_WHERE_OUT = (2, 6)
SAFE_SOFTMAX = (_safe_softmax_where_out if torch_release() >= SAFE_SOFTMAX_WHERE_OUT
                else _safe_softmax_eq)


def _log_sigmoid_forward(x):
    """``log_sigmoid_forward_cuda`` (``aten/src/ATen/native/cuda/Activation.cpp``): the
    result and an empty buffer ("only used by CPU dispatch"), where the meta kernel makes
    the buffer full size."""
    return torch.empty_like(x), x.new_empty((0,))


def _fused_step_in_place(*args, **kwargs) -> None:
    """``_fused_sgd_`` (``aten/src/ATen/native/cuda/FusedSgdKernel.cu``): updates the
    parameters and momentum buffers in place through ``multi_tensor_apply``, whose
    metadata is a kernel argument: nothing allocated. torch 2.13 gives it no meta kernel
    (``_fused_adam_``/``_fused_adamw_`` have one, which allocates nothing either)."""
    return None


CUDA_COMPOSITES = {**{op.default: SAFE_SOFTMAX for op in
                      [getattr(torch.ops.aten, "_safe_softmax", None)] if op is not None},
                   torch.ops.aten.log_sigmoid_forward.default: _log_sigmoid_forward,
                   **{getattr(torch.ops.aten._fused_sgd_, overload): _fused_step_in_place
                      for overload in torch.ops.aten._fused_sgd_.overloads()}}


def _reduced_input(out, self):
    """``sum``'s structured impl (``aten/src/ATen/native/ReduceOps.cpp``, ``sum_out``) builds
    its iterator with ``make_reduction_from_out_ty`` (``ReduceOpsUtils.h``), which reduces
    ``self.to(out_dtype)``: a full-size copy whenever the dtypes differ (a bool or integer
    tensor summed into int64: 8 bytes an element), but for CUDA's half or bfloat16 summed
    into float32, which the kernel reads as it is. None when no copy is made."""
    lowp_to_f32 = self.dtype in (torch.float16, torch.bfloat16) and out.dtype == torch.float32
    if self.dtype == out.dtype or lowp_to_f32:
        return None
    return self.to(out.dtype)


def _reduced_dims(self: torch.Tensor, dim=None) -> tuple[int, ...]:
    """The dimensions a ``sum``/``mean`` reduces: all of them for none or ``[]``."""
    if dim is None or (isinstance(dim, (list, tuple)) and not dim):
        return tuple(range(self.dim()))
    dims = dim if isinstance(dim, (list, tuple)) else (dim,)
    return tuple(d % max(self.dim(), 1) for d in dims)


def _reduction(tracer, out, self, dim=None, *rest, **kwargs):
    """A ``sum`` or ``mean`` as CUDA runs it: the converted copy (``_reduced_input``), then
    what ``gpu_reduce_kernel`` takes inside itself (``memcalc.impls.reductions``: the
    staging buffer and semaphores of an output split across blocks), freed as it returns."""
    copy = _reduced_input(out, self)
    source = self if copy is None else copy
    tracer.scratch(reduction_of(source, _reduced_dims(self, dim), out.dtype), "sum")
    return [copy] if copy is not None else []


def _embedding_backward(tracer, out, grad, indices, num_weights, padding_idx,
                        scale_grad_by_freq) -> list:
    """``embedding_dense_backward_cuda``'s buffers past 3,072 indices: the sort and the
    segment sums (``memcalc.impls.embedding``), after the result, freed as it returns."""
    dtype, index = (str(t.dtype).removeprefix("torch.") for t in (grad, indices))
    call = EmbeddingBackward(indices.numel(), num_weights, grad.shape[-1], dtype, index,
                             bool(scale_grad_by_freq), not indices.is_contiguous(),
                             not grad.is_contiguous())
    tracer.scratch(call, "embedding")
    if call.sorted and tracer.paths is not None:
        tracer.paths.note("embedding_dense_backward past 3,072 indices sorts them: its "
                          "buffers are modelled (memcalc/impls/embedding.py), not the "
                          "temporary storage CUB sizes for its sort and scans at run time")
    return []


def reduction_of(source: torch.Tensor, dims: tuple, out_dtype) -> Reduction:
    """The ``memcalc.impls.reductions.Reduction`` of reducing ``source`` over ``dims``."""
    out_name = str(out_dtype).removeprefix("torch.")
    return Reduction(tuple(source.shape), tuple(source.stride()), dims, source.element_size(),
                     ITEMSIZE[out_name], accumulator_bytes(out_name), source.storage_offset())


def _batch_operand_copied(t: torch.Tensor, transpose_result: bool, m: int, n: int) -> bool:
    """``prepare_batch_matrix_for_cublas`` (``aten/src/ATen/native/cuda/Blas.cpp``): an
    operand cuBLAS cannot read through its strides (a stride-0 expand, say) is cloned
    contiguous for the call."""
    stride = t.stride()
    fast, leading = (2, 1) if transpose_result else (1, 2)
    if stride[fast] == 1 and stride[leading] >= max(1, m):
        return False
    if stride[leading] == 1 and stride[fast] >= max(1, n):
        return False
    return not (t.is_contiguous() and stride[1] != 0 and stride[2] != 0)


def _bmm_copies(tracer, out, batch1, batch2, *rest, **kwargs) -> list:
    """``baddbmm_out_cuda_impl`` (``Blas.cpp``) for ``bmm``: its fresh result is read
    transposed, so the operands are prepared swapped; each one cuBLAS cannot read is cloned
    (``_batch_operand_copied``), held until the call returns."""
    sizes, stride = out.shape, out.stride()
    transpose_result = not (stride[1] == 1 and (sizes[2] == 1 or stride[2] >= max(1, sizes[1])))
    leading = 1 if transpose_result else 2
    m, n = sizes[2 if transpose_result else 1], sizes[leading]
    k = (batch2 if transpose_result else batch1).shape[leading]
    first, second = (batch2, batch1) if transpose_result else (batch1, batch2)
    return [t.clone(memory_format=torch.contiguous_format)
            for t, rows, cols in ((first, m, k), (second, k, n))
            if _batch_operand_copied(t, transpose_result, rows, cols)]


def dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its extent once each (a permutation of contiguous):
    ``is_non_overlapping_and_dense`` (``c10/core/Contiguity.h``)."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda p: (p[1], p[0])):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _mm_copies(tracer, out, mat1, mat2, *rest, **kwargs) -> list:
    """``cublasCommonArgs`` (``Blas.cpp``) for ``mm``: ``prepare_matrix_for_cublas`` clones an
    operand that is neither dense nor readable through one unit stride."""
    def copied(t):
        if dense(t):
            return False
        (rows, cols), (s0, s1) = t.shape, t.stride()
        return not ((s0 == 1 and s1 >= max(1, rows)) or (s1 == 1 and s0 >= max(1, cols)))

    return [t.clone(memory_format=torch.contiguous_format) for t in (mat1, mat2) if copied(t)]


# temporaries a CUDA kernel allocates and frees inside itself, after its outputs, which the
# meta kernel does not, each ``f(tracer, out, *args, **kwargs)``: ``softmax_backward_cuda_out``
# (aten/src/ATen/native/cuda/SoftMax.cu) computes ``Tensor tmp = grad * output``
# (memcalc.impls.common.softmax_backward models it); a ``sum`` or ``mean`` reduces a
# converted copy of another dtype and may take a split reduction's buffers (``_reduction``);
# ``bmm`` and ``mm`` clone an operand cuBLAS cannot read (``_bmm_copies``, ``_mm_copies``)
CUDA_TEMPORARIES = {torch.ops.aten._softmax_backward_data.default:
                    lambda tracer, out, grad, output, *rest: grad * output,
                    torch.ops.aten.bmm.default: _bmm_copies,
                    torch.ops.aten.mm.default: _mm_copies,
                    torch.ops.aten.embedding_dense_backward.default: _embedding_backward,
                    **{op: _reduction for op in (torch.ops.aten.sum.dim_IntList,
                                                 torch.ops.aten.sum.default,
                                                 torch.ops.aten.mean.dim,
                                                 torch.ops.aten.mean.default)}}


class Tracer(TorchDispatchMode):
    """Dispatch mode that replays a meta-device run through the allocator model."""

    def __init__(self, workspace_bytes: int, capacity: int | None = None, paths=None,
                 gpu: Gpu | None = None, settings: Settings = DEFAULT_SETTINGS):
        super().__init__()
        # what CUDA kernels read of the device (SM count, compute capability): the split of
        # a reduction across blocks depends on it (``memcalc.impls.reductions``)
        self.gpu = gpu or gpu_of(None)
        # ``settings``: the caching allocator's (PYTORCH_ALLOC_CONF)
        self.ledger = Ledger(workspace_bytes, capacity, record=True, settings=settings)
        # each tracked storage (by its StorageImpl's address): a weak reference to its
        # Python object, which torch keeps while anything holds the storage (a view, a
        # tensor autograd saved) and frees with it; the reference's callback notes the
        # death, in ``dead``, and its tracking order in ``order``, the order frees are taken
        self.refs: dict[int, weakref.ref] = {}
        self.order: dict[int, int] = {}
        self.dead: list[int] = []
        # ``memcalc.tracing.cuda_paths.CudaPaths`` for ``memcalc trace`` (the GPU's code
        # paths); None for validation, which checks the models of what meta runs
        self.paths = paths
        self._quiet = 0
        # math SDPA calls with a mask whose in-place add is still to come (``math_mask_add``)
        self.mask_adds = 0
        # values of the small integer and bool tensors, for code that reads them
        self.shadows = Shadows()
        # functional collectives as NCCL (or a fake process group) runs them
        # (``collectives.py``)
        group = paths.cp.group if paths and paths.cp else "nccl"
        self.collectives = Collectives(paths.release.torch if paths else torch_release(), group)
        # ("alloc", key, component) | ("free", key) | ("cublas", thread) | ("mark", what) |
        # ("stream", number):
        # the run as a program, for memcalc/trace.py
        self.events: list[tuple] = []
        # the measured phase running (``TracerProbe.reset_peak``): the optimizer's
        # allocations on the main thread are its temporaries, not activations
        self.phase = ""
        # the CUDA stream allocations are made on (0: the default one), which FSDP's
        # stand-in device handle sets (``set_stream``)
        self.stream = 0
        self.given: tuple | None = None  # (name, role, op) set by ``naming``

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """torch wraps a dispatch mode's ``__torch_dispatch__`` in ``torch._dynamo.disable``
        unless this says no (``torch/utils/_python_dispatch.py``, torch 2.13), importing
        ``torch._dynamo`` (0.8 s, a third of a trace) at the first op; a trace compiles
        nothing."""
        return False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """While traced code compiles (``compiled.compiling``), dynamo switches this mode off
        as it compiles and on again for the compiled code it runs
        (``torch/utils/_python_dispatch.py``): the trace sees inductor's wrapper, not the
        compiler's fake-tensor work; otherwise dynamo, seeing the mode, would run the code
        eagerly."""
        return compiled.compiling()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        interrupt.check()  # a Ctrl-C the trace held (``interrupt.held``) stops it here
        subclass = _subclass(types)
        if subclass == "DTensor":  # its own dispatch runs the local ops, through this mode
            return NotImplemented
        if self._quiet or subclass == "FakeTensor":  # DTensor's sharding propagation
            return func(*args, **(kwargs or {}))
        self.collect_frees()
        alias = self.collectives.wrap(func, args)
        if alias is not None:
            return alias
        if self.collectives.in_flight:
            self.collectives.wait_for(args, kwargs)
            self.collect_frees()
        if func in CUDA_COMPOSITES:
            with self:
                return CUDA_COMPOSITES[func](*args, **(kwargs or {}))
        if self.mask_adds and is_mask_add(func, args):
            return self.math_mask_add(args[0])
        if self.paths is not None:
            kernel = self.paths.kernel(func)
            if kernel is not None:  # a fused attention op: its model, in the op's place
                return kernel(self.paths, *args, **(kwargs or {}))
            self.paths.observe(func, args, kwargs)
        answer = self.shadows.read(func, args, kwargs or {})
        if answer is not NotImplemented:
            return answer
        out = func(*args, **(kwargs or {}))
        self.collectives.issued(func, args, kwargs, out)
        self.shadows.follow(func, args, kwargs or {}, out)
        op = func.overloadpacket.__name__
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                self._track(t, op)
        held = None
        if func in CUDA_TEMPORARIES:  # made before the kernel asks for its cuBLAS handle
            with self:
                held = CUDA_TEMPORARIES[func](self, out, *args, **(kwargs or {}))
        elif func.namespace == "fsdp" and op in FSDP_COPIES:
            with self:
                FSDP_COPIES[op](self, *args, **(kwargs or {}))
        if op in CUBLAS_OPS:
            self.ledger.ensure_workspace(_thread(), _where()[0])
            self.events.append(("cublas", _thread()))
            if op in LT_OPS and self.separate_lt_workspace() and _lt_addmm(out, *args,
                                                                           **(kwargs or {})):
                self.ledger.ensure_workspace(_thread(), _where()[0], "cuBLASLt",
                                             LT_WORKSPACE_BYTES)
        if held is not None:
            del held  # dropped as the kernel returns
            self.collect_frees()
        return out

    def separate_lt_workspace(self) -> bool:
        """Whether the release traced for keeps cuBLASLt's workspace apart from cuBLAS's."""
        release = self.paths.release.torch if self.paths is not None else torch_release()
        return tuple(release[:2]) < LT_UNIFIED_SINCE

    def scratch(self, call, op: str) -> None:
        """Allocate and free what a kernel takes inside itself, in the order its model
        declares it (``call.events``: a ``Reduction``'s accumulation buffer around every
        launch's buffer and semaphores, each launch's freed before the next; an
        ``EmbeddingBackward``'s sort and segment sums). Marked in the events (``reduce`` ...
        ``reduce_end``), so that a program fitted over lengths recomputes them."""
        self.events.append(("reduce", call))
        held = {}
        for event in call.events(op, self.gpu):
            if isinstance(event, Tensor):
                # shown as the op's own ("sum split-reduction buffer"), not a tensor's
                held[event.name] = self._scratch_tensor(event, event.name.replace(": ", " ", 1))
            else:  # a Free
                for name in event.names:
                    del held[name]
                self.collect_frees()
        self.events.append(("reduce_end",))

    def _scratch_tensor(self, event: Tensor, name: str) -> torch.Tensor:
        with self.quiet():
            t = torch.empty(event.shape, dtype=getattr(torch, event.dtype), device="meta")
        self.track(t, "empty", name)  # a buffer the kernel takes for itself
        return t

    def math_mask_add(self, scores: torch.Tensor) -> torch.Tensor:
        """The math SDPA backend's ``attn.add_(*attn_mask)`` (``attention.cpp``,
        ``_scaled_dot_product_attention_math``), in place as without a dispatch mode: it adds
        out of place when ``areAnyTensorSubclassLike`` holds, which any active dispatch mode
        makes true (``c10::impl::dispatch_mode_enabled``, ``TensorSubclassLikeUtils.h``), so
        the tracer itself would add an N x M block no GPU run has. The result is the scores'
        own storage."""
        self.mask_adds -= 1
        if self.paths is not None:
            self.paths.note("math backend mask add: in place, as on a GPU (attention.cpp "
                            "attn.add_)")
        return scores.view(scores.shape)

    def __exit__(self, *exc):
        self.collect_frees()
        return super().__exit__(*exc)

    def collect_frees(self) -> None:
        """Free the blocks of every storage that died since the last op, in the order they
        were tracked. Told by the storages' deaths, not found by checking every live one
        at every op (quadratic in a loop's saved tensors: a chunked loop at 65,536 rows
        traced in 565 s)."""
        if not self.dead:
            return
        dead = sorted(self.dead, key=self.order.__getitem__)
        self.dead.clear()  # the list the callbacks append to
        for key in dead:
            del self.refs[key], self.order[key]
            if key in self.ledger.live:  # not if resized to nothing before it died
                self.ledger.free(key)
                self.events.append(("free", key))

    def _track(self, t: torch.Tensor, op: str) -> None:
        self.track(t, op, op)

    def track(self, t: torch.Tensor, op: str, name: str) -> None:
        """Track ``t``'s storage, made by ``op``, as ``name`` at the calling line: an input,
        a temporary in backward, an activation in forward (roles the end of the step may
        change)."""
        role = Role.input if op == "randn" else (
            Role.temporary if _thread() == "autograd" or self.phase == "optimizer"
            else Role.activation)
        if self.given is not None:  # named by who asked for it (``naming``)
            name, role, op = self.given
        self.adopt(t, component(name, role, op, tuple(t.shape),
                                str(t.dtype).removeprefix("torch."), t.untyped_storage().nbytes()),
                   located=self.given is None)

    def set_stream(self, number: int) -> None:
        """Allocations from here on are made on CUDA stream ``number`` (``torch.cuda.stream``
        as FSDP's stand-in device handle runs it: ``memcalc.tracing.fsdp``)."""
        if number != self.stream:
            self.stream = number
            self.events.append(("stream", number))

    @contextmanager
    def naming(self, name: str, role: Role, op: str):
        """What is allocated in the block is ``name`` in ``role``, made by ``op`` (FSDP's
        buffers: torch's code, with no line of the user's to name them by)."""
        before, self.given = self.given, (name, role, op)
        try:
            yield
        finally:
            self.given = before

    def adopt(self, t: torch.Tensor, part: Component, located: bool = True) -> None:
        """Track ``t``'s storage as ``part`` (named after the calling line unless not
        ``located``) until it dies; a storage already tracked, or of 0 bytes, is left alone."""
        storage = local(t).untyped_storage()
        key = storage._cdata
        if key in self.dead:  # its last storage died in this op, and this one took its place
            self.collect_frees()
        if key in self.refs or storage.nbytes() == 0:
            return
        where, code = _where() if located else ("", "")
        name = f"{part.name} ({where})" if located else part.name
        role = Role.recomputed if located and _recomputing(part.role) else part.role
        named = part.model_copy(update={"name": name, "source": code, "role": role,
                                        "bytes": storage.nbytes()})
        note = self.dead.append
        self.refs[key] = weakref.ref(storage, lambda _, key=key: note(key))
        self._alloc(key, named)

    def _alloc(self, key: int, named: Component) -> None:
        """Allocate a tracked storage's block on the current stream, and log it."""
        self.order[key] = len(self.events)
        self.ledger.alloc(key, named, self.stream)
        self.events.append(("alloc", key, self.ledger.live[key].component))

    def resized(self, t: torch.Tensor, named: Component | None = None) -> None:
        """``t``'s storage resized in place (``storage.resize_``, which no dispatch mode
        sees: FSDP frees and re-allocates its unsharded parameters so,
        ``_fsdp_param.free_storage``/``alloc_storage``): its block freed at 0 bytes, a new
        one allocated, named ``named``, when it grows again."""
        self.collect_frees()
        storage = local(t).untyped_storage()
        key = storage._cdata
        if storage.nbytes() == 0 and key in self.ledger.live:
            self.ledger.free(key)
            self.events.append(("free", key))
        elif storage.nbytes() and key not in self.ledger.live and named is not None:
            if key not in self.refs:
                note = self.dead.append
                self.refs[key] = weakref.ref(storage, lambda _, key=key: note(key))
            self._alloc(key, named.model_copy(update={"bytes": storage.nbytes()}))

    def relabel(self, t: torch.Tensor, **update) -> None:
        """Give ``t``'s tracked storage another name, role or op (``update``: Component
        fields), in the ledger and in the event log a program is made from."""
        key = local(t).untyped_storage()._cdata
        if key not in self.ledger.live:
            return
        live = self.ledger.live[key]
        live.component = live.component.model_copy(update=update)
        live.role = live.component.role
        self.events[self.order[key]] = ("alloc", key, live.component)

    @contextmanager
    def quiet(self):
        """Ops run here allocate nothing the tracer sees (stand-ins for kernel tensors
        that ``adopt`` then tracks under the model's names)."""
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    def mark(self, what: str) -> None:
        """Note a protocol point (a counter read) in the event log, after pending frees."""
        self.collect_frees()
        self.events.append(("mark", what))


def component(name: str, role: Role, op: str, shape: tuple, dtype: str, nbytes: int) -> Component:
    """A traced allocation (its block is set by the ledger)."""
    return Component(name=name, role=role, op=op, shape=tuple(shape), dtype=dtype,
                     bytes=nbytes, allocated=0)


def is_mask_add(func, args) -> bool:
    """``add.Tensor(scores, mask)`` whose result has the scores' shape and dtype: what the
    first add of a math SDPA call with a mask is."""
    return (func is torch.ops.aten.add.Tensor and isinstance(args[0], torch.Tensor)
            and isinstance(args[1], torch.Tensor)
            and torch.broadcast_shapes(args[0].shape, args[1].shape) == args[0].shape
            and torch.result_type(args[0], args[1]) == args[0].dtype)


class MathSdpa(TorchFunctionMode):
    """Counts the math SDPA calls with a mask (every SDPA call takes the math backend on the
    meta device), whose add the tracer makes in place. With a GPU's code paths the SDPA rule
    of ``memcalc.tracing.cuda_paths`` counts them instead, as it picks the backend."""

    def __init__(self, tracer: Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            masked = len(args) > 3 and args[3] is not None or kwargs.get("attn_mask") is not None
            causal = len(args) > 5 and args[5] or kwargs.get("is_causal", False)
            self.tracer.mask_adds += bool(masked or causal)
        return call_within(self, func, types, args, kwargs)


def call_within(mode: TorchFunctionMode, func, types, args, kwargs):
    """``func`` run with ``mode`` active for the calls it makes. A torch-function mode is
    popped while its handler runs, so a torch function written in Python
    (``F.multi_head_attention_forward``, ``Tensor.backward``: the whole backward pass,
    activation checkpointing's recomputation included) would run every inner call unseen;
    ``torch.overrides.redispatch_function`` (torch 2.13) skips only the call at hand. Older
    releases lack it: there the inner calls of such functions stay unseen. A builtin's inner
    calls are C++, below every torch-function mode, and it is called as it is (some, such
    as ``torch._C._set_grad_enabled``, do not take the skip)."""
    kwargs = kwargs or {}
    redispatch = getattr(torch.overrides, "redispatch_function", None)
    if redispatch is None or not inspect.isfunction(func):
        return func(*args, **kwargs)
    if _reentered(func, args):
        return _c_method(func, args, kwargs)
    running = _redispatched()
    running.append((func, _first(args)))
    try:
        with mode:
            return redispatch(func, types, args, kwargs)
    finally:
        running.pop()


_THREAD = threading.local()


def _redispatched() -> list[tuple]:
    """``(function, its first argument)`` of each Python torch function this thread runs
    under ``call_within``, innermost last."""
    if not hasattr(_THREAD, "running"):
        _THREAD.running = []
    return _THREAD.running


def _first(args):
    return args[0] if args else None


def _reentered(func, args) -> bool:
    """Whether this call is the C++ method under a Python ``Tensor`` method asking the modes
    again: ``Tensor.unflatten`` (``torch/_tensor.py``) checks for torch functions, then calls
    ``super().unflatten``, whose C++ check names the Python method again
    (``torch/csrc/utils/python_arg_parser.cpp`` looks the override up on ``torch.Tensor``);
    redispatched again it would recurse without end (``nn.MultiheadAttention``'s
    ``unflatten``)."""
    running = _redispatched()
    return bool(running) and running[-1][0] is func and running[-1][1] is _first(args)


def _c_method(func, args, kwargs):
    """The re-entered call run below every torch-function mode: it is the C++ op itself,
    whose work the dispatch modes (the tracer) still see, and the modes have already
    handled it once under its Python name."""
    with torch._C.DisableTorchFunction():
        return func(*args, **kwargs)


class TracerProbe:
    """The counters of ``harness.Probe``, read from a tracer's allocator model. It also
    keeps what a live GPU cannot tell: the live set behind each counter it reads."""

    def __init__(self, tracer: Tracer):
        self.tracer = tracer
        self.allocator = tracer.ledger.allocator
        self.start: set = set()  # live keys when the phase running started
        # each measured phase's peak and the live set there (a phase measured again, a
        # micro-step, keeps the higher; the first of equals)
        self.peaks: dict[str, tuple[int, tuple[Component, ...]]] = {}
        self.grads: set[int] = set()  # ids of the temporaries a backward left alive
        self.leaves: tuple = ()  # (name, tensor) of the leaves that need grad: q, a weight
        self.output_key = None
        self.phase_start = 0  # the event log's length when the running phase started
        # compiled code's recomputed buffers in the backward whose peak is kept (None: no
        # compiled code ran)
        self.recomputed: tuple[Component, ...] | None = None

    def allocated(self) -> int:
        self.tracer.mark("allocated")
        return self.allocator.allocated

    def max_allocated(self) -> int:
        self.tracer.mark("max_allocated")
        peak, phase = self.allocator.peak_allocated, self.tracer.phase
        if phase == "backward":  # what it leaves alive are the leaf grads
            self._name_grads()
            self.grads = {id(c) for c in self.tracer.ledger.components()
                          if c.role is Role.temporary}
        if peak > self.peaks.get(phase, (-1,))[0]:
            self.peaks[phase] = (peak, self.tracer.ledger.peak_live)
            if phase == "backward" and GENERATED:
                self.recomputed = self._recomputed()
        return peak

    def _recomputed(self) -> tuple[Component, ...]:
        """What the running phase allocated as ``Role.recomputed``, in order."""
        return tuple(event[2] for event in self.tracer.events[self.phase_start:]
                     if event[0] == "alloc" and event[2].role is Role.recomputed)

    def _name_grads(self) -> None:
        """Call each leaf's grad after it, keeping the node that made it
        (``c_attn.weight.grad (AddmmBackward0)``), before the peak's live set is read."""
        live = self.tracer.ledger.live
        for name, t in self.leaves:
            key = local(t.grad).untyped_storage()._cdata if t.grad is not None else None
            if key in live and live[key].role is Role.temporary:
                where = located_name(live[key].component.name)[1]
                self.tracer.relabel(t.grad, name=f"{name}.grad ({where})" if where
                                    else f"{name}.grad")

    def max_reserved(self) -> int:
        return self.allocator.peak_reserved

    def reset_peak(self, phase: str = "") -> None:
        """Reset the peak where the protocol's measured ``phase`` starts (``forward``,
        ``backward``, ``optimizer``), which the event log and the ledger's history mark
        (for programs and plots)."""
        self.tracer.mark(f"reset_peak {phase}")
        self.tracer.phase = phase
        self.tracer.ledger.phase(phase)
        self.tracer.ledger.reset_peak()
        self.start = set(self.tracer.ledger.live)  # a forward's: a0, what it saves is not
        self.phase_start = len(self.tracer.events)

    def block_bytes(self, tensor) -> int:
        """Block of ``out``, read right after the forward: the moment to note what the
        forward left alive besides it (``saved_bytes`` counts exactly these)."""
        key = self.output_key = tensor.untyped_storage()._cdata
        live = self.tracer.ledger.live
        self.output = live[key].component
        self.saved = tuple(v.component for k, v in live.items()
                           if k not in self.start and k != key)
        return self.tracer.ledger.block_bytes(key)


_PLACE = re.compile(r"(?:^| at )([^\s()]+:\d+)$")


def user_place(name: str) -> str:
    """``gpt.py:27``, the user's line, of a tracked component named ``addmm (gpt.py:27)``
    or, made by compiled code, ``empty_strided (buf4 by addmm at gpt.py:27)``; ``""``
    where it has none (a resident tensor, an autograd node's)."""
    where = name.rpartition(" (")[2].removesuffix(")") if " (" in name else ""
    found = _PLACE.search(where)
    return found.group(1) if found else ""


def located_name(name: str) -> tuple[str, str]:
    """``("addmm", "gpt.py:27")`` of a tracked component's ``"addmm (gpt.py:27)"``; a
    resident tensor's name (``c_attn.weight``) has no place: ``(name, "")``."""
    what, sep, where = name.partition(" (")
    return (what, where.removesuffix(")")) if sep else (name, "")


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding ``t``'s storage: a DTensor's local shard (FSDP's sharded
    parameters and grads, an optimizer's state of them), else ``t``."""
    return getattr(t, "_local_tensor", t)


_FAKE = torch._C._TorchDispatchModeKey.FAKE


def _subclass(types) -> str | None:
    """``DTensor`` or ``FakeTensor`` when an op's arguments hold one (by class name:
    neither module is imported for a trace that has none), else None; ``FakeTensor`` too
    for a factory op (no tensor arguments) under a ``FakeTensorMode``, which DTensor's
    sharding propagation runs (its fake tensors' meta storage is not the step's)."""
    for t in types:
        name = t.__name__
        if name in ("DTensor", "FakeTensor"):
            return name
    if not types and torch._C._get_dispatch_mode(_FAKE) is not None:
        return "FakeTensor"
    return None


def _thread() -> str:
    """``autograd`` inside a backward pass (the engine's device thread on CUDA), else ``main``."""
    return "autograd" if torch._C._current_graph_task_id() != -1 else "main"


class CompiledLine(NamedTuple):
    """A line of code a compiler generated, as its compiler named it."""

    where: str  # the buffer, the kernel and the user's line: buf4 by triton_poi_... at m.py:30
    code: str  # the user's code on that line
    recomputed: bool = False  # a backward's kernel recomputing forward values (not saved)


# code a compiler generated, by file path: line number -> its ``CompiledLine``
# (``memcalc/compiling/wrapper.py``)
GENERATED: dict[str, dict[int, CompiledLine]] = {}
_UNNAMED = CompiledLine("compiled", "")


def _compiled_line(depth: int = 3) -> CompiledLine | None:
    """The line of generated code (``GENERATED``) the op was called from, if any."""
    if not GENERATED:
        return None
    frame = sys._getframe(depth)
    while frame is not None and frame.f_code.co_filename not in GENERATED:
        frame = frame.f_back
    if frame is None:
        return None
    return GENERATED[frame.f_code.co_filename].get(frame.f_lineno, _UNNAMED)


def _recomputing(role: Role) -> bool:
    """Whether a tensor in ``role`` made now is a compiled backward's recomputation of
    forward values (a kernel's scratch too; not a cuBLAS workspace, the thread's own)."""
    return role is not Role.workspace and _thread() == "autograd" and \
        getattr(_compiled_line(), "recomputed", False)


def _where() -> tuple[str, str]:
    """Where an op was called from: ``(file:line, code)`` of the innermost frame outside
    torch and this harness, or ``(autograd node, "")`` in backward, which has no user frame;
    a line of compiled code (``GENERATED``) as its compiler named it, in backward too."""
    compiled = _compiled_line()
    if compiled is not None:
        return compiled[:2]
    if _thread() == "autograd":
        node = torch._C._current_autograd_node()
        return (node.name() if node is not None else "autograd"), ""
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path == _HARNESS:  # the protocol's own call (the backward's seed, --loss sum)
            return "protocol", ""
        if _is_user_code(path) or path.startswith(_OPTIM_DIR):  # the optimizer's step
            code = linecache.getline(path, frame.f_lineno).strip()
            return f"{os.path.basename(path)}:{frame.f_lineno}", code
        frame = frame.f_back
    return "?", ""


def run_traced(config: Config, fn: Callable, tracer: Tracer, probe: TracerProbe,
               state: tuple = (), out_like: tuple | None = None,
               inputs: tuple[Input, ...] = QKV, loop: Loop = Loop()) -> Measured:
    """The protocol for ``fn`` on the meta device, under ``tracer`` (and, when the tracer
    has CUDA paths, their torch-function rules). ``state``: ``(name, tensor, role)`` the
    function keeps resident (a module's parameters and buffers), counted from the start;
    ``out_like``: ``grad_out``'s ``(shape, dtype)`` when not q's; ``inputs``: what ``fn``
    is called with, in order (``q, k, v`` by default); ``loop``: the training loop's
    optimizer and micro-steps, if any."""
    proto = config.protocol
    with deferred(), tracer, function_modes(tracer), loop.running():
        for name, t, role in state:  # a DTensor's: its local shard's shape
            tracer.adopt(t, component(name, role, "resident", tuple(local(t).shape),
                                      str(t.dtype).removeprefix("torch."), 0), located=False)
        made = make_inputs(torch, config.dims, "meta", inputs, out_like)
        _name_inputs(tracer, made, inputs, config.dims)
        tracer.mark("inputs")  # the warm-up step starts here
        parameters = trained(state)
        probe.leaves = parameters + tuple((i.name, t) for i, t in zip(inputs, made.leaves)
                                          if t.requires_grad)
        measured = run_protocol(torch, fn, probe, made, proto.forward_only,
                                tuple(t for _, t in parameters),
                                loop.training(parameters, tracer))
        del made
    return measured


def function_modes(tracer: Tracer):
    """The torch-function layer a trace runs under: the GPU's code paths (``tracer.paths``,
    CUDA's autocast included) or, on the meta device's own paths, the math SDPA calls'
    count (``MathSdpa``)."""
    if tracer.paths is None:
        return MathSdpa(tracer)
    tracer.paths.tracer = tracer
    return tracer.paths.mode()


def output_of(config: Config, fn: Callable, tracer: Tracer,
              inputs: tuple[Input, ...] = QKV) -> tuple[tuple[int, ...], str]:
    """``(shape, dtype name)`` of what ``fn`` returns for ``inputs``, from one forward under
    ``no_grad`` on the meta device, along ``tracer``'s code paths (a scratch tracer: what
    it records is not read)."""
    with deferred(), tracer, function_modes(tracer):
        made = make_inputs(torch, config.dims.replace(forward_only=True), "meta", inputs)
        with torch.no_grad():
            out = fn(*made.leaves)
        return tuple(out.shape), str(out.dtype).removeprefix("torch.")


def _name_inputs(tracer: Tracer, made, inputs: tuple[Input, ...], d) -> None:
    """Call the protocol's inputs by their names, in the role ``input``, made by their fill
    (``randn``: the meta device makes them with ``empty``), not by the line that made them."""
    names = [(i.name, i.filled(d)) for i in inputs] + [("grad_out", "randn")]
    for (name, fill), t in zip(names, (*made.leaves, made.grad_out)):
        if t is not None:
            tracer.relabel(t, name=name, source="", role=Role.input, op=fill)


def measure(config: Config, fn: Callable, capacity: int | None = None,
            paths=None, state: tuple = (), out_like: tuple | None = None,
            tracer: Tracer | None = None, inputs: tuple[Input, ...] = QKV,
            loop: Loop = Loop()) -> Breakdown:
    """Run the protocol for ``config`` on the meta device and read the breakdown off the
    trace of ``fn`` (``fn(q, k, v)`` unless ``inputs`` says otherwise). With
    ``capacity``, the allocator model raises ``OutOfMemory`` where the device would.
    ``paths`` (``memcalc.tracing.cuda_paths.CudaPaths``): follow a GPU's code paths;
    ``state``, ``out_like``, ``inputs``, ``loop``: see ``run_traced``; ``tracer``: a
    tracer to run under (to read its history afterwards)."""
    tracer = tracer or Tracer(config.workspace_bytes, capacity, paths, gpu_of(config.dims),
                              config.protocol.allocator)
    probe = TracerProbe(tracer)
    measured = run_traced(config, fn, tracer, probe, state, out_like, inputs, loop)
    relabel = _roles(probe)
    live = {phase: relabel(probe.peaks.get(phase, (0, ()))[1])
            for phase in ("forward", "backward", "optimizer")}
    result = Breakdown(config=config, forward_live=live["forward"],
                       backward_live=live["backward"], optimizer_live=live["optimizer"],
                       saved=relabel(probe.saved), recomputed=probe.recomputed,
                       reserved_peak_bytes=measured.reserved_peak_bytes)
    _check_consistent(result, measured)
    return result


def _roles(probe: TracerProbe) -> Callable:
    """Roles the trace only knows once a phase ends: what the forward left alive is saved,
    the output is the output, and what the backward left alive are the leaf grads."""
    # FSDP's unsharded parameters and buffers keep their roles past the forward
    roles = {id(c): Role.saved for c in probe.saved if c.role not in FSDP_ROLES}
    roles[id(probe.output)] = Role.output
    roles.update({key: Role.gradient for key in probe.grads})

    def relabel(components):
        return tuple(c.model_copy(update={"role": roles[id(c)]}) if id(c) in roles else c
                     for c in components)

    return relabel


FSDP_ROLES = (Role.unsharded, Role.collective, Role.gradient)


def _check_consistent(result: Breakdown, measured: Measured) -> None:
    """The live sets must add up to the counters the protocol read."""
    for name in ("saved_bytes", "forward_peak_bytes", "backward_peak_bytes",
                 "optimizer_peak_bytes"):
        if getattr(result, name) != getattr(measured, name):
            raise AssertionError(f"trace bookkeeping: {name} {getattr(result, name)} "
                                 f"!= counter {getattr(measured, name)}")


