"""``torch.compile`` in traced code: refused in one line, or run uncompiled when asked.

memcalc does not follow compiled code yet. A compiled step allocates otherwise than the
eager one: AOTAutograd's partitioner chooses what is saved and what recomputed, inductor
fuses pointwise ops (their intermediates never exist) and reuses buffers. Tracing the code
eagerly would report the eager step's figures as the compiled one's. So while a trace runs
(``stand_in``), ``torch.compile`` and ``nn.Module.compile`` stop it at the user's line,
unless the trace was asked for the eager step (``--compile eager``, API ``compile="eager"``:
``calls``): then each returns what it was given, uncompiled, and the result says where
(``notes``). A model compiled before it is handed to ``memcalc.trace`` is found the same way
(``check_module``). Compiled FlexAttention, ``torch.compile(flex_attention)``, is modelled
(``flex.py``) and is not refused.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from memcalc.tracing.errors import NotModelled

MODES = ("eager",)  # what --compile takes: the eager step

# the mode asked for (None: refuse), and where the code called torch.compile under it
_MODE: ContextVar[str | None] = ContextVar("memcalc_compile_mode", default=None)
_CALLS: ContextVar[list | None] = ContextVar("memcalc_compile_calls", default=None)


def check_mode(mode: str | None, option: str = "--compile") -> None:
    """One line for a mode memcalc cannot trace."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"{option} {mode}: compiled steps are not modelled yet; "
                         f"'eager' traces the step with the code's torch.compile calls "
                         f"left uncompiled")


@contextmanager
def calls(mode: str | None, option: str = "--compile"):
    """Inside, torch.compile calls in traced code are refused (``mode`` None) or left
    uncompiled (``"eager"``), and where they were made is collected for ``notes``;
    ``option``: the name a bad mode is refused under."""
    check_mode(mode, option)
    modes, made = _MODE.set(mode), _CALLS.set([])
    try:
        yield
    finally:
        _MODE.reset(modes)
        _CALLS.reset(made)


def mode() -> str | None:
    return _MODE.get()


def notes() -> tuple[str, ...]:
    """What the result says of the compile calls left uncompiled."""
    made = _CALLS.get() or []
    if not made:
        return ()
    return (f"torch.compile left uncompiled (--compile eager): these are the eager step's "
            f"figures; called at {', '.join(dict.fromkeys(made))}",)


def _caller() -> str:
    """``file.py:line`` of the first frame outside torch and memcalc."""
    frame = sys._getframe(2)
    skipped = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
    while frame is not None and frame.f_code.co_filename.startswith(skipped):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def uncompiled(what: str, where: str | None = None) -> None:
    """A compile call of ``what`` in traced code: noted under ``--compile eager``, else one
    line saying why it is refused."""
    where = where or _caller()
    if _MODE.get() == "eager":
        made = _CALLS.get()
        if made is not None:
            made.append(where)
        return
    raise NotModelled(
        f"{what} ({where}): memcalc does not follow compiled code yet (inductor's fusion, "
        f"buffer reuse and the partitioner's saved tensors differ from eager), and will not "
        f"report the eager step as the compiled one; --compile eager (API: "
        f"compile=\"eager\") traces it uncompiled")


def compile_call(model=None, **options):
    """``torch.compile`` in traced code: ``model`` itself, uncompiled, or refused
    (``uncompiled``)."""
    if model is None:  # @torch.compile(...) as a decorator factory
        return lambda fn: compile_call(fn, **options)
    uncompiled(f"torch.compile({_name(model)})")
    return model


def _name(model) -> str:
    """A function's name, or a module's class's."""
    return getattr(model, "__name__", None) or type(model).__name__


@contextmanager
def stand_in():
    """Inside, ``nn.Module.compile`` is ``compile_call``'s (torch.compile itself is patched
    with FlexAttention's stand-in, ``flex.stand_in``, which hands other calls here)."""
    real = torch.nn.Module.compile

    def module_compile(self, *args, **kwargs):
        uncompiled(f"{type(self).__name__}.compile()")

    torch.nn.Module.compile = module_compile
    try:
        yield
    finally:
        torch.nn.Module.compile = real


def check_module(fn) -> object:
    """A model compiled before the trace (``torch.compile(model)``, a block compiled in
    place or wrapped inside it): refused, or under ``--compile eager`` the model as it was
    before compiling (the wrapped blocks are not unwrapped: refused)."""
    original = getattr(fn, "_orig_mod", None) or getattr(fn, "_torchdynamo_orig_callable", None)
    if original is not None:
        uncompiled(f"torch.compile({_name(original)})", "the target")
        fn = original
    if isinstance(fn, torch.nn.Module):
        for name, module in fn.named_modules():
            if getattr(module, "_orig_mod", None) is not None or \
                    getattr(module, "_compiled_call_impl", None) is not None:
                raise NotModelled(
                    f"{name or 'the model'}: compiled before the trace (torch.compile); "
                    f"memcalc does not follow compiled code yet: trace the model before "
                    f"compiling it (its eager step), or compile it inside the traced code "
                    f"and pass --compile eager")
    return fn
