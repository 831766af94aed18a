"""One-line messages for bad input, shared by the CLI and the file loaders, with a
suggestion for a near miss (``did_you_mean``); the one line a missing extra ends in
(``require``, ``error_line``, ``run_main``); and Ctrl-C while the ``memcalc`` command starts
(``hold``, ``release``).

Ctrl-C at start-up is held until ``memcalc.cli.main`` answers it with its one line
(``memcalc: interrupted``, status 130), whenever in start-up it came.

A ``KeyboardInterrupt`` can be raised at any bytecode of an import, and one raised while
pydantic_core (a Rust extension, built with PyO3) imports the ``datetime`` C API becomes
``pyo3_runtime.PanicException: failed to import datetime C API`` with a traceback (PyO3's
``PyDateTime_IMPORT`` failing is a panic, and the panic is not a ``KeyboardInterrupt``).
So the package's first lines block SIGINT in this thread (``hold``, POSIX only: elsewhere
the package's ``except KeyboardInterrupt`` guards are all there is) and ``release`` unblocks
it where an interrupt can be answered: the command's ``main``, inside its ``try``, or, for
other code importing memcalc, the end of the package's import, which raises it there as a
plain ``KeyboardInterrupt``. Threads started while it is held (numpy's BLAS pool) keep it
blocked, so the signal comes to this thread. Before ``hold`` (this module's own imports),
the package's ``except KeyboardInterrupt`` answers it the same way (``interrupted``).
"""

from __future__ import annotations

import re
import signal
import sys
from typing import Callable, Iterable, NoReturn

# config field -> the CLI option that sets it
FLAGS = {
    "batch": "--batch", "heads": "--heads", "seq_len": "--seq", "head_dim": "--head-dim",
    "kv_len": "--kv-len", "kv_heads": "--kv-heads", "chunk": "--chunk", "dtype": "--dtype",
    "impl": "--impl", "gpu": "--gpu", "loss": "--loss", "causal": "--causal",
    "cublas_workspace_config": "--cublas-workspace-config", "time_limit": "--time-limit",
    "alloc_conf": "--alloc-conf",
    "work_limit": "--work-limit", "memory_limit": "--memory-limit",
    "deterministic": "--deterministic",
    "mask": "--mask", "block_mask": "--block-mask", "cp": "--cp", "cp_method": "--cp-method",
    "tp": "--tp",
}


# an optional dependency -> the extra of memcalc's that installs it (pyproject.toml)
EXTRAS = {"matplotlib": "plot", "pandas": "pandas", "deepspeed": "deepspeed",
          "transformers": "hf", "nbclient": "notebook", "nbformat": "notebook",
          "ipykernel": "notebook"}
NAMES = {"torch": "PyTorch"}  # as its makers write it, where that is not its module's name
INTERRUPTED = 130  # the shell's status for a process stopped by Ctrl-C (128 + SIGINT)


class MissingExtra(ImportError):
    """What a function needs is not installed: one line naming the extra that installs it
    (``needs matplotlib, which is not installed: pip install 'memcalc[plot]'``)."""


def install(package: str) -> str:
    """How to install ``package``: its extra of memcalc's, or torch itself."""
    if package == "torch":
        return "pip install torch (the CPU build is enough)"
    return f"pip install 'memcalc[{EXTRAS[package]}]'" if package in EXTRAS \
        else f"pip install {package}"


def require(package: str, what: str):
    """``package``, imported; missing, a ``MissingExtra`` saying that ``what`` needs it and
    how to install it (instead of a bare ``No module named ...`` from deep inside)."""
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError:
        name = NAMES.get(package, package)
        raise MissingExtra(f"{what} needs {name}, which is not installed: {install(package)}",
                           name=package) from None


def install_hint(error: BaseException) -> str:
    """``; pip install 'memcalc[deepspeed]'`` for an ImportError of a package one of
    memcalc's extras installs (user code importing DeepSpeed, transformers), else ``""``."""
    name = (getattr(error, "name", None) or "").split(".")[0]
    if not isinstance(error, ImportError) or (name not in EXTRAS and name != "torch"):
        return ""
    return f"; {install(name)}"


def error_line(error: BaseException, flags: dict[str, str] | None = None) -> str | None:
    """The one line of an error a user can act on (bad input: pydantic's ValidationError, a
    ValueError, an OSError; a missing extra), else None (a bug: its traceback stands)."""
    if isinstance(error, MissingExtra):
        return str(error)
    if isinstance(error, ImportError):
        hint = install_hint(error)
        return f"{_first_line(str(error), type(error).__name__)}{hint}" if hint else None
    if isinstance(error, (ValueError, OSError)):  # pydantic's ValidationError is a ValueError
        return one_line(error, flags)
    return None


def run_main(main: Callable[..., int | None], *args, prog: str | None = None) -> NoReturn:
    """``sys.exit(main(*args))`` for a script or a ``python -m`` module of memcalc's, ending
    as the ``memcalc`` command does: bad input or a missing extra in one line ``prog:
    error: ...`` and exit status 2, Ctrl-C in ``prog: interrupted`` and 130, no traceback."""
    prog = prog or _program()
    try:
        status = main(*args)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(INTERRUPTED)
    except Exception as error:  # noqa: BLE001 - what error_line does not know is re-raised
        line = error_line(error)
        if line is None:
            raise
        print(f"{prog}: error: {line}", file=sys.stderr)
        sys.exit(2)
    sys.exit(status or 0)


