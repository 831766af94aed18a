"""``torch.compile`` in traced code: compiled for the trace, run uncompiled, or refused.

A compiled step allocates otherwise than the eager one: AOTAutograd's partitioner chooses
what is saved and what recomputed, inductor fuses pointwise ops (their intermediates never
exist) and reuses buffers. Tracing the code eagerly would report the eager step's figures
as the compiled one's. So while a trace runs (``stand_in``), ``torch.compile`` and
``nn.Module.compile`` go to the compiler the trace was given (``--compile default``:
``memcalc/compiling``, which hands it to ``calls``), or, when the trace was asked for the
eager step (``--compile eager``, API ``compile="eager"``), return what they were given,
uncompiled, and the result says where (``notes``); without either they stop the trace at
the user's line. A model compiled before it is handed to ``memcalc.trace`` is found the same way
(``check_module``). Compiled FlexAttention, ``torch.compile(flex_attention)``, is modelled
(``flex.py``) and is not refused.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable

import torch

from memcalc.tracing.errors import NotModelled

# what --compile takes: the eager step, inductor's default mode
MODES = ("eager", "default")

# the mode asked for (None: the code's calls as written), where the code called
# torch.compile under it, and the compiler (``compiler(model, name, options)``; None: the
# calls are refused unless the mode is "eager")
_MODE: ContextVar[str | None] = ContextVar("memcalc_compile_mode", default=None)
_CALLS: ContextVar[list | None] = ContextVar("memcalc_compile_calls", default=None)
_COMPILER: ContextVar[Callable | None] = ContextVar("memcalc_compiler", default=None)


def check_mode(mode: str | None, option: str = "--compile") -> None:
    """One line for a mode memcalc cannot trace."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"{option} {mode}: one of {', '.join(MODES)} (default: inductor's "
                         f"default mode, as the GPU runs it; eager: the step with the code's "
                         f"torch.compile calls left uncompiled)")


@contextmanager
def calls(mode: str | None, option: str = "--compile", compiler: Callable | None = None):
    """Inside, torch.compile calls in traced code are left uncompiled (``"eager"``), handed
    to ``compiler`` when one is given (``mode`` None or ``"default"``, which compiles the
    target too: ``target``), else refused; where they were made is collected for
    ``notes``; ``option``: the name a bad mode is refused under."""
    check_mode(mode, option)
    if mode == "default" and compiler is None:
        raise ValueError(f"{option} default: needs a compiler (memcalc.compiling's calls)")
    tokens = _MODE.set(mode), _CALLS.set([]), _COMPILER.set(compiler)
    try:
        yield
    finally:
        for var, token in zip((_MODE, _CALLS, _COMPILER), tokens):
            var.reset(token)


def mode() -> str | None:
    return _MODE.get()


def compiling() -> bool:
    """Whether torch.compile calls in traced code compile (a compiler was given)."""
    return _COMPILER.get() is not None


def notes() -> tuple[str, ...]:
    """What the result says of the compile calls left uncompiled (or compiled)."""
    made = _CALLS.get() or []
    if not made:
        return ()
    if _COMPILER.get() is not None:
        return (f"torch.compile followed as inductor compiles it for the GPU (mode default, "
                f"torch {torch.__version__.split('+')[0]}; triton kernels not built): "
                f"called at {', '.join(dict.fromkeys(made))}",)
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
        f"{what} ({where}): compiled code is followed only where memcalc's compiler is "
        f"given (memcalc trace, oom, sweep, validate --trace; API memcalc.trace), and will "
        f"not be reported as the eager step; --compile eager (API: compile=\"eager\") "
        f"traces it uncompiled")


def compile_call(model=None, **options):
    """``torch.compile`` in traced code: ``model`` compiled by the trace's compiler, or
    itself, uncompiled, or refused (``uncompiled``)."""
    if model is None:  # @torch.compile(...) as a decorator factory
        return lambda fn: compile_call(fn, **options)
    compiler = _COMPILER.get()
    if compiler is not None:
        _CALLS.get().append(_caller())
        return compiler(model, _name(model), options)
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
        compiler = _COMPILER.get()
        if compiler is None:
            uncompiled(f"{type(self).__name__}.compile()")
            return
        _CALLS.get().append(_caller())
        self._compiled_call_impl = compiler(self._call_impl, type(self).__name__, kwargs)

    torch.nn.Module.compile = module_compile
    try:
        yield
    finally:
        torch.nn.Module.compile = real


def target(fn):
    """The traced target as ``--compile default`` runs it: a module compiled in place
    (``Module.compile``: its parameters keep their names), a function compiled; else as
    it is."""
    compiler = _COMPILER.get()
    if _MODE.get() != "default" or compiler is None:
        return fn
    _CALLS.get().append("the target")
    if isinstance(fn, torch.nn.Module):
        fn._compiled_call_impl = compiler(fn._call_impl, type(fn).__name__, {})
        return fn
    return compiler(fn, _name(fn), {})


def check_module(fn) -> object:
    """A model compiled before the trace (``torch.compile(model)``, a block compiled in
    place or wrapped inside it): refused, or under ``--compile eager`` the model as it was
    before compiling (the wrapped blocks are not unwrapped: refused)."""
    original = getattr(fn, "_orig_mod", None) or getattr(fn, "_torchdynamo_orig_callable", None)
    if original is not None and _COMPILER.get() is not None:  # compiled again, for the trace
        _CALLS.get().append("the target")
        return _COMPILER.get()(original, _name(original), {})
    if original is not None:
        uncompiled(f"torch.compile({_name(original)})", "the target")
        fn = original
    if isinstance(fn, torch.nn.Module):
        for name, module in fn.named_modules():
            if getattr(module, "_orig_mod", None) is not None or \
                    getattr(module, "_compiled_call_impl", None) is not None:
                raise NotModelled(
                    f"{name or 'the model'}: compiled before the trace (torch.compile); "
                    f"memcalc compiles what is compiled inside the trace: pass the model "
                    f"uncompiled, with compile=\"default\" to compile it whole, or compile "
                    f"the block in the traced code (its constructor)")
    return fn
