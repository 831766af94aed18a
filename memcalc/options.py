"""The options the ``memcalc`` commands share, and what turns them into the library's
models: each command's parser gets them here (``shape_options``, ``input_options``,
``budget_options``, ...), and its ``run`` reads them back (``config_from``,
``calling_from``, ``budget_from``) and renders the result (``emit``, ``show``).

Below both ``memcalc.cli`` (the parser and ``main``) and ``memcalc/commands/``: a command
imports its options from here, never from the module that imports the commands. Imports
stay lazy so that ``memcalc breakdown`` never loads torch, matplotlib or pandas.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager
from typing import Iterator

from memcalc.errors import INTERRUPTED  # noqa: F401  (the commands' status on Ctrl-C)


class UsageError(Exception):
    """Bad input: reported as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """The commands' parser: bad input is one line (``UsageError``), not usage + message,
    in the format of every other error: argparse's ``argument --seq: ...`` (and ``not
    allowed with argument --json``) read ``--seq: ...``, as the configuration's do."""

    def error(self, message: str):
        import re

        raise UsageError(re.sub(r"(^|with )argument ", r"\1", message))


DTYPE_HELP = "fp32, fp16 or bf16; also float32, float16/half, bfloat16 (default fp32)"


class _Once(argparse.Action):
    """An option that takes one value: given twice, refused (argparse keeps the last)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string in getattr(namespace, "_given", set()):
            raise argparse.ArgumentError(self, f"given twice ({getattr(namespace, self.dest)}, "
                                               f"then {values}); it takes one value")
        namespace._given = getattr(namespace, "_given", set()) | {option_string}
        setattr(namespace, self.dest, values)


def whole(text: str) -> int:
    """A size option's value: ``16384``, ``1_000_000``, or a whole number in exponent
    notation (``1e6``, ``2.5e3``), read exactly. Zero and negatives pass here: the
    configuration refuses them with the field's allowed range."""
    from decimal import Decimal, InvalidOperation

    try:
        value = Decimal(str(text).strip())
    except InvalidOperation:
        value = None
    if value is None or not value.is_finite() or value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number (1024, 1_000_000 "
                                         f"or 1e6)")
    return int(value)


def shape_options(p: argparse.ArgumentParser, impls: str = "one") -> None:
    """The options that make a ``Config``; defaults are the benchmark's shape.
    ``impls="many"``: ``--impl`` takes a list (``impl_option``); ``"none"``: no ``--impl``
    (``memcalc trace`` traces the user's function)."""
    p.add_argument("--seq", type=whole, default=16384, help="sequence length N (default 16384)")
    p.add_argument("--batch", type=whole, default=8, help="batch size (default 8)")
    p.add_argument("--heads", type=whole, default=1, help="attention heads (default 1)")
    p.add_argument("--head-dim", type=whole, default=16, help="head dimension d (default 16)")
    p.add_argument("--dtype", default="fp32", help=DTYPE_HELP)
    if impls == "many":
        impl_option(p)
    elif impls == "one":
        p.add_argument("--impl", default="naive", action=_Once,
                       help="implementation (memcalc impls; default naive, the custom softmax "
                            "that keeps exp_x; naive-softmax is torch.softmax attention)")
    step_options(p, chunk=impls != "none")  # a traced target's own code has no --chunk


def impl_option(p: argparse.ArgumentParser, default: str | None = None,
                *aliases: str) -> None:
    """``--impl``, the same on every command that takes several: repeat it or give a comma
    list (``--impl naive,flash2``), or ``all``; checked by ``memcalc.names.impl_list``."""
    every = "every implementation" if default is None else default
    p.add_argument("--impl", *aliases, dest="impl", action="append", default=None,
                   metavar="IMPL[,IMPL]",
                   help=f"implementations (memcalc impls): repeat or comma-separate, or 'all' "
                        f"(default: {every})")


