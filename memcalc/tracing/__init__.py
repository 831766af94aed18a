"""Bring your own attention: trace a user's function or model on the meta device and treat
it like a built-in implementation.

``trace(fn, config, calling=...)`` runs the protocol (DESIGN.md section 1) for ``fn``
called as ``calling`` says (``target.py``: ``q, k, v``, or the inputs of ``--input``; an
autocast region; the module's dtype) on the emulated backend and returns the same
``Breakdown`` as ``predict``, its components named by the op that allocated them and the
user's source line. It follows the code paths of the configured GPU, not the meta device's,
where they allocate differently (``cuda_paths.py``: SDPA backend choice and fused kernels,
half-to-float softmax, fused dropout, the matmul dtype check; ``autocast.py``: CUDA's
autocast); ``grad_out`` is shaped like the function's output (learnt from a scratch
forward first); a module's parameters and buffers, and a function's module-level tensors,
are resident, and state built on the first call is left to the warm-up (``state.py``).
``traced`` adds what the trace took or could not see (``report.Traced``).

``traced_program(fn, config, calling)`` turns the function into a program of the kind
built-in implementations declare, resident state and inputs included: it traces at a few
sequence lengths, checks that the op sequence does not change, and recovers every
allocation's size as an exact polynomial in seq_len (fitted with fractions on four lengths,
verified on two more). Registered under a name (``register_function``), the traced code
then works everywhere a built-in does: ``predict``, OOM solving, sweeps.

The user's file is imported, so it runs as code: only what the user names is imported.

The tracer itself (``tracer.py``) runs the measurement protocol (``protocol.py``) on the
meta device. May import: everything but ``validation``, ``plots``, ``cli`` and ``commands``.
"""

from __future__ import annotations

import inspect
import os
import traceback
import warnings
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Callable

from memcalc.analysis.breakdown import Breakdown
from memcalc.config import Config
from memcalc.errors import one_line as _first_line
from memcalc.engine.inputs import QKV, Input, sizes_read
from memcalc.engine.program import Cublas, Dims, Free, Phase, Program, Release, Role, Tensor
from memcalc.impls.device import gpu_of
from memcalc.impls.reductions import Reduction, scratch_events
from memcalc.impls.sdpa_cudnn import Workspace
from memcalc.tracing.errors import NotModelled, RefusedOnGpu, TraceError
from memcalc.tracing.sdpa_select import Release as TorchRelease
from memcalc.tracing.target import (Bound, Calling, bound, check_causal,  # noqa: F401
                                    check_inputs, label_of, load_function, prepared,
                                    takes_causal)

# odd lengths sharing no padding multiple: the first four fit, the last two verify
SAMPLE_LENGTHS = (61, 97, 131, 173, 211, 257)


def installed_release() -> TorchRelease:
    """The SDPA rules of the installed torch's release (with its PyPI wheel's cuDNN and
    CUDA), else the newest known."""
    import torch

    try:
        return TorchRelease.of(torch.__version__)
    except ValueError:
        return TorchRelease()


@dataclass(frozen=True)
class TraceOptions:
    """How a trace emulates the GPU: ``cuda=False`` follows the meta device's code paths
    (what validation checks); ``release``: the torch release whose SDPA rules apply, with
    its build's cuDNN/CUDA versions (default: the installed torch's); ``workspace``: cuDNN's
    workspace sizes; ``group``: under ``--cp``, the process group's collectives as ``nccl``
    runs them (default) or as a ``fake`` group does (``context_parallel.Ranks``)."""

    cuda: bool = True
    release: TorchRelease = field(default_factory=installed_release)
    workspace: Workspace = Workspace()
    group: str = "nccl"


def trace(fn: Callable, config: Config, options: TraceOptions = TraceOptions(),
          calling: Calling = Calling()) -> Breakdown:
    """The breakdown of ``fn``'s step under ``config``, traced on the meta device as it
    would run on ``config``'s GPU; ``fn`` is called as ``calling`` says (with ``q, k, v``
    unless it gives other inputs: ``memcalc.engine.inputs``)."""
    return traced(fn, config, options, calling=calling).breakdown


