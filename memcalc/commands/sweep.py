"""``memcalc sweep``: scaling tables, every figure over a grid of shapes."""

from argparse import ArgumentTypeError

from memcalc.cli import (DTYPE_HELP, budget_options, check_output, format_options, impl_option,
                         naming, step_options, whole)

HELP = "scaling tables over lists of seq lengths, head dims, batches, heads, impls, dtypes"


def int_list(text: str, option: str) -> list[int]:
    """``"256,1024"`` or ranges ``"256:4096:256"`` (start:stop:step, stop included)."""
    values: list[int] = []
    for part in text.split(","):
        bits = part.strip().split(":")
        try:
            if len(bits) == 1:
                values.append(whole(bits[0]))
            elif len(bits) == 3:
                start, stop, step = (whole(b) for b in bits)
                if step < 1 or stop < start:
                    raise ValueError
                values += range(start, stop + 1, step)
            else:
                raise ValueError
        except (ValueError, ArgumentTypeError):
            raise ValueError(f"{option}: {text!r} is not a comma-separated list of positive "
                             f"integers (or start:stop:step ranges)") from None
    if not values or min(values) < 1 or max(values) >= 2**62:
        raise ValueError(f"{option}: {text!r} is not a comma-separated list of positive integers "
                         "below 2^62")
    return values


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
    step_options(p)
    budget_options(p)
    p.add_argument("--pivot", default=None, metavar="FIGURE",
                   help="one figure as a table with a row per seq_len and a column per "
                        "head_dim: peak, saved, reserved, forward or backward")
    p.add_argument("--bytes", action="store_true", help="exact bytes in the tables, not MiB")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="also draw the reserved peak (what must fit) against seq_len, log-log, "
                        "with the budget and each line's largest fitting seq_len (needs "
                        "matplotlib)")
    format_options(p)


def run(args) -> int:
    from memcalc.cli import budget_from, check_chunk, config_options, emit
    from memcalc.config import make_config
    from memcalc.progress import progress
    from memcalc.scaling import FIGURE_KEY, sweep

    seq = int_list(args.seq, "--seq")
    dims = int_list(args.head_dim, "--head-dim")
    batch = int_list(args.batch, "--batch")
    heads = int_list(args.heads, "--heads")
    dtypes = name_list(args.dtype, "--dtype")
    from memcalc.names import impl_choices, impl_list, unknown

    impls = impl_list(args.impl or ["naive"])
    impls = impls if impls is not None else impl_choices()
    check_chunk(args, impls)
    if args.pivot is not None and args.pivot not in FIGURE_KEY:
        raise unknown("--pivot", args.pivot, list(FIGURE_KEY), "figure")
    dtypes = [make_config(dtype=dtype).dtype.value for dtype in dtypes]  # aliases; names the option
    options = {**config_options(args), "dtype": dtypes[0]}
    base = _base(impls, options, {"head_dim": dims, "heads": heads, "batch": batch,
                                  "seq_len": seq})
    check_output(args.plot, "--plot")
    result = sweep(base, budget_from(args), seq, dims, batch, heads, impls, dtypes,
                   pivot=args.pivot, unit="bytes" if args.bytes else "MiB", progress=progress)
    if args.plot:  # before printing, so that a failure to write it prints nothing else
        from memcalc.plots import plot_peaks

        with naming("--plot"):
            plot_peaks(result, path=args.plot)
    emit(result, args.format)
    return 0


def _base(impls: list[str], options: dict, lists: dict):
    """The sweep's base configuration: the options with the first of the lists' values, and
    the first implementation, that are taken (``--heads 3,4 --kv-heads 2``: heads 3 is
    refused, listed as such, the rest swept); the first refusal when none is."""
    from itertools import product

    from memcalc.config import first_accepted, first_taken

    return first_taken(product(*lists.values()),
                       lambda values: first_accepted(impls, **{**options,
                                                              **dict(zip(lists, values))}))
