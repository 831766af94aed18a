"""What ``memcalc trace`` calls: the user's function or ``nn.Module``, loaded from a file or
module, and how its inputs reach its parameters.

``load_function("file.py:name")`` imports exactly that file; ``prepared`` builds an
``nn.Module`` class on the meta device; ``bound(fn, inputs, causal)`` is the callable the
protocol calls with the input tensors in order: each input goes to the parameter of its
name (positionally for ``q, k, v`` by default, as before), ``causal`` to a ``causal`` or
``is_causal`` parameter, and what comes back is reduced to the one output tensor the
backward starts from (``primary``).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from memcalc.errors import install_hint, one_line as _first_line
from memcalc.engine.inputs import QKV, Input, letters_help

EXAMPLE_DIMS = "('B', 'N', 768)"
from memcalc.tracing.errors import TraceError
from memcalc.tracing.optimizers import Loop


def load_function(spec: str) -> Callable:
    """``path/to/file.py:fn`` or ``package.module:fn``: import exactly that, return ``fn``."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise TraceError(f"--trace {spec}: expected FILE.py:FUNCTION or MODULE:FUNCTION"
                         f"{_defines(Path(spec.rstrip(':')))}")
    module = _import(target, spec)
    fn = getattr(module, name, None)
    if not callable(fn):
        from memcalc.names import did_you_mean

        known = _callables(module)
        raise TraceError(f"--trace {spec}: {target} has no function {name!r}"
                         f"{did_you_mean(name, known)}{_listing('it', known)}")
    return prepared(fn, spec)


def prepared(fn, spec: str) -> Callable:
    """What is traced of ``fn``: a function or an ``nn.Module`` instance as it is, an
    ``nn.Module`` class built with no arguments on the meta device. ``spec`` names it in
    an error."""
    from memcalc.tracing import compiled

    if _is_module_class(fn):
        from memcalc.tracing.state import instantiate

        with stand_ins():  # a constructor may import flash_attn, or call torch.compile
            fn = instantiate(fn, spec)
    elif not callable(fn):
        raise TraceError(f"--trace {spec}: not a function or an nn.Module: "
                         f"{type(fn).__name__}")
    return compiled.target(fn)


def label_of(fn) -> str:
    """A traced function's name: its qualified name, or a module instance's class's."""
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def _callables(module) -> list[str]:
    """The functions and classes ``module`` defines itself (not those it imports)."""
    return [k for k, v in vars(module).items() if not k.startswith("_") and callable(v)
            and getattr(v, "__module__", None) == module.__name__]


def _defines(path: Path) -> str:
    """``; x.py defines f, g`` for a Python file named without ``:FUNCTION``, read without
    running it (its top-level functions and classes); else ``""``."""
    import ast

    if path.suffix != ".py" or not path.is_file():
        return ""
    try:
        tree = ast.parse(path.read_text())
    except (SyntaxError, ValueError, OSError):
        return ""
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return _listing(path.name, [n.name for n in tree.body
                                if isinstance(n, kinds) and not n.name.startswith("_")])


def _listing(where: str, names: list[str]) -> str:
    return f"; {where} defines {', '.join(names)}" if names else ""


def _is_module_class(obj) -> bool:
    """An ``nn.Module`` subclass (checked without importing torch for plain functions)."""
    nn = getattr(sys.modules.get("torch"), "nn", None)
    return isinstance(obj, type) and nn is not None and issubclass(obj, nn.Module)


def _import(target: str, spec: str):
    """The user's module, imported as Python would, with the stand-ins of what cannot run on
    meta (``stand_ins``)."""
    from memcalc.tracing.interrupt import held

    with stand_ins(), held():  # a Ctrl-C half-way through the file's imports: after them
        return _imported(target, spec)


@contextmanager
def stand_ins():
    """The stand-ins of what cannot run on the meta device, while the user's code runs:
    the flash-attn packages (``memcalc.tracing.flash_attn``) and compiled FlexAttention
    (``memcalc.tracing.flex``), ``torch.compile`` (``memcalc.tracing.compiled``: refused, or
    left uncompiled); held while the file is imported and while it is traced, so
    that ``from flash_attn import flash_attn_func`` inside a function (imported lazily, as
    many codebases do) finds the stand-in too."""
    from memcalc.tracing import compiled, flex
    from memcalc.tracing.flash_attn import stand_ins as flash_attn

    with flash_attn(), flex.stand_in(), compiled.stand_in():
        yield