def step_options(p: argparse.ArgumentParser, chunk: bool = True, cp: bool = True) -> None:
    """The single-valued options besides the sizes (``memcalc sweep`` lists the sizes);
    ``chunk``: ``--chunk`` and ``--mask``, for commands that run memcalc's implementations
    (a traced target's own code has neither: it builds its chunks and masks); ``cp``:
    ``--cp`` (``memcalc sweep`` takes a list of its own)."""
    p.add_argument("--kv-len", type=whole, default=None, help="key/value length (default: --seq)")
    p.add_argument("--kv-heads", type=whole, default=None, help="key/value heads (GQA; default: --heads)")
    p.add_argument("--causal", action="store_true", help="causal mask")
    if chunk:
        p.add_argument("--chunk", type=whole, default=None,
                       help="chunk length of chunked implementations (default 64)")
    p.add_argument("--gpu", default="h100-80gb", help="GPU preset (memcalc gpus)")
    p.add_argument("--loss", default=None,
                   help="grad: out.backward(grad_out) (default); sum: out.sum().backward()")
    p.add_argument("--forward-only", action="store_true", help="inference under no_grad")
    if chunk:
        p.add_argument("--mask", default=None,
                       help="the mask: flex's BlockMask (causal, sliding:W, document:L) or "
                            "sdpa-efficient's bool attn_mask (padding: (B, 1, 1, M); full: "
                            "(B, 1, N, M))")
        p.add_argument("--block-mask", default=None, choices=("given", "dense"),
                       help="flex: the BlockMask built before the step (given, default) or "
                            "by create_block_mask run eagerly in it (dense: the N x M mask "
                            "it builds, and its int64 copy)")
    p.add_argument("--deterministic", action="store_true",
                   help="the kernels' deterministic backward (flash-attn, flash-attn3)")
    parallel_options(p, cp)


def parallel_options(p: argparse.ArgumentParser, cp: bool = True) -> None:
    """Several GPUs: ``--tp`` (heads over ranks) and, with ``cp``, ``--cp`` and
    ``--cp-method`` (the sequence over ranks; ``memcalc sweep`` lists ``--cp`` itself)."""
    if cp:
        p.add_argument("--cp", type=whole, default=None, metavar="P",
                       help="context-parallel ranks: the sequence split over P GPUs as "
                            "PyTorch's ring attention splits it (sdpa-flash, sdpa-cudnn, "
                            "sdpa-efficient; --causal; N a multiple of 2P), or as "
                            "DeepSpeed-Ulysses does (--cp-method ulysses); figures are the "
                            "busiest rank's")
    p.add_argument("--cp-method", default=None, metavar="METHOD",
                   help="how context-parallel ranks exchange K/V: allgather (PyTorch's "
                        "default) or alltoall; ulysses: DeepSpeed-Ulysses' all-to-alls "
                        "of heads for rows (sdpa-flash, sdpa-cudnn, sdpa-efficient, "
                        "flash-attn, sdpa-math, naive, naive-softmax, naive-weights; P "
                        "divides the heads)")
    p.add_argument("--tp", type=whole, default=None, metavar="T",
                   help="tensor-parallel ranks: the heads (and key/value heads) split over T")
    p.add_argument("--cublas-workspace-config", default=None, metavar="CFG",
                   help='CUBLAS_WORKSPACE_CONFIG, e.g. ":4096:8"')
    p.add_argument("--alloc-conf", default=None, metavar="CONF",
                   help="PYTORCH_ALLOC_CONF, the caching allocator's settings, e.g. "
                        "expandable_segments:True (default: that variable, or "
                        "PYTORCH_CUDA_ALLOC_CONF, when set; else the allocator's defaults)")