def traced(fn: Callable, config: Config, options: TraceOptions = TraceOptions(),
           budget=None, history: list | None = None, calling: Calling = Calling(),
           rank: int | None = None):
    """``trace`` with its notes (SDPA backends and why, what is not modelled, which of
    several returned values was the output) and, given a ``memcalc.analysis.budget.Budget``, whether
    the step fits in it (a capped direct trace). ``history``: a list to extend with the
    allocator ledger's history (for plots). Under ``--cp``, every rank is traced and the
    busiest shown, or only ``rank`` when given."""
    from memcalc.analysis.budget import fit
    from memcalc.tracing.report import Traced

    if calling.autocast and not options.cuda:
        raise TraceError("--autocast: autocast is CUDA's; --meta-paths follows the meta "
                         "device, where torch turns CUDA autocast off")
    if config.cp > 1 and not options.cuda:
        raise TraceError("--cp: context parallelism runs NCCL's collectives, on the GPU's "
                         "code paths; not with --meta-paths")
    call = bound(fn, config, calling)
    inputs = calling.inputs
    if rank is not None:
        result, paths, tracer = _rank_traced(call, config, options, inputs, rank)
    else:
        result, paths, tracer, rank = _busiest_traced(call, config, options, inputs)
    if history is not None:
        history.extend(tracer.ledger.history)
    checked = {}
    if budget is not None:
        replay = lambda capacity: _measure(call, config, options, inputs, capacity,  # noqa: E731
                                           rank=rank)
        checked = dict(budget=budget, fit=fit(config, budget.budget_bytes, result, replay))
    notes = (*(paths.notes if paths else ()), *_returned(call))
    return Traced(breakdown=result, gpu=config.device.spec.label, cuda_paths=options.cuda,
                  notes=notes, kernels=tuple(paths.kernels) if paths else (),
                  inputs=tuple(i.text() for i in inputs if inputs is not QKV),
                  autocast=calling.autocast, param_dtype=calling.param_dtype,
                  optimizer=calling.loop.optimizer.text() if calling.loop.optimizer else None,
                  grad_accum=calling.loop.accumulate, **checked)


def _returned(call: Bound) -> tuple[str, ...]:
    """The note that says which returned value the backward started from, if there were
    several."""
    if not call.returned:
        return ()
    return (f"the function returned {call.returned} is the output the backward starts from "
            "(the rest is dropped before it)",)


def _busiest_traced(call: Bound, config: Config, options: TraceOptions,
                    inputs: tuple[Input, ...]) -> tuple:
    """Every rank's step, the busiest one's shown as ``memcalc.analysis.predict`` shows
    it: ``(breakdown, paths, tracer, rank)``."""
    from memcalc.analysis.predict import busiest, ranked

    ranks = [_rank_traced(call, config, options, inputs, r) for r in range(config.cp)]
    breakdowns = [b for b, _, _ in ranks]
    rank = busiest(breakdowns)
    result, paths, tracer = ranks[rank]
    if config.cp > 1:
        result = ranked(result, rank, breakdowns)
    return result, paths, tracer, rank


def _rank_traced(call: Bound, config: Config, options: TraceOptions,
                 inputs: tuple[Input, ...], rank: int) -> tuple:
    """``(breakdown, paths, tracer)`` of one rank's step (the only one's without ``--cp``)."""
    from memcalc.tracing.tracer import Tracer

    paths = _paths(config, options, rank)
    tracer = Tracer(config.workspace_bytes, None, paths, gpu_of(config.dims))
    result = _measure(call, config, options, inputs, paths=paths, tracer=tracer)
    if config.cp > 1 and config.cp_method == "ulysses" and not paths.collectives:
        raise TraceError("--cp-method ulysses: the step made no all-to-all; DeepSpeed-Ulysses "
                         "is the caller's code (DistributedAttention around the attention): "
                         "trace the function that calls it, on its rank's (B, N, H, D) rows")
    return result, paths, tracer