# each file imported, by its resolved path: (its size, modification time and the
# environment it was imported in, the module)
_FILES: dict[Path, tuple[tuple, object]] = {}


def _imported(target: str, spec: str):
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise TraceError(f"--trace {spec}: no file {target}")
            return _file_module(path)
        return importlib.import_module(target)
    except (TraceError, KeyboardInterrupt):
        raise
    except BaseException as error:  # the user's module may raise anything, SystemExit too
        raise TraceError(f"--trace {spec}: importing {target} failed: "
                         f"{type(error).__name__}: {_first_line(error)}"
                         f"{install_hint(error)}") from None


def _file_module(path: Path):
    """The module of a user's file, imported once as Python imports a module (the target
    and ``--fsdp-apply`` named in one file share its classes: an ``isinstance`` between
    them holds), again only when the file or the environment changed since (module-level
    code reads environment variables: ``LAYERS`` of the examples) or the way its
    ``torch.compile`` calls run (``compiled.mode``)."""
    import os

    from memcalc.tracing import compiled

    key, stat = path.resolve(), path.stat()
    state = (stat.st_size, stat.st_mtime_ns, frozenset(os.environ.items()), compiled.mode())
    if key in _FILES and _FILES[key][0] == state:
        return _FILES[key][1]
    name = f"memcalc_user_{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    # registered, as an import would: inspect finds a class's file through it (an error in
    # a module's forward names the user's line), dataclasses need it
    sys.modules[name] = module
    module_spec.loader.exec_module(module)
    _FILES[key] = (state, module)
    return module


# --- the signature ------------------------------------------------------------------------

def called(fn: Callable) -> Callable:
    """What a call of ``fn`` runs: an ``nn.Module``'s ``forward`` (its ``__call__`` takes
    ``*args, **kwargs``, which read as "any keyword": ``--causal`` reached no module)."""
    return fn.forward if _is_module_class(type(fn)) else fn


def _parameters(fn: Callable) -> dict[str, inspect.Parameter] | None:
    """``fn``'s parameters by name (a module's ``forward``'s), None for builtins without a
    signature."""
    try:
        return dict(inspect.signature(called(fn)).parameters)
    except (TypeError, ValueError):
        return None


def takes_causal(fn: Callable) -> bool:
    """Whether ``fn`` takes ``causal`` or ``is_causal`` (or any keyword; unknown: yes)."""
    params = _parameters(fn)
    return params is None or any(p.name in ("causal", "is_causal") or p.kind is p.VAR_KEYWORD
                                 for p in params.values())


def check_causal(fn: Callable, config) -> None:
    """``causal`` reaches the function only through a ``causal`` or ``is_causal``
    argument: refused, not ignored, when it takes neither."""
    if config.causal and not takes_causal(fn):
        raise ValueError("causal: the function takes neither causal nor is_causal (a mask "
                         "it builds itself is traced as written)")


def signature_text(fn: Callable) -> str:
    """``forward(x, mask=None)``: how the user wrote the call, for messages."""
    name = "forward" if _is_module_class(type(fn)) else getattr(fn, "__name__", "fn")
    try:
        return f"{name}{inspect.signature(called(fn))}"
    except (TypeError, ValueError):
        return f"{name}(...)"


