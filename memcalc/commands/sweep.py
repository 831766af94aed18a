"""``memcalc sweep``: scaling tables, every figure over a grid of shapes."""

from argparse import ArgumentTypeError
from math import prod

from memcalc.options import (DTYPE_HELP, budget_options, check_output, compile_budget_option,
                             format_options, impl_option, input_options, plotting, step_options,
                             whole, work_options)

HELP = "scaling tables over lists of seq lengths, head dims, batches, heads, impls, dtypes"


def int_ranges(text: str, option: str) -> list[range]:
    """``"256,1024"`` or ranges ``"256:4096:256"`` (start:stop:step, stop included), as
    ranges not yet made: a sweep's size is known (and refused, ``memcalc.engine.work``) before a
    hundred million lengths are."""
    ranges: list[range] = []
    for part in text.split(","):
        bits = part.strip().split(":")
        try:
            if len(bits) == 1:
                ranges.append(range(whole(bits[0]), whole(bits[0]) + 1))
            elif len(bits) == 3:
                start, stop, step = (whole(b) for b in bits)
                if step < 1 or stop < start:
                    raise ValueError
                ranges.append(range(start, stop + 1, step))
            else:
                raise ValueError
        except (ValueError, ArgumentTypeError):
            raise ValueError(f"{option}: {text!r} is not a comma-separated list of positive "
                             f"integers (or start:stop:step ranges)") from None
    if min(r[0] for r in ranges) < 1 or max(r[-1] for r in ranges) >= 2**62:
        raise ValueError(f"{option}: {text!r} is not a comma-separated list of positive integers "
                         "below 2^62")
    return ranges


def name_list(text: str, option: str) -> list[str]:
    names = [n.strip() for n in text.split(",")]
    if not all(names):
        raise ValueError(f"{option}: {text!r} is not a comma-separated list of names")
    return names


def add_arguments(p) -> None:
    p.add_argument("--seq", default="256,1024,4096,8192,16384", metavar="LIST",
                   help="sequence lengths (default: 256,1024,4096,8192,16384)")
    p.add_argument("--head-dim", default="16", metavar="LIST", help="head dims (default 16)")
    p.add_argument("--batch", default="8", metavar="LIST", help="batch sizes (default 8)")
    p.add_argument("--heads", default="1", metavar="LIST", help="heads (default 1)")
    impl_option(p, "naive")
    p.add_argument("--dtype", default="fp32", metavar="LIST", help=f"a list of {DTYPE_HELP}")
    step_options(p, cp=False)
    p.add_argument("--cp", default="1", metavar="LIST",
                   help="context-parallel ranks (default 1): a list sweeps each, the busiest "
                        "rank's figures (PyTorch's ring: sdpa-flash, sdpa-cudnn, "
                        "sdpa-efficient; --causal; lengths multiples of 2P; or --cp-method "
                        "ulysses)")
    budget_options(p)
    p.add_argument("--trace", default=None, metavar="FILE.py:FUNCTION",
                   help="sweep your own function or module, traced on the meta device "
                        "(imports and runs the named file), its program fitted over lengths; "
                        "--fsdp 1,2,4,8 sweeps the number of FSDP ranks")
    input_options(p)
    compile_budget_option(p, "a series each (with --trace)")
    p.add_argument("--pivot", default=None, metavar="FIGURE",
                   help="one figure as a table with a row per seq_len and a column per "
                        "head_dim: peak, saved, reserved, forward or backward")
    p.add_argument("--bytes", action="store_true", help="exact bytes in the tables, not MiB")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="also draw the reserved peak (what must fit) against seq_len, log-log, "
                        "with the budget and each line's largest fitting seq_len (needs "
                        "matplotlib)")
    work_options(p)
    format_options(p)


def run(args) -> int:
    """Each step asked for swept (one, unless ``--compile eager,default`` or
    ``--compile-budget`` ask for more: a series each), in one table."""
    from memcalc.analysis.scaling import FIGURE_KEY, merged
    from memcalc.names import unknown
    from memcalc.options import compile_steps, emit

    grid = {option: int_ranges(getattr(args, key), option) for option, key in (
        ("--seq", "seq"), ("--head-dim", "head_dim"), ("--batch", "batch"), ("--heads", "heads"))}
    cps = [n for r in int_ranges(args.cp, "--cp") for n in r]
    dtypes = name_list(args.dtype, "--dtype")
    if args.pivot is not None and args.pivot not in FIGURE_KEY:
        raise unknown("--pivot", args.pivot, list(FIGURE_KEY), "figure")
    check_output(args.plot, "--plot")
    steps = compile_steps(args) if args.trace is not None else ((args.compile, None),)
    labelled = len(steps) > 1 or steps[0][1] is not None  # series named by their step
    result = merged([_swept(args, grid, cps, dtypes, index == 0, mode, budget, labelled,
                            len(steps)) for index, (mode, budget) in enumerate(steps)])
    if args.plot:  # before printing, so that a failure to write it prints nothing else
        from memcalc.plots import plot_peaks

        with plotting(args.plot, "the reserved peak against seq_len"):
            plot_peaks(result, path=args.plot)
    emit(result, args.format)
    return 0


def _swept(args, grid: dict, cps: list[int], dtypes: list[str], first: bool, mode,
           activation_budget, labelled: bool, steps: int):
    """The sweep of one step: the target compiled as ``mode`` says at
    ``activation_budget``, in a compiler session of its own (a budget holds for a whole
    session), with ``--impl``'s implementations when ``first``."""
    import copy

    from memcalc.analysis.scaling import sweep
    from memcalc.config import make_config
    from memcalc.engine.work import check_rows
    from memcalc.names import impl_choices
    from memcalc.options import (about_target, budget_from, check_chunk, config_options,
                                 impls_with_trace)
    from memcalc.output.progress import progress, status

    one = copy.copy(args)
    one.compile = mode
    one.impl = (args.impl if first else None) if args.trace else (args.impl or ["naive"])
    impls = impls_with_trace(one, activation_budget, labelled)  # a traced option: --trace's
    impls = impls if impls is not None else impl_choices()
    rows = len(impls) * len(dtypes) * len(cps) * prod(sum(map(len, r)) for r in grid.values())
    check_rows(rows * steps)
    seq, dims, batch, heads = ([n for r in ranges for n in r] for ranges in grid.values())
    check_chunk(one, impls)
    dtypes = [make_config(dtype=dtype).dtype.value for dtype in dtypes]  # aliases; names the option
    options = {**config_options(one), "dtype": dtypes[0], "cp": cps[0]}
    # a traced target failing at a length: one line
    with about_target(args.trace, compile=mode, activation_budget=activation_budget):
        base = _base(impls, options, {"head_dim": dims, "heads": heads, "batch": batch,
                                      "seq_len": seq})
        with status(f"sweeping {rows:,} configurations"):  # a million rows: seconds
            return sweep(base, budget_from(args), seq, dims, batch, heads, impls, dtypes,
                         pivot=args.pivot, unit="bytes" if args.bytes else "MiB",
                         progress=progress, cps=cps)


def _base(impls: list[str], options: dict, lists: dict):
    """The sweep's base configuration: the options with the first of the lists' values, and
    the first implementation, that are taken (``--heads 3,4 --kv-heads 2``: heads 3 is
    refused, listed as such, the rest swept); the first refusal when none is."""
    from itertools import product

    from memcalc.config import first_accepted, first_taken

    return first_taken(product(*lists.values()),
                       lambda values: first_accepted(impls, **{**options,
                                                              **dict(zip(lists, values))}))
