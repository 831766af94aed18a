"""Inductor's generated wrapper, run on meta tensors under the trace.

Inductor writes a Python module per compiled graph (``torch/_inductor/codegen/wrapper.py``):
its ``call`` allocates each buffer with ``empty_strided_cuda``, launches triton kernels,
calls fallback kernels (``extern_kernels.mm(..., out=buf)``, the SDPA ops), reuses buffers
(``buf3 = reinterpret_tensor(buf1, ...); del buf1  # reuse``) and frees them (``del``).
``loading()`` makes that module runnable here: its triton kernels are never compiled (a
kernel launch allocates nothing, so a stand-in that does nothing takes its place), and
``empty_strided_cuda`` makes a meta tensor, which the trace's dispatch mode sees as the
allocation it is. The rest (fallback kernels, views, frees) runs as written.
Each module's source is kept (``Generated``) for the result's attribution and its tests.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from memcalc.tracing.tracer import CompiledLine

@dataclass
class Generated:
    """The wrapper modules a trace's compilations wrote, by file path, and where each line
    of one comes from (``lines``: line number -> ``(where, code)``, for the trace's names)."""

    sources: dict[str, str] = field(default_factory=dict)
    lines: dict[str, dict[int, CompiledLine]] = field(default_factory=dict)
    last: str = ""

    def add(self, path: str) -> None:
        with open(path) as f:
            self.sources[path] = f.read()
        self.last = path

    def describe(self, path: str, origins: dict[str, tuple[str, str]],
                 recomputed: frozenset[str] = frozenset()) -> None:
        """Name ``path``'s lines from its graph's nodes (``origins``: FX node name ->
        the user's ``(file:line, code)``; ``recomputed``: the forward nodes a backward
        recomputes), and register them with the tracer."""
        from memcalc.tracing import tracer

        self.lines[path] = attribution(self.sources[path], origins, recomputed)
        tracer.GENERATED[path] = self.lines[path]


_ALLOCATION = re.compile(r"^\s*(buf\d+) = empty_strided_cuda\(")
_REUSED = re.compile(r"^\s*(buf\d+) = reinterpret_tensor\((buf\d+),.*# reuse")
_NODES = re.compile(r"# Topologically Sorted Source Nodes: \[(.*?)\]")
_CALLED = re.compile(r"(\w+)\.run\(|extern_kernels\.(\w+)\(|torch\.ops\.\w+\.(\w+)\.")


def attribution(source: str, origins: dict[str, tuple[str, str]],
                recomputed: frozenset[str] = frozenset()) -> dict[int, CompiledLine]:
    """Each line of a wrapper's ``call`` as a ``CompiledLine``: a buffer's allocation named
    by the buffer, the kernel that first writes it, and the user's line it computes
    (``buf4 by triton_poi_fused_gelu_1 at model.py:30``); any other line by the kernel
    it runs and the user's line. A kernel of a backward that computes only forward nodes
    the partitioner chose to recompute (``recomputed``) is marked so (its buffers' role)."""
    lines = source.splitlines()
    named: dict[int, CompiledLine] = {}
    for number, text in enumerate(lines, 1):
        allocated = _ALLOCATION.match(text)
        kernel, nodes = _writer(lines, number, allocated.group(1) if allocated else None)
        at = _origin(nodes, origins)
        label = f"{allocated.group(1)} by {kernel}" if allocated else kernel
        named[number] = CompiledLine(f"{label} at {at[0]}" if at[0] else label, at[1],
                                     bool(nodes) and all(name in recomputed for name in nodes))
    return named


def _writer(lines: list[str], number: int, buffer: str | None) -> tuple[str, list[str]]:
    """The kernel that writes ``buffer`` (allocated on line ``number``, 1-based; None: the
    kernel on that line itself), and the FX nodes it computes."""
    pattern = re.compile(rf"\b{buffer}\b") if buffer else None
    for index in range(number - 1, len(lines) if buffer else number):
        reused = _REUSED.match(lines[index])
        if reused and pattern is not None and reused.group(2) == buffer:  # buffer, renamed
            buffer = reused.group(1)
            pattern = re.compile(rf"\b{buffer}\b")
            continue
        called = _CALLED.search(lines[index])
        if called and (pattern is None or pattern.search(lines[index])):
            return next(g for g in called.groups() if g), _nodes(lines, index)
    return "inductor", []


def _nodes(lines: list[str], index: int) -> list[str]:
    """The FX nodes of the source-nodes comment just above line ``index`` (0-based)."""
    for above in range(index, max(index - 4, -1), -1):
        nodes = _NODES.search(lines[above])
        if nodes:
            return nodes.group(1).split(", ")
    return []


def _origin(nodes: list[str], origins: dict) -> tuple[str, str]:
    """The user's line of the last of ``nodes`` that has one."""
    for name in reversed(nodes):
        if origins.get(name, ("", ""))[0]:
            return origins[name]
    return "", ""


def user_line(stack_trace: str | None) -> tuple[str, str]:
    """``(file:line, code)`` of the last frame of an FX node's ``stack_trace``."""
    found = re.findall(r'File "([^"]+)", line (\d+)[^\n]*\n\s*([^\n]*)', stack_trace or "")
    if not found:
        return "", ""
    path, line, code = found[-1]
    return f"{os.path.basename(path)}:{line}", code.strip()


class _Kernel:
    """A triton kernel that is never compiled: its launch does nothing."""

    def __init__(self, name: str):
        self.name = name

    def run(self, *args, **kwargs) -> None:
        return None

    def __getitem__(self, grid):  # kernel[grid](...) launches
        return self.run


def empty_strided_meta(size, stride, dtype) -> torch.Tensor:
    """``empty_strided_cuda`` (``torch/csrc/dynamo/guards.cpp``) on the meta device."""
    return torch.empty_strided(size, stride, dtype=dtype, device="meta")


# the wrapper's checks of its inputs' and fallback outputs' layouts: memcalc's models of a
# fused kernel (``memcalc/impls``) give its outputs' bytes, not always the strides the
# kernel's meta function promises (a cuDNN attention backward's grads), so they are not run
_CHECKS = ("assert_size_stride", "assert_size_stride_grouped", "assert_tensor_metadata",
           "assert_alignment")


def _unchecked(*args, **kwargs) -> None:
    return None


def _runnable(module) -> None:
    """Point a loaded wrapper module's allocator and stream at the meta device, its layout
    checks at nothing (``_CHECKS``)."""
    module.empty_strided_cuda = empty_strided_meta
    module.get_raw_stream = lambda index: 0
    for name in _CHECKS:
        if hasattr(module, name):
            setattr(module, name, _unchecked)


@contextmanager
def loading(generated: Generated):
    """Inside, inductor's triton kernels are stand-ins and the wrapper modules it loads
    allocate on meta; their sources go to ``generated``."""
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.codecache import PyCodeCache

    real_triton, real_load = AsyncCompile.triton, PyCodeCache.__dict__["load_by_key_path"]

    def load(cls, key, path, *args, **kwargs):
        module = real_load.__func__(cls, key, path, *args, **kwargs)
        if hasattr(module, "empty_strided_cuda"):
            _runnable(module)
            generated.add(path)
        return module

    AsyncCompile.triton = lambda self, name, source, *args, **kwargs: _Kernel(name)
    PyCodeCache.load_by_key_path = classmethod(load)
    try:
        yield
    finally:
        AsyncCompile.triton = real_triton
        PyCodeCache.load_by_key_path = real_load
        _forget(PyCodeCache, generated)


def _forget(cache, generated: Generated) -> None:
    """Drop the modules made runnable on meta from inductor's module cache, so that a real
    compilation later in the same process loads its own."""
    import sys

    from memcalc.tracing import tracer

    for path in generated.sources:
        tracer.GENERATED.pop(path, None)
        module = cache.modules_no_attr.pop(path, None)
        if module is not None and sys.modules.get(module.__name__) is module:
            del sys.modules[module.__name__]