def check_inputs(fn: Callable, inputs: tuple[Input, ...] | None,
                 field: str = "--input") -> tuple[Input, ...]:
    """The inputs ``fn`` is called with: ``inputs`` when given, each binding to a parameter
    (by name, or through ``*args``/``**kwargs``) and every parameter without a default
    given; ``q, k, v`` when not given and ``fn`` takes three tensors. A TraceError that
    names the parameters and shows an input (as ``field``, ``--input`` or the API's
    ``inputs``, spells it) otherwise."""
    params = _parameters(fn)
    if not inputs:
        if params is None or _binds(fn, 3):
            return QKV
        first = _first(params)
        how = (f"inputs={{{first!r}: {EXAMPLE_DIMS}, ...}}" if field == "inputs" else
               f"--input NAME=DIMS[:DTYPE], e.g. --input {first}=B,N,768")
        raise TraceError(f"{signature_text(fn)} does not take (q, k, v): give each of its "
                         f"inputs as {how} ({letters_help(field)})")
    if params is None:
        return inputs
    kinds = {p.kind for p in params.values()}
    for i in inputs:
        p = params.get(i.name)
        if (p is None or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)) \
                and inspect.Parameter.VAR_KEYWORD not in kinds \
                and inspect.Parameter.VAR_POSITIONAL not in kinds:
            from memcalc.errors import did_you_mean

            name = f"inputs[{i.name!r}]" if field == "inputs" else f"{field} {i.name}"
            raise TraceError(f"{name}: {signature_text(fn)} has no parameter "
                             f"{i.name!r}{did_you_mean(i.name, list(params))}")
    given = {i.name for i in inputs}
    missing = [p.name for p in params.values() if p.default is p.empty and p.name not in given
               and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if missing and not any(i.name not in params for i in inputs):
        how = (f"inputs[{missing[0]!r}] = (dims)" if field == "inputs" else
               f"--input {missing[0]}=DIMS[:DTYPE]")
        raise TraceError(f"{signature_text(fn)} needs {', '.join(missing)}: add {how} "
                         f"({letters_help(field)})")
    return inputs


def _first(params: dict | None) -> str:
    """The first parameter's name (``x`` when there is none to name)."""
    return next((n for n, p in (params or {}).items()
                 if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)), "x")


def _binds(fn: Callable, count: int) -> bool:
    try:
        inspect.signature(called(fn)).bind(*([None] * count))
        return True
    except TypeError:
        return False


# --- the call -----------------------------------------------------------------------------

class Bound:
    """``fn`` called as the protocol calls it: the input tensors in order, each to its
    parameter, ``causal`` to ``causal``/``is_causal``; returns the one output tensor
    (``primary``) and notes what that was when ``fn`` returned more (``returned``)."""

    def __init__(self, fn: Callable, inputs: tuple[Input, ...] = QKV, causal: bool = False,
                 autocast: str | None = None, param_dtype: str | None = None,
                 loop: Loop = Loop(), sharding=None, rank: int | None = None):
        params = _parameters(fn) or {}
        self.fn = fn
        self.sharding = sharding  # FSDP2's (``memcalc.tracing.fsdp.Sharding``), or None
        self.rank = rank  # the one rank traced (``Calling.rank``), or None
        self.autocast = autocast
        self.param_dtype = param_dtype  # the module's floating state in it (on_meta)
        self.loop = loop  # the training loop's optimizer and micro-steps
        keywords = any(p.kind is p.VAR_KEYWORD for p in params.values())
        self.names = [None if inputs is QKV or _positional(params.get(i.name), keywords)
                      else i.name for i in inputs]
        self.options = {k: causal for k in ("causal", "is_causal") if k in params}
        self.returned = ""

    def __call__(self, *tensors):
        args = [t for name, t in zip(self.names, tensors) if name is None]
        kwargs = {name: t for name, t in zip(self.names, tensors) if name is not None}
        with self.region():
            returned = self.fn(*args, **kwargs, **self.options)
        out, self.returned = primary(returned)
        return out

    def region(self):
        """``torch.autocast("cuda", dtype)`` around the forward (``--autocast``), as a
        mixed-precision training loop writes it; else nothing."""
        import contextlib

        import torch

        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=getattr(torch, self.autocast))


def _positional(p: inspect.Parameter | None, keywords: bool) -> bool:
    """An input with no parameter of its name goes to ``**kwargs`` by name if there is
    one, else to ``*args``; one for a positional-only parameter goes positionally."""
    return (p is None and not keywords) or (p is not None and p.kind is p.POSITIONAL_ONLY)


@dataclass(frozen=True)
class Calling:
    """How a traced target is called: its inputs, the autocast region around its forward
    (``bfloat16`` or ``float16``; None: none but the target's own), the dtype of its
    module's floating parameters and buffers (None: as built), the training loop
    around it (an optimizer, accumulated micro-steps: ``memcalc.tracing.optimizers``), and
    FSDP2 over its ranks (``memcalc.tracing.fsdp.Sharding``; None: one GPU holds it all);
    ``rank``: the one rank traced, whose program is fitted (None: every rank traced and the
    busiest shown; rank 0's program fitted, under ``--cp`` each place in the ring's)."""

    inputs: tuple[Input, ...] = QKV
    autocast: str | None = None
    param_dtype: str | None = None
    loop: Loop = Loop()
    fsdp: object = None
    rank: int | None = None


