"""A traced step as a program at any length: traced at a few sequence lengths, checked that
the op sequence does not change, every allocation's size recovered as an exact polynomial in
seq_len (``traced_program``); registered under a name (``register_function``), the traced
code then works everywhere a built-in does: ``predict``, OOM solving, sweeps."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Callable

from memcalc.config import Config
from memcalc.engine.inputs import QKV, Input, sizes_read
from memcalc.engine.program import Dims, Phase, Program, Tensor
from memcalc.impls.device import gpu_of
from memcalc.impls.embedding import EmbeddingBackward
from memcalc.impls.packed_copies import ChunkCat, SplitCopy
from memcalc.impls.reductions import Reduction
from memcalc.impls.sdpa_select import EFFICIENT
from memcalc.tracing.direct import TraceOptions, mesh_of, paths_for, rank_state
from memcalc.tracing.errors import NotPolynomial, TraceError
from memcalc.tracing.explain import called_with, guarded
from memcalc.tracing.segments import step_events
from memcalc.tracing.target import Bound, Calling, bound

# odd lengths sharing no padding multiple: the first four fit, the last two verify
SAMPLE_LENGTHS = (61, 97, 131, 173, 211, 257)


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


def traced_program(fn: Callable, config: Config, calling: Calling = Calling(),
                   options: TraceOptions | None = None,
                   lengths: tuple[int, ...] = SAMPLE_LENGTHS,
                   kernels: dict | None = None) -> Callable[[int], Program]:
    """``fn``'s program at any seq_len, from traces at ``lengths`` under ``config`` (its
    seq_len ignored; key/value length follows seq_len), resident state and inputs included:
    what a direct trace holds from the start, the fitted program holds too. A
    ``NotPolynomial`` when a size is not a polynomial in N at those lengths. ``kernels``:
    a dict to add the fused SDPA backends its ring ran to (under ``--cp``)."""
    if config.shape.kv_len is not None:
        raise TraceError("--kv-len: traced code is solved with kv_len = seq_len")
    call = bound(fn, config, calling)
    options = options or TraceOptions()
    samples = [_sample_events(call, config, n, calling.inputs, options, kernels)
               for n in lengths]
    _check_same_structure(samples)
    labels = [label for label, _ in samples[0]]
    fitted = [_fit_events([s[i][1] for s in samples], lengths) for i in range(len(labels))]
    gpu = gpu_of(config.dims)
    return lambda n: _program([(label, _at(f, n, gpu)) for label, f in zip(labels, fitted)])


def direct_program(fn: Callable, config: Config, calling: Calling = Calling(),
                   options: TraceOptions | None = None, kernels: dict | None = None
                   ) -> Program:
    """``fn``'s program at exactly ``config``'s sizes, from one trace: what a fitted
    program gives at that length, where no fitted program holds."""
    call = bound(fn, config, calling)
    segments = _sample_events(call, config, config.dims.N, calling.inputs,
                              options or TraceOptions(), kernels)
    gpu = gpu_of(config.dims)
    return _program([(label, _at([_constant(e) for e in events], 0, gpu))
                     for label, events in segments])


def _constant(event) -> Callable[[int], object]:
    return lambda n: event


def _program(segments: list[tuple[str, tuple]]) -> Program:
    """Fitted segments at one length as a program: inputs, forward and backward; a
    training loop's warm-up and measured phases besides."""
    phases = tuple(Phase(label, events) for label, events in segments[1:] if label != "warm-up")
    forward, backward = (next((p.events for p in phases if p.label == label), ())
                         for label in ("forward", "backward"))
    warm_up = next((events for label, events in segments if label == "warm-up"), None)
    return Program(forward, backward, segments[0][1], warm_up,
                   phases if warm_up is not None else None)


# kernels whose own buffers a traced program recomputes at each length from the call's
# fitted sizes (``Tracer.scratch``): what they are called in the program's names
KERNEL_CALLS = {Reduction: "reduction", EmbeddingBackward: "embedding",
                SplitCopy: "all-gather copy-out", ChunkCat: "reduce-scatter copy-in"}


def _at(fitted: list, n: int, gpu) -> tuple:
    """The fitted events at length ``n``, each kernel call's buffers computed there."""
    events = []
    for i, fit_of in enumerate(fitted):
        e = fit_of(n)
        if type(e) in KERNEL_CALLS:
            events += e.events(f"{KERNEL_CALLS[type(e)]} {i}", gpu)
        else:
            events.append(e)
    return tuple(events)


