"""The ``memcalc`` command: parse, build the config model, call the library, render.

Imports stay lazy so that ``memcalc breakdown`` never loads torch, matplotlib or pandas.
Bad input ends with one line naming the option and what it allows, and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

class UsageError(Exception):
    """Bad input: reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + message
        raise UsageError(message)


def _shape_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq", type=int, default=16384, help="sequence length N (default 16384)")
    p.add_argument("--kv-len", type=int, default=None, help="key/value length (default: --seq)")
    p.add_argument("--batch", type=int, default=8, help="batch size (default 8)")
    p.add_argument("--heads", type=int, default=1, help="attention heads (default 1)")
    p.add_argument("--head-dim", type=int, default=16, help="head dimension d (default 16)")
    p.add_argument("--dtype", default="fp32", help="fp32, fp16 or bf16 (default fp32)")
    p.add_argument("--impl", default="naive", help="implementation (memcalc impls)")
    p.add_argument("--causal", action="store_true", help="causal mask")
    p.add_argument("--gpu", default="h100-80gb", help="GPU preset (memcalc gpus)")
    p.add_argument("--loss", default="grad", help="grad: out.backward(grad_out); sum: out.sum()")
    p.add_argument("--forward-only", action="store_true", help="inference under no_grad")
    p.add_argument("--cublas-workspace-config", default=None, metavar="CFG",
                   help='CUBLAS_WORKSPACE_CONFIG, e.g. ":4096:8"')


def _format_options(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    for fmt in ("json", "csv", "markdown"):
        g.add_argument(f"--{fmt}", dest="format", action="store_const", const=fmt)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="memcalc", description="Byte-exact GPU memory of attention steps.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    b = sub.add_parser("breakdown", help="what one forward+backward step allocates")
    _shape_options(b)
    _format_options(b)
    v = sub.add_parser("validate", help="compare predictions with traced or live runs")
    v.add_argument("--backend", default="emulated", choices=["emulated", "cuda"])
    v.add_argument("--impl", action="append", help="only these implementations (repeatable)")
    v.add_argument("--grid", default=None, help="grid file (default: the shipped grid)")
    v.add_argument("--out", default=None, help="write the JSON report here")
    _format_options(v)
    sub.add_parser("impls", help="list the implementations")
    sub.add_parser("gpus", help="list the GPU presets")
    return parser


def config_from(args):
    """The ``Config`` the options describe (raises pydantic's ValidationError)."""
    from memcalc.config import Config, Device, Protocol, Shape

    return Config(
        impl=args.impl, dtype=args.dtype, causal=args.causal,
        shape=Shape(batch=args.batch, heads=args.heads, seq_len=args.seq,
                    head_dim=args.head_dim, kv_len=args.kv_len),
        device=Device(gpu=args.gpu),
        protocol=Protocol(loss=args.loss, forward_only=args.forward_only,
                          cublas_workspace_config=args.cublas_workspace_config),
    )


def emit(result, fmt: str | None) -> None:
    """Print ``result`` as a rich renderable or in the chosen text format."""
    if fmt is None:
        from rich.console import Console

        Console().print(result)
        return
    from memcalc.render import to_json

    text = {"json": to_json, "csv": lambda r: r.to_csv(), "markdown": lambda r: r.to_markdown()}
    sys.stdout.write(text[fmt](result))


def cmd_breakdown(args) -> int:
    from memcalc.timeline import predict

    emit(predict(config_from(args)), args.format)
    return 0


def cmd_validate(args) -> int:
    from memcalc.validate import validate

    report = validate(backend=args.backend, impls=args.impl, grid=args.grid)
    if args.out:
        from pathlib import Path

        Path(args.out).write_text(report.model_dump_json(indent=2) + "\n")
    emit(report, args.format)
    return 0 if report.ok else 1


def cmd_impls(args) -> int:
    from memcalc.impls import IMPLS, impl_names
    from rich.console import Console
    from rich.table import Table

    table = Table("implementation", "what it is")
    for name in impl_names():
        table.add_row(name, IMPLS[name].summary)
    Console().print(table)
    return 0


def cmd_gpus(args) -> int:
    from memcalc.gpus import gpu_presets
    from memcalc.units import human
    from rich.console import Console
    from rich.table import Table

    table = Table("name", "device", "cc", "memory (bytes)", "", "source")
    for g in gpu_presets().values():
        cc = ".".join(map(str, g.compute_capability))
        table.add_row(g.name, g.label, cc, str(g.memory_bytes), human(g.memory_bytes), g.source)
    Console().print(table)
    return 0


COMMANDS = {"breakdown": cmd_breakdown, "validate": cmd_validate, "impls": cmd_impls,
            "gpus": cmd_gpus}


def main(argv: Sequence[str] | None = None) -> int:
    from pydantic import ValidationError

    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except (UsageError, ValidationError, ValueError, OSError) as error:
        from memcalc.errors import FLAGS, one_line

        print(f"memcalc: error: {one_line(error, FLAGS)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
