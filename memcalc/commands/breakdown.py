"""``memcalc breakdown``: what one forward and backward step allocates."""

from memcalc.cli import budget_from, budget_options, config_from, emit, format_options, shape_options

HELP = "what one forward+backward step allocates, by component"


def add_arguments(parser) -> None:
    shape_options(parser)
    budget_options(parser)
    format_options(parser)
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="also draw the step's memory timeline (needs matplotlib)")


def run(args) -> int:
    from memcalc.budget import check

    config = config_from(args)
    emit(check(config, budget_from(args)), args.format)
    if args.plot:
        from memcalc.plots import plot_timeline

        plot_timeline(config, args.plot)
    return 0
