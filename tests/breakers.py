"""Deliberate errors the tests plant in a model, to see a check fail."""

import dataclasses

import memcalc.analysis.probe

from memcalc.impls import IMPLS
from memcalc.engine.program import Tensor


def row_sum_as_int64(monkeypatch) -> None:
    """``naive`` declares its row sum as int64 instead of the dtype (a wrong formula the
    trace, and a GPU, disagree with)."""
    original = IMPLS["naive"].build

    def broken(d):
        program = original(d)
        fix = lambda e: Tensor(e.name, e.shape, "int64", e.role, e.op) if (  # noqa: E731
            isinstance(e, Tensor) and e.name == "row_sum") else e
        return type(program)(tuple(map(fix, program.forward)), program.backward)

    monkeypatch.setitem(IMPLS, "naive", dataclasses.replace(IMPLS["naive"], build=broken))


def interrupt_after(monkeypatch, impl: str, replays: int) -> None:
    """Ctrl-C in ``impl``'s search, at the replay after ``replays`` of them (the solver's
    predictions and capped replays)."""
    count = [0]

    def counted(real):
        def replay(config, *args, **kwargs):
            if config.impl == impl:
                count[0] += 1
                if count[0] > replays:
                    raise KeyboardInterrupt
            return real(config, *args, **kwargs)
        return replay

    probe = memcalc.analysis.probe  # where the search replays
    monkeypatch.setattr(probe, "predict", counted(probe.predict))
    monkeypatch.setattr(probe, "replay_within", counted(probe.replay_within))

