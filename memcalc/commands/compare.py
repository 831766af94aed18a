"""``memcalc compare``: every implementation side by side."""

from memcalc.cli import budget_from, budget_options, config_from, emit, format_options, shape_options

HELP = "every implementation side by side: saved, peaks, savings, largest seq_len"


def add_arguments(parser) -> None:
    shape_options(parser)
    budget_options(parser)
    format_options(parser)
    parser.add_argument("--only", action="append", metavar="IMPL",
                        help="only these implementations (repeatable)")
    parser.add_argument("--baseline", default="naive", help="compare against (default naive)")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="also draw what is alive at each peak (needs matplotlib)")


def run(args) -> int:
    from memcalc.comparison import compare

    result = compare(config_from(args), budget_from(args), args.only, args.baseline)
    emit(result, args.format)
    if args.plot:
        from memcalc.plots import plot_components

        plot_components([r.breakdown for r in result.rows if r.breakdown], args.plot)
    return 0