def input_options(p: argparse.ArgumentParser) -> None:
    """What a traced target is called with (``memcalc.engine.inputs``)."""
    p.add_argument("--input", action="append", default=None, metavar="NAME=DIMS[:DTYPE]",
                   help="an argument of the traced target, repeated for each, in call order "
                        "or by parameter name: DIMS a comma list of whole numbers and the "
                        "letters B, N, M, H, K, D (--batch, --seq, --kv-len, --heads, "
                        "--kv-heads, --head-dim) or products (H*D); DTYPE default --dtype "
                        "(bool, int64, ... for masks and ids; then :ones, :zeros, :arange or "
                        ":padded for their values). Example: --input x=B,N,768")
    p.add_argument("--no-grad", action="append", default=[], metavar="NAME",
                   help="a floating input that needs no gradient (repeatable)")
    p.add_argument("--autocast", default=None, metavar="DTYPE",
                   help="run the forward under torch.autocast('cuda', dtype) as mixed-precision "
                        "training does: bf16 or fp16 (CUDA's autocast policy; autocast written "
                        "in the code itself is followed without this)")
    p.add_argument("--param-dtype", default=None, metavar="DTYPE",
                   help="the module's floating parameters and buffers in this dtype, as "
                        "model.to(dtype) makes them for pure bf16 training (default: as built)")
    p.add_argument("--torch", metavar="X.Y", default=None,
                   help="the torch release whose SDPA backend rules apply (default: the "
                        "installed torch; a release without written rules is refused, naming "
                        "those known)")
    p.add_argument("--optimizer", default=None, metavar="NAME[:IMPL]",
                   help="train the target's parameters: the step adds optimizer.step() and "
                        "zero_grad(set_to_none=True), a training loop's: adamw, adam or sgd "
                        "(momentum 0.9), foreach as torch picks on CUDA, or :fused, :forloop")
    p.add_argument("--grad-accum", type=whole, default=1, metavar="K",
                   help="forward and backward passes per optimizer step, grads accumulating "
                        "(default 1)")
    p.add_argument("--clip-grad-norm", default=None, metavar="MAX",
                   help="clip the grads to a total norm of MAX before the optimizer step, "
                        "as torch.nn.utils.clip_grad_norm_(params, MAX, foreach=True) "
                        "(torchtitan's and the Hugging Face Trainer's loops do, with 1.0)")
    p.add_argument("--compile", nargs="?", const="default", default=None, metavar="MODE",
                   help="default (the flag alone): compile the target as torch.compile does, "
                        "with inductor, as the GPU runs it; eager: leave the code's own "
                        "torch.compile calls uncompiled (the eager step's figures, said in "
                        "the notes). Without it the code's own calls are compiled")
    p.add_argument("--fsdp", default=None, metavar="P",
                   help="shard the module with PyTorch's FSDP2 over P ranks (fully_shard on "
                        "each repeated layer, then the root, as torchtitan does); the busiest "
                        "rank is shown, every rank in --json. With --cp: the same P ranks. "
                        "oom and sweep take a list (1,2,4,8): a row or series each")
    p.add_argument("--mesh", default=None, metavar="AXIS=SIZE,...",
                   help="the ranks by torchtitan's axes: dp_replicate (HSDP replicas), "
                        "dp_shard (FSDP shards), cp (context parallelism: the sequence "
                        "split), tp (tensor parallelism), e.g. dp_shard=4,cp=2; FSDP over "
                        "dp_shard x cp, the ring over cp; --fsdp-apply's function gets the "
                        "mesh of these axes (with dp_shard_cp flattened). In place of --fsdp, "
                        "--cp and --fsdp-tp")
    p.add_argument("--reshard-after-forward", default="default", metavar="POLICY",
                   help="FSDP's reshard_after_forward, as torchtitan's policy: default "
                        "(every layer but the last), always or never")
    p.add_argument("--fsdp-param-dtype", default=None, metavar="DTYPE",
                   help="FSDP's MixedPrecisionPolicy param_dtype: the all-gathered "
                        "parameters' dtype (bf16; default: the parameters' own)")
    p.add_argument("--fsdp-apply", default=None, metavar="FILE.py:FUNCTION",
                   help="your own apply(model, mesh) calling fully_shard (as torchtitan's "
                        "apply_fsdp does), called on each rank's copy of the model instead "
                        "of memcalc's torchtitan-style sharding; traced as written")
    p.add_argument("--fsdp-tp", type=whole, default=None, metavar="T",
                   help="tensor-parallel ranks in each FSDP rank group: --fsdp-apply's "
                        "function gets a 2-D mesh ('dp_shard', 'tp') of P x T ranks and "
                        "applies the model's plan (parallelize_module) over mesh['tp']")
    p.add_argument("--fsdp-reduce-dtype", default=None, metavar="DTYPE",
                   help="FSDP's MixedPrecisionPolicy reduce_dtype: the gradients' "
                        "reduce-scatter dtype (fp32; default: torch's, the param dtype up to "
                        "2.14, each parameter's own dtype from 2.15)")


def release_of(args) -> dict:
    """``--torch X.Y`` as ``TraceOptions``' keyword: that release's SDPA rules (none given:
    the installed torch's, the options' default)."""
    from memcalc.impls.sdpa_select import Release

    return {} if args.torch is None else {"release": Release.of(args.torch)}


