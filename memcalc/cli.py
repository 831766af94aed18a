"""The ``memcalc`` command: parse, build the config model, call the library, render.

Subcommands live in ``memcalc/commands/``, one module each, their shared options in
``memcalc.options`` (below both: a command never imports this module). Imports stay lazy so that
``memcalc breakdown`` never loads torch, matplotlib or pandas. Bad input ends with one
line naming the option and what it allows, and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from typing import Sequence

from memcalc.options import INTERRUPTED, Parser, UsageError, limits
from memcalc.errors import release


def command_names() -> list[str]:
    """The subcommands, one per module of ``memcalc.commands`` (named, not imported)."""
    import memcalc.commands as package

    return [m.name.replace("_", "-") for m in pkgutil.iter_modules(package.__path__)]


def command(name: str):
    """The module of subcommand ``name``."""
    return importlib.import_module(f"memcalc.commands.{name.replace('-', '_')}")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``memcalc`` parser with one subparser per module of ``memcalc.commands``; with
    ``only``, that command's alone is built and the others are named, not imported
    (importing and building every command was a fifth of a command's start-up)."""
    version = sys.modules["memcalc"].__version__  # the package, imported before this module
    parser = Parser(prog="memcalc", description="Byte-exact GPU memory of attention steps.")
    parser.add_argument("--version", action="version", version=f"memcalc {version}")
    sub = parser.add_subparsers(dest="command", parser_class=Parser)
    for name in command_names():
        if only is None or name == only:
            module = command(name)
            module.add_arguments(sub.add_parser(name, help=module.HELP))
        else:
            sub.add_parser(name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``memcalc argv``; the exit status (2 and one stderr line on bad input; 130 and
    one line on Ctrl-C, which long replays invite; ``memcalc`` alone: the commands in one
    line, and 2)."""
    from memcalc.engine.deadline import TimeUp
    from memcalc.errors import FLAGS, error_line

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        release()  # a Ctrl-C held since start-up (memcalc.errors.hold) is raised here
        args = build_parser(argv[0] if argv and argv[0] in command_names() else None
                            ).parse_args(argv)
        if args.command is None:  # ``memcalc`` alone: the commands there are
            raise UsageError(f"give a command: {_listed(command_names(), 'or')} (memcalc "
                             f"--help says what each does)")
        with limits(args):
            return command(args.command).run(args)
    except KeyboardInterrupt:
        print("memcalc: interrupted", file=sys.stderr)
        return INTERRUPTED
    except UsageError as error:
        print(f"memcalc: error: {suggest_option(str(error), argv)}", file=sys.stderr)
        return 2
    except TimeUp:
        print(f"memcalc: error: --time-limit: {args.command} ran past {args.time_limit:g} s "
              f"and stopped; raise the limit to let it finish", file=sys.stderr)
        return 2
    except (ValueError, OSError, ImportError) as error:  # pydantic's ValidationError too
        line = _torch_line(error, argv) or error_line(error, FLAGS)
        if line is None:
            raise
        print(f"memcalc: error: {line}", file=sys.stderr)
        return 2


def _torch_line(error: BaseException, argv: list[str]) -> str | None:
    """The line for PyTorch missing: what needed it (``_needing_torch``) and how to get it."""
    from memcalc.errors import install

    if not isinstance(error, ImportError) or (error.name or "").split(".")[0] != "torch":
        return None
    return f"{_needing_torch(argv)} needs PyTorch, which is not installed: {install('torch')}"


def _needing_torch(argv: list[str]) -> str:
    """What needs PyTorch: ``trace``, ``validate``, or the option that asked for a trace
    (``oom --trace``: oom itself does not)."""
    command = argv[0] if argv else "this command"
    traced = [a.split("=")[0] for a in argv[1:] if a.split("=")[0] == "--trace"]
    return f"{command} {traced[0]}" if traced else command


def suggest_option(message: str, argv: list[str]) -> str:
    """argparse's message, with "did you mean" for an unknown option or subcommand."""
    from memcalc.names import did_you_mean

    parser = build_parser()
    if message.startswith("unrecognized arguments:"):
        name, sub = _subparser(parser, argv)
        known = sorted(o for o in (sub or parser)._option_string_actions if o.startswith("--"))
        wrong = [a.split("=")[0] for a in message.split(":", 1)[1].split() if a.startswith("-")]
        hints = [_option_hint(w, known, name, parser) for w in wrong]
        hints = [h for h in hints if h]
        return message + (f"; {', '.join(hints)}" if hints else "")
    if "invalid choice:" in message and argv and argv[0].startswith("-"):
        takers = [name for name, sub in _subparsers(parser)
                  if argv[0].split("=")[0] in sub._option_string_actions]
        return (f"{argv[0]}: options follow a command (memcalc COMMAND {argv[0]} ...)"
                + (f"; {argv[0]} is an option of {_listed(takers)}" if takers else ""))
    if "invalid choice:" in message and argv and argv[0] not in command_names():
        return message + did_you_mean(argv[0], command_names())
    return message


def _option_hint(option: str, known: list[str], command: str | None, parser) -> str:
    """What to say of an option that was not taken: where it goes when ``command`` takes
    it (it came before the command); the commands that take it when there are some
    (``trace --impl``: trace runs your code, not an implementation); else the closest
    option ``command`` takes."""
    from memcalc.names import did_you_mean

    takers = [name for name, sub in _subparsers(parser) if option in sub._option_string_actions]
    if command in takers:
        return f"{option} goes after the command (memcalc {command} {option} ...)"
    if command and takers:
        return f"{option} is an option of {_listed(takers)}, not of {command}"
    hint = did_you_mean(option, known)
    return f"{option}{hint}" if hint else ""


def _listed(words: list[str], last: str = "and") -> str:
    """``a``, ``a and b``, ``a, b and c`` (``last``: ``or``)."""
    if len(words) < 3:
        return f" {last} ".join(words)
    return f"{', '.join(words[:-1])} {last} {words[-1]}"


def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    """Every subcommand's name and parser, in the order of ``memcalc --help``."""
    return [(name, sub) for action in parser._subparsers._group_actions
            for name, sub in action.choices.items()]


def _subparser(parser: argparse.ArgumentParser, argv: list[str]):
    """The subcommand named in ``argv`` and its parser; ``(None, None)`` when none is."""
    subs = dict(_subparsers(parser))
    for word in argv:
        if word in subs:
            return word, subs[word]
    return None, None


if __name__ == "__main__":
    sys.exit(main())
