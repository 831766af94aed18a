"""``memcalc compare``: every implementation side by side."""

from memcalc.options import (budget_from, budget_options, check_chunk, check_output,
                             config_from, emit, format_options, plotting, shape_options,
                             work_options)
from memcalc.names import check_impl, impl_list

HELP = "every implementation side by side: saved, peaks, savings, largest seq_len"


def add_arguments(parser) -> None:
    shape_options(parser, impls="many")
    parser.add_argument("--only", dest="impl", action="append", help=argparse_suppress())
    budget_options(parser)
    work_options(parser)
    format_options(parser)
    parser.add_argument("--baseline", default=None,
                        help="compare against (default naive, the custom softmax keeping exp_x, "
                             "or, when naive is not compared or has no figures for the "
                             "options, the first implementation that has)")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="also draw what is alive at each peak (needs matplotlib)")


def argparse_suppress():
    """``--only`` is the old spelling of ``--impl``: still accepted, no longer listed."""
    import argparse

    return argparse.SUPPRESS


def check_baseline(baseline: str, names: list[str] | None) -> None:
    """``--baseline`` must be a known implementation, and one of ``--impl``'s if given."""
    check_impl(baseline, "--baseline")
    if names is not None and baseline not in names:
        raise ValueError(f"--baseline: {baseline!r} is not among the compared implementations "
                         f"(--impl {','.join(names)}); add it to --impl")


def base_config(args, names: list[str] | None):
    """The shared options as a ``Config``, under the first implementation (of ``--impl``, or
    any) that accepts them: ``--kv-heads`` alone must not fail because naive has no GQA."""
    from memcalc.impls import impl_names

    first = None
    for name in names or [n for n in impl_names() if not n.startswith("trace:")]:
        try:
            return config_from(args, impl=name)
        except ValueError as error:  # pydantic's ValidationError is one
            first = first or error
    raise first


def run(args) -> int:
    """Check the options, compare, draw the plot if asked, then print."""
    from memcalc.analysis.comparison import compare
    from memcalc.output.progress import status

    check_output(args.plot, "--plot")
    names = impl_list(args.impl)
    check_chunk(args, names)
    if args.baseline is not None:
        check_baseline(args.baseline, names)
    with status("comparing"):  # chunked loops at a million rows replay for seconds each
        result = compare(base_config(args, names), budget_from(args), names, args.baseline)
    if args.plot:
        from memcalc.plots import plot_components

        # the baseline's row at least has figures
        with plotting(args.plot, "what is alive at each implementation's peak"):
            plot_components([r.breakdown for r in result.rows if r.breakdown], args.plot)
    emit(result, args.format)
    return 0
