"""Python's references, for models of code whose tensors die where its variables let go.

The context-parallel models (``memcalc.impls.ring``: PyTorch's ring attention;
``memcalc.impls.ulysses``: DeepSpeed-Ulysses) follow the variables of the code they model:
each tensor dies when nothing holds it, as CPython frees it, and the frees are declared in
the order the tracer collects them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memcalc.engine.program import Cublas, Free, Release, Role, Tensor, free, new, release

T = Role.temporary


@dataclass
class Frame:
    """Torch's code run over names: ``hold(variable, *tensors)`` binds a variable (or an
    object's field) to tensors, dropping what it held; a tensor dies when nothing holds it,
    and its free is declared before the next allocation, deaths in the order the tensors
    were made (as the tracer collects them)."""

    events: list = field(default_factory=list)
    made: dict = field(default_factory=dict)  # tensor -> its place in the making order
    holders: dict = field(default_factory=dict)  # tensor -> the variables holding it
    bound: dict = field(default_factory=dict)  # variable -> the tensors it holds
    dead: list = field(default_factory=list)

    def new(self, name: str, shape: tuple, dtype: str, op: str, role: Role = T) -> str:
        """Allocate ``name`` and bind the variable of the same name to it."""
        self.flush()
        self.events.append(new(name, shape, dtype, role, op))
        self.made[name] = len(self.made)
        self.holders[name] = set()
        self.hold(name, name)
        return name

    def kernel(self, events: list, returned: tuple[str, ...]) -> None:
        """A kernel's events as the model declares them; what it returns (``returned``)
        lives on as the caller binds it, everything else dies inside."""
        for event in events:
            if isinstance(event, Tensor):
                self.new(event.name, event.shape, event.dtype, event.op)
            elif isinstance(event, Free):
                self.drop(*[n for n in event.names if n not in returned])
            elif isinstance(event, (Cublas, Release)):  # a workspace, autograd's frees
                self.flush()
                self.events.append(event)

    def hold(self, variable: str, *tensors: str) -> None:
        before = self.bound.pop(variable, ())
        self.bound[variable] = tensors
        for t in tensors:
            self.holders.setdefault(t, set()).add(variable)
        for t in before:
            self._let_go(t, variable)

    def drop(self, *variables: str) -> None:
        for variable in variables:
            for t in self.bound.pop(variable, ()):
                self._let_go(t, variable)

    def _let_go(self, tensor: str, variable: str) -> None:
        holding = self.holders.get(tensor)
        if holding is None or variable in self.bound and tensor in self.bound[variable]:
            return
        holding.discard(variable)
        if not holding:
            del self.holders[tensor]
            self.dead.append(tensor)

    def flush(self) -> None:
        if self.dead:
            self.events.append(free(*sorted(self.dead, key=self.made.__getitem__)))
            self.dead = []


def prefixed(events: list, prefix: str) -> list:
    """A kernel's events (its tensors, frees, releases and cuBLAS calls, what a frame
    follows) under names that say where it runs (``step 2: lse``, ``local: lse``)."""
    out = []
    for e in events:
        if isinstance(e, Tensor):
            out.append(e.replace(name=prefix + e.name))
        elif isinstance(e, Free):
            out.append(free(*(prefix + n for n in e.names)))
        elif isinstance(e, Release):
            out.append(release(*(prefix + n for n in e.names)))
        elif isinstance(e, Cublas):
            out.append(e)
    return out


def roled(events: list, names: tuple, role: Role) -> list:
    """``names`` as ``role``: what a node saves (autograd holds it to the backward), the
    output, the grads."""
    return [e.replace(role=role) if isinstance(e, Tensor) and e.name in names else e
            for e in events]
