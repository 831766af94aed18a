"""The Python API, as ``memcalc`` exports it (``memcalc.breakdown``, ``oom``, ``sweep``,
``compare``, ``trace``, ``validate``, ``make_config``): the same options as the command,
checked the way it checks them (an unknown keyword is a TypeError with a did-you-mean), each
function's signature read from ``make_config`` for ``help()`` (``sign``, once every model is
imported). Nothing here imports torch unless a function needs it (``trace``, ``validate``).
"""

from __future__ import annotations

import functools
import inspect
import operator
from typing import Callable, Sequence

from memcalc.engine.deadline import DEFAULT_WORK_LIMIT


# other spellings of make_config's keywords that are accepted as they are (the CLI's
# ``--seq`` is ``seq``; the usual names from model configs)
ALIASES = {"seq": "seq_len", "seq_length": "seq_len", "sequence_length": "seq_len",
           "seqlen": "seq_len", "batch_size": "batch", "num_heads": "heads",
           "n_heads": "heads", "num_kv_heads": "kv_heads", "n_kv_heads": "kv_heads",
           "kv_seq_len": "kv_len", "impl_name": "impl", "device": "gpu"}


@functools.lru_cache(maxsize=1)
def _config_parameters() -> list[inspect.Parameter]:
    """``make_config``'s keywords, as keyword-only parameters (for ``help()``; read once:
    ``inspect.signature`` costs more than a replay)."""
    from memcalc.config import make_config as make

    return [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
            for p in inspect.signature(make).parameters.values()]


def _options(function: str, options: dict, extra: tuple[str, ...] = ()) -> dict:
    """``options`` with aliases resolved; an unknown keyword is a TypeError that suggests
    the closest one (``memcalc.breakdown(seqence=8192)``: did you mean 'seq_len'?), of the
    function's own keywords (``extra``, and those its signature lists) and the options."""
    from memcalc.names import did_you_mean

    own = [name for name, p in inspect.signature(globals()[function]).parameters.items()
           if p.kind is p.KEYWORD_ONLY]
    known = list(dict.fromkeys([*own, *extra, *(p.name for p in _config_parameters())]))
    out: dict = {}
    for key, value in options.items():
        name = ALIASES.get(key, key)
        if name not in known:
            hint = did_you_mean(key, known)
            alias = did_you_mean(key, list(ALIASES)).split("'")
            if not hint and len(alias) > 1:
                hint = f" (did you mean {ALIASES[alias[1]]!r}?)"
            raise TypeError(f"{function}() got an unexpected keyword argument {key!r}{hint}; "
                            f"it takes {', '.join(known)}")
        if name in out:
            given = next(k for k in options if ALIASES.get(k, k) == name)
            raise TypeError(f"{function}(): {given!r} and {key!r} are the same option")
        out[name] = value
    return out


_SIGNED: list[tuple[Callable, tuple]] = []  # the functions _signature signs, with extras


def _signature(*extra: inspect.Parameter):
    """Give the decorated ``f(**options)`` the signature ``help()`` shows: ``extra``, then
    ``make_config``'s keywords (signed once every function is defined: ``_sign``)."""
    def wrap(function):
        _SIGNED.append((function, extra))
        return function
    return wrap


def sign() -> None:
    """The signatures ``_signature`` promised, and ``trace``'s: read from ``make_config``,
    which imports the configuration models (most of ``import memcalc``'s time)."""
    for function, extra in _SIGNED:
        names = {p.name for p in extra}
        params = list(extra) + [p for p in _config_parameters() if p.name not in names]
        function.__signature__ = inspect.Signature(params)
    own = [p for p in inspect.signature(trace).parameters.values()  # its own keywords
           if p.kind is not p.VAR_KEYWORD]
    trace.__signature__ = inspect.Signature(
        own + [p for p in _config_parameters() if p.name != "impl"])


def _kw(name: str, default=None) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)