def bound(fn: Callable, config, calling: Calling = Calling()) -> Bound:
    """``fn`` with ``config``'s options, to be called as ``calling`` says."""
    if calling.loop.optimizer is not None and config.protocol.forward_only:
        raise TraceError(f"--optimizer {calling.loop.optimizer.text()}: steps after a "
                         f"backward; --forward-only traces inference")
    if calling.fsdp is not None and not _is_module_class(type(fn)):
        raise TraceError("--fsdp: FSDP shards an nn.Module's parameters; trace the model "
                         "(FILE:CLASS or a module instance), not a function")
    world = calling.fsdp.ranks if calling.fsdp is not None else 1
    mesh = calling.fsdp.mesh if calling.fsdp is not None else None
    if mesh is not None and mesh.cp > 1 and mesh.cp < mesh.ranks \
            and config.cp_method == "ulysses":
        raise TraceError(f"--mesh {mesh.text()} --cp-method ulysses: DeepSpeed-Ulysses runs "
                         f"over the process group the caller gives it; with other axes beside "
                         f"cp, trace its ring (allgather, alltoall)")
    if mesh is not None and config.cp != mesh.cp:
        raise TraceError(f"--mesh {mesh.text()}: its cp={mesh.cp} is the configuration's "
                         f"context parallelism; give it there only")
    if calling.fsdp is not None and getattr(config, "tp", 1) > 1:
        raise TraceError(f"--fsdp {calling.fsdp.world} --tp {config.tp}: --tp splits the heads "
                         f"of a built-in implementation; a traced model's tensor parallelism "
                         f"is its own plan: --fsdp-tp T with --fsdp-apply FILE.py:FUNCTION")
    if calling.fsdp is not None and calling.fsdp.tp > 1 and config.cp > 1:
        raise TraceError("--fsdp-tp with --cp: not traced (context and tensor parallelism "
                         "over one mesh)")
    if mesh is None and world > 1 and config.cp > 1 and world != config.cp:
        raise TraceError(f"--fsdp {world} --cp {config.cp}: FSDP and context parallelism run "
                         f"over the same ranks here (torchtitan's dp_shard_cp mesh): give "
                         f"both the same P, or the axes apart with --mesh "
                         f"dp_shard=S,cp=C")
    return Bound(fn, calling.inputs, config.causal, calling.autocast, calling.param_dtype,
                 calling.loop, calling.fsdp, calling.rank)


def primary(out) -> tuple[object, str]:
    """The tensor a step's backward starts from, and what was returned when that was more
    than one tensor: a tensor itself; a Hugging Face ``ModelOutput`` or a dict with a
    ``loss`` (``loss.backward()``); a tuple holding one 0-d floating tensor, the loss
    (nanoGPT's ``logits, loss``); else a tuple's or a dict's first tensor (an attention
    module's ``(output, weights)``). The rest is dropped before the backward."""
    import torch

    if isinstance(out, torch.Tensor):
        return out, ""
    loss = out.get("loss") if hasattr(out, "get") and hasattr(out, "keys") else None
    if isinstance(loss, torch.Tensor):
        return loss, f"{type(out).__name__}: its loss"
    values = list(out.values()) if hasattr(out, "values") and hasattr(out, "keys") else \
        list(out) if isinstance(out, (tuple, list)) else []
    keys = list(out.keys()) if hasattr(out, "keys") else list(range(len(values)))
    losses = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor) and v.dim() == 0
              and v.is_floating_point()]
    if len(losses) == 1 and isinstance(out, (tuple, list)) and len(values) > 1:
        return values[losses[0]], f"{type(out).__name__}: its [{losses[0]}] (a 0-d loss)"
    for key, value in zip(keys, values):
        if isinstance(value, torch.Tensor):
            where = f"[{key!r}]" if isinstance(key, str) else f"[{key}]"
            return value, f"{type(out).__name__}: its {where} {tuple(value.shape)}"
    raise TraceError(f"the function must return a tensor (or a tuple, a dict or a Hugging "
                     f"Face output holding one), not {type(out).__name__}")