def calling_from(args, fn):
    """``--input``, ``--no-grad``, ``--autocast``, ``--param-dtype``, ``--optimizer``,
    ``--grad-accum`` and ``--clip-grad-norm`` as the ``memcalc.tracing.Calling`` of ``fn`` (raises its TraceError
    when they do not fit it)."""
    from memcalc.engine.inputs import inputs_of
    from memcalc.names import autocast_dtype, torch_dtype
    from memcalc.tracing import Calling, check_inputs
    from memcalc.tracing.optimizers import loop_of

    autocast = autocast_dtype(args.autocast)
    param_dtype = torch_dtype(args.param_dtype, "--param-dtype")
    if not args.input and args.no_grad:
        raise ValueError(f"--no-grad {args.no_grad[0]}: give the inputs with --input first "
                         f"(without it the target takes q, k, v, which need grad)")
    inputs = inputs_of(args.input, args.no_grad) if args.input else None
    loop = loop_of(args.optimizer, args.grad_accum, clip_grad_norm=args.clip_grad_norm)
    return Calling(check_inputs(fn, inputs), autocast, param_dtype, loop, sharding_from(args))


def sharding_from(args):
    """``--fsdp P`` and its options as a ``memcalc.tracing.fsdp.Sharding`` (None without
    it); its options without it are refused, not ignored."""
    from memcalc.names import torch_dtype
    from memcalc.tracing.fsdp import sharding_of

    mesh = mesh_of(args)
    worlds = fsdp_worlds(args.fsdp)
    if mesh is not None and (worlds is not None or args.fsdp_tp is not None
                             or getattr(args, "cp", None) is not None):
        raise ValueError(f"--mesh {args.mesh}: it lays out every rank; drop --fsdp, --cp and "
                         f"--fsdp-tp (dp_shard=, cp=, tp= are its axes)")
    if worlds is not None and len(worlds) > 1:
        raise ValueError(f"--fsdp {args.fsdp}: one number of ranks here (memcalc oom takes a "
                         f"list, a row each)")
    if worlds is None and mesh is None:
        for flag, value in (("--reshard-after-forward", None if args.reshard_after_forward
                             == "default" else args.reshard_after_forward),
                            ("--fsdp-param-dtype", args.fsdp_param_dtype),
                            ("--fsdp-reduce-dtype", args.fsdp_reduce_dtype),
                            ("--fsdp-apply", args.fsdp_apply),
                            ("--fsdp-tp", args.fsdp_tp)):
            if value is not None:
                raise ValueError(f"{flag} {value}: an FSDP option; give --fsdp P")
    apply = None
    if args.fsdp_apply is not None and (worlds or mesh):
        from memcalc.tracing import load_function

        apply = load_function(args.fsdp_apply)
    return sharding_of(worlds[0] if worlds else None, args.reshard_after_forward,
                       torch_dtype(args.fsdp_param_dtype, "--fsdp-param-dtype"),
                       torch_dtype(args.fsdp_reduce_dtype, "--fsdp-reduce-dtype"),
                       apply=apply, apply_name=args.fsdp_apply or "",
                       tp=args.fsdp_tp if args.fsdp_tp is not None else 1, mesh=mesh)


def mesh_of(args):
    """``--mesh`` as a ``memcalc.config.Mesh``, or None."""
    if getattr(args, "mesh", None) is None:
        return None
    from memcalc.config import Mesh

    return Mesh.parse(args.mesh)


def fsdp_worlds(text) -> list[int] | None:
    """``--fsdp``'s numbers of ranks: ``8``, or a list ``1,2,4,8``; None without it."""
    if text is None:
        return None
    try:
        return [whole(part) for part in str(text).split(",")]
    except argparse.ArgumentTypeError:
        raise ValueError(f"--fsdp: {text!r} is not a whole number of ranks (8) or a list of "
                         f"them (1,2,4,8)") from None


def compile_budget_option(p: argparse.ArgumentParser, each: str) -> None:
    """``--compile-budget B,B,...``: the compiled step at each activation memory budget,
    ``each`` saying what a budget gets."""
    p.add_argument("--compile-budget", metavar="B,B,...", default=None,
                   help=f"the compiled step at each activation memory budget (torch's "
                        f"activation_memory_budget, 0 to 1: the share of saved activations "
                        f"the partitioner keeps), {each}; with --compile eager,default the "
                        f"eager step beside them")


