"""Bring your own attention: trace a user's function on the meta device and treat it like
a built-in implementation.

``trace(fn, config)`` runs the protocol (DESIGN.md section 1) for ``fn(q, k, v)`` on the
emulated backend and returns the same ``Breakdown`` as ``predict``, its components named by
the op that allocated them and the user's source line. It follows the code paths of the
configured GPU, not the meta device's, where they allocate differently
(``cuda_paths.py``: SDPA backend choice and fused kernels, half-to-float softmax, fused
dropout, the math backend's in-place mask add); ``grad_out`` is shaped like the function's
output (learnt from a shape-only run first); a module's parameters and buffers, and a
function's module-level tensors, are resident (``state.py``). ``traced`` adds what the trace
took or could not see (``report.Traced``).

``traced_program(fn, config)`` turns the function into a program of the kind built-in
implementations declare: it traces at a few sequence lengths, checks that the op sequence
does not change, and recovers every allocation's size as an exact polynomial in seq_len
(fitted with fractions on four lengths, verified on two more). Registered under a name
(``register_function``), the traced code then works everywhere a built-in does:
``predict``, OOM solving, sweeps.

The user's file is imported, so it runs as code: only what the user names is imported.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import traceback
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Callable

from memcalc.breakdown import Breakdown
from memcalc.config import Config
from memcalc.tensors import Cublas, Dims, Free, Program, Release, Role, Tensor
from memcalc.errors import one_line as _first_line
from memcalc.tracing.cudnn import Workspace
from memcalc.tracing.errors import NotModelled, TraceError
from memcalc.tracing.sdpa_select import Release as TorchRelease

# odd lengths sharing no padding multiple: the first four fit, the last two verify
SAMPLE_LENGTHS = (61, 97, 131, 173, 211, 257)


def load_function(spec: str) -> Callable:
    """``path/to/file.py:fn`` or ``package.module:fn``: import exactly that, return ``fn``."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise TraceError(f"--trace {spec}: expected FILE.py:FUNCTION or MODULE:FUNCTION"
                         f"{_defines(Path(spec.rstrip(':')))}")
    module = _import(target, spec)
    fn = getattr(module, name, None)
    if not callable(fn):
        from memcalc.names import did_you_mean

        known = _callables(module)
        raise TraceError(f"--trace {spec}: {target} has no function {name!r}"
                         f"{did_you_mean(name, known)}{_listing('it', known)}")
    return prepared(fn, spec)


def prepared(fn, spec: str) -> Callable:
    """What is traced of ``fn``: a function or an ``nn.Module`` instance as it is, an
    ``nn.Module`` class built with no arguments on the meta device; it must take
    ``(q, k, v)``. ``spec`` names it in an error."""
    if _is_module_class(fn):
        from memcalc.tracing.state import instantiate

        fn = instantiate(fn, spec)
    elif not callable(fn):
        raise TraceError(f"--trace {spec}: not a function or an nn.Module: "
                         f"{type(fn).__name__}")
    _check_signature(fn, spec)
    return fn


def label_of(fn) -> str:
    """A traced function's name: its qualified name, or a module instance's class's."""
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def _callables(module) -> list[str]:
    """The functions and classes ``module`` defines itself (not those it imports)."""
    return [k for k, v in vars(module).items() if not k.startswith("_") and callable(v)
            and getattr(v, "__module__", None) == module.__name__]


def _defines(path: Path) -> str:
    """``; x.py defines f, g`` for a Python file named without ``:FUNCTION``, read without
    running it (its top-level functions and classes); else ``""``."""
    import ast

    if path.suffix != ".py" or not path.is_file():
        return ""
    try:
        tree = ast.parse(path.read_text())
    except (SyntaxError, ValueError, OSError):
        return ""
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return _listing(path.name, [n.name for n in tree.body
                                if isinstance(n, kinds) and not n.name.startswith("_")])


def _listing(where: str, names: list[str]) -> str:
    return f"; {where} defines {', '.join(names)}" if names else ""


def _is_module_class(obj) -> bool:
    """An ``nn.Module`` subclass (checked without importing torch for plain functions)."""
    import sys

    nn = getattr(sys.modules.get("torch"), "nn", None)
    return isinstance(obj, type) and nn is not None and issubclass(obj, nn.Module)


