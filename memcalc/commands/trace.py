"""``memcalc trace FILE.py:FUNCTION``: the breakdown of your own attention code."""

from memcalc.cli import config_from, emit, format_options, shape_options

HELP = ("breakdown of your own attention function, traced on the meta device "
        "(imports and runs the named file or module as Python code)")


def add_arguments(parser) -> None:
    parser.add_argument("target", metavar="FILE.py:FUNCTION",
                        help="fn(q, k, v) returning out; also MODULE:FUNCTION. The file is "
                             "imported (its code runs); nothing else is imported")
    shape_options(parser)
    format_options(parser)


def run(args) -> int:
    """Load, trace and print; a failure of the target is one line naming it as given."""
    import torch  # noqa: F401  (missing: memcalc.cli says how to install it, exit 2)

    from memcalc.tracing import TraceError, load_function, register_function, trace

    try:
        fn = load_function(args.target)
        name = register_function(fn, args.target)
        result = trace(fn, config_from(args, impl=name))
    except TraceError as error:
        text = str(error).removeprefix(f"--trace {args.target}: ")
        raise ValueError(f"target {args.target}: {text.splitlines()[0]}") from None
    emit(result, args.format)
    return 0
