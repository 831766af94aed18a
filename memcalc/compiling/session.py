"""What a compiled trace switches on while it runs, and ``torch.compile`` as traced code
calls it (``compile``).

``session()`` holds for the whole trace: inductor's and AOTAutograd's caches off (a cached
graph would skip the lowering the trace must see, and a module made runnable on meta must
not be found by a later real compilation), the backward compiled with the forward (not at
the first backward, inside the trace's autograd), triton kernels left uncompiled and
inductor's wrappers run on meta (``wrapper.py``).

``compile(model, options)`` is ``torch.compile`` with the trace's backend
(``backend.py``): the returned model runs its compiled code under the trace's dispatch mode
(the tracer declares ``ignore_compile_internals``, so dynamo switches the mode off while it
compiles and on again for the compiled code, ``torch/utils/_python_dispatch.py``) and
without the trace's torch-function modes, which dynamo would otherwise trace into the graph;
each call is compiled for the preset GPU (``device.py``).
"""

from __future__ import annotations

import functools
import os
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar

import torch

from memcalc.compiling import backend, device, live, wrapper
from memcalc.tracing.errors import NotModelled

_GENERATED: ContextVar[wrapper.Generated | None] = ContextVar("memcalc_generated", default=None)
_PATHS: ContextVar[object] = ContextVar("memcalc_compile_paths", default=None)
# torch._functorch.config.activation_memory_budget for the trace's compilations (None: torch's)
_ACTIVATION_BUDGET: ContextVar[float | None] = ContextVar("memcalc_activation_budget",
                                                          default=None)
# the graph breaks dynamo met in the trace: (where, why)
_BREAKS: ContextVar[list | None] = ContextVar("memcalc_graph_breaks", default=None)
# opens the session where a model compiled in an earlier trace (a file imported once) runs
_OPEN: ContextVar[object] = ContextVar("memcalc_compile_open", default=None)
# closes the open session, if one is (a live run's code must not run in it: ``live_run``)
_CLOSE: ContextVar[object] = ContextVar("memcalc_compile_close", default=None)

# what torch.compile takes that memcalc follows, and why the rest is refused
_MODES = (None, "default")
_REFUSED_MODES = {
    "reduce-overhead": "CUDA graphs keep their own memory pool, which memcalc does not model",
    "max-autotune": "autotuning picks kernels by timing them, which needs the GPU, and uses "
                    "CUDA graphs",
    "max-autotune-no-cudagraphs": "autotuning picks kernels (triton templates or cuBLAS) by "
                                  "timing them, which needs the GPU"}


def _configs(stack: ExitStack) -> None:
    """The compiler settings a trace runs under."""
    import torch._dynamo.config as dynamo
    import torch._functorch.config as functorch
    import torch._inductor.config as inductor

    stack.enter_context(inductor.patch(compile_threads=1, fx_graph_cache=False,
                                       fx_graph_remote_cache=False,
                                       autotune_local_cache=False))
    stack.enter_context(functorch.patch(enable_autograd_cache=False,
                                        force_non_lazy_backward_lowering=True))
    if _ACTIVATION_BUDGET.get() is not None:
        stack.enter_context(functorch.patch(activation_memory_budget=_ACTIVATION_BUDGET.get()))
    # a compiled model called at many shapes (an oom search, a sweep) recompiles for each,
    # and with grad and without (the scratch forward): no limit, and never a silent fall
    # back to eager code
    stack.enter_context(dynamo.patch(recompile_limit=1 << 30,
                                     accumulated_recompile_limit=1 << 30,
                                     fail_on_recompile_limit_hit=True))


@contextmanager
def session():
    """Inside, ``torch.compile`` in traced code compiles for the trace; yields the
    ``wrapper.Generated`` sources it writes."""
    import torch._dynamo
    import torch._inductor.compile_fx  # noqa: F401 (before the trace defers imports)

    generated = wrapper.Generated()
    torch._dynamo.reset()
    token = _GENERATED.set(generated)
    try:
        with ExitStack() as stack:
            _configs(stack)
            stack.enter_context(wrapper.loading(generated))
            stack.enter_context(_breaks_noted())
            stack.enter_context(_quiet_compiler())
            stack.enter_context(device.runtime())
            yield generated
    finally:
        _GENERATED.reset(token)
        torch._dynamo.reset()  # the compiled code holds wrappers made runnable on meta


