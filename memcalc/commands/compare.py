"""``memcalc compare``: every implementation side by side."""

from memcalc.cli import (budget_from, budget_options, check_output, config_from, emit,
                         format_options, naming, shape_options)

HELP = "every implementation side by side: saved, peaks, savings, largest seq_len"


def add_arguments(parser) -> None:
    shape_options(parser)
    budget_options(parser)
    format_options(parser)
    parser.add_argument("--only", action="append", metavar="IMPL",
                        help="only these implementations (repeatable, or comma-separated)")
    parser.add_argument("--baseline", default="naive", help="compare against (default naive)")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="also draw what is alive at each peak (needs matplotlib)")


def impl_list(only: list[str] | None) -> list[str] | None:
    """The names of ``--only`` (repeated or comma-separated), each a known implementation."""
    from memcalc.impls import get_impl

    if only is None:
        return None
    names = [name.strip() for text in only for name in text.split(",")]
    if not all(names):
        raise ValueError(f"--only: {','.join(only)!r} is not a comma-separated list of names")
    for name in names:
        with naming("--only"):
            get_impl(name)
    return names


def check_baseline(baseline: str, names: list[str] | None) -> None:
    """``--baseline`` must be a known implementation, and one of ``--only``'s if given."""
    from memcalc.impls import get_impl

    with naming("--baseline"):
        get_impl(baseline)
    if names is not None and baseline not in names:
        raise ValueError(f"--baseline: {baseline!r} is not among the compared implementations "
                         f"(--only {','.join(names)}); add it to --only")


def base_config(args, names: list[str] | None):
    """The shared options as a ``Config``, under the first implementation (of ``--only``, or
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
    from memcalc.comparison import compare

    check_output(args.plot, "--plot")
    names = impl_list(args.only)
    check_baseline(args.baseline, names)
    result = compare(base_config(args, names), budget_from(args), names, args.baseline)
    if args.plot:
        from memcalc.plots import plot_components

        with naming("--plot"):
            plot_components([r.breakdown for r in result.rows if r.breakdown], args.plot)
    emit(result, args.format)
    return 0