def _sample_events(call: Bound, config: Config, n: int, inputs: tuple[Input, ...],
                   options: TraceOptions, kernels: dict | None = None
                   ) -> list[tuple[str, list]]:
    from memcalc.tracing.tracer import Tracer, TracerProbe, run_traced

    # ``n``: one rank's rows; under context parallelism the sequence is cp times as long
    sample, rank = config.replace(seq_len=n * config.cp), call.rank or 0
    tracer = Tracer(sample.workspace_bytes, paths=paths_for(sample, options, rank,
                                                            mesh_of(call)),
                    gpu=gpu_of(sample.dims), settings=sample.protocol.allocator)
    probe = TracerProbe(tracer)

    def run():
        with rank_state(call, sample, options, inputs, tracer, rank) as (on_rank, state, like):
            run_traced(sample, on_rank, tracer, probe, state, like, inputs, call.loop)

    try:
        guarded(run, call.fn, called_with(sample, inputs))
    finally:  # under --cp: the backends its ring ran, or failed to run at this length
        if kernels is not None and tracer.paths is not None:
            kernels.update(tracer.paths.kernels)
    return step_events(tracer, probe)


def _check_same_structure(samples: list) -> None:
    shapes = {tuple((label, *(_skeleton(e) for e in events)) for label, events in s)
              for s in samples}
    if len(shapes) != 1:
        raise NotPolynomial("the step's ops change with seq_len (a kernel picked by length, "
                            "or control flow that reads values)")


def _skeleton(event) -> tuple:
    if isinstance(event, Tensor):
        return ("alloc", event.name, event.dtype, event.role, len(event.shape))
    if type(event) in KERNEL_CALLS:  # its sizes fitted, the rest the same at every length
        return (type(event).__name__, *(len(v) if isinstance(v, tuple) else
                                        v if isinstance(v, (bool, str)) else "int"
                                        for v in event))
    return (type(event).__name__, getattr(event, "names", ()))


def _fit_events(per_sample: list[list], lengths: tuple[int, ...]
                ) -> list[Callable[[int], object]]:
    """For each event position, a function of N giving the event at that length."""
    return [_fit_event([events[i] for events in per_sample], lengths)
            for i in range(len(per_sample[0]))]


def _fit_event(versions: list, lengths: tuple[int, ...]) -> Callable[[int], object]:
    first = versions[0]
    if type(first) in KERNEL_CALLS:
        return _fit_call(versions, lengths)
    if not isinstance(first, Tensor):
        return lambda n: first
    dims = [_fit_or_fail([v.shape[i] for v in versions], first, lengths)
            for i in range(len(first.shape))]
    nbytes = _fit_or_fail([v.bytes for v in versions], first, lengths)
    return lambda n: Tensor(first.name, tuple(p(n) for p in dims), first.dtype, first.role,
                            first.op, storage_bytes=nbytes(n))


def _fit_call(versions: list, lengths: tuple[int, ...]) -> Callable[[int], object]:
    """A kernel call (a ``Reduction``, an ``EmbeddingBackward``: a named tuple) whose
    integers, alone or in tuples, are polynomials in N; its other fields (dtypes, flags)
    the same at every length (``_skeleton`` checked them)."""
    first = versions[0]

    def fitted(i: int, value) -> Callable[[int], object]:
        column = [v[i] for v in versions]
        if isinstance(value, tuple):
            parts = [_fit_or_fail([c[j] for c in column], first, lengths)
                     for j in range(len(value))]
            return lambda n: tuple(p(n) for p in parts)
        if isinstance(value, int) and not isinstance(value, bool):
            return _fit_or_fail(column, first, lengths)
        return lambda n: value

    fields = [fitted(i, value) for i, value in enumerate(first)]
    return lambda n: type(first)(*(f(n) for f in fields))


def _fit_or_fail(values: list[int], tensor, lengths: tuple[int, ...]) -> Poly:
    poly = fit(lengths, values)
    if poly is None:
        what = tensor.name if isinstance(tensor, Tensor) else \
            f"a {KERNEL_CALLS[type(tensor)]}'s input"
        raise NotPolynomial(f"the size of {what} is not a polynomial in seq_len (padded or "
                            f"rounded?): {dict(zip(lengths, values))}")
    return poly


# under context parallelism, a rank's rows: the ring's two chunks of each sample length
EVEN_LENGTHS = tuple(2 * n for n in SAMPLE_LENGTHS)  # 122 to 514 rows a rank
RING = "the ring takes a rank's rows in two chunks"
EFFICIENT_RING = "the memory-efficient kernel's ring takes multiples of 64 rows a rank"

# Multiples of 256 rows are where the fused kernels' padded buffers are polynomials in N
# (the memory-efficient kernel's logsumexp pads to 32 rows, flash's softmax_d and dq
# accumulator, flash-attn's and cuDNN's to 128); sampled long enough that no kernel picks
# another variant for short rows there (flash's split keys, ``num_splits_heuristic``).
PADDED = 256
PADDED_LENGTHS = tuple(PADDED * n for n in SAMPLE_LENGTHS)  # 15,616 to 65,792 rows


