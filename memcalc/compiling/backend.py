"""The ``torch.compile`` backend a compiled trace uses: inductor's own (``compile_fx``),
with the graphs moved to CUDA before inductor's passes (``graphs.py``).

Two things differ from ``backend="inductor"``, both because the graph is traced on meta:

* ``F.scaled_dot_product_attention`` takes the fused kernel a GPU would take (and fp16
  softmax to float32 and training dropout take CUDA's branches of their composites). Its composite
  (``aten/src/ATen/native/transformers/attention.cpp``) asks the device which backend to
  run; on meta the answer is the math one. While AOTAutograd traces, the call goes to
  memcalc's CUDA rule (``memcalc/tracing/cuda_paths.py``), which selects the backend as
  ``sdp_utils.cpp`` does and calls that kernel's aten op, which inductor then runs as a
  fallback kernel, as it does on a GPU.
* The joint graph is moved to CUDA before ``_recursive_joint_graph_passes``
  (``torch/_inductor/compile_fx.py``), and each partitioned graph's example inputs before
  ``compile_fx_inner``.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from memcalc.compiling import graphs, wrapper


def _names(node) -> list[str]:
    """The names inductor's comments may give ``node`` by: its own, and those of the
    nodes it came from (the dynamo graph's ``linear``, ``layer_norm``)."""
    names = [node.name, *(name for name, _ in node.meta.get("source_fn_stack", []))]
    sources = list(node.meta.get("from_node", []))
    while sources:
        source = sources.pop()
        names.append(source.name)
        sources.extend(getattr(source, "from_node", []))
    return names


def _recomputed(gm, kwargs) -> frozenset[str]:
    """In a backward graph, the names of the forward nodes the partitioner placed there to
    recompute (tagged ``is_forward``: ``torch/_functorch/partitioners.py``)."""
    if not kwargs.get("is_backward"):
        return frozenset()
    return frozenset(name for n in gm.graph.nodes
                     if n.meta.get("partitioner_tag") == "is_forward" for name in _names(n))


def _inner(generated):
    """``compile_fx_inner`` with the example inputs on CUDA, as the graph now is; the
    wrapper it writes described in ``generated`` by the graph's nodes."""
    def inner(gm, example_inputs, **kwargs):
        from torch._guards import detect_fake_mode
        from torch._inductor.compile_fx import compile_fx_inner

        moved = graphs.cuda_inputs(detect_fake_mode(example_inputs), example_inputs)
        origins = {name: wrapper.user_line(n.meta.get("stack_trace"))
                   for n in gm.graph.nodes for name in _names(n)}
        compiled = compile_fx_inner(gm, moved, **kwargs)
        generated.describe(generated.last, origins, _recomputed(gm, kwargs))
        return compiled
    return inner


@contextmanager
def _joint_passes_on_cuda():
    """Inside, inductor's joint-graph passes get the graph moved to CUDA."""
    import torch._inductor.compile_fx as compile_fx

    real = compile_fx._recursive_joint_graph_passes

    def passes(gm, *args, **kwargs):
        graphs.to_cuda(gm)
        kwargs["input_device"] = graphs.CUDA
        return real(gm, *args, **kwargs)

    compile_fx._recursive_joint_graph_passes = passes
    try:
        yield
    finally:
        compile_fx._recursive_joint_graph_passes = real


class _GpuComposites(TorchFunctionMode):
    """While AOTAutograd traces, the composites whose CUDA branch differs from the meta
    device's take CUDA's (``memcalc/tracing/cuda_paths.py``): SDPA's backend choice, fp16
    softmax to float32 (``half_to_float``), training dropout as ``native_dropout`` (a bool
    mask, which inductor's decomposition then generates). Nothing is tracked: the trace's
    tracer is not running while the compiler traces (a math-backend SDPA's in-place mask
    add is the eager trace's count, kept apart)."""

    def __init__(self, paths):
        super().__init__()
        self.paths = dataclasses.replace(paths, tracer=SimpleNamespace(mask_adds=0))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from memcalc.tracing import cuda_paths
        from memcalc.tracing.tracer import call_within

        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return cuda_paths.sdpa(self.paths, func, args, kwargs)
        if func in _SOFTMAXES:
            return cuda_paths.half_to_float(self.paths, func, args, kwargs)
        fused = cuda_paths.fused_dropout_of(func, args, kwargs) if func in _DROPOUTS else None
        if fused is not None:
            return torch.ops.aten.native_dropout(fused[0], fused[1], True)[0]
        # a torch function written in Python (F.multi_head_attention_forward, which dynamo
        # leaves whole in its graph) makes its inner calls with this mode active
        return call_within(self, func, types, args, kwargs)


_SOFTMAXES = (F.softmax, torch.softmax, torch.Tensor.softmax, F.log_softmax,
              torch.log_softmax, torch.Tensor.log_softmax)
_DROPOUTS = (F.dropout, torch.dropout)


def _real() -> bool:
    """Whether a tensor made here is a real one: no fake mode, or dispatch modes switched
    off (``no_dispatch``)."""
    python = torch._C.DispatchKey.Python
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None or \
        torch._C._dispatch_tls_local_exclude_set().has(python)


class _RealTensorsOnCpu(TorchFunctionMode):
    """Real tensors the compiler makes for CUDA, made on the CPU instead: inductor's
    constant folders (``torch/_inductor/constant_folding.py``, ``UniformValueConstantFolder``
    in ``fx_passes/joint_graph.py``) run a graph's constant nodes on real tensors to learn
    their values; there is no GPU to run them on, and the values do not depend on the
    device. A fake tensor (no fake mode active means a real one) is left alone."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda" and _real():
            kwargs = {**kwargs, "device": torch.device("cpu")}
        return func(*args, **kwargs)


@contextmanager
def _matmuls_unpadded():
    """Inside, inductor's ``pad_mm`` pass (``torch/_inductor/fx_passes/pad_mm.py``) keeps
    a matmul whose dimensions are not multiples of the alignment as it is: on a GPU it
    times the padded and the unpadded matmul and keeps the faster, which needs the GPU."""
    from torch._inductor.fx_passes import pad_mm

    real = pad_mm._should_pad
    pad_mm._should_pad = lambda *args, **kwargs: False
    try:
        yield
    finally:
        pad_mm._should_pad = real


def _shadowing_composites() -> list:
    """The ops whose Python meta kernel shadows their CompositeImplicitAutograd kernel.

    ``activate_meta`` (``torch/_meta_registrations.py``; 2.13 and 2.15 alike) registers a
    decomposition as the Python ``Meta`` kernel of every op it has one for, composite ops
    included (``nll_loss``, ``_fused_rms_norm``, ``dropout``, ...). Under the Python
    dispatcher, which AOTAutograd runs while it traces the joint graph, an op with a kernel
    of its own for ``Meta`` does not decompose above autograd on the meta device, so
    autograd has no formula for it: ``cross_entropy``'s grad came out None, and with it
    every grad before the loss (a compiled step with its loss ran its backward in the
    forward, with None for a grad). On CUDA the composite runs, and with it autograd."""
    from torch._C import DispatchKey
    from torch._decomp import global_decomposition_table

    return [op for table in global_decomposition_table.values() for op in table
            if isinstance(op, torch._ops.OpOverload) and DispatchKey.Meta in op.py_kernels
            and torch._C._dispatch_has_kernel_for_dispatch_key(op.name(),
                                                               "CompositeImplicitAutograd")]


@contextmanager
def _composites_decomposed():
    """Inside, composite ops decompose above autograd on the meta device, as they do on
    CUDA (``_shadowing_composites``); their Python meta kernels are put back after."""
    from torch._C import DispatchKey

    removed = {op: op.py_kernels.pop(DispatchKey.Meta) for op in set(_shadowing_composites())}
    for op in removed:
        op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, kernel in removed.items():
            op.py_kernels[DispatchKey.Meta] = kernel
            op._dispatch_cache.clear()


def backend(paths, generated: wrapper.Generated):
    """The backend for ``torch.compile`` under a trace following ``paths``; the wrappers
    it writes go to ``generated``."""
    def compile_graph(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        with _GpuComposites(paths), _joint_passes_on_cuda(), _composites_decomposed(), \
                _RealTensorsOnCpu(), _matmuls_unpadded():
            return compile_fx(gm, example_inputs, inner_compile=_inner(generated))
    compile_graph.__name__ = "memcalc_inductor"
    return compile_graph
