"""One-line messages for bad input, shared by the CLI and the file loaders, with a
suggestion for a near miss (``did_you_mean``)."""

from __future__ import annotations

import difflib
import re
from typing import Iterable

# config field -> the CLI option that sets it
FLAGS = {
    "batch": "--batch", "heads": "--heads", "seq_len": "--seq", "head_dim": "--head-dim",
    "kv_len": "--kv-len", "kv_heads": "--kv-heads", "chunk": "--chunk", "dtype": "--dtype",
    "impl": "--impl", "gpu": "--gpu", "loss": "--loss", "causal": "--causal",
    "cublas_workspace_config": "--cublas-workspace-config", "time_limit": "--time-limit",
    "work_limit": "--work-limit", "memory_limit": "--memory-limit",
    "deterministic": "--deterministic",
    "mask": "--mask", "block_mask": "--block-mask", "cp": "--cp", "cp_method": "--cp-method",
    "tp": "--tp",
}


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
    known = list(known)
    low = str(word).strip().lower()
    matches = [k for k in known if low and k.lower().startswith(low)][:3]
    if not matches:
        close = difflib.get_close_matches(low, [k.lower() for k in known], n=1, cutoff=0.6)
        matches = [k for k in known if close and k.lower() == close[0]]
    if not matches:
        return ""
    return f" (did you mean {' or '.join(repr(m) for m in matches)}?)"
