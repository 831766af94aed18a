"""``memcalc oom``: the largest seq_len (or batch, or head_dim) whose step fits, per implementation."""

from memcalc.cli import (INTERRUPTED, budget_from, budget_options, calling_from, check_chunk,
                         config_options, emit, format_options, fsdp_worlds, input_options,
                         shape_options, traced_options_given, whole, work_options)

HELP = "largest seq_len (--solve batch, head-dim) whose step fits the GPU, per implementation"


def add_arguments(parser) -> None:
    shape_options(parser, impls="many")
    budget_options(parser)
    parser.add_argument("--solve", default="seq", metavar="FIELD",
                        help="what to maximise: seq (default), batch or head-dim; the search "
                             "starts from that size's default, whatever its option says "
                             "(unless the implementation refuses the default); the other "
                             "options fix the rest")
    parser.add_argument("--trace", default=None, metavar="FILE.py:FUNCTION",
                        help="solve for your own function or module, traced on the meta "
                             "device (imports and runs the named file as Python code), "
                             "called with q, k, v or --input's tensors")
    input_options(parser)
    parser.add_argument("--multiple-of", type=whole, default=None, metavar="M",
                        help="with --trace: only sequence lengths that are multiples of M, "
                             "the lengths you run (a step with padded buffers is solved from "
                             "a program fitted at multiples of 256, other lengths traced "
                             "directly)")
    parser.add_argument("--time-limit", type=float, default=60.0, metavar="SECONDS",
                        help="give up on an implementation after this long, saying what is "
                             "known so far (default: 60; a chunked program at millions of "
                             "rows replays for minutes)")
    work_options(parser, time_limit=False)
    format_options(parser)


def run(args) -> int:
    from memcalc.config import first_accepted
    from memcalc.output.progress import status
    from memcalc.analysis.thresholds import PartialReport, solve

    from memcalc.names import solve_field

    field = solve_field(args.solve)
    impls = _impls(args)
    check_chunk(args, impls)
    base = first_accepted(impls, **config_options(args))
    try:
        with status(f"solving {field}"):  # a chunked loop's search replays for a minute
            report = solve(base, budget_from(args), field, impls, args.time_limit)
    except PartialReport as stop:  # Ctrl-C: what is known so far is the whole answer
        emit(stop.report, args.format)
        return INTERRUPTED
    emit(report, args.format)
    return 0


def _impls(args) -> list[str] | None:
    """The implementations asked for: ``--impl a,b``, and ``--trace`` registered as one."""
    from memcalc.names import impl_list

    impls = impl_list(args.impl)
    if args.trace is None:
        given = traced_options_given(args) or (
            f"--multiple-of {args.multiple_of}" if args.multiple_of is not None else None)
        if given:
            raise ValueError(f"{given}: an option of a traced target; give --trace "
                             f"FILE.py:FUNCTION")
        return impls
    if args.multiple_of is not None and args.multiple_of < 1:
        raise ValueError(f"--multiple-of: a whole number of rows, at least 1 (got "
                         f"{args.multiple_of})")
    import torch  # noqa: F401  (missing: memcalc.cli says how to install it, exit 2)

    from memcalc.tracing import TraceError, load_function, register_function

    fn = load_function(args.trace)
    worlds = fsdp_worlds(args.fsdp) or [None]
    try:
        callings = [calling_from(_with_fsdp(args, world), fn) for world in worlds]
    except TraceError as error:
        raise ValueError(f"--trace {args.trace}: {error}") from None
    from memcalc.cli import release_of
    from memcalc.tracing import TraceOptions

    options = TraceOptions(**release_of(args))
    label = lambda c: args.trace if len(worlds) == 1 else f"{args.trace} {c.fsdp.text()}"  # noqa: E731
    return (impls or []) + [register_function(fn, label(c), c, options, args.multiple_of or 1,
                                              fsdp_in_title=len(worlds) == 1)
                            for c in callings]


def _with_fsdp(args, world: int | None):
    """``args`` with ``--fsdp`` one of its list's numbers of ranks (oom solves each)."""
    import copy

    one = copy.copy(args)
    one.fsdp = None if world is None else str(world)
    return one
