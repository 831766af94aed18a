"""Imports a trace defers: ``torch._dynamo`` and sympy, which torch's Python meta kernels
import on their first call although a trace on concrete sizes needs neither.

On the meta device many ops run torch's Python kernels (``torch/_meta_registrations.py``,
``torch/_refs``, ``torch/_decomp``). Their first call imports, only to answer questions
whose answer is known for plain Python values:

* ``torch._dynamo`` (0.5 s): ``torch._disable_dynamo`` (``torch/_compile.py``) wraps the
  type-promotion wrapper of ``torch/_prims_common/wrappers.py`` in ``torch._dynamo.disable``,
  which outside ``torch.compile`` only calls the function, and an optimizer's ``step``
  calls ``torch._dynamo.graph_break``, which outside it does nothing;
* sympy (0.3 s): ``elementwise_dtypes`` (``torch/_prims_common/__init__.py``) asks whether
  an argument is a ``sympy.Basic`` (none is before sympy is imported), the dense-layout
  check there imports ``torch.utils._sympy.functions.Max`` and does not use it on
  concrete sizes, and ``torch._check``
  (``torch/__init__.py``) and the refs call ``torch.fx.experimental.symbolic_shapes``'s
  ``expect_true``, ``guard_or_false`` and kin, which return a Python bool as it is.

While a trace runs, ``deferred()`` puts a stand-in for each of the three modules in
``sys.modules`` (where none is imported yet) that answers those calls for plain values and,
at anything else (a symbolic size, another name, a submodule), imports the real module,
takes on its contents and steps aside: correct whatever the traced code does, and cheap
when it does what models do. On exit the stand-ins leave and the functions that cached
the stand-in's ``disable`` forget it, so torch is as it was.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import types
from contextlib import contextmanager


class StandIn(types.ModuleType):
    """A module in ``sys.modules`` under the real one's name, holding ``names``, until
    anything else is asked of it: then the real module is imported in its place and its
    contents copied in (references to the stand-in keep working)."""

    def __init__(self, name: str, names: dict):
        super().__init__(name)
        self.__dict__.update(names)
        self._names, self._real = tuple(names), None

    def __getattr__(self, attr: str):  # only for names the stand-in lacks
        if attr == "__path__" and _importing_a_submodule():
            return self.become_real().__path__
        if attr.startswith("__") or attr in ("_real", "_names"):
            raise AttributeError(attr)
        return getattr(self.become_real(), attr)

    def step_aside(self) -> None:
        """Leave ``sys.modules``; a module that kept a reference to the stand-in finds the
        real module through it from now on (its own names are dropped)."""
        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        if self._real is None:
            for name in self._names:
                self.__dict__.pop(name, None)

    def become_real(self) -> types.ModuleType:
        """The real module, imported now if it is not yet."""
        if self._real is None:
            if sys.modules.get(self.__name__) is self:
                del sys.modules[self.__name__]
            self._real = importlib.import_module(self.__name__)
            self.__dict__.update(self._real.__dict__)
        return self._real


def _importing_a_submodule() -> bool:
    """Whether the stand-in's ``__path__`` is read by an import of one of its submodules
    (``torch._dynamo._trace_wrapped_higher_order_op``, which ``create_block_mask`` imports
    when called): Python reads the parent's path before any finder runs
    (``importlib._bootstrap._find_and_load_unlocked``), and a module without one "is not a
    package". ``from module import name`` asks for it too (``hasattr``), and is answered
    as a plain module: no path."""
    return sys._getframe(2).f_code.co_name == "_find_and_load_unlocked"


def _real(module: str, name: str):
    """``name`` of the real ``module``, importing it (through its stand-in, if present)."""
    found = sys.modules.get(module)
    return getattr(found.become_real() if isinstance(found, StandIn) else
                   importlib.import_module(module), name)


_SHAPES = "torch.fx.experimental.symbolic_shapes"


def _plain(name: str, answer, plain: tuple = (bool,)):
    """A function of ``symbolic_shapes`` that, for a value of a ``plain`` type (exactly),
    returns ``answer(value)``; for anything else, what the real function returns."""
    def function(value, *args, **kwargs):
        if type(value) in plain:
            return answer(value)
        return _real(_SHAPES, name)(value, *args, **kwargs)

    function.__name__ = name
    return function


def _plain_all(name: str, answer):
    """Like ``_plain`` for a function of several bools (``sym_and``, ``sym_or``)."""
    def function(*values):
        if all(type(v) is bool for v in values):
            return answer(values)
        return _real(_SHAPES, name)(*values)

    function.__name__ = name
    return function


def _sym_eq(x, y):
    """``sym_eq`` of two ints or two sequences of ints (shapes): ``==``, element by element."""
    ints = (type(x) is int and type(y) is int) or (
        isinstance(x, (tuple, list)) and isinstance(y, (tuple, list))
        and all(type(v) is int for v in (*x, *y)))
    if not ints:
        return _real(_SHAPES, "sym_eq")(x, y)
    return x == y if type(x) is int else (len(x) == len(y) and all(map(int.__eq__, x, y)))


class _Later(type):
    """The type of a stand-in's class (``sympy.Basic``, ``torch.utils._sympy.functions.Max``):
    nothing is an instance of a class whose module is not imported; once it is, the real
    class answers ``isinstance``, calls and attributes."""

    def _loaded(cls):
        module = sys.modules.get(cls._module)
        if isinstance(module, StandIn):
            module = module._real
        return None if module is None else getattr(module, cls.__name__)

    def __instancecheck__(cls, obj) -> bool:
        real = cls._loaded()
        return real is not None and isinstance(obj, real)

    def __subclasscheck__(cls, sub) -> bool:
        real = cls._loaded()
        return real is not None and issubclass(sub, real)

    def __call__(cls, *args, **kwargs):
        return _real(cls._module, cls.__name__)(*args, **kwargs)

    def __getattr__(cls, attr: str):
        if attr.startswith("__") or attr == "_module":
            raise AttributeError(attr)
        return getattr(_real(cls._module, cls.__name__), attr)


def _later(module: str, name: str) -> type:
    """A stand-in for class ``name`` of ``module`` (``_Later``)."""
    return _Later(name, (), {"_module": module})


def _symbolic_shapes_names() -> dict:
    """What ``symbolic_shapes`` answers for concrete values, as its own code does: a bool
    is returned as it is by ``expect_true``, ``guard_or_false``, ``guard_or_true`` and
    ``statically_known_true``, ``guard_size_oblivious`` (negated by
    ``statically_known_false``), bools are joined by ``sym_and`` and ``sym_or`` and ints
    (and shapes) compared by ``sym_eq`` as Python does; a bool or int is its
    own hint (``guarding_hint_or_throw``), has one, and is no nested int."""
    same = {name: _plain(name, lambda v: v) for name in (
        "expect_true", "guard_or_false", "guard_or_true", "statically_known_true",
        "guard_size_oblivious")}
    return {**same, "sym_and": _plain_all("sym_and", all), "sym_or": _plain_all("sym_or", any),
            "sym_eq": _sym_eq,
            "statically_known_false": _plain("statically_known_false", lambda v: not v),
            "guarding_hint_or_throw": _plain("guarding_hint_or_throw", lambda v: v, (bool, int)),
            "has_guarding_hint": _plain("has_guarding_hint", lambda v: True, (bool, int, float)),
            "is_nested_int": _plain("is_nested_int", lambda v: False, (bool, int, float))}


class _Undisabled:
    """``torch._dynamo.disable`` while a trace runs (outside ``torch.compile``): the
    function itself. Remembers the functions whose wrappers cached it
    (``__dynamo_disable``), to make them forget; after the trace, the real ``disable``."""

    def __init__(self):
        self.cached: list = []
        self.active = True

    def __call__(self, fn=None, recursive=True, **kwargs):
        if not self.active or fn is None:
            return _real("torch._dynamo", "disable")(fn, recursive, **kwargs)
        self.cached.append(fn)
        return fn

    def forget(self) -> None:
        self.active = False
        for fn in self.cached:
            if getattr(fn, "__dict__", {}).get("__dynamo_disable") is fn:
                del fn.__dict__["__dynamo_disable"]


def _no_graph_break(msg: str = "") -> None:
    """``torch._dynamo.graph_break`` outside ``torch.compile`` (``torch/_dynamo/decorators.py``):
    nothing; the optimizers' ``step`` calls it (``torch/optim/optimizer.py``)."""