def compile_steps(args) -> tuple[tuple[str | None, float | None], ...]:
    """The ``(compile mode, activation budget)`` of each step asked for: one, unless
    ``--compile eager,default`` or ``--compile-budget`` with several values ask for more
    (a single budget is one step)."""
    given = getattr(args, "compile_budget", None)
    if given is None and "," not in (args.compile or ""):
        return ((args.compile, None),)
    from memcalc.compiling.variants import parse_budgets, parse_modes

    budgets = parse_budgets(given)
    if budgets and "default" not in (args.compile or "default").split(","):
        raise ValueError(f"--compile-budget {given}: the budget is the compiled step's; "
                         f"not with --compile {args.compile} (add default: --compile "
                         f"eager,default)")
    return parse_modes(args.compile, budgets)


def impls_with_trace(args, activation_budget: float | None = None,
                     several: bool = False) -> list[str] | None:
    """The implementations asked for: ``--impl a,b``, and ``--trace`` registered as one (one
    a number of ranks under ``--fsdp 1,2,4``): what ``oom`` solves and ``sweep`` tabulates.
    ``several``: one of several steps (``--compile eager,default``), named by its own
    (``step_label``)."""
    from memcalc.names import impl_list

    impls = impl_list(args.impl)
    multiple_of = getattr(args, "multiple_of", None)  # oom's
    if args.trace is None:
        given = traced_options_given(args) or (
            f"--multiple-of {multiple_of}" if multiple_of is not None else None)
        if given:
            raise ValueError(f"{given}: an option of a traced target; give --trace "
                             f"FILE.py:FUNCTION")
        return impls
    if multiple_of is not None and multiple_of < 1:
        raise ValueError(f"--multiple-of: a whole number of rows, at least 1 (got "
                         f"{multiple_of})")
    import torch  # noqa: F401  (missing: memcalc.cli says how to install it, exit 2)

    from memcalc.tracing import load_function, register_function

    worlds = fsdp_worlds(args.fsdp) or [None]
    with about_target(args.trace, compile=args.compile, activation_budget=activation_budget):
        fn = load_function(args.trace)
        callings = [calling_from(_with_fsdp(args, world), fn) for world in worlds]
    from memcalc.tracing import TraceOptions

    options = TraceOptions(**release_of(args))
    from memcalc.compiling.variants import step_label

    step = f" ({step_label(args.compile, activation_budget)})" if several else ""
    label = lambda c: args.trace + step if len(worlds) == 1 else \
        f"{args.trace}{step} {c.fsdp.text()}"  # noqa: E731
    return (impls or []) + [register_function(fn, label(c), c, options, multiple_of or 1,
                                              fsdp_in_title=len(worlds) == 1)
                            for c in callings]


@contextmanager
def about_target(spec: str | None, argument: str = "--trace", compile: str | None = None,
                 activation_budget: float | None = None) -> Iterator[None]:
    """A ``TraceError`` inside (the traced target ``spec`` cannot be loaded, called or
    traced) as the one line every command gives of it, naming the argument that named the
    target: ``--trace SPEC: why`` (``oom``, ``sweep``, ``validate``), ``target SPEC: why``
    (``trace``'s positional); its first line, the tracer's own ``--trace SPEC: `` dropped;
    one naming an option (``--kv-len: ...``) as it is. No target: nothing imported.
    Inside, the code's ``torch.compile`` calls run as ``compile`` says (``--compile``:
    ``memcalc.compiling``), at ``activation_budget`` (``--compile-budget``)."""
    if spec is None:
        yield
        return
    from memcalc.compiling.session import calls
    from memcalc.tracing.errors import TraceError

    try:
        with calls(compile, activation_budget=activation_budget):
            yield
    except TraceError as error:
        text = str(error).removeprefix(f"--trace {spec}: ")
        line = (text.splitlines() or [""])[0]
        raise ValueError(line if line.startswith("--") else f"{argument} {spec}: {line}"
                         ) from None


def _with_fsdp(args, world: int | None):
    """``args`` with ``--fsdp`` one of its list's numbers of ranks (oom solves each)."""
    import copy

    one = copy.copy(args)
    one.fsdp = None if world is None else str(world)
    return one


def traced_options_given(args) -> str | None:
    """The first of a traced target's options given (``--input x=...``), for a command
    told no target."""
    for flag, value in (("--input", (args.input or [None])[0]), ("--autocast", args.autocast),
                        ("--param-dtype", args.param_dtype), ("--torch", args.torch),
                        ("--no-grad", (args.no_grad or [None])[0]),
                        ("--optimizer", args.optimizer),
                        ("--grad-accum", args.grad_accum if args.grad_accum != 1 else None),
                        ("--clip-grad-norm", args.clip_grad_norm),
                        ("--compile", args.compile),
                        ("--compile-budget", getattr(args, "compile_budget", None)),
                        ("--fsdp", args.fsdp)):
        if value is not None:
            return f"{flag} {value}"
    return None


