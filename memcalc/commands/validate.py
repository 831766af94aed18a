"""``memcalc validate``: predictions against traced (emulated) or live (cuda) runs."""

import os

from memcalc.cli import check_output, emit, format_options, impl_option, naming

HELP = "compare predictions with the emulated trace or a live GPU run"


def add_arguments(parser) -> None:
    parser.add_argument("--backend", default="emulated", choices=["emulated", "cuda"])
    impl_option(parser)
    parser.add_argument("--grid", default=None, help="grid file (default: the shipped grids)")
    parser.add_argument("--out", default=None,
                        help="write the JSON report to this file, or into this directory "
                             "as <device>-<torch>.json")
    format_options(parser)


def check_grid(path: str | None) -> None:
    """``--grid`` must name a readable file (its content is checked by ``load_grid``)."""
    if path is None:
        return
    if not os.path.isfile(path):
        what = "a directory, not a grid file" if os.path.isdir(path) else "no such file"
        raise ValueError(f"--grid {path}: {what}")
    if not os.access(path, os.R_OK):
        raise ValueError(f"--grid {path}: not readable")


def run(args) -> int:
    """Check the options, validate, write the report if asked, print; 1 on a mismatch."""
    from memcalc.validation import validate, write_report

    from memcalc.names import impl_list

    check_grid(args.grid)
    impls = impl_list(args.impl)
    if args.out and not (os.path.isdir(args.out) or args.out.endswith("/")):
        check_output(args.out, "--out")
    from memcalc.progress import progress

    report = validate(backend=args.backend, impls=impls, grid=args.grid, progress=progress)
    if args.out:
        with naming("--out"):
            write_report(report, args.out)
    emit(report, args.format)
    return 0 if report.ok else 1