def _paths(config: Config, options: TraceOptions, rank: int = 0):
    """The CUDA dispatch layer for ``config``'s GPU, or None with ``cuda=False``; under
    ``--cp``, as rank ``rank`` (``context_parallel.py``)."""
    if not options.cuda:
        return None
    from memcalc.tracing.cuda_paths import CudaPaths

    paths = CudaPaths(config.device.spec, options.release, options.workspace)
    if config.cp > 1:
        from memcalc.tracing.context_parallel import Ranks

        paths.cp = Ranks(config.cp, rank, config.cp_method, options.group)
    return paths


def _measure(call: Bound, config: Config, options: TraceOptions, inputs: tuple[Input, ...],
             capacity: int | None = None, paths=None, tracer=None, rank: int = 0) -> Breakdown:
    """One direct trace of the bound call's step (see ``trace``)."""
    from memcalc.tracing.state import kept, on_meta
    from memcalc.tracing.tracer import measure

    paths = paths or _paths(config, options, rank)

    def run():
        with kept(call.fn), on_meta(call.fn, call.param_dtype) as state:
            return measure(config, call, capacity, paths, state,
                           output_like(call, config, options, inputs), tracer, inputs,
                           call.loop)

    return _guarded(run, call.fn, called_with(config, inputs))


def output_like(call: Bound, config: Config, options: TraceOptions,
                inputs: tuple[Input, ...]) -> tuple | None:
    """``(shape, dtype)`` of the call's output when it is not q's, from a forward under
    ``no_grad`` along the same code paths (a scratch trace): what ``grad_out`` must look
    like. None when there is no ``grad_out`` to make. What the scratch forward leaves on the
    function's modules and module-level names (state built on the first call, such as a
    causal mask buffer registered lazily) is undone after it (``state.kept``): on a GPU the
    protocol's warm-up is the first call, and builds it there."""
    from memcalc.tracing.state import kept
    from memcalc.tracing.tracer import Tracer, output_of

    if config.protocol.forward_only or config.protocol.loss != "grad":
        return None
    scratch = Tracer(config.workspace_bytes, None, _paths(config, options), gpu_of(config.dims))
    with kept(call.fn):
        shape, dtype = output_of(config, call, scratch, inputs)
    d = config.dims
    if inputs is QKV and shape == (d.B, d.H, d.N, d.D) and dtype == d.dtype:
        return None
    if not dtype.startswith(("float", "bfloat")):
        raise TraceError(f"the output is {dtype}: the backward needs a floating tensor")
    return shape, dtype


def _guarded(run: Callable, fn: Callable, called_with: str = ""):
    """Run a trace; a failure becomes a TraceError naming the user's line, what the target
    was ``called_with`` (``q (8, 1, 1024, 16) float32, ...``) where that explains it, and a
    hint where one applies."""
    from memcalc.engine.allocator import OutOfMemory

    try:
        with warnings.catch_warnings():
            # torch's own warnings concern running on the meta device (dynamo refusing a
            # meta tensor, autocast without CUDA), not the user's code
            warnings.filterwarnings("ignore", module=r"torch\.")
            return run()
    except (TraceError, OutOfMemory):  # a capped trace's OOM is an answer, not a failure
        raise
    except Exception as error:  # noqa: BLE001 - anything the user's code raises on meta
        raise TraceError(_explain(error, fn, called_with)) from None


