"""``memcalc validate``: predictions against traced (emulated) or live (cuda) runs."""

import math
import os
import sys

from memcalc.cli import check_output, emit, format_options, impl_option, naming
from memcalc.names import CASE_KINDS, EMULATED_KINDS, unknown

HELP = "compare predictions with the emulated trace or a live GPU run"


def add_arguments(parser) -> None:
    parser.add_argument("--backend", default="emulated", choices=["emulated", "cuda"],
                        help="emulated (default): each step traced on PyTorch's meta device, "
                             "here; cuda: run on this machine's GPU and compared with "
                             "torch.cuda's own counters")
    impl_option(parser)
    parser.add_argument("--grid", default=None, help="grid file (default: the shipped grids)")
    parser.add_argument("--out", default=None,
                        help="write the JSON report to this file, or into this directory "
                             "as <device>-<torch>.json; with --backend cuda it is rewritten "
                             "after each configuration and a rerun resumes from it")
    parser.add_argument("--max-seconds", default=None,
                        help="--backend cuda: stop starting new configurations after this "
                             "many seconds (rerun with the same --out to resume)")
    parser.add_argument("--cases", default=None,
                        help=f"comma-separated kinds of cases: with --backend cuda, of "
                             f"{','.join(CASE_KINDS)} (default: all, in that order); "
                             f"emulated, of {','.join(EMULATED_KINDS)} (default: grid; cp: "
                             f"context parallelism, every rank against torch's ring attention)")
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


def parse_seconds(text: str | None) -> float | None:
    """``--max-seconds``: a positive, finite number of seconds."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"--max-seconds: a positive number of seconds (got {text!r})")
    return value


def parse_cases(text: str | None) -> tuple[str, ...] | None:
    """``--cases``: kinds of live cases, each one of ``CASE_KINDS``."""
    if text is None:
        return None
    kinds = tuple(k.strip() for k in text.split(","))
    known = (*CASE_KINDS, *[k for k in EMULATED_KINDS if k not in CASE_KINDS])
    for kind in kinds:
        if kind not in known:
            raise unknown("--cases", kind, known, "kind of case")
    return kinds


def check_cases(kinds: tuple[str, ...] | None, live: bool) -> None:
    """Which kinds each backend runs: context parallelism needs several GPUs to run live."""
    for kind in kinds or ():
        if live and kind not in CASE_KINDS:
            raise ValueError(f"--cases {kind}: context parallelism runs live on several GPUs: "
                             f"torchrun --nproc-per-node P validation/cp_live.py, or rank "
                             f"after rank on one: python validation/cp_one_gpu.py (the README, "
                             f"'Several GPUs'); emulated here without --backend cuda")
        if not live and kind not in EMULATED_KINDS:
            raise ValueError(f"--cases {kind}: a live case (--backend cuda); emulated runs "
                             f"{' and '.join(EMULATED_KINDS)}")


def run(args) -> int:
    """Check the options, validate, write the report if asked, print; 1 on a mismatch."""
    from memcalc.validation import validate, write_report

    from memcalc.names import impl_list

    check_grid(args.grid)
    impls = impl_list(args.impl)
    seconds, kinds = parse_seconds(args.max_seconds), parse_cases(args.cases)
    if args.out and not (os.path.isdir(args.out) or args.out.endswith("/")):
        check_output(args.out, "--out")
    live = args.backend == "cuda"
    if seconds is not None and not live:
        raise ValueError("--max-seconds: only with --backend cuda")
    check_cases(kinds, live)
    from memcalc.output.progress import progress

    report = validate(backend=args.backend, impls=impls, grid=args.grid,
                      out=args.out if live else None, max_seconds=seconds, cases=kinds,
                      progress=progress)
    if args.out and not live:
        with naming("--out"):
            write_report(report, args.out)
    emit(report, args.format)
    if kinds and "cp" in kinds:
        from memcalc.validation.context_parallel import ulysses_checked

        if not ulysses_checked():
            print("note: DeepSpeed is not installed: its Ulysses configurations were not "
                  "checked (pip install 'memcalc[deepspeed]')", file=sys.stderr)
    return 0 if report.ok else 1

