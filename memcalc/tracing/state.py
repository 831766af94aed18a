"""What a traced function keeps resident: an ``nn.Module``'s parameters and buffers, and a
plain function's module-level tensors and modules, whether made at import or at
construction (nanoGPT's causal ``bias`` buffer is made in ``__init__``, often at import).

They exist before the step, so they count in every figure from the start, in their own
roles (``parameter``, ``buffer``; a module-level ``nn.Parameter`` is a parameter). A module's
state found on the CPU is swapped for meta copies while the step runs there, tied weights
kept tied, and put back after; CPU tensors that are not in a module are the user's data on
the host and are not device memory.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Callable, Iterator

from memcalc.errors import one_line
from memcalc.engine.program import Role
from memcalc.tracing.errors import NotModelled, TraceError

Resident = tuple[str, object, Role]  # (name, tensor, role)


def instantiate(cls, spec: str):
    """``cls()`` built on the meta device (its parameters and buffers never materialize)."""
    import torch

    from memcalc.tracing.deferred import deferred

    try:
        with deferred(), torch.device("meta"):
            return cls()
    except NotModelled as error:  # a call memcalc refuses (torch.compile): its own line
        raise TraceError(f"--trace {spec}: {cls.__name__}(): {error}") from None
    except Exception as error:  # noqa: BLE001 - the user's constructor may raise anything
        raise TraceError(f"--trace {spec}: {cls.__name__}() failed on the meta device: "
                         f"{type(error).__name__}: {one_line(error)} (the module must be "
                         "constructible without arguments)") from None


@contextmanager
def on_meta(fn: Callable, dtype: str | None = None) -> Iterator[tuple[Resident, ...]]:
    """``on_device(fn, "meta", dtype)``: the state a trace runs with."""
    with on_device(fn, "meta", dtype) as state:
        yield state


@contextmanager
def on_device(fn: Callable, device: str, dtype: str | None = None
              ) -> Iterator[tuple[Resident, ...]]:
    """The tensors ``fn`` keeps resident, on ``device`` while the block runs: a module's
    own state, or for a plain function the modules and tensors on ``device`` among the
    module-level names its code refers to (``referenced``), each storage once. With
    ``dtype`` (``--param-dtype``), a module's floating parameters and buffers are in that
    dtype, as ``module.to(dtype)`` makes them (pure bf16 training).

    The user's objects are left as they were: a module's parameters and buffers elsewhere
    (a trace's on the CPU; a live run's on the meta device, as examples build models) are
    swapped for empty copies on ``device`` for the block and back after it (a notebook's
    trained model keeps its weights; moving it with ``module.to("meta")`` erased them).
    One copy per tensor, so weights tied across modules stay tied: one weight, and one
    grad, counted."""
    import torch

    swapped: list[tuple[dict, str, object]] = []  # (a module's store, key, the user's tensor)
    copies: dict[int, object] = {}  # id(the user's tensor) -> its copy on the device
    try:
        to = getattr(torch, dtype) if dtype else None
        if isinstance(fn, torch.nn.Module):
            found = _module_state("", _swapped(fn, device, swapped, copies, to))
        else:
            found = []
            for name, value in referenced(fn):
                if isinstance(value, torch.nn.Module):
                    found += _module_state(f"{name}.",
                                           _swapped(value, device, swapped, copies, to))
                elif isinstance(value, torch.Tensor) and value.device.type == device:
                    # a module-level nn.Parameter is a parameter: its grad is cleared between
                    # steps
                    role = Role.parameter if isinstance(value, torch.nn.Parameter) else Role.buffer
                    found.append((name, value, role))
        yield _dedupe(found)
    finally:
        for store, key, original in reversed(swapped):
            store[key] = original


_ABSENT = object()
_STORES = ("_parameters", "_buffers", "_modules")


@contextmanager
def kept(fn: Callable) -> Iterator[None]:
    """Undo, when the block ends, what running ``fn`` left on its modules (each submodule's
    attributes, parameters, buffers and children: ``register_buffer`` in a first
    ``forward``), on the module-level names its code refers to (a global set on the first
    call), and in the containers among them filled in place (a dict caching a causal mask,
    a list, an ``lru_cache``'d mask builder, an object's attributes: ``_refiller``). Such state is built by the first call on a GPU, the protocol's warm-up, with the
    temporaries that build it; a scratch forward run before the protocol must not build it
    instead, and a trace must not leave meta tensors on the user's objects."""
    import torch

    if isinstance(fn, torch.nn.Module):
        roots = [fn]
    else:
        roots = [v for _, v in referenced(fn) if isinstance(v, torch.nn.Module)]
    modules = list({id(m): m for r in roots for m in r.modules()}.values())
    saved = [(m, dict(m.__dict__), {k: dict(m.__dict__[k]) for k in _STORES if k in m.__dict__},
              set(m.__dict__.get("_non_persistent_buffers_set", ()))) for m in modules]
    code = _code(fn)
    namespace, names = getattr(code, "__globals__", None), _names(code)
    values = {n: namespace.get(n, _ABSENT) for n in names} if namespace is not None else {}
    filled = [r for r in map(_refiller, [*values.values(), *(v for m in modules
                                                            for k, v in m.__dict__.items()
                                                            if k not in _STORES)]) if r]
    try:
        yield
    finally:
        for refill in filled:
            refill()
        for m, attrs, stores, non_persistent in saved:
            now = m.__dict__
            for key in [k for k in now if k not in attrs]:
                del now[key]
            for key, value in attrs.items():
                if now.get(key, _ABSENT) is not value:
                    now[key] = value
            for key, content in stores.items():  # in place: ``on_meta`` holds these dicts
                now[key].clear()
                now[key].update(content)
            if "_non_persistent_buffers_set" in now:
                now["_non_persistent_buffers_set"].clear()
                now["_non_persistent_buffers_set"].update(non_persistent)
        for name, value in values.items():
            if value is _ABSENT:
                namespace.pop(name, None)
            elif namespace.get(name, _ABSENT) is not value:
                namespace[name] = value