def _explain(error: Exception, fn: Callable, called_with: str = "") -> str:
    """One line: the user's line that failed, the library line under it where the failure
    came from a library's code (transformers' mask builders), what was raised, and what
    explains it: the meta device's refusal and a hint, an output that needs no grad, or the
    inputs (a shape the code did not expect); the code's own ``raise``, as it is."""
    source = _source_file(fn)
    frames = traceback.extract_tb(error.__traceback__)
    mine = [f for f in frames if f.filename == source]
    where = f"line {mine[-1].lineno} of {Path(source).name} ({mine[-1].line})" if mine \
        else getattr(fn, "__name__", None) or type(fn).__name__
    where += _library_line(frames, source)
    if isinstance(error, (NotModelled, RefusedOnGpu)):
        return f"{where}: {_first_line(error)}"
    known = next((why for text, why in UNFOLLOWED.items() if text in str(error)), None)
    if known:
        return f"{where}: {known}"
    raised = f"{type(error).__name__}: {_first_line(error)}"
    if _own_raise(frames, source):
        return f"{where} raised {raised}"
    if _meta_refused(error):
        hint = CPU_HINT if "device cpu" in str(error) else META_HINT
        return f"{where} cannot run on the meta device: {raised}. Hint: {hint}"
    if "does not require grad" in str(error):
        return (f"{where} raised {raised}: the output needs no gradient (detached, or made "
                f"under no_grad), so there is no backward to trace; --forward-only traces "
                f"inference")
    if any(word in str(error).lower() for word in ("cuda", "device")):
        return f"{where} raised {raised}. If it runs on a GPU: {META_HINT}"
    return f"{where} raised {raised}" + (f" (called with {called_with})" if called_with else "")


def _own_raise(frames, source: str) -> bool:
    """Whether the failure is a ``raise`` statement of the user's own file."""
    last = frames[-1] if frames else None
    return last is not None and last.filename == source and \
        (last.line or "").startswith("raise")


def called_with(config: Config, inputs: tuple[Input, ...]) -> str:
    """``q (8, 1, 1024, 16) float32, k ..., v ...``: the tensors a trace calls its target with."""
    d = config.dims
    return ", ".join(f"{i.name} {i.shape(d)} {i.dtype_in(d)}" for i in inputs)


def _library_line(frames, source: str) -> str:
    """`` (in masking_utils.py:761, find_packed_sequence_indices)``: the last frame of the
    failure in neither the user's file nor torch nor memcalc, when there is one after the
    user's last; else ``""``."""
    from memcalc.tracing.tracer import _is_user_code

    last_mine = max((i for i, f in enumerate(frames) if f.filename == source), default=-1)
    library = [f for f in frames[last_mine + 1:] if f.filename != source
               and _is_user_code(os.path.abspath(f.filename))]
    if not library:
        return ""
    f = library[-1]
    return f" (in {Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno}, {f.name})"


# kernels a trace cannot follow, told by what they raise on the meta device: one line each
UNFOLLOWED = {
    "FlexAttention is only supported on": (
        "FlexAttention (torch.nn.attention.flex_attention) runs a kernel that torch compiles "
        "for the GPU, which memcalc does not model yet; trace the same model with "
        "attn_implementation 'sdpa' or 'eager'"),
}
# code that needs a process group (a collective, DeepSpeed's DistributedAttention), traced
# without one: DeepSpeed's and torch's own words for it
NO_GROUP = ("the code needs a process group (a collective, DeepSpeed's DistributedAttention): "
            "trace it under --cp P, where it runs as each rank of P on a fake group; "
            "DeepSpeed's communication backend is set up under --cp-method ulysses")
UNFOLLOWED.update({"DeepSpeed backend not set": NO_GROUP,
                   "Default process group has not been initialized": NO_GROUP})
CPU_HINT = ("a tensor or module on the CPU is traced on meta copies only when the function "
            "refers to it by a module-level name (or it is the nn.Module traced): one reached "
            "through a closure, another object's attribute or a bound method stays on the CPU; "
            "make it with device='meta', or refer to it by its module-level name")
META_HINT = ("data-dependent code (.item(), .cpu(), shapes from values) cannot be traced; give "
             "a custom CUDA/Triton kernel a fake implementation (torch.library.register_fake), "
             "or pick the built-in model that matches it (memcalc impls)")


def _meta_refused(error: Exception) -> bool:
    """Whether torch refused an op for lack of data or of a meta kernel ("Tensor.item()
    cannot be called on meta tensors", "Cannot copy out of meta tensor", "Could not run
    'x' with arguments from the 'Meta' backend"): not an error of the code itself."""
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