def budget_options(p: argparse.ArgumentParser) -> None:
    """The device budget: ``--gpu``'s memory (or ``--gpu-gb``) less ``--reserve``."""
    p.add_argument("--gpu-gb", default=None, metavar="X",
                   help="device memory in GiB (2^30 B, as GPUs are sold), instead of the "
                        "--gpu preset's (whose compute capability still sets the cuBLAS "
                        "workspace); 79.11 is rounded down to a whole byte")
    p.add_argument("--reserve", default=None, metavar="SIZE",
                   help="memory the allocator cannot have: CUDA context, other processes "
                        "(default 512MiB; units B, KiB, MiB, GiB, TiB, and KB, MB, GB, TB "
                        "the same powers of 2; a bare number is bytes)")


def budget_from(args):
    """The ``Budget`` the options describe (``memcalc.analysis.budget``)."""
    from memcalc.analysis.budget import Budget
    from memcalc.config import Device

    return Budget.given(Device(gpu=args.gpu), args.gpu_gb, args.reserve)


FORMATS = {"json": "print the result as JSON (every figure; bytes as integers)",
           "csv": "print the table's rows as CSV, for a spreadsheet",
           "markdown": "print the tables as Markdown"}


def work_options(p: argparse.ArgumentParser, time_limit: bool = True) -> None:
    """What a command may take: ``--memory-limit`` (``memcalc.engine.work``) and, with
    ``time_limit``, ``--time-limit`` for the whole command (``oom`` has its own, per
    implementation)."""
    p.add_argument("--memory-limit", default=None, metavar="SIZE",
                   help="refuse, before starting, what would take more of this machine's "
                        "memory (default 8GiB; none: no limit): a chunked loop at 10^8 rows, "
                        "a sweep of 10^8 lengths, take tens of GiB")
    if time_limit:
        p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                       help="stop with one line past this many seconds (default: none)")


@contextmanager
def limits(args) -> Iterator[None]:
    """The command's ``--memory-limit`` and ``--time-limit`` (a deadline for its builds
    and replays; oom's limits each implementation's search instead)."""
    import time

    from memcalc.engine.deadline import deadline
    from memcalc.engine.work import DEFAULT_MEMORY_LIMIT, memory_limit

    text = getattr(args, "memory_limit", None)
    nbytes = DEFAULT_MEMORY_LIMIT if text is None else (
        None if text.strip().lower() == "none" else parse_size_option(text, "--memory-limit"))
    seconds = getattr(args, "time_limit", None) if args.command != "oom" else None
    if seconds is not None and not 0 < seconds < float("inf"):
        raise ValueError(f"--time-limit: a positive number of seconds (got {seconds:g})")
    with memory_limit(nbytes), deadline(None if seconds is None else time.perf_counter() + seconds):
        yield


def parse_size_option(text: str, option: str) -> int:
    """A positive size (``memcalc.analysis.budget.parse_size``'s units) for ``option``."""
    from memcalc.analysis.budget import parse_size

    nbytes = parse_size(text, option)
    if nbytes < 1:
        raise ValueError(f"{option}: a positive size such as 16GiB, or none (got {text!r})")
    return nbytes


