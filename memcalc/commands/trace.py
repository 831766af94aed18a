"""``memcalc trace FILE.py:FUNCTION``: the breakdown of your own attention code, traced as
the configured GPU would run it, with its fit in the device's budget."""

import contextlib
import sys

from memcalc.options import (about_target, budget_from, budget_options, calling_from,
                             check_output, compile_budget_option, compile_steps, config_from,
                             emit, format_options, input_options, plotting, release_of,
                             shape_options, work_options)

HELP = ("breakdown of your own attention function or nn.Module, traced on the meta device "
        "along the GPU's code paths (imports and runs the named file or module as Python code)")


def add_arguments(parser) -> None:
    parser.add_argument("target", metavar="FILE.py:FUNCTION",
                        help="a function or an nn.Module class (built with no arguments on "
                             "the meta device) or instance, called with --input's tensors "
                             "(default: q, k, v of shape (B, H, N, D)); also "
                             "MODULE:FUNCTION. The file is imported (its code runs)")
    input_options(parser)
    shape_options(parser, impls="none")
    budget_options(parser)
    work_options(parser)
    format_options(parser)
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="also draw the step's memory timeline (needs matplotlib)")
    parser.add_argument("--cudnn-workspace", metavar="SIZE", default=None,
                        help="cuDNN attention's workspace, forward and backward (default: "
                             "0 forward, (B*H*N*d + B*H*N) x 4 B backward, an estimate)")
    compile_budget_option(parser, "a row each (one budget: that step's breakdown)")
    parser.add_argument("--meta-paths", action="store_true",
                        help="follow the meta device's code paths instead of the GPU's")


def run(args) -> int:
    """Load, trace, check the budget, draw if asked, print; a failure of the target is one
    line naming it as given."""
    import torch  # noqa: F401  (missing: memcalc.cli says how to install it, exit 2)

    from memcalc.tracing import TraceOptions

    check_output(args.plot, "--plot")
    budget = budget_from(args)
    options = TraceOptions(cuda=not args.meta_paths, workspace=_workspace(args.cudnn_workspace),
                           **release_of(args))
    history = []
    if args.cp_method == "ulysses":
        from memcalc.tracing.context_parallel import deepspeed_installed, quiet_deepspeed

        if deepspeed_installed():
            quiet_deepspeed()  # before the target's file imports it
    steps = compile_steps(args)
    if len(steps) > 1:
        emit(_traced_variants(args, steps, options, budget), args.format)
        return 0
    result = _traced(args, options, budget, history, *steps[0])
    if args.plot:
        from memcalc.plots import plot_timeline

        with plotting(args.plot, "the step's memory timeline"):
            plot_timeline(result.breakdown.config, args.plot, (history, result.breakdown))
    emit(result, args.format)
    return 0


def _traced(args, options, budget, history, compile, activation_budget=None):
    """The target traced once, its torch.compile calls run as ``compile`` says."""
    from memcalc.tracing import check_causal, load_function, register_function, traced

    with about_target(args.target, "target", compile, activation_budget):
        # the target's import-time output (DeepSpeed's logger writes to stdout) goes to
        # stderr: stdout is memcalc's, piped as JSON or CSV
        with contextlib.redirect_stdout(sys.stderr):
            fn = load_function(args.target)
        calling = calling_from(args, fn)
        config = config_from(args, impl=register_function(fn, args.target, calling))
        check_causal(fn, config)
        return traced(fn, config, options, budget, history, calling)


def _traced_variants(args, steps, options, budget):
    """Each step of ``steps``, side by side."""
    from memcalc.compiling.variants import Variant, Variants

    if args.plot:
        raise ValueError("--plot: one step at a time (not with --compile A,B or "
                         "several --compile-budget values)")
    rows = []
    for mode, activation_budget in steps:
        result = _traced(args, options, budget, [], mode, activation_budget)
        rows.append(Variant(mode=mode, activation_budget=activation_budget,
                            breakdown=result.breakdown,
                            fits=result.fit.fits if result.fit else None))
    return Variants(rows=tuple(rows), budget=result.budget)


def _workspace(text):
    """``--cudnn-workspace SIZE``: both workspaces, in bytes."""
    from memcalc.impls.sdpa_cudnn import Workspace

    if text is None:
        return Workspace()
    from memcalc.analysis.budget import parse_size

    size = parse_size(text, "--cudnn-workspace")
    return Workspace(size, size)