def step_events(tracer, probe) -> list[tuple[str, list]]:
    """The step as segments of program events, from a tracer's log: ``("inputs", ...)``,
    what exists before the warm-up (resident state, inputs, grad_out); for a training
    loop's step, ``("warm-up", ...)`` as traced (its optimizer creates state); then each
    measured phase, ``("forward", ...)``, ``("backward", ...)``, ``("optimizer", ...)``,
    from the reset of its peak to the next reset, the last one to its peak's reading."""
    events = tracer.events
    marks = [(i, e[1]) for i, e in enumerate(events) if e[0] == "mark"]
    resets = [(i, what.removeprefix("reset_peak ")) for i, what in marks
              if what.startswith("reset_peak")]
    first = marks[0][0]  # "inputs": the warm-up step starts here
    ends = [i for i, _ in resets[1:]] + [max(i for i, what in marks if what == "max_allocated")]
    segments = [("inputs", events[:first])]
    if any(label == "optimizer" for _, label in resets):
        segments.append(("warm-up", events[first + 1:resets[0][0]]))
    segments += [(label, [e for e in events[i + 1:end] if e[0] != "mark"])
                 for (i, label), end in zip(resets, ends)]
    return _convert(segments, probe.output_key)


def _convert(segments: list[tuple[str, list]], output_key) -> list[tuple[str, list]]:
    """Name each allocation and give it a role (before the step: its own, or input; in a
    warm-up: a resident one's, else activation; alive at the end of its phase: saved,
    gradient; else activation or temporary), and turn frees of saved tensors into
    releases. A reduction's scratch becomes its ``Reduction``, whose buffers the fitted
    program recomputes at each length."""
    names: dict = {}
    converted = []
    # the output is the last forward's (storage keys are addresses, reused by other steps)
    last = max(i for i, (label, _) in enumerate(segments) if label == "forward")
    for n, (label, events) in enumerate(segments):
        events = _reductions(events)
        alive = _alive(events)
        out_index = max((i for i, e in alive.items() if e[1] == output_key), default=None) \
            if n == last else None
        roles = [_phase_role(label, i, e, alive, out_index) for i, e in enumerate(events)]
        made = [_event(e, names, role) for e, role in zip(events, roles)]
        converted.append((label, [e for e in made if e]))
    return converted


def _phase_role(label: str, index: int, event, alive: dict, out_index) -> Role | None:
    """The role of an allocation in segment ``label`` (``_convert``)."""
    if event[0] != "alloc":
        return None
    if label == "inputs":
        return _given_role(event)
    if label == "warm-up":
        role = event[2].role
        return role if role in RESIDENT else Role.activation
    if index == out_index:
        return Role.output
    kept, dropped = {"forward": (Role.saved, Role.activation),
                     "backward": (Role.gradient, Role.temporary),
                     "optimizer": (Role.temporary, Role.temporary)}[label]
    return kept if index in alive else dropped


# what exists before a phase and outlives it, in a role of its own
RESIDENT = (Role.parameter, Role.buffer, Role.optimizer_state, Role.input)


def _given_role(event) -> Role | None:
    """Before the step: a parameter or buffer stays one, anything else is an input."""
    if event[0] != "alloc":
        return None
    role = event[2].role
    return role if role in (Role.parameter, Role.buffer) else Role.input


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


def _reductions(events: list) -> list:
    """``events`` with each ``reduce`` ... ``reduce_end`` span (a kernel's own buffers,
    allocated and freed inside it) replaced by its ``Reduction``."""
    kept, inside = [], False
    for e in events:
        if e[0] == "reduce":
            kept.append(e)
            inside = True
        elif e[0] == "reduce_end":
            inside = False
        elif not inside:
            kept.append(e)
    return kept


def _event(event, names: dict, role):
    kind = event[0]
    if kind == "cublas":
        return Cublas(event[1])
    if kind == "reduce":
        return event[1]
    if kind == "alloc":
        c = event[2]
        name = _unique(c.name, names)
        names[event[1]] = (name, role)
        return Tensor(name, c.shape, c.dtype, role, c.op, storage_bytes=c.bytes)
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