@dataclass
class Programs:
    """A traced step's programs by length: ``fitted`` where it holds (multiples of ``step``
    from ``start``; every length when each size is a polynomial in N), else one direct
    trace at that length (``direct``), kept once made; ``why`` the fitted program does not
    hold everywhere."""

    fitted: Callable[[int], Program] | None
    direct: Callable[[int], Program]
    step: int = 1
    start: int = 1
    why: str = ""
    traced: dict[int, Program] = field(default_factory=dict)
    kernels: dict[str, None] = field(default_factory=dict)  # the ring's SDPA backends

    def ring_kernel(self) -> str:
        """The implementation whose lengths the ring takes, by the backends its traces
        ran: the memory-efficient kernel's (multiples of 64 P: its logsumexp is padded to
        32 rows; torch fails on others, on a GPU too) where it ran, else "" (2 P)."""
        return "sdpa-efficient" if EFFICIENT in self.kernels else ""

    def holds(self, n: int) -> bool:
        return self.fitted is not None and n >= self.start and n % self.step == 0

    def at(self, n: int) -> Program:
        """The program at length ``n``."""
        return self.fitted(n) if self.holds(n) else self.exact(n)

    def exact(self, n: int) -> Program:
        """The program of a direct trace at ``n`` (to confirm an answer)."""
        if n not in self.traced:
            if len(self.traced) >= 64:
                del self.traced[next(iter(self.traced))]
            self.traced[n] = self.direct(n)
        return self.traced[n]

    def describe(self) -> str:
        """How its programs are made, for the OOM report."""
        if self.fitted is None:
            return f"traced directly at each length the search tried ({self.why})"
        if self.step == 1:
            return (f"its program fitted over lengths (traced at {SAMPLE_LENGTHS[0]} to "
                    f"{SAMPLE_LENGTHS[-1]:,} rows, each size an exact polynomial in seq_len)")
        if self.why == RING:
            return (f"each rank's program fitted over its rows (traced at {EVEN_LENGTHS[0]} "
                    f"to {EVEN_LENGTHS[-1]:,} rows a rank, each size an exact polynomial in "
                    f"seq_len; {RING}: even lengths)")
        return (f"its program fitted at multiples of {self.step} rows from {self.start:,} "
                f"({self.why}), other lengths traced directly")


def programs_of(fn: Callable, config: Config, calling: Calling = Calling(),
                options: TraceOptions | None = None) -> Programs:
    """``fn``'s ``Programs`` under ``config``'s sizes but seq_len: fitted at every length
    where it can be, else at multiples of ``PADDED`` (padded buffers), else none (the ops
    change with the length beyond it too): then each length is traced as it is asked for."""
    kernels: dict[str, None] = {}
    direct = lambda n: direct_program(fn, config.replace(seq_len=n * config.cp),  # noqa: E731
                                      calling, options, kernels)
    try:
        if config.cp > 1:  # the ring takes a rank's rows in two chunks: even lengths only
            return Programs(traced_program(fn, config, calling, options, EVEN_LENGTHS,
                                           kernels), direct, 2, EVEN_LENGTHS[0],
                            RING, kernels=kernels)
        return Programs(traced_program(fn, config, calling, options), direct,
                        kernels=kernels)
    except NotPolynomial as error:
        why = str(error)
    except TraceError:  # the memory-efficient kernel's ring: multiples of 64 rows only
        if config.cp == 1 or EFFICIENT not in kernels:
            raise
        why = EFFICIENT_RING
    try:
        fitted = traced_program(fn, config, calling, options, PADDED_LENGTHS, kernels)
        return Programs(fitted, direct, PADDED, PADDED_LENGTHS[0], _short(why),
                        kernels=kernels)
    except (NotPolynomial, TraceError):  # a code that stops at long lengths, too
        return Programs(None, direct, why=_short(why), kernels=kernels)


def _short(why: str) -> str:
    """``the size of efficient lse (gpt.py:72) is not a polynomial in seq_len``: the
    reason without the sampled values."""
    return why.split(" (padded or rounded?)")[0]


