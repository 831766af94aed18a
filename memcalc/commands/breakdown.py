"""``memcalc breakdown``: what one forward and backward step allocates."""

from memcalc.cli import config_from, emit, format_options, shape_options

HELP = "what one forward+backward step allocates, by component"


def add_arguments(parser) -> None:
    shape_options(parser)
    format_options(parser)
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="also draw the step's memory timeline (needs matplotlib)")


def run(args) -> int:
    from memcalc.timeline import predict

    config = config_from(args)
    emit(predict(config), args.format)
    if args.plot:
        from memcalc.plots import plot_timeline

        plot_timeline(config, args.plot)
    return 0