@_signature()
def make_config(**options):
    """The ``Config`` for these options, validated (``memcalc.config.make_config``).

        >>> memcalc.make_config(seq_len=4096, dtype="bf16").shape.seq_len
        4096
    """
    from memcalc.config import make_config as make

    return make(**_options("make_config", options))


@_signature(_kw("gpu_gb"), _kw("reserve"))
def breakdown(**options):
    """What one forward and backward step allocates: a ``Breakdown``, whose ``fits`` says
    whether it fits the device (``gpu``'s preset, or ``gpu_gb`` x 2^30 B) less ``reserve``
    (default 512 MiB), a budget it shows and serializes as ``memcalc breakdown`` does.
    ``seq`` is accepted for ``seq_len``, as on the command line.

        >>> b = memcalc.breakdown(impl="naive", seq_len=16384)
        >>> b.saved_bytes  # exp_x and p (2 x 8 x 16384^2 x 4 B), row sum and int64 argmax
        17181442048
        >>> [c.name for c in b.components][:2]
        ['exp_x', 'dp']
    """
    from memcalc.analysis.predict import predict

    options = _options("breakdown", options, ("gpu_gb", "reserve"))
    gpu_gb, reserve = options.pop("gpu_gb", None), options.pop("reserve", None)
    config = make_config(**options)
    b = predict(config)
    return b.with_budget(_budget(config, gpu_gb, reserve))


def _budget(config, gpu_gb=None, reserve=None):
    """The device budget: the preset's memory (or ``gpu_gb`` x 2^30 B) less ``reserve``
    (bytes, or a size string such as ``"1GiB"``; default 512 MiB)."""
    from memcalc.analysis.budget import Budget

    return Budget.given(config.device, gpu_gb, reserve)


def _names(values, field: str, known: list[str]) -> list[str]:
    """A non-empty list of implementation names, each known (in any case), each once; a
    ValueError naming ``field`` (with a suggestion) otherwise."""
    from memcalc.impls import canonical
    from memcalc.names import unknown

    if isinstance(values, str) or not all(isinstance(v, str) for v in values):
        raise ValueError(f"{field}: a list of names, e.g. [{known[0]!r}] (got {values!r})")
    if not len(values):
        raise ValueError(f"{field}: an empty list (leave it out for every implementation)")
    names = list(dict.fromkeys(canonical(v) for v in values))
    missing = [v for v in names if v not in known]
    if missing:
        raise unknown(field, missing[0], known)
    return names


def _dtypes(values) -> tuple[str, ...]:
    """``dtypes``: each fp32/fp16/bf16 or an alias (``bfloat16``, ``half``, ...)."""
    from memcalc.engine.program import DTYPE_ALIASES, dtype_name

    if isinstance(values, str) or not all(isinstance(v, str) for v in values):
        raise ValueError(f"dtypes (dtype): a list of names, e.g. ['bf16'] (got {values!r})")
    for v in values:
        if dtype_name(v) is None:
            raise ValueError(f"dtypes (dtype): unknown {v!r}; known: fp32, fp16, bf16 and "
                             f"{', '.join(a for a in DTYPE_ALIASES if '.' not in a)}")
    return tuple(dtype_name(v) for v in values)


def _sizes(values, field: str) -> Sequence[int]:
    """A non-empty list of positive integers below 2^62 (numpy's integers are integers: a
    ``np.arange`` is a list of lengths); a ValueError naming ``field``. A ``range`` stays
    one, so that a sweep's size is judged before its lengths are made."""
    if isinstance(values, range) and values.step > 0 and values and 0 < values[0] \
            and values[-1] < 2**62:
        return values
    sizes = [_integer(v) for v in values] if not isinstance(values, (str, int)) else []
    if not sizes or not all(s is not None and 0 < s < 2**62 for s in sizes):
        raise ValueError(f"{field}: a non-empty list of integers from 1 to 2^62 - 1 "
                         f"(got {values!r})")
    return tuple(sizes)