def _import(target: str, spec: str):
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise TraceError(f"--trace {spec}: no file {target}")
            module_spec = importlib.util.spec_from_file_location(f"memcalc_user_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
            return module
        return importlib.import_module(target)
    except (TraceError, KeyboardInterrupt):
        raise
    except BaseException as error:  # the user's module may raise anything, SystemExit too
        raise TraceError(f"--trace {spec}: importing {target} failed: "
                         f"{type(error).__name__}: {_first_line(error)}") from None


def _check_signature(fn: Callable, spec: str) -> None:
    try:
        inspect.signature(fn).bind(None, None, None)
    except TypeError:
        raise TraceError(f"--trace {spec}: the function must accept (q, k, v)") from None
    except ValueError:  # builtins without a signature: let the call decide
        pass


def takes_causal(fn: Callable) -> bool:
    """Whether ``fn`` takes ``causal`` or ``is_causal`` (or any keyword; unknown: yes)."""
    try:
        params = inspect.signature(_called(fn)).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature
        return True
    return any(p.name in ("causal", "is_causal") or p.kind is p.VAR_KEYWORD for p in params)


def _called(fn: Callable) -> Callable:
    """What a call of ``fn`` runs: an ``nn.Module``'s ``forward`` (its ``__call__`` takes
    ``*args, **kwargs``, which read as "any keyword": ``--causal`` reached no module)."""
    return fn.forward if _is_module_class(type(fn)) else fn


def check_causal(fn: Callable, config: Config) -> None:
    """``causal`` reaches the function only through a ``causal`` or ``is_causal``
    argument: refused, not ignored, when it takes neither."""
    if config.causal and not takes_causal(fn):
        raise ValueError("causal: the function takes neither causal nor is_causal (a mask "
                         "it builds itself is traced as written)")


def bind_options(fn: Callable, config: Config) -> Callable:
    """``fn(q, k, v)`` with ``causal``/``is_causal`` passed when the function takes it."""
    params = _parameters(fn)
    options = {k: config.causal for k in ("causal", "is_causal") if k in params}
    return lambda q, k, v: fn(q, k, v, **options)


def _parameters(fn: Callable) -> set[str]:
    try:
        return set(inspect.signature(_called(fn)).parameters)
    except ValueError:
        return set()


@dataclass(frozen=True)
class TraceOptions:
    """How a trace emulates the GPU: ``cuda=False`` follows the meta device's code paths
    (what validation checks); ``release``: the torch build's cuDNN/CUDA versions, which the
    SDPA backend choice reads; ``workspace``: cuDNN's workspace sizes."""

    cuda: bool = True
    release: TorchRelease = TorchRelease()
    workspace: Workspace = Workspace()


def trace(fn: Callable, config: Config, options: TraceOptions = TraceOptions()) -> Breakdown:
    """The breakdown of ``fn``'s step under ``config``, traced on the meta device as it
    would run on ``config``'s GPU."""
    return traced(fn, config, options).breakdown


def traced(fn: Callable, config: Config, options: TraceOptions = TraceOptions(),
           budget=None, history: list | None = None):
    """``trace`` with its notes (SDPA backends and why, what is not modelled) and, given a
    ``memcalc.budget.Budget``, whether the step fits in it (a capped direct trace).
    ``history``: a list to extend with the allocator ledger's history (for plots)."""
    from memcalc.budget import fit
    from memcalc.tracing.report import Traced
    from memcalc.validation.emulated import Tracer

    paths = _paths(config, options)
    tracer = Tracer(config.workspace_bytes, None, paths)
    result = _measure(fn, config, options, paths=paths, tracer=tracer)
    if history is not None:
        history.extend(tracer.ledger.history)
    checked = {}
    if budget is not None:
        replay = lambda capacity: _measure(fn, config, options, capacity)  # noqa: E731
        checked = dict(budget=budget, fit=fit(config, budget.budget_bytes, result, replay))
    return Traced(breakdown=result, gpu=config.device.spec.label, cuda_paths=options.cuda,
                  notes=tuple(paths.notes) if paths else (),
                  kernels=tuple(paths.kernels) if paths else (), **checked)


def _paths(config: Config, options: TraceOptions):
    """The CUDA dispatch layer for ``config``'s GPU, or None with ``cuda=False``."""
    if not options.cuda:
        return None
    from memcalc.tracing.cuda_paths import CudaPaths

    return CudaPaths(config.device.spec, options.release, options.workspace)


def _measure(fn: Callable, config: Config, options: TraceOptions, capacity: int | None = None,
             paths=None, tracer=None) -> Breakdown:
    """One direct trace of ``fn``'s step (see ``trace``)."""
    from memcalc.tracing.state import on_meta
    from memcalc.validation.emulated import measure

    paths = paths or _paths(config, options)

    def run():
        with on_meta(fn) as state:
            return measure(config, bind_options(fn, config), capacity, paths, state,
                           output_like(fn, config), tracer)

    return _guarded(run, fn)


def output_like(fn: Callable, config: Config) -> tuple | None:
    """``(shape, dtype)`` of ``fn``'s output when it is not q's, from a shape-only run
    (meta tensors, no grad, no tracer): what ``grad_out`` must look like."""
    import torch

    from memcalc.validation.emulated import _shapes

    if config.protocol.forward_only or config.protocol.loss != "grad":
        return None
    dtype = getattr(torch, config.dtype.torch_name)
    q_shape, kv_shape = _shapes(config)
    with torch.no_grad():
        q, k, v = (torch.empty(s, dtype=dtype, device="meta") for s in (q_shape, kv_shape, kv_shape))
        out = bind_options(fn, config)(q, k, v)
    if not isinstance(out, torch.Tensor):
        raise TraceError(f"the function must return one tensor, not {type(out).__name__} "
                         "(return the attention output only)")
    if tuple(out.shape) == tuple(q_shape) and out.dtype == dtype:
        return None
    return tuple(out.shape), out.dtype


def _guarded(run: Callable, fn: Callable):
    """Run a trace; a failure becomes a TraceError naming the user's line and a hint."""
    from memcalc.allocator import OutOfMemory

    try:
        return run()
    except (TraceError, OutOfMemory):  # a capped trace's OOM is an answer, not a failure
        raise
    except Exception as error:  # noqa: BLE001 - anything the user's code raises on meta
        raise TraceError(_explain(error, fn)) from None


def _explain(error: Exception, fn: Callable) -> str:
    source = _source_file(fn)
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == source]
    where = f"line {frames[-1].lineno} of {Path(source).name} ({frames[-1].line})" if frames \
        else getattr(fn, "__name__", "the function")
    if isinstance(error, NotModelled):
        return f"{where}: {_first_line(error)}"
    raised = f"{type(error).__name__}: {_first_line(error)}"
    if _meta_refused(error, source):
        hint = CPU_HINT if "device cpu" in str(error) else META_HINT
        return f"{where} cannot run on the meta device: {raised}. Hint: {hint}"
    return (f"{where} raised {raised} (traced on the meta device: tensors without values). "
            f"If it runs on a GPU: {META_HINT}")


