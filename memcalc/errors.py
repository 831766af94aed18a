"""One-line messages for bad input, shared by the CLI and the file loaders."""

from __future__ import annotations

# config field -> the CLI option that sets it
FLAGS = {
    "batch": "--batch", "heads": "--heads", "seq_len": "--seq", "head_dim": "--head-dim",
    "kv_len": "--kv-len", "kv_heads": "--kv-heads", "chunk": "--chunk", "dtype": "--dtype", "impl": "--impl", "gpu": "--gpu",
    "loss": "--loss", "cublas_workspace_config": "--cublas-workspace-config",
    "time_limit": "--time-limit",
}


def one_line(error: Exception, flags: dict[str, str] | None = None) -> str:
    """A pydantic ValidationError as ``field: message (got value)``, the field named by its
    CLI option when ``flags`` maps it; anything else as its first line."""
    errors = getattr(error, "errors", None)
    if callable(errors):
        first = error.errors()[0]
        loc = [str(p) for p in first["loc"] if not str(p).startswith("function-")]
        message = first["msg"].removeprefix("Value error, ")
        if not loc:  # a check across fields: its message names them
            return message
        name = (flags or {}).get(loc[-1], ".".join(loc))
        return f"{name}: {message} (got {first.get('input')!r})"
    text = str(error)
    first = text.splitlines()[0] if text else type(error).__name__
    field, sep, rest = first.partition(": ")
    if sep and field in (flags or {}):  # "kv_len: ..." from the library: name the option
        return f"{flags[field]}: {rest}"
    return first
