"""The ``memcalc`` command: parse, build the config model, call the library, render.

Subcommands live in ``memcalc/commands/``, one module each. Imports stay lazy so that
``memcalc breakdown`` never loads torch, matplotlib or pandas. Bad input ends with one
line naming the option and what it allows, and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
from contextlib import contextmanager
from typing import Iterator, Sequence


class UsageError(Exception):
    """Bad input: reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + message
        raise UsageError(message)


def shape_options(p: argparse.ArgumentParser) -> None:
    """The options that make a ``Config``; defaults are the seeds' benchmark."""
    p.add_argument("--seq", type=int, default=16384, help="sequence length N (default 16384)")
    p.add_argument("--batch", type=int, default=8, help="batch size (default 8)")
    p.add_argument("--heads", type=int, default=1, help="attention heads (default 1)")
    p.add_argument("--head-dim", type=int, default=16, help="head dimension d (default 16)")
    p.add_argument("--dtype", default="fp32", help="fp32, fp16 or bf16 (default fp32)")
    p.add_argument("--impl", default="naive", help="implementation (memcalc impls)")
    step_options(p)


def step_options(p: argparse.ArgumentParser) -> None:
    """The single-valued options besides the sizes (``memcalc sweep`` lists the sizes)."""
    p.add_argument("--kv-len", type=int, default=None, help="key/value length (default: --seq)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (GQA; default: --heads)")
    p.add_argument("--causal", action="store_true", help="causal mask")
    p.add_argument("--chunk", type=int, default=64, help="chunk length of chunked implementations")
    p.add_argument("--gpu", default="h100-80gb", help="GPU preset (memcalc gpus)")
    p.add_argument("--loss", default="grad", help="grad: out.backward(grad_out); sum: out.sum()")
    p.add_argument("--forward-only", action="store_true", help="inference under no_grad")
    p.add_argument("--cublas-workspace-config", default=None, metavar="CFG",
                   help='CUBLAS_WORKSPACE_CONFIG, e.g. ":4096:8"')


def budget_options(p: argparse.ArgumentParser) -> None:
    """The device budget: ``--gpu``'s memory (or ``--gpu-gb``) less ``--reserve``."""
    p.add_argument("--gpu-gb", default=None, metavar="X",
                   help="device memory in GB of 2^30 B, instead of the --gpu preset's "
                        "(whose compute capability still sets the cuBLAS workspace)")
    p.add_argument("--reserve", default=None, metavar="SIZE",
                   help="memory the allocator cannot have: CUDA context, other processes "
                        "(default 512MiB; units B, KiB, MiB, GiB, bare numbers MiB)")


def budget_from(args):
    """The ``Budget`` the options describe (``memcalc.budget``)."""
    from memcalc.budget import Budget, parse_gb, parse_size
    from memcalc.config import Device

    memory = parse_gb(args.gpu_gb) if args.gpu_gb is not None else None
    reserve = parse_size(args.reserve) if args.reserve is not None else None
    return Budget.of(Device(gpu=args.gpu), reserve, memory)


def format_options(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    for fmt in ("json", "csv", "markdown"):
        g.add_argument(f"--{fmt}", dest="format", action="store_const", const=fmt)


def config_from(args, **overrides):
    """The ``Config`` the options describe (raises pydantic's ValidationError)."""
    from memcalc.config import make_config

    flat = dict(impl=args.impl, seq_len=args.seq, batch=args.batch, heads=args.heads,
                head_dim=args.head_dim, kv_len=args.kv_len, kv_heads=args.kv_heads,
                dtype=args.dtype, causal=args.causal, chunk=args.chunk, gpu=args.gpu,
                loss=args.loss, forward_only=args.forward_only,
                cublas_workspace_config=args.cublas_workspace_config)
    return make_config(**{**flat, **overrides})


def emit(result, fmt: str | None) -> None:
    """Print ``result`` as a rich renderable or in the chosen text format."""
    if fmt is None:
        from rich.console import Console

        Console().print(result)
        return
    from memcalc.render import to_json

    text = {"json": to_json, "csv": lambda r: r.to_csv(), "markdown": lambda r: r.to_markdown()}
    sys.stdout.write(text[fmt](result))


def check_output(path: str | None, option: str) -> None:
    """Fail before any work, naming ``option``, when ``path`` cannot become a file."""
    if not path:
        return
    parent = os.path.dirname(path) or "."
    if os.path.isdir(path):
        raise ValueError(f"{option}: {path!r} is a directory, not a file")
    if not os.path.isdir(parent):
        raise ValueError(f"{option}: {path!r}: no directory {parent!r} to write it into")


@contextmanager
def naming(option: str) -> Iterator[None]:
    """Re-raise an OSError or ValueError from writing or reading ``option``'s file as a
    one-line ValueError that names the option."""
    try:
        yield
    except (OSError, ValueError) as error:
        from memcalc.errors import one_line

        text = one_line(error)
        raise ValueError(text if text.startswith(option) else f"{option}: {text}") from None


def commands() -> dict:
    """Every module of ``memcalc.commands`` by subcommand name."""
    import memcalc.commands as package

    return {m.name.replace("_", "-"): importlib.import_module(f"{package.__name__}.{m.name}")
            for m in pkgutil.iter_modules(package.__path__)}


def build_parser() -> argparse.ArgumentParser:
    """The ``memcalc`` parser with one subparser per module of ``memcalc.commands``."""
    parser = _Parser(prog="memcalc", description="Byte-exact GPU memory of attention steps.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, module in commands().items():
        module.add_arguments(sub.add_parser(name, help=module.HELP))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``memcalc argv``; the exit status (2 and one stderr line on bad input)."""
    from pydantic import ValidationError

    from memcalc.errors import FLAGS, one_line

    try:
        args = build_parser().parse_args(argv)
        return commands()[args.command].run(args)
    except (UsageError, ValidationError, ValueError, OSError) as error:
        print(f"memcalc: error: {one_line(error, FLAGS)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