CPU_HINT = ("a tensor or module on the CPU is traced on meta copies only when the function "
            "refers to it by a module-level name (or it is the nn.Module traced): one reached "
            "through a closure, another object's attribute or a bound method stays on the CPU; "
            "make it with device='meta', or refer to it by its module-level name")
META_HINT = ("data-dependent code (.item(), .cpu(), shapes from values) cannot be traced; give "
             "a custom CUDA/Triton kernel a fake implementation (torch.library.register_fake), "
             "or pick the built-in model that matches it (memcalc impls)")


def _meta_refused(error: Exception, source: str) -> bool:
    """Whether torch refused an op for lack of data or of a meta kernel ("Tensor.item()
    cannot be called on meta tensors", "Cannot copy out of meta tensor", "Could not run
    'x' with arguments from the 'Meta' backend"): not an error of the code itself, which
    raises its own (the last frame is a ``raise`` statement in the user's ``source``)."""
    last = (traceback.extract_tb(error.__traceback__) or [None])[-1]
    if last is not None and last.filename == source and (last.line or "").startswith("raise"):
        return False
    return isinstance(error, NotImplementedError) or "meta" in str(error).lower()


def _source_file(fn: Callable) -> str:
    """The file ``fn`` (or a module's class) is written in, "" when unknown."""
    for target in (fn, type(fn)):
        try:
            return inspect.getsourcefile(target) or ""
        except TypeError:
            continue
    return ""


# --- from traces to a program -------------------------------------------------------------

