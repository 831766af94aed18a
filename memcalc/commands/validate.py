"""``memcalc validate``: predictions against traced (emulated) or live (cuda) runs."""

from memcalc.cli import emit, format_options

HELP = "compare predictions with the emulated trace or a live GPU run"


def add_arguments(parser) -> None:
    parser.add_argument("--backend", default="emulated", choices=["emulated", "cuda"])
    parser.add_argument("--impl", action="append", help="only these implementations (repeatable)")
    parser.add_argument("--grid", default=None, help="grid file (default: the shipped grids)")
    parser.add_argument("--out", default=None,
                        help="write the JSON report to this file, or into this directory "
                             "as <device>-<torch>.json")
    format_options(parser)


def run(args) -> int:
    from memcalc.validation import validate, write_report

    report = validate(backend=args.backend, impls=args.impl, grid=args.grid)
    if args.out:
        write_report(report, args.out)
    emit(report, args.format)
    return 0 if report.ok else 1