def traced_program(fn: Callable, config: Config, calling: Calling = Calling(),
                   options: TraceOptions | None = None) -> Callable[[int], Program]:
    """``fn``'s program at any seq_len, from traces at ``SAMPLE_LENGTHS`` under ``config``
    (its seq_len ignored; key/value length follows seq_len), resident state and inputs
    included: what a direct trace holds from the start, the fitted program holds too."""
    if config.shape.kv_len is not None:
        raise TraceError("--kv-len: traced code is solved with kv_len = seq_len")
    call = bound(fn, config, calling)
    options = options or TraceOptions()
    samples = [_sample_events(call, config, n, calling.inputs, options) for n in SAMPLE_LENGTHS]
    _check_same_structure(samples)
    labels = [label for label, _ in samples[0]]
    fitted = [_fit_events([s[i][1] for s in samples]) for i in range(len(labels))]
    gpu = gpu_of(config.dims)
    return lambda n: _program([(label, _at(f, n, gpu)) for label, f in zip(labels, fitted)])


def _program(segments: list[tuple[str, tuple]]) -> Program:
    """Fitted segments at one length as a program: inputs, forward and backward; a
    training loop's warm-up and measured phases besides."""
    phases = tuple(Phase(label, events) for label, events in segments[1:] if label != "warm-up")
    forward, backward = (next((p.events for p in phases if p.label == label), ())
                         for label in ("forward", "backward"))
    warm_up = next((events for label, events in segments if label == "warm-up"), None)
    return Program(forward, backward, segments[0][1], warm_up,
                   phases if warm_up is not None else None)


def _at(fitted: list, n: int, gpu) -> tuple:
    """The fitted events at length ``n``, each reduction's scratch computed there."""
    events = []
    for i, fit_of in enumerate(fitted):
        e = fit_of(n)
        if isinstance(e, Reduction):
            events += scratch_events(f"reduction {i}", e.scratch(gpu), "sum")
        else:
            events.append(e)
    return tuple(events)


def _sample_events(call: Bound, config: Config, n: int, inputs: tuple[Input, ...],
                   options: TraceOptions) -> list[tuple[str, list]]:
    from memcalc.tracing.state import kept, on_meta
    from memcalc.tracing.tracer import Tracer, TracerProbe, run_traced

    sample = config.replace(seq_len=n)
    tracer = Tracer(sample.workspace_bytes, paths=_paths(sample, options), gpu=gpu_of(sample.dims))
    probe = TracerProbe(tracer)

    def run():
        with kept(call.fn), on_meta(call.fn, call.param_dtype) as state:
            run_traced(sample, call, tracer, probe, state,
                       output_like(call, sample, options, inputs), inputs, call.loop)

    _guarded(run, call.fn, called_with(sample, inputs))
    return step_events(tracer, probe)


def _check_same_structure(samples: list) -> None:
    shapes = {tuple((label, *(_skeleton(e) for e in events)) for label, events in s)
              for s in samples}
    if len(shapes) != 1:
        raise TraceError("the step's op sequence changes with seq_len (data-dependent "
                         "control flow?): it cannot be solved as a polynomial in seq_len")


def _skeleton(event) -> tuple:
    if isinstance(event, Tensor):
        return ("alloc", event.name, event.dtype, event.role, len(event.shape))
    if isinstance(event, Reduction):
        return ("reduce", len(event.sizes), event.dims, event.in_itemsize, event.out_itemsize)
    return (type(event).__name__, getattr(event, "names", ()))


def _fit_events(per_sample: list[list]) -> list[Callable[[int], object]]:
    """For each event position, a function of N giving the event at that length."""
    return [_fit_event([events[i] for events in per_sample]) for i in range(len(per_sample[0]))]


