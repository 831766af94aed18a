"""``memcalc breakdown``: what one forward and backward step allocates."""

from memcalc.options import (budget_from, budget_options, check_chunk, check_output,
                             config_from, emit, format_options, plotting, shape_options,
                             work_options)

HELP = "what one forward+backward step allocates, by component"


def add_arguments(parser) -> None:
    shape_options(parser)
    budget_options(parser)
    work_options(parser)
    format_options(parser)
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="also draw the step's memory timeline (needs matplotlib)")


def run(args) -> int:
    """Check the options, compute, draw the plot if asked (so that a failure to write it
    prints nothing else), then print."""
    from memcalc.analysis.budget import check
    from memcalc.output.progress import status

    check_output(args.plot, "--plot")
    if "," in args.impl or args.impl.strip() == "all":
        raise ValueError(f"--impl: breakdown takes one implementation; memcalc compare --impl "
                         f"{args.impl} puts several side by side")
    config = config_from(args)
    check_chunk(args, [config.impl])
    with status(f"replaying {config.impl}"):  # a chunked loop at a million rows: seconds
        result = check(config, budget_from(args))
    if args.plot:
        from memcalc.plots import plot_timeline

        with plotting(args.plot, "the step's memory timeline"):
            plot_timeline(config, args.plot)
    emit(result, args.format)
    return 0