def format_options(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    for fmt, help in FORMATS.items():
        g.add_argument(f"--{fmt}", dest="format", action="store_const", const=fmt, help=help)


def config_from(args, **overrides):
    """The ``Config`` the options describe (raises pydantic's ValidationError)."""
    from memcalc.config import make_config
    from memcalc.names import check_impl

    if "impl" not in overrides:
        check_impl(args.impl)
    return make_config(**{**config_options(args), "impl": getattr(args, "impl", None),
                          **overrides})


def alloc_conf_of(args) -> str | None:
    """``--alloc-conf``, else the caching allocator's settings in the environment, as a
    launch script sets them for the run (torchtitan's sets expandable_segments:True):
    ``PYTORCH_ALLOC_CONF``, or its older name ``PYTORCH_CUDA_ALLOC_CONF``, which torch
    reads when the first is not set (``c10/core/AllocatorConfig.cpp``)."""
    import os

    given = getattr(args, "alloc_conf", None)
    if given is not None:
        return given
    return (os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
            or None)


def config_options(args) -> dict:
    """The options' ``make_config`` keywords, but the implementation."""
    flat = dict(seq_len=args.seq, batch=args.batch, heads=args.heads, head_dim=args.head_dim,
                kv_len=args.kv_len, kv_heads=args.kv_heads, dtype=args.dtype,
                causal=args.causal, gpu=args.gpu, loss=loss_of(args),
                forward_only=args.forward_only, deterministic=args.deterministic,
                cublas_workspace_config=args.cublas_workspace_config,
                alloc_conf=alloc_conf_of(args))
    if getattr(args, "chunk", None) is not None:
        flat["chunk"] = args.chunk
    if getattr(args, "mask", None) is not None:
        flat["mask"] = args.mask
    if getattr(args, "block_mask", None) is not None:
        flat["block_mask"] = args.block_mask
    for option in ("cp", "cp_method", "tp"):
        if getattr(args, option, None) is not None:
            flat[option] = getattr(args, option)
    mesh = mesh_of(args)
    if mesh is not None and mesh.cp > 1:  # the sequence over its cp axis
        flat["cp"] = mesh.cp
    return flat


def loss_of(args) -> str:
    """``--loss``, ``grad`` by default; refused with ``--forward-only``, which runs no
    backward for a loss to start (not ignored)."""
    if args.loss is not None and args.forward_only:
        raise ValueError(f"--loss {args.loss}: --forward-only runs no backward; give one or "
                         f"the other")
    return "grad" if args.loss is None else args.loss


def check_chunk(args, names: list[str] | None) -> None:
    """``--chunk`` given for implementations none of which has chunks: refused, not
    ignored (with several, it applies to those that have)."""
    from memcalc.impls import IMPLS

    if args.chunk is None or names is None or any(IMPLS[n].chunked for n in names):
        return
    chunked = ", ".join(n for n, impl in IMPLS.items() if impl.chunked)
    raise ValueError(f"--chunk: {', '.join(names)} has no chunks; only {chunked} read it")


def emit(result, fmt: str | None) -> None:
    """Print ``result`` as a rich renderable or in the chosen text format."""
    if fmt is None:
        show(result)
        return
    from memcalc.output.render import to_json

    text = {"json": to_json, "csv": lambda r: r.to_csv(), "markdown": lambda r: r.to_markdown()}
    sys.stdout.write(text[fmt](result))


PIPED_WIDTH = 200
"""Columns of output that does not go to a terminal (rich would assume 80): wide enough for
every table side by side, so that a pipe or a file gets the full layout."""


def show(renderable) -> None:
    """Print ``renderable`` to stdout: styled at the terminal's width; piped, as plain text
    at ``COLUMNS`` (else ``PIPED_WIDTH``) columns with no trailing spaces."""
    from rich.console import Console

    from memcalc.output.render import text

    out = Console()
    if out.is_terminal:
        out.print(renderable)
        return
    columns = os.environ.get("COLUMNS", "")
    sys.stdout.write(text(renderable, out.width if columns.isdigit() else PIPED_WIDTH))


def check_output(path: str | None, option: str) -> None:
    """Fail before any work, naming ``option``, when ``path`` cannot become a file."""
    if not path:
        return
    parent = os.path.dirname(path) or "."
    if os.path.isdir(path):
        raise ValueError(f"{option}: {path!r} is a directory, not a file")
    if not os.path.isdir(parent):
        raise ValueError(f"{option}: {path!r}: no directory {parent!r} to write it into")


@contextmanager
def naming(option: str) -> Iterator[None]:
    """Re-raise an OSError or ValueError from writing or reading ``option``'s file, or a
    missing extra (``--plot`` without matplotlib), as a one-line ValueError that names the
    option."""
    from memcalc.errors import MissingExtra

    try:
        yield
    except (OSError, ValueError, MissingExtra) as error:
        from memcalc.errors import one_line

        text = one_line(error)
        raise ValueError(text if text.startswith(option) else f"{option}: {text}") from None


@contextmanager
def plotting(path: str, what: str) -> Iterator[None]:
    """Draw ``--plot``'s file inside (a failure is one line naming the option), then say on
    stderr which file was written and what it shows: matplotlib adds ``.png`` to a name
    without an extension (``--plot step`` wrote ``step.png`` without a word)."""
    with naming("--plot"):
        yield
    written = path if os.path.splitext(path)[1] else f"{path}.png"
    print(f"memcalc: wrote {written}: {what}", file=sys.stderr)