def register_function(fn: Callable, label: str, calling: Calling = Calling(),
                      options: TraceOptions | None = None, multiple_of: int = 1,
                      fsdp_in_title: bool = True) -> str:
    """Register ``fn`` (called as ``calling`` says, traced with ``options``: the default's
    when None) as implementation ``trace:<label>`` and return that name, for
    ``Config(impl=...)``. Its programs are made on first use (``programs_of``), once per
    combination of the sizes other than seq_len (batch, heads, head_dim, dtype, causal,
    loss, forward-only); ``multiple_of``: the lengths a search tries (the ones you run);
    ``fsdp_in_title``: False where ``label`` says it (one row per number of ranks)."""
    from memcalc.impls.accepted import Accepted
    from memcalc.impls.registry import Impl, add

    name = f"trace:{label}"
    made: dict[Dims, Programs] = {}

    def programs(d: Dims) -> Programs:
        if d.M != d.N:
            raise TraceError("--kv-len: traced code is solved with kv_len = seq_len")
        key = d.__class__(**{**d.__dict__, "N": 0, "M": 0})
        if key not in made:
            made[key] = programs_of(fn, _config_of(name, d), _as_rank(calling, d), options)
        return made[key]

    rules = (Accepted("seq_len", multiple_of, kernel="the search (--multiple-of)",
                      step_source="the lengths you run"),) if multiple_of > 1 else ()
    # tracing the same function again replaces its earlier registration, on purpose
    reads = None if calling.inputs is QKV else sizes_read(calling.inputs)
    add(Impl(name, f"traced from {label}", lambda d: programs(d).at(d.N), gqa=True,
             traced=True, accepted=lambda d: rules, reads=reads, user_code=True,
             exact=lambda d: programs(d).exact(d.N),
             how=lambda d: programs(d).describe(), title=_title(calling, fsdp_in_title),
             ring_kernel=lambda d: programs(d).ring_kernel()),
        replace=True)
    return name


def _as_rank(calling: Calling, d: Dims) -> Calling:
    """``calling`` as the rank whose step ``d`` is: under ``--cp``, the first rank at
    ``d.cp_rank`` in the ring (on a ``--mesh``, the one at dp_shard 0, as FSDP alone
    solves rank 0); else as given. Each rank of the ring holds other blocks at each step
    (causal: a half of its queries or of the keys), so its step is its own. (Every rank
    was once traced as rank 0: ``oom --trace --cp 8`` on Llama-3-8B answered 67,072,
    where the busiest rank does not fit.)"""
    if d.cp == 1 or calling.rank is not None:
        return calling
    mesh = calling.fsdp.mesh if calling.fsdp is not None else None
    rank = d.cp_rank if mesh is None else next(
        r for r in range(mesh.ranks) if mesh.coordinates(r)["cp"] == d.cp_rank)
    return replace(calling, rank=rank)


def _title(calling: Calling, fsdp: bool = True) -> Callable[[str], str]:
    """What a traced step's title says after its sizes: ``--dtype``'s name only where an
    input takes it (token ids do not), its weights' dtype (``--param-dtype``), autocast's,
    and the optimizer and micro-steps: ``bf16 weights adamw:fused x2``."""
    from memcalc.engine.program import dtype_name

    takes = calling.inputs is QKV or any(i.dtype is None for i in calling.inputs)
    said = [f"{dtype_name(calling.param_dtype)} weights"] if calling.param_dtype else []
    said += [f"autocast {dtype_name(calling.autocast)}"] if calling.autocast else []
    loop = calling.loop
    said += [loop.optimizer.text()] if loop.optimizer else []
    said += [f"x{loop.accumulate} micro-steps"] if loop.accumulate > 1 else []
    said += [calling.fsdp.text()] if calling.fsdp is not None and fsdp else []
    return lambda dtype: " ".join(([dtype] if takes else []) + said)


def _config_of(impl: str, d: Dims) -> Config:
    """A config with the sizes of ``d`` (for sampling traces), on a device of ``d``'s
    compute capability and SM count: the CUDA paths a trace follows (the SDPA backend, a
    reduction's split) are that GPU's. (Without them every fitted program was traced as on
    an H100: ``oom --trace --gpu a100-80gb --autocast bf16`` solved cuDNN's step, which
    torch runs on sm90 only, instead of flash's.) Under context parallelism ``d.N`` is one
    rank's rows: the sequence is ``cp`` times as long, the ring in the trace."""
    from memcalc.config import Device, DType, Protocol, Shape

    dtype = next(t for t in DType if t.torch_name == d.dtype)
    device = Device(gpu=None, memory_bytes=1 << 40, compute_capability=d.compute_capability,
                    sm_count=d.sm_count)  # its memory is not read: traces are unbounded
    return Config(impl=impl, dtype=dtype, causal=d.causal, chunk=d.chunk, device=device,
                  shape=Shape(batch=d.B, heads=d.H, kv_heads=d.Hk, seq_len=d.N * d.cp,
                              head_dim=d.D),
                  mask=d.mask, cp=d.cp, cp_method=d.cp_method,
                  protocol=Protocol(loss=d.loss, forward_only=d.forward_only,
                                    deterministic=d.deterministic))