def _code(fn: Callable) -> Callable:
    """The function whose module-level names a call of ``fn`` reads: ``fn``, or a module's
    ``forward`` (a GPT-2-style cache in its file's namespace)."""
    import torch

    return type(fn).forward if isinstance(fn, torch.nn.Module) else inspect.unwrap(fn)


def _refiller(value) -> Callable[[], None] | None:
    """What puts ``value``'s contents back as they are now, for state a first call may build
    in place rather than by rebinding a name: a dict, list or set (a mask cached by
    shape), a ``functools.lru_cache``'d builder that has cached nothing yet, a plain
    object's attributes; None for anything else."""
    import types

    if isinstance(value, (dict, set)):
        copy = value.copy()
        return lambda: (value.clear(), value.update(copy))
    if isinstance(value, list):
        copy = list(value)
        return lambda: value.__setitem__(slice(None), copy)
    if callable(getattr(value, "cache_clear", None)) and hasattr(value, "cache_info"):
        return value.cache_clear if value.cache_info().currsize == 0 else None
    import torch

    plain = not isinstance(value, (type, types.ModuleType, types.FunctionType,
                                   types.BuiltinFunctionType, types.MethodType,
                                   torch.nn.Module, torch.Tensor))  # modules: ``kept``'s own
    if plain and not type(value).__module__.startswith(("builtins", "torch")) \
            and isinstance(getattr(value, "__dict__", None), dict):
        attrs = dict(vars(value))
        return lambda: (vars(value).clear(), vars(value).update(attrs))
    return None


def _names(fn: Callable) -> set[str]:
    """Every global name ``fn``'s code refers to, present or not (one its first call sets),
    through its nested code and the module's functions it calls (as ``referenced``); a
    wrapped function's (``torch.compile``'s, ``functools.wraps``) is its original's."""
    fn = inspect.unwrap(fn)
    namespace = getattr(fn, "__globals__", None)
    if namespace is None:
        return set()
    names: set[str] = set()
    codes, seen = [fn.__code__], set()
    while codes:
        code = codes.pop()
        if id(code) in seen:
            continue
        seen.add(id(code))
        codes += [c for c in code.co_consts if inspect.iscode(c)]
        for name in code.co_names:
            names.add(name)
            value = namespace.get(name)
            if inspect.isfunction(value) and value.__globals__ is namespace:
                codes.append(value.__code__)
    return names


def referenced(fn: Callable) -> list[tuple[str, object]]:
    """The module-level names ``fn``'s code refers to, with their values, in the order of
    its module's namespace: those of its own code, of the functions and classes defined in
    it, and of the module's functions it calls, recursively (``_names``). Not the rest of
    the namespace: a notebook's holds every model the user has loaded."""
    fn = inspect.unwrap(fn)
    namespace = getattr(fn, "__globals__", None)
    if namespace is None:
        return []
    names = _names(fn)
    return [(name, value) for name, value in namespace.items() if name in names]


def _swapped(module, device: str, swapped: list, copies: dict, dtype=None):
    """``module`` with each parameter and buffer off ``device`` (or, with ``dtype``,
    floating in another dtype) replaced by an empty copy on it (the same copy wherever one
    tensor is held), noted in ``swapped`` to be put back."""
    for sub in module.modules():
        for store in (sub._parameters, sub._buffers):
            for key, t in list(store.items()):
                cast = dtype is not None and t is not None and t.is_floating_point() \
                    and t.dtype != dtype
                if t is None or (t.device.type == device and not cast):
                    continue
                if id(t) not in copies:
                    copies[id(t)] = _copy_on(t, device, dtype if cast else None)
                swapped.append((store, key, t))
                store[key] = copies[id(t)]
    return module


def _copy_on(t, device: str, dtype=None):
    """An empty tensor like ``t`` on ``device`` (in ``dtype`` if given): a parameter stays
    a parameter, with its ``requires_grad``."""
    import torch

    copy = torch.empty_like(t, device=device, dtype=dtype)
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(copy, requires_grad=t.requires_grad)
    return copy


def trained(state: tuple[Resident, ...]) -> tuple[tuple[str, object], ...]:
    """``(name, tensor)`` of the parameters in ``state`` that need grad: what the protocol
    resets the grads of, and what an optimizer trains."""
    return tuple((name, t) for name, t, role in state
                 if role is Role.parameter and t.requires_grad)


def _module_state(prefix: str, module) -> list[Resident]:
    return ([(f"{prefix}{n}", p, Role.parameter) for n, p in module.named_parameters()]
            + [(f"{prefix}{n}", b, Role.buffer) for n, b in module.named_buffers()])


def _dedupe(found: list[Resident]) -> tuple[Resident, ...]:
    """Each storage once (tied weights, a module reachable under two names)."""
    seen, kept = set(), []
    for name, t, role in found:
        key = t.untyped_storage()._cdata
        if key not in seen:
            seen.add(key)
            kept.append((name, t, role))
    return tuple(kept)