def _fit_event(versions: list) -> Callable[[int], object]:
    first = versions[0]
    if isinstance(first, Reduction):
        return _fit_reduction(versions)
    if not isinstance(first, Tensor):
        return lambda n: first
    dims = [_fit_or_fail([v.shape[i] for v in versions], first) for i in range(len(first.shape))]
    nbytes = _fit_or_fail([v.bytes for v in versions], first)
    return lambda n: Tensor(first.name, tuple(p(n) for p in dims), first.dtype, first.role,
                            first.op, storage_bytes=nbytes(n))


def _fit_reduction(versions: list) -> Callable[[int], Reduction]:
    """A reduction whose sizes, strides and offset are polynomials in N."""
    first = versions[0]
    fields = [[_fit_or_fail([v.sizes[i] for v in versions], first)
               for i in range(len(first.sizes))],
              [_fit_or_fail([v.strides[i] for v in versions], first)
               for i in range(len(first.strides))]]
    offset = _fit_or_fail([v.storage_offset for v in versions], first)
    return lambda n: first._replace(sizes=tuple(p(n) for p in fields[0]),
                                    strides=tuple(p(n) for p in fields[1]),
                                    storage_offset=offset(n))


def _fit_or_fail(values: list[int], tensor) -> Poly:
    poly = fit(SAMPLE_LENGTHS, values)
    if poly is None:
        what = tensor.name if isinstance(tensor, Tensor) else "a reduction's input"
        raise TraceError(f"the size of {what} is not a polynomial in seq_len "
                         f"(padded or rounded?): {dict(zip(SAMPLE_LENGTHS, values))}; fused "
                         f"SDPA kernels pad their buffers: solve those with --impl sdpa-flash "
                         f"or sdpa-efficient, or trace one length at a time (memcalc trace)")
    return poly


def register_function(fn: Callable, label: str, calling: Calling = Calling(),
                      options: TraceOptions | None = None) -> str:
    """Register ``fn`` (called as ``calling`` says, traced with ``options``: the default's
    when None) as implementation ``trace:<label>`` and return that name, for
    ``Config(impl=...)``. Its program is fitted on first use, once per combination of the
    sizes other than seq_len (batch, heads, head_dim, dtype, causal, loss, forward-only)."""
    from memcalc.impls.registry import Impl, add

    name = f"trace:{label}"
    programs: dict[Dims, Callable[[int], Program]] = {}

    def build(d: Dims) -> Program:
        if d.M != d.N:
            raise TraceError("--kv-len: traced code is solved with kv_len = seq_len")
        key = d.__class__(**{**d.__dict__, "N": 0, "M": 0})
        if key not in programs:
            programs[key] = traced_program(fn, _config_of(name, d), calling, options)
        return programs[key](d.N)

    # tracing the same function again replaces its earlier registration, on purpose
    reads = None if calling.inputs is QKV else sizes_read(calling.inputs)
    add(Impl(name, f"traced from {label}", build, gqa=True, traced=True, reads=reads,
             user_code=True),
        replace=True)
    return name


def _config_of(impl: str, d: Dims) -> Config:
    """A config with the sizes of ``d`` (for sampling traces), on a device of ``d``'s
    compute capability and SM count: the CUDA paths a trace follows (the SDPA backend, a
    reduction's split) are that GPU's. (Without them every fitted program was traced as on
    an H100: ``oom --trace --gpu a100-80gb --autocast bf16`` solved cuDNN's step, which
    torch runs on sm90 only, instead of flash's.)"""
    from memcalc.config import Device, DType, Protocol, Shape

    dtype = next(t for t in DType if t.torch_name == d.dtype)
    device = Device(gpu=None, memory_bytes=1 << 40, compute_capability=d.compute_capability,
                    sm_count=d.sm_count)  # its memory is not read: traces are unbounded
    return Config(impl=impl, dtype=dtype, causal=d.causal, chunk=d.chunk, device=device,
                  shape=Shape(batch=d.B, heads=d.H, kv_heads=d.Hk, seq_len=d.N, head_dim=d.D),
                  mask=d.mask, protocol=Protocol(loss=d.loss, forward_only=d.forward_only,
                                    deterministic=d.deterministic))