class _Submodules(importlib.abc.MetaPathFinder):
    """Importing a submodule of a stand-in (``torch._dynamo.external_utils``) makes the
    stand-in real first: a stand-in is no package."""

    def __init__(self, stand_ins: list[StandIn]):
        self.stand_ins = stand_ins

    def find_spec(self, fullname, path=None, target=None):
        for stand_in in self.stand_ins:
            if fullname.startswith(stand_in.__name__ + "."):
                stand_in.become_real()
        return None


@contextmanager
def deferred():
    """Stand-ins for ``torch._dynamo``, sympy, ``torch.utils._sympy.functions`` and
    ``torch.fx.experimental.symbolic_shapes`` (those not imported yet) while the block
    runs."""
    disable = _Undisabled()
    wanted = {"torch._dynamo": {"disable": disable, "graph_break": _no_graph_break},
              "sympy": {"Basic": _later("sympy", "Basic")},
              "torch.utils._sympy.functions": {"Max": _later("torch.utils._sympy.functions",
                                                             "Max")},
              _SHAPES: _symbolic_shapes_names()}
    stand_ins = [StandIn(name, names) for name, names in wanted.items()
                 if name not in sys.modules]
    sys.modules.update({s.__name__: s for s in stand_ins})
    finder = _Submodules(stand_ins)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for stand_in in stand_ins:
            stand_in.step_aside()
        disable.forget()