@dataclass(frozen=True)
class Poly:
    """An exact polynomial in N with rational coefficients, lowest degree first."""

    coefficients: tuple[Fraction, ...]

    def value(self, n: int) -> Fraction:
        return sum((c * n**i for i, c in enumerate(self.coefficients)), Fraction(0))

    def __call__(self, n: int) -> int:
        value = self.value(n)
        if value.denominator != 1:
            raise TraceError(f"a traced size is not an integer at seq_len {n}")
        return int(value)


def fit(xs: tuple[int, ...], ys: list[int]) -> Poly | None:
    """The lowest-degree polynomial through the first points that also passes through the
    others; None when none fits (a size that is not polynomial in N, e.g. padded)."""
    for degree in range(len(xs) - 1):
        poly = _interpolate(xs[: degree + 1], ys[: degree + 1])
        if all(poly.value(x) == y for x, y in zip(xs, ys)):
            return poly
    return None


def _interpolate(xs, ys) -> Poly:
    """Newton's divided differences, expanded to monomial coefficients, in fractions."""
    coefficients = [Fraction(0)] * len(xs)
    table = [Fraction(y) for y in ys]
    basis = [Fraction(1)]  # prod (N - x_j) so far, as monomial coefficients
    for i in range(len(xs)):
        if i:
            table = [(table[j + 1] - table[j]) / (xs[j + i] - xs[j]) for j in range(len(table) - 1)]
            basis = [Fraction(0)] + basis
            for j in range(len(basis) - 1):
                basis[j] -= xs[i - 1] * basis[j + 1]
        for j, b in enumerate(basis):
            coefficients[j] += table[0] * b
    return Poly(tuple(coefficients))


def step_events(tracer, probe) -> tuple[list, list]:
    """The measured step's forward and backward as program events, from a tracer's log."""
    events = tracer.events
    marks = [i for i, e in enumerate(events) if e[0] == "mark"]
    # marks: reset, a0, a1, forward peak [, reset, backward peak]
    forward = events[marks[1] + 1: marks[2]]
    backward = events[marks[4] + 1: marks[5]] if len(marks) >= 6 else []
    return _convert(forward, backward, probe.output_key)


def _convert(forward: list, backward: list, output_key) -> tuple[list, list]:
    """Name each allocation, give it a role (alive at the end of its phase: saved or
    gradient; else activation or temporary), and turn frees of saved tensors into releases."""
    names: dict = {}
    out_index = max((i for i, e in _alive(forward).items() if e[1] == output_key), default=None)
    fwd = [_event(e, names, _role(i, e, _alive(forward), out_index, Role.saved, Role.activation))
           for i, e in enumerate(forward)]
    bwd = [_event(e, names, _role(i, e, _alive(backward), None, Role.gradient, Role.temporary))
           for i, e in enumerate(backward)]
    return [e for e in fwd if e], [e for e in bwd if e]


def _alive(events: list) -> dict[int, tuple]:
    """Allocation events (by position) still alive at the end; storage keys are addresses
    and get reused, so liveness is tracked per allocation, not per key."""
    current: dict = {}
    for i, e in enumerate(events):
        if e[0] == "alloc":
            current[e[1]] = i
        elif e[0] == "free":
            current.pop(e[1], None)
    return {i: events[i] for i in current.values()}


def _role(index: int, event, alive: dict, out_index, kept: Role, dropped: Role) -> Role | None:
    if event[0] != "alloc":
        return None
    if index == out_index:
        return Role.output
    return kept if index in alive else dropped


def _event(event, names: dict, role):
    kind = event[0]
    if kind == "cublas":
        return Cublas()
    if kind == "alloc":
        c = event[2]
        name = _unique(c.name, names)
        names[event[1]] = (name, role)
        return Tensor(name, c.shape, c.dtype, role, c.op, storage_bytes=c.nbytes)
    if kind == "free" and event[1] in names:
        name, role = names.pop(event[1])
        return Release((name,)) if role is Role.saved else Free((name,))
    return None  # frees of what the step did not allocate, marks


def _unique(name: str, names: dict) -> str:
    taken = {n for n, _ in names.values()}
    candidate, i = name, 2
    while candidate in taken:
        candidate, i = f"{name} #{i}", i + 1
    return candidate