def _program() -> str:
    """What the user ran: ``memcalc.validation.recorded`` for ``python -m ...``, else the
    script's file name (``peaks.py``)."""
    import os

    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        return spec.name
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"


def one_line(error: Exception, flags: dict[str, str] | None = None) -> str:
    """A pydantic ValidationError as ``field: message (got value)``, the field named by its
    CLI option when ``flags`` maps it; anything else as its first line."""
    errors = getattr(error, "errors", None)
    if callable(errors):
        first = error.errors()[0]
        loc = [str(p) for p in first["loc"] if not str(p).startswith("function-")]
        message = _first_line(first["msg"].removeprefix("Value error, "), "invalid")
        value = first.get("input")
        if not loc:  # a check across fields: its message names them ("kv_heads: ...")
            return _flagged(message, flags)
        name = (flags or {}).get(loc[-1], ".".join(loc))
        if isinstance(value, dict):  # a check across a nested model's fields: the same
            return f"{name}: {message}"
        return f"{name}: {message} (got {value!r}){_suggestion(first, value)}"
    return _flagged(_first_line(str(error), type(error).__name__), flags)


def _flagged(message: str, flags: dict[str, str] | None) -> str:
    """``kv_len: ...`` from the library with the field named by its option (``--kv-len:
    ...``) when ``flags`` maps it."""
    field, sep, rest = message.partition(": ")
    if sep and field in (flags or {}):
        return f"{flags[field]}: {rest}"
    return message


def _suggestion(error: dict, value) -> str:
    """``; did you mean 'grad'?`` for a near miss of one of a choice's values
    (``--loss gard``), else ``""``."""
    expected = (error.get("ctx") or {}).get("expected")
    if error.get("type") not in ("literal_error", "enum") or not isinstance(value, str) \
            or not isinstance(expected, str):
        return ""
    hint = did_you_mean(value, re.findall(r"'([^']*)'", expected))
    return f"; {hint.removeprefix(' (').removesuffix(')')}" if hint else ""


def refusal(error: Exception, impl: str) -> str:
    """Why ``impl`` has no figures, in one line, for a row or a skip line that names it: its
    refusal without the ``impl: `` its messages start with, or what the model raised."""
    text = one_line(error).removeprefix(f"{impl}: ").replace(f": {impl}: ", ": ", 1)
    if isinstance(error, ValueError):  # pydantic's ValidationError is one
        return text
    return f"the model raised {type(error).__name__}: {text}"


def _first_line(text: str, otherwise: str) -> str:
    """The first line of ``text`` that says something; ``otherwise`` if none does."""
    return next((line for line in text.splitlines() if line.strip()), otherwise)


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)``: the names that start with ``word`` (``a100`` ->
    ``a100-40gb`` or ``a100-80gb``), else the closest one by ``difflib``; or ``""``."""
    import difflib

    known = list(known)
    low = str(word).strip().lower()
    matches = [k for k in known if low and k.lower().startswith(low)][:3]
    if not matches:
        close = difflib.get_close_matches(low, [k.lower() for k in known], n=1, cutoff=0.6)
        matches = [k for k in known if close and k.lower() == close[0]]
    if not matches:
        return ""
    return f" (did you mean {' or '.join(repr(m) for m in matches)}?)"


# --- Ctrl-C while the command starts ------------------------------------------------------

_HELD: list[bool] = []  # one entry while held: whether hold() blocked SIGINT itself


def the_command() -> bool:
    """Whether this process is the ``memcalc`` command (``memcalc ...`` or ``python -m
    memcalc.cli ...``), not other code importing the package."""
    import os

    argv = getattr(sys, "orig_argv", sys.argv)
    script = os.path.basename(sys.argv[0]) if sys.argv else ""
    module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""
    return script in ("memcalc", "memcalc.exe") or module in ("memcalc", "memcalc.cli")


def hold() -> None:
    """Block SIGINT in this thread until ``release`` (no-op where it cannot be blocked, or
    where the caller had blocked it: it stays as the caller left it)."""
    if _HELD or not hasattr(signal, "pthread_sigmask"):
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    _HELD.append(signal.SIGINT not in before)


def release() -> None:
    """Unblock SIGINT if ``hold`` blocked it; one that came meanwhile is raised here, as a
    ``KeyboardInterrupt`` (``pthread_sigmask`` runs the handlers of signals it unblocks)."""
    if _HELD and _HELD.pop():
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def interrupted() -> None:
    """Ctrl-C while the command starts, before ``memcalc.cli.main`` can catch it (where
    ``hold`` cannot block it): its one line and status, as main's; imported by other code,
    the interrupt goes on."""
    if not the_command():
        raise KeyboardInterrupt
    print("memcalc: interrupted", file=sys.stderr)
    raise SystemExit(130)