@contextmanager
def calls(mode: str | None, option: str = "--compile", activation_budget: float | None = None):
    """``memcalc.tracing.compiled.calls`` for ``mode``: the traced code's torch.compile
    calls compiled by this package (``session`` opened at the first), unless ``mode`` is
    ``"eager"``; under ``"default"`` the target is compiled too. ``activation_budget``:
    the partitioner's ``activation_memory_budget`` (None: torch's default, 1.0)."""
    from memcalc.tracing.compiled import calls as traced_calls

    if mode == "eager":
        with traced_calls(mode, option):
            yield
        return
    with ExitStack() as stack:
        def opened() -> None:  # the first compile call, or compiled call, opens the session
            if _GENERATED.get() is None:
                stack.enter_context(session())

        def compiler(model, name: str, options: dict):
            if not live.running():  # a live run's code runs outside the session
                opened()
            return compile(model, name, options)
        tokens = (_OPEN.set(opened), _CLOSE.set(stack.close),
                  _ACTIVATION_BUDGET.set(activation_budget))
        try:
            with traced_calls(mode, option, compiler):
                yield
        finally:
            for var, token in zip((_OPEN, _CLOSE, _ACTIVATION_BUDGET), tokens):
                var.reset(token)


@contextmanager
def live_run():
    """Inside, the code's compiled calls run as torch compiles them on the GPU in hand, at
    the budget a trace compiles them at (``live.py``; ``validate --backend cuda``); the
    trace's session is closed first: its wrappers run on meta, its device is the preset's."""
    if _CLOSE.get() is not None:
        _CLOSE.get()()
    with live.run(_ACTIVATION_BUDGET.get()):
        yield


