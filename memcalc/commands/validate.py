"""``memcalc validate``: predictions against traced (emulated) or live (cuda) runs."""

import math
import os
import sys
from functools import cache

from memcalc.options import (check_output, emit, format_options, impl_option, input_options,
                             naming, shape_options)
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
                             f"{', '.join(CASE_KINDS)} (default: all, in that order); "
                             f"emulated, of {', '.join(EMULATED_KINDS)} (default: grid; cp: "
                             f"context parallelism, every rank against torch's ring attention)")
    format_options(parser)
    parser.add_argument("--trace", metavar="FILE.py:FUNCTION", default=None,
                        help="check your own function or nn.Module instead of the shipped "
                             "cases: its step as oom --trace solves it (fitted over lengths), "
                             "traced directly, and with --backend cuda run on this GPU, figure "
                             "by figure; it takes memcalc trace's options (--input, --seq, "
                             "--optimizer, ...). The file is imported (its code runs)")
    target = parser.add_argument_group("with --trace, as memcalc trace takes them")
    input_options(target)
    shape_options(target, impls="none")


# the options that describe a --trace target's step: refused without --trace
TARGET_OPTIONS = ("input", "no_grad", "autocast", "param_dtype", "torch", "optimizer",
                  "grad_accum", "clip_grad_norm", "seq", "batch", "heads", "head_dim", "dtype", "kv_len",
                  "kv_heads", "causal", "gpu", "loss", "forward_only", "deterministic",
                  "cp", "cp_method", "tp", "cublas_workspace_config")


def check_target_options(args, parser_defaults: dict) -> None:
    """Without ``--trace`` the shipped cases run: an option of a target's step is refused,
    not ignored."""
    if args.trace is not None:
        return
    for dest in TARGET_OPTIONS:
        if getattr(args, dest, None) != parser_defaults.get(dest):
            flag = "--" + dest.replace("_", "-")
            raise ValueError(f"{flag}: describes a traced target's step; give --trace "
                             f"FILE.py:FUNCTION (without it validate runs the shipped cases)")


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
                             f"after rank on one: python validation/cp_one_gpu.py "
                             f"(docs/guides/several-gpus.md); emulated here without --backend cuda")
        if not live and kind not in EMULATED_KINDS:
            raise ValueError(f"--cases {kind}: a live case (--backend cuda); emulated runs "
                             f"{' and '.join(EMULATED_KINDS)}")


def run(args) -> int:
    """Check the options, validate, write the report if asked, print; 1 on a mismatch."""
    from memcalc.validation import validate, write_report

    from memcalc.names import impl_list

    check_target_options(args, _defaults())
    if args.out and not (os.path.isdir(args.out) or args.out.endswith("/")):
        check_output(args.out, "--out")
    if args.trace is not None:
        return _run_target(args)
    check_grid(args.grid)
    impls = impl_list(args.impl)
    seconds, kinds = parse_seconds(args.max_seconds), parse_cases(args.cases)
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



@cache
def _defaults() -> dict:
    """The parser's defaults of the target's options (what "not given" is)."""
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return {dest: parser.get_default(dest) for dest in TARGET_OPTIONS}



def _run_target(args) -> int:
    """``--trace``: the target's step predicted, traced and (``--backend cuda``) run live;
    1 when a figure differs."""
    for option, given in (("--impl", args.impl), ("--grid", args.grid),
                          ("--cases", args.cases), ("--max-seconds", args.max_seconds)):
        if given:
            raise ValueError(f"{option}: checks the shipped cases; --trace checks its target")
    import torch  # noqa: F401  (missing: memcalc.cli says how to install it, exit 2)

    from memcalc.options import about_target, calling_from, config_from
    from memcalc.tracing import check_causal, load_function, register_function
    from memcalc.validation import validate_target

    with about_target(args.trace, compile=args.compile):
        fn = load_function(args.trace)
        calling = calling_from(args, fn)
        config = config_from(args, impl=register_function(fn, args.trace, calling))
        check_causal(fn, config)
        # inside: the traces compile the code's torch.compile calls (memcalc.compiling)
        report = validate_target(fn, config, calling, backend=args.backend)
    if args.out:
        from memcalc.validation import write_report

        with naming("--out"):
            write_report(report, args.out)
    emit(report, args.format)
    return 0 if report.ok else 1