def _integer(value) -> int | None:
    """``value`` as an int when it is an integer (a numpy one too), not a bool; else None."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _needs_torch(what: str) -> None:
    """An ImportError that says how to get PyTorch, instead of a bare ``No module named
    'torch'`` from deep inside ``what``."""
    from memcalc.errors import require

    require("torch", what)


def _impl_names() -> list[str]:
    from memcalc.impls import impl_names

    return impl_names()


@_signature(_kw("gpu_gb"), _kw("reserve"), _kw("impls"), _kw("solve", "seq_len"),
            _kw("work_limit", DEFAULT_WORK_LIMIT), _kw("time_limit"))
def oom(*, gpu_gb=None, reserve=None, impls=None, solve: str = "seq_len",
        work_limit=DEFAULT_WORK_LIMIT, time_limit=None, **options):
    """The largest seq_len (or ``solve="batch"``, ``"head_dim"``) whose step fits, per
    implementation: an ``OomReport``. ``work_limit``: allocator events replayed per
    implementation, as ``memcalc oom --work-limit`` (the same answer on any machine);
    ``time_limit``: seconds per implementation as well, as ``--time-limit`` (None: none;
    the answer then depends on the machine's load). A chunked loop's search past either
    is listed under ``unsolved`` with the bounds it found (its replays take seconds per
    million rows). Interrupted
    (Ctrl-C, a notebook's stop button), it raises a ``KeyboardInterrupt`` whose ``report``
    holds what was solved and what the interrupted search knew.

        >>> report = memcalc.oom(gpu_gb=80, impls=["naive"])
        >>> r = report.results[0]
        >>> (r.max_value, r.at_max.fits, r.at_next.fits)  # fits at N, not at N + 1
        (19511, True, False)
    """
    from memcalc.config import first_accepted
    from memcalc.names import solve_field
    from memcalc.analysis.thresholds import solve as run

    solve = solve_field(solve, "solve")
    options = _options("oom", options)
    impls = _one_or_many("oom", impls, options)
    config = first_accepted(impls, **options)
    return run(config, _budget(config, gpu_gb, reserve), solve, impls, time_limit,
               work_limit=work_limit)


def _one_or_many(function: str, impls, options: dict) -> list[str] | None:
    """``impls``, or ``[impl]`` when only ``impl`` is given (it named the base
    configuration's implementation, and the others were solved or compared as well)."""
    if "impl" in options:
        if impls is not None:
            raise TypeError(f"{function}(): give impls or impl, not both")
        impls = [options["impl"]]
    return None if impls is None else _names(impls, "impls (impl)", _impl_names())


SWEPT_SEQ_LENS = (256, 1024, 4096, 8192, 16384)


@_signature(*(_kw(n, d) for n, d in (("seq_lens", SWEPT_SEQ_LENS),
             ("head_dims", ()), ("batches", ()), ("head_counts", ()), ("impls", ()),
             ("dtypes", ()), ("gpu_gb", None), ("reserve", None))))
def sweep(*, seq_lens=None, head_dims=(), batches=(),
          head_counts=(), impls=(), dtypes=(), gpu_gb=None, reserve=None, cps=(), **options):
    """A scaling table: every combination, exact, with OOM marks: a ``Sweep``.
    The lists are ``seq_lens`` (default 256, 1024, 4096, 8192, 16384), ``head_dims``,
    ``batches``, ``head_counts``, ``impls``, ``dtypes`` and ``cps`` (context-parallel
    ranks: the busiest rank's figures); the other options (``heads=4``, ``batch=2``,
    ``seq_len=1024``, ...) fix the rest.

        >>> table = memcalc.sweep(seq_lens=(8192, 16384))
        >>> table.rows[1].peak_bytes  # 6 x 8 x 16384^2 x 4 + rows + 2 workspaces + 7 (8, N, 16)
        51658620928
    """
    from memcalc.config import first_accepted
    from memcalc.analysis.scaling import sweep as run

    options = _options("sweep", options)
    if seq_lens is not None and "seq_len" in options:
        raise TypeError("sweep(): give seq_lens or seq_len, not both")
    if seq_lens is None:
        seq_lens = (options["seq_len"],) if "seq_len" in options else SWEPT_SEQ_LENS
    seq_lens = _sizes(seq_lens, "seq_lens (seq_len)")
    head_dims, batches, head_counts = (_sizes(v, f) if isinstance(v, int) or len(v) else ()
                                       for v, f in ((head_dims, "head_dims"),
                                                    (batches, "batches"),
                                                    (head_counts, "head_counts")))
    impls = _names(impls, "impls", _impl_names()) if len(impls) else ()
    dtypes = _dtypes(dtypes) if len(dtypes) else ()
    cps = _sizes(cps, "cps") if isinstance(cps, int) or len(cps) else ()
    options = {**options, "cp": cps[0]} if cps else options
    config = first_accepted(impls or [options.get("impl", "naive")], **options)
    return run(config, _budget(config, gpu_gb, reserve), seq_lens, head_dims, batches,
               head_counts, impls, dtypes, cps=cps)


@_signature(_kw("gpu_gb"), _kw("reserve"), _kw("impls"), _kw("baseline", "naive"))
def compare(*, gpu_gb=None, reserve=None, impls=None, baseline: str | None = None, **options):
    """Every implementation side by side against ``baseline`` (default naive, or the first
    with figures for the options when naive is not compared or has none): a ``Comparison``.

        >>> rows = memcalc.compare(seq_len=4096, impls=["naive", "naive-softmax"]).rows
        >>> [(r.impl, r.breakdown.saved_bytes) for r in rows]  # 8 x 4096^2 x 4 B = 536,870,912
        [('naive', 1074135040), ('naive-softmax', 536870912)]

    (naive: ``exp_x`` and ``p``, plus the row sum 8 x 4096 x 4 B and the int64 argmax
    8 x 4096 x 8 B: 2 x 536,870,912 + 131,072 + 262,144.)
    """
    from memcalc.analysis.comparison import compare as run
    from memcalc.config import first_accepted

    options = _options("compare", options)
    impls = _one_or_many("compare", impls, options)
    if baseline is not None:
        _names([baseline], "baseline", _impl_names())
    config = first_accepted(impls, **options)
    return run(config, _budget(config, gpu_gb, reserve), impls, baseline)


def trace(fn: Callable, *, inputs=None, no_grad=(), autocast=None, param_dtype=None,
          step=None, optimizer=None, grad_accum=1, clip_grad_norm=None, compile=None,
          activation_budget=None, mesh=None, fsdp=None,
          reshard_after_forward="default", fsdp_param_dtype=None, fsdp_reduce_dtype=None,
          fsdp_apply=None, fsdp_tp=1, gpu_gb=None, reserve=None, **options):
    """The breakdown of your own function or module's step, traced on the meta device as
    the GPU runs it (needs torch): a function, an ``nn.Module`` instance (its weights are
    left as they are), or an ``nn.Module`` class (built with no arguments on the meta
    device). It is called with ``q, k, v`` ``(B, H, N, D)``, or with ``inputs``: a mapping
    from its parameters to dims, as ``memcalc trace --input`` takes them
    (``{"x": ("B", "N", 768), "mask": ("B", "N", "bool")}``; letters B, N, M, H, K, D are
    the sizes ``batch``, ``seq_len``, ``kv_len``, ``heads``, ``kv_heads``, ``head_dim``);
    ``no_grad`` names floating inputs that need no gradient; ``autocast="bf16"`` runs the
    forward under ``torch.autocast("cuda", ...)``; ``param_dtype="bf16"`` puts a module's
    floating parameters and buffers in that dtype (``model.to(torch.bfloat16)``);
    ``optimizer="adamw"`` (``adam``, ``sgd``; ``:fused``, ``:forloop``) adds its
    ``step()`` and ``zero_grad()`` as a training loop runs them, after ``grad_accum``
    forward and backward passes, the grads clipped to a total norm of ``clip_grad_norm``
    first when given (``torch.nn.utils.clip_grad_norm_``, foreach); the code's ``torch.compile``
    calls are compiled as inductor compiles them for the GPU (``memcalc.compiling``);
    ``compile="default"`` compiles the whole model as ``torch.compile(model)`` does,
    ``compile="eager"`` traces the calls uncompiled (the eager step);
    ``activation_budget=0.5`` compiles them at that activation memory budget (torch's
    ``activation_memory_budget``: the share of saved activations the partitioner keeps);
    or those five as one ``step=memcalc.Step(optimizer="adamw", grad_accum=2,
    clip_grad_norm=1.0)``. ``fsdp=8`` shards the module with PyTorch's FSDP2
    (``fully_shard`` on each repeated layer, then the root, as torchtitan applies it;
    ``reshard_after_forward`` its policy ``default``, ``always`` or ``never``;
    ``fsdp_param_dtype``/``fsdp_reduce_dtype`` its ``MixedPrecisionPolicy``; or
    ``fsdp_apply``, your own ``apply(model, mesh)`` calling ``fully_shard``, over a 2-D mesh
    ``("dp_shard", "tp")`` with ``fsdp_tp`` tensor-parallel ranks) and shows the busiest
    rank's step. ``mesh=memcalc.Mesh(dp_shard=4, cp=2)`` (or ``"dp_shard=4,cp=2"``) lays the
    ranks out on torchtitan's axes instead: FSDP over dp_shard x cp (HSDP with
    dp_replicate), the ring of context parallelism over cp, ``fsdp_apply`` given that mesh. ``causal=True`` is passed as its
    ``causal`` or ``is_causal`` argument (refused when it takes neither); ``gpu_gb``,
    ``reserve``: the budget ``fits`` judges, as for ``breakdown``.

        >>> import math, torch
        >>> def attn(q, k, v):
        ...     return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), -1) @ v
        >>> memcalc.trace(attn, seq_len=1024, batch=1).saved_bytes  # p: 1024 x 1024 x 4 B
        4194304
    """
    from memcalc.engine.inputs import inputs_of
    from memcalc.names import autocast_dtype, torch_dtype

    _needs_torch("memcalc.trace")
    from memcalc.tracing import (Calling, TraceError, check_causal, check_inputs, label_of,
                                 prepared, register_function, trace as run)
    from memcalc.tracing.fsdp import sharding_of
    from memcalc.tracing.optimizers import loop_of

    options = _options("trace", options, ("gpu_gb", "reserve"))
    mesh = _mesh(mesh, options)
    optimizer, grad_accum, clip_grad_norm, compile, activation_budget = _step(
        step, optimizer, grad_accum, clip_grad_norm, compile, activation_budget)
    if not callable(fn):
        raise TypeError(f"trace(): fn is a function or an nn.Module, not {type(fn).__name__}")
    if "impl" in options:
        raise TypeError("trace(): takes no impl: it traces fn (memcalc.breakdown(impl=...) "
                        "replays an implementation)")
    if isinstance(no_grad, str):
        no_grad = (no_grad,)
    if inputs is not None and not isinstance(inputs, dict):
        raise ValueError(f"inputs: a mapping from the parameters to their dims, e.g. "
                         f"{{'x': ('B', 'N', 768)}} (got {type(inputs).__name__})")
    given = inputs_of(inputs, no_grad, "inputs") if inputs else None
    if no_grad and not inputs:
        raise ValueError(f"no_grad: {no_grad[0]!r}: give inputs= first (without it the "
                         f"function takes q, k, v, which need grad)")
    from memcalc.compiling.session import calls
    from memcalc.tracing.compiled import check_module
    from memcalc.tracing.errors import NotModelled

    with calls(compile, "compile", activation_budget=activation_budget):
        try:
            fn = prepared(check_module(fn), label_of(fn))
            calling = Calling(check_inputs(fn, given, "inputs"),
                              autocast_dtype(autocast, "autocast"),
                              torch_dtype(param_dtype, "param_dtype"),
                              loop_of(optimizer, grad_accum,
                                      ("optimizer", "grad_accum", "clip_grad_norm"),
                                      clip_grad_norm),
                              sharding_of(fsdp, reshard_after_forward,
                                          torch_dtype(fsdp_param_dtype, "fsdp_param_dtype"),
                                          torch_dtype(fsdp_reduce_dtype, "fsdp_reduce_dtype"),
                                          "fsdp", fsdp_apply,
                                          getattr(fsdp_apply, "__qualname__", "fsdp_apply"),
                                          fsdp_tp, mesh))
        except (TraceError, NotModelled) as error:
            raise ValueError(str(error).removeprefix("--trace ")) from None
        config = make_config(**{**options, "impl": register_function(fn, label_of(fn), calling)})
        check_causal(fn, config)
        b = run(fn, config, calling=calling)
        return b.with_budget(_budget(config, gpu_gb, reserve))


def _step(step, optimizer, grad_accum, clip_grad_norm, compile, activation_budget) -> tuple:
    """The loop's options, from ``step=`` (a ``Step``) or from the keywords, not both;
    the activation budget checked as ``Step`` checks it."""
    from memcalc.config import Step

    if step is None:
        step = _checked_step(optimizer, grad_accum, clip_grad_norm, compile, activation_budget)
    elif not isinstance(step, Step):
        raise ValueError(f"step: a memcalc.Step(optimizer=..., grad_accum=..., "
                         f"clip_grad_norm=..., compile=..., activation_budget=...), not "
                         f"{type(step).__name__}")
    elif (optimizer, grad_accum, clip_grad_norm, compile, activation_budget) != (
            None, 1, None, None, None):
        raise ValueError("step: it holds optimizer, grad_accum, clip_grad_norm, compile and "
                         "activation_budget; give them there only")
    if step.activation_budget is not None and step.compile == "eager":
        raise ValueError(f"activation_budget: {step.activation_budget:g} is the compiled "
                         f"step's; not with compile='eager'")
    return (step.optimizer, step.grad_accum, step.clip_grad_norm, step.compile,
            step.activation_budget)


def _checked_step(optimizer, grad_accum, clip_grad_norm, compile, activation_budget):
    """The keywords as a ``Step``, when its fields can hold them (an activation budget
    outside 0 to 1: one line naming it); else the keywords as they are, which the trace
    checks with its own words (an unknown optimizer, a compile mode)."""
    from types import SimpleNamespace

    from memcalc.compiling.variants import parse_budgets

    if activation_budget is not None:
        if isinstance(activation_budget, bool) or not isinstance(activation_budget,
                                                                 (int, float)):
            raise ValueError(f"activation_budget: a fraction from 0 to 1, not "
                             f"{activation_budget!r}")
        parse_budgets(repr(float(activation_budget)), "activation_budget")
    return SimpleNamespace(optimizer=optimizer, grad_accum=grad_accum,
                           clip_grad_norm=clip_grad_norm, compile=compile,
                           activation_budget=activation_budget)


def _mesh(mesh, options: dict):
    """``mesh=`` as a ``Mesh`` (a string as ``--mesh`` takes it), its cp set on the options
    (refused beside ``cp=``); None without it."""
    from memcalc.config import Mesh

    if mesh is None:
        return None
    if isinstance(mesh, str):
        mesh = Mesh.parse(mesh, "mesh")
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh: a memcalc.Mesh or a string such as 'dp_shard=4,cp=2', not "
                         f"{type(mesh).__name__}")
    if "cp" in options:
        raise ValueError("mesh: it gives the context parallelism (its cp axis); drop cp=")
    if mesh.cp > 1:
        options["cp"] = mesh.cp
    return mesh


def validate(backend: str = "emulated", impls: list[str] | None = None, grid=None):
    """Check predictions against the emulated trace or a live GPU: a ``Report``.

        >>> report = memcalc.validate(impls=["naive-weights"])
        >>> report.mismatches
        0
    """
    _needs_torch("memcalc.validate")
    from memcalc.validation import validate as run

    if impls is not None:
        impls = _names(impls, "impls", _impl_names())
    return run(backend=backend, impls=impls, grid=grid)