@contextmanager
def _quiet_compiler():
    """Inside, torch's loggers say errors only: the compiler's warnings (a checkpoint's
    ``context_fn`` under compile, no CUDA runtime for ``cpp_extension``) are about running
    it on a GPU, and carry the time they were written, which a result must not."""
    import logging

    names = ["torch", *(n for n in logging.root.manager.loggerDict if n.startswith("torch."))]
    levels = {name: logging.getLogger(name).level for name in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


@contextmanager
def _breaks_noted():
    """Inside, each graph break dynamo logs (``InstructionTranslatorBase.log_graph_break``,
    ``torch/_dynamo/symbolic_convert.py``) is noted in ``_BREAKS``."""
    from torch._dynamo.symbolic_convert import InstructionTranslatorBase

    real = InstructionTranslatorBase.log_graph_break
    token = _BREAKS.set([])

    def noted(self, code_options, reason, exc):
        _BREAKS.get().append(_break_of(self, reason, exc))
        return real(self, code_options, reason, exc)

    InstructionTranslatorBase.log_graph_break = noted
    try:
        yield
    finally:
        InstructionTranslatorBase.log_graph_break = real
        _BREAKS.reset(token)


def _break_of(translator, reason, exc) -> tuple[str, str]:
    """``(where, why)`` of one graph break: where the unsupported call is, the innermost
    frame of the exception's stack in code users write (``Unsupported.real_stack``; dynamo
    logs the break at each frame it inlined, the caller's first), and the exception's
    first line (the reason dynamo logs starts with the instruction, "a function call")."""
    from memcalc.tracing.explain import written_by_users

    stack = [f for f in getattr(exc, "real_stack", None) or () if written_by_users(f.filename)]
    if stack:
        where = f"{os.path.basename(stack[-1].filename)}:{stack[-1].lineno}, in {stack[-1].name}"
    else:
        where = f"{os.path.basename(translator.f_code.co_filename)}:{translator.lineno}"
    said = str(exc).strip() if exc is not None else ""
    lines = (said or str(reason).strip() or "no reason given").splitlines()
    hints = [line.strip() for line in lines if line.strip().startswith("Hint:")][:1]
    return where, "; dynamo's ".join([lines[0]] + [h.replace("Hint:", "hint:") for h in hints])


def _check_breaks(name: str) -> None:
    """One line for compiled code whose graph broke: the code dynamo runs between the
    graphs runs without the trace's torch-function rules (the GPU's SDPA choice, its
    autocast), and memcalc will not report that as the GPU's step."""
    breaks = _BREAKS.get()
    if breaks:
        where, why = breaks[0]
        raise NotModelled(f"torch.compile({name}): the graph breaks at {where} ({why}); "
                          f"memcalc follows whole graphs only so far (fullgraph=True code); "
                          f"--compile eager traces it uncompiled")


def check_options(name: str, options: dict) -> None:
    """One line for a ``torch.compile`` option memcalc does not follow."""
    mode, chosen = options.get("mode"), options.get("backend", "inductor")
    if mode in _REFUSED_MODES:
        raise NotModelled(f"torch.compile({name}, mode={mode!r}): {_REFUSED_MODES[mode]}; "
                          f"memcalc follows mode 'default'")
    if mode not in _MODES:
        raise NotModelled(f"torch.compile({name}, mode={mode!r}): unknown mode")
    if chosen != "inductor":
        raise NotModelled(f"torch.compile({name}, backend={chosen!r}): memcalc follows "
                          f"inductor, the default backend")
    if options.get("options"):
        raise NotModelled(f"torch.compile({name}, options=...): inductor options are not "
                          f"followed yet")


def compile(model, name: str, options: dict):
    """``torch.compile(model, **options)`` for the trace: a compiled module or function."""
    import importlib.util

    import torch._dynamo

    check_options(name, options)
    if importlib.util.find_spec("triton") is None:
        raise NotModelled(f"torch.compile({name}): following compiled code needs triton, "
                          f"inductor's code generator (pip install 'memcalc[compile]'); "
                          f"--compile eager traces it uncompiled")
    compiled = torch._dynamo.optimize(
        backend=_backend, nopython=options.get("fullgraph", False), dynamic=False)(model)
    if isinstance(compiled, torch.nn.Module):
        compiled.forward = _called(compiled.forward, name, model, options)
        compiled.__dict__["__deepcopy__"] = functools.partial(_copied, model, name, options)
        return compiled
    return _called(compiled, name, model, options)


def _copied(model, name: str, options: dict, memo: dict):
    """A deep copy of a module compiled for the trace, compiled for it too: FSDP's trace
    shards a copy of the model (``tracing/fsdp.py``), and torch rebuilds a copied
    ``OptimizedModule`` from its ``__reduce__``, with dynamo's forward, not the trace's."""
    import copy

    return compile(copy.deepcopy(model, memo), name, options)


def _backend(gm, example_inputs):
    """The trace's backend for the call running now (``_PATHS``)."""
    return backend.backend(_PATHS.get(), _GENERATED.get())(gm, example_inputs)


def _called(fn, name: str, model, options: dict):
    """``fn``, ``model`` compiled for traces, run for the trace's GPU without its
    torch-function modes, a compiler failure said in one line; in a live run outside any
    trace, ``model`` as torch compiles it for this GPU (``live.py``)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if live.running() and not _in_trace():  # validate --backend cuda: torch's own
            return live.compiled(model, options)(*args, **kwargs)
        paths = _trace_paths(name)
        _check_autocast(name)
        if _OPEN.get() is None:
            raise NotModelled(f"torch.compile({name}): called outside memcalc's compiler "
                              f"(a trace with --compile eager, or none)")
        _OPEN.get()()
        token = _PATHS.set(paths)
        try:
            with device.device(paths.gpu), _without_function_modes():
                out = fn(*args, **kwargs)
            _check_breaks(name)
            return out
        except Exception as error:  # dynamo wraps what the backend raised
            raise _one_line(error, name) from None
        finally:
            _PATHS.reset(token)
    return call


def _in_trace() -> bool:
    """Whether a trace on the GPU's code paths is running."""
    from memcalc.tracing.cuda_paths import active_paths

    try:
        active_paths("torch.compile")
    except NotModelled:
        return False
    return True


def _trace_paths(name: str):
    """The CUDA rules of the trace running now; one line outside a trace and a live run."""
    from memcalc.tracing.cuda_paths import active_paths

    try:
        return active_paths(f"torch.compile({name})")
    except NotModelled:
        raise NotModelled(f"torch.compile({name}): memcalc's compiled code runs inside a "
                          f"trace on the GPU's code paths (not with --meta-paths), or in the "
                          f"live run of validate --backend cuda") from None


def _check_autocast(name: str) -> None:
    """One line for a compiled call under CUDA autocast: AOTAutograd traces the graph on
    meta tensors, which CUDA's autocast does not cast (its dispatch key is CUDA's), so the
    compiled graph would run in the parameters' dtypes."""
    from memcalc.tracing.autocast import enabled

    if enabled():
        raise NotModelled(f"torch.compile({name}) under autocast: not followed yet (the "
                          f"graph is traced on the meta device, which CUDA's autocast does not "
                          f"cast); --param-dtype casts the model instead, --compile eager "
                          f"traces it uncompiled")


@contextmanager
def _without_function_modes():
    """The torch-function mode stack emptied for the block, put back after."""
    stack = []
    while torch._C._len_torch_function_stack() > 0:
        stack.append(torch._C._pop_torch_function_stack())
    try:
        yield
    finally:
        for mode in reversed(stack):
            torch._C._push_on_torch_function_stack(mode)


def _one_line(error: Exception, name: str) -> Exception:
    """The exception to raise for a failed compiled call: memcalc's own refusals as they
    are, anything from the compiler as one line naming the call."""
    inner = error
    while getattr(inner, "inner_exception", None) is not None:
        inner = inner.inner_exception
    if isinstance(inner, (NotModelled, KeyboardInterrupt)):
        return inner
    if isinstance(error, NotModelled):
        return error
    first = str(inner).strip().splitlines()[0] if str(inner).strip() else ""
    return NotModelled(f"torch.compile({name}): the compiler stopped: "
                       f"{type(inner).__name__}: {first}")
