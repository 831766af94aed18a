"""A trace's event log as program events: what exists before the step, a training loop's
warm-up, and each measured phase (``segments``), every allocation named and given the role
it has in the step (saved, gradient, a model's state, ...)."""

from __future__ import annotations

from memcalc.engine.program import Cublas, Free, Release, Role, Stream, Tensor


def step_events(tracer, probe) -> list[tuple[str, list]]:
    """The step as segments of program events, from a tracer's log: ``("inputs", ...)``,
    what exists before the warm-up (resident state, inputs, grad_out); for a training
    loop's step, ``("warm-up", ...)`` as traced (its optimizer creates state); then each
    measured phase, ``("forward", ...)``, ``("backward", ...)``, ``("optimizer", ...)``,
    from the reset of its peak to the next reset, the last one to its peak's reading."""
    events = tracer.events
    marks = [(i, e[1]) for i, e in enumerate(events) if e[0] == "mark"]
    resets = [(i, what.removeprefix("reset_peak ")) for i, what in marks
              if what.startswith("reset_peak")]
    first = marks[0][0]  # "inputs": the warm-up step starts here
    ends = [i for i, _ in resets[1:]] + [max(i for i, what in marks if what == "max_allocated")]
    segments = [("inputs", events[:first])]
    if any(label == "optimizer" for _, label in resets):
        segments.append(("warm-up", events[first + 1:resets[0][0]]))
    segments += [(label, [e for e in events[i + 1:end] if e[0] != "mark"])
                 for (i, label), end in zip(resets, ends)]
    return _convert(segments, probe.output_key)


def _convert(segments: list[tuple[str, list]], output_key) -> list[tuple[str, list]]:
    """Name each allocation and give it a role (before the step: its own, or input; in a
    warm-up: a resident one's, else activation; alive at the end of its phase: saved,
    gradient; else activation or temporary), and turn frees of saved tensors into
    releases. A reduction's scratch becomes its ``Reduction``, whose buffers the fitted
    program recomputes at each length."""
    names: dict = {}
    converted = []
    # the output is the last forward's (storage keys are addresses, reused by other steps)
    last = max(i for i, (label, _) in enumerate(segments) if label == "forward")
    for n, (label, events) in enumerate(segments):
        events = _reductions(events)
        alive = _alive(events)
        out_index = max((i for i, e in alive.items() if e[1] == output_key), default=None) \
            if n == last else None
        roles = [_phase_role(label, i, e, alive, out_index) for i, e in enumerate(events)]
        made = [_event(e, names, role) for e, role in zip(events, roles)]
        converted.append((label, [e for e in made if e]))
    return converted


def _phase_role(label: str, index: int, event, alive: dict, out_index) -> Role | None:
    """The role of an allocation in segment ``label`` (``_convert``)."""
    if event[0] != "alloc":
        return None
    if label == "inputs":
        return _given_role(event)
    if label == "warm-up":
        role = event[2].role
        return role if role in RESIDENT else Role.activation
    if index == out_index:
        return Role.output
    kept, dropped = {"forward": (Role.saved, Role.activation),
                     "backward": (Role.gradient, Role.temporary),
                     "optimizer": (Role.temporary, Role.temporary)}[label]
    return kept if index in alive else dropped


# what exists before a phase and outlives it, in a role of its own
RESIDENT = (Role.parameter, Role.buffer, Role.optimizer_state, Role.input)


def _given_role(event) -> Role | None:
    """Before the step: a parameter or buffer stays one, anything else is an input."""
    if event[0] != "alloc":
        return None
    role = event[2].role
    return role if role in (Role.parameter, Role.buffer) else Role.input


def _alive(events: list) -> dict[int, tuple]:
    """Allocation events (by position) still alive at the end; storage keys are addresses
    and get reused, so liveness is tracked per allocation, not per key."""
    current: dict = {}
    for i, e in enumerate(events):
        if e[0] == "alloc":
            current[e[1]] = i
        elif e[0] == "free":
            current.pop(e[1], None)
    return {i: events[i] for i in current.values()}


def _reductions(events: list) -> list:
    """``events`` with each ``reduce`` ... ``reduce_end`` span (a kernel's own buffers,
    allocated and freed inside it) replaced by its ``Reduction``."""
    kept, inside = [], False
    for e in events:
        if e[0] == "reduce":
            kept.append(e)
            inside = True
        elif e[0] == "reduce_end":
            inside = False
        elif not inside:
            kept.append(e)
    return kept


def _event(event, names: dict, role):
    kind = event[0]
    if kind == "cublas":
        return Cublas(event[1])
    if kind == "stream":
        return Stream(event[1])
    if kind == "reduce":
        return event[1]
    if kind == "alloc":
        c = event[2]
        name = _unique(c.name, names)
        names[event[1]] = (name, role)
        return Tensor(name, c.shape, c.dtype, role, c.op, storage_bytes=c.bytes)
    if kind == "free" and event[1] in names:
        name, role = names.pop(event[1])
        return Release((name,)) if role is Role.saved else Free((name,))
    return None  # frees of what the step did not allocate, marks


def _unique(name: str, names: dict) -> str:
    taken = {n for n, _ in names.values()}
    candidate, i = name, 2
    while candidate in taken:
        candidate, i = f"{name} #{i}", i + 1
    return candidate