def traced_program(fn: Callable, config: Config) -> Callable[[int], Program]:
    """``fn``'s program at any seq_len, from traces at ``SAMPLE_LENGTHS`` under ``config``
    (its seq_len ignored; key/value length follows seq_len)."""
    if config.shape.kv_len is not None:
        raise TraceError("--kv-len: traced code is solved with kv_len = seq_len")
    samples = [_sample_events(fn, config, n) for n in SAMPLE_LENGTHS]
    _check_same_structure(samples)
    forward = _fit_events([s[0] for s in samples])
    backward = _fit_events([s[1] for s in samples])
    return lambda n: Program(tuple(e(n) for e in forward), tuple(e(n) for e in backward))


def _sample_events(fn: Callable, config: Config, n: int) -> tuple[list, list]:
    from memcalc.tracing.state import on_meta
    from memcalc.validation.emulated import Tracer, TracerProbe, run_traced

    sample = config.replace(seq_len=n)
    tracer = Tracer(sample.workspace_bytes, paths=_paths(sample, TraceOptions()))
    probe = TracerProbe(tracer)

    def run():
        with on_meta(fn) as state:
            run_traced(sample, bind_options(fn, config), tracer, probe, state,
                       output_like(fn, sample))

    _guarded(run, fn)
    return step_events(tracer, probe)


def _check_same_structure(samples: list) -> None:
    shapes = {tuple(_skeleton(e) for e in s[0] + s[1]) for s in samples}
    if len(shapes) != 1:
        raise TraceError("the step's op sequence changes with seq_len (data-dependent "
                         "control flow?): it cannot be solved as a polynomial in seq_len")


def _skeleton(event) -> tuple:
    if isinstance(event, Tensor):
        return ("alloc", event.name, event.dtype, event.role, len(event.shape))
    return (type(event).__name__, getattr(event, "names", ()))


def _fit_events(per_sample: list[list]) -> list[Callable[[int], object]]:
    """For each event position, a function of N giving the event at that length."""
    return [_fit_event([events[i] for events in per_sample]) for i in range(len(per_sample[0]))]


def _fit_event(versions: list) -> Callable[[int], object]:
    first = versions[0]
    if not isinstance(first, Tensor):
        return lambda n: first
    dims = [_fit_or_fail([v.shape[i] for v in versions], first) for i in range(len(first.shape))]
    nbytes = _fit_or_fail([v.nbytes for v in versions], first)
    return lambda n: Tensor(first.name, tuple(p(n) for p in dims), first.dtype, first.role,
                            first.op, storage_bytes=nbytes(n))


def _fit_or_fail(values: list[int], tensor: Tensor) -> Poly:
    poly = fit(SAMPLE_LENGTHS, values)
    if poly is None:
        raise TraceError(f"the size of {tensor.name} is not a polynomial in seq_len "
                         f"(padded or rounded?): {dict(zip(SAMPLE_LENGTHS, values))}; fused "
                         f"SDPA kernels pad their buffers: solve those with --impl sdpa-flash "
                         f"or sdpa-efficient, or trace one length at a time (memcalc trace)")
    return poly


def register_function(fn: Callable, label: str) -> str:
    """Register ``fn`` as implementation ``trace:<label>`` and return that name, for
    ``Config(impl=...)``. Its program is fitted on first use, once per combination of the
    sizes other than seq_len (batch, heads, head_dim, dtype, causal, loss, forward-only)."""
    from memcalc.registry import Impl, add

    name = f"trace:{label}"
    programs: dict[Dims, Callable[[int], Program]] = {}

    def build(d: Dims) -> Program:
        if d.M != d.N:
            raise TraceError("--kv-len: traced code is solved with kv_len = seq_len")
        key = d.__class__(**{**d.__dict__, "N": 0, "M": 0})
        if key not in programs:
            programs[key] = traced_program(fn, _config_of(name, d))
        return programs[key](d.N)

    # tracing the same function again replaces its earlier registration, on purpose
    add(Impl(name, f"traced from {label}", build, gqa=True, traced=True), replace=True)
    return name


def _config_of(impl: str, d: Dims) -> Config:
    """A config with the sizes of ``d`` (for sampling traces)."""
    from memcalc.config import DType, Protocol, Shape

    dtype = next(t for t in DType if t.torch_name == d.dtype)
    return Config(impl=impl, dtype=dtype, causal=d.causal, chunk=d.chunk,
                  shape=Shape(batch=d.B, heads=d.H, kv_heads=d.Hk, seq_len=d.N, head_dim=d.D),
                  protocol=Protocol(loss=d.loss, forward_only=d.forward_only))
