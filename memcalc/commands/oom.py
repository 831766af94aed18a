"""``memcalc oom``: the largest seq_len (or batch, or head_dim) whose step fits, per implementation."""

from memcalc.options import (INTERRUPTED, about_target, budget_from, budget_options, check_chunk,
                             compile_budget_option, compile_steps, config_options, emit,
                             format_options, impls_with_trace, input_options, shape_options,
                             whole, work_options)
from memcalc.engine.deadline import DEFAULT_WORK_LIMIT

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
    compile_budget_option(parser, "a longest length each (with --trace)")
    parser.add_argument("--multiple-of", type=whole, default=None, metavar="M",
                        help="with --trace: only sequence lengths that are multiples of M, "
                             "the lengths you run (a step with padded buffers is solved from "
                             "a program fitted at multiples of 256, other lengths traced "
                             "directly)")
    parser.add_argument("--work-limit", type=_events, default=DEFAULT_WORK_LIMIT,
                        metavar="EVENTS",
                        help="give up on an implementation after replaying this many "
                             "allocator events, saying what is known so far: the same "
                             f"answer on any machine (default: {DEFAULT_WORK_LIMIT:,}, "
                             "about a minute; none: no limit; a chunked program at "
                             "millions of rows replays millions of events at each length)")
    parser.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                        help="give up on an implementation after this long as well "
                             "(default: none; the answer then depends on the machine's "
                             "speed and load)")
    work_options(parser, time_limit=False)
    format_options(parser)


def _events(text: str) -> int | None:
    """``--work-limit``'s value: a whole number (``whole``; zero and negatives are refused
    with the limit's allowed range), or ``none``: no limit."""
    return None if text.strip().lower() == "none" else whole(text)


def run(args) -> int:
    """Each step asked for solved (one, unless ``--compile eager,default`` or
    ``--compile-budget`` ask for more), in one report; Ctrl-C: what is known so far."""
    from memcalc.analysis.thresholds import PartialReport, merged
    from memcalc.names import solve_field

    field = solve_field(args.solve)
    steps = compile_steps(args) if args.trace is not None else ((args.compile, None),)
    labelled = len(steps) > 1 or steps[0][1] is not None  # rows named by their step
    reports = []
    try:
        for index, (mode, activation_budget) in enumerate(steps):
            reports.append(_solved(args, field, index == 0, mode, activation_budget, labelled))
    except PartialReport as stop:  # Ctrl-C: what is known so far is the whole answer
        emit(merged([*reports, stop.report]), args.format)
        return INTERRUPTED
    emit(merged(reports), args.format)
    return 0


def _solved(args, field, first: bool, mode, activation_budget, labelled: bool):
    """The report of one step: the target compiled as ``mode`` says at
    ``activation_budget``, in a compiler session of its own (a budget holds for a whole
    session), with ``--impl``'s implementations when ``first``."""
    import copy

    from memcalc.analysis.thresholds import solve
    from memcalc.config import first_accepted
    from memcalc.output.progress import status

    one = copy.copy(args)
    one.compile, one.impl = mode, args.impl if first else None
    impls = impls_with_trace(one, activation_budget, several=labelled)
    check_chunk(one, impls)
    with about_target(args.trace, compile=mode, activation_budget=activation_budget), \
            status(f"solving {field}"):  # a loop: a minute
        base = first_accepted(impls, **config_options(one))
        return solve(base, budget_from(args), field, impls, args.time_limit,
                     work_limit=args.work_limit)
