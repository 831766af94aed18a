"""Compiled code run on a real GPU: what ``validate --backend cuda`` measures of a compiled
step, beside the trace that predicts it.

A trace compiles each ``torch.compile`` call for the preset GPU with memcalc's backend
(``session.compile``): its wrappers run on meta, under the trace. A live run must run the
same calls as torch runs them on the GPU in hand: inductor, the user's options, the same
activation memory budget, triton kernels built and launched. So inside ``run()``, a call
of a model memcalc compiled, made outside any trace, runs ``torch.compile`` of the model it
was given (compiled at its first call, in the protocol's warm-up step, as a training loop
compiles at its first step). Nothing of the trace's session may be in force meanwhile: its
wrappers run on meta and its device answers are the preset's, so ``session.live_run``
closes an open session first (the next trace opens another). Imports nothing of this
package: ``session`` imports it.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from contextvars import ContextVar

# the real compilations of one live run, by the model memcalc compiled (None: not live)
_COMPILED: ContextVar[dict | None] = ContextVar("memcalc_live_compiled", default=None)


@contextmanager
def run(activation_budget: float | None):
    """Inside, models memcalc compiled for a trace run as torch compiles them on this GPU,
    at ``activation_budget`` (``activation_memory_budget``; None: torch's); dynamo's
    compiled code is dropped before and after, so each live run compiles its own (the
    budget is not among dynamo's guards). ``session.live_run`` closes the trace's session
    first."""
    import torch._dynamo
    import torch._functorch.config as functorch
    import torch._inductor.config as inductor

    torch._dynamo.reset()
    token = _COMPILED.set({})
    try:
        with ExitStack() as stack:
            # caches off, as in a trace: a graph cached at another budget must not be found
            stack.enter_context(inductor.patch(fx_graph_cache=False,
                                               fx_graph_remote_cache=False))
            stack.enter_context(functorch.patch(enable_autograd_cache=False))
            if activation_budget is not None:
                stack.enter_context(functorch.patch(
                    activation_memory_budget=activation_budget))
            yield
    finally:
        _COMPILED.reset(token)
        torch._dynamo.reset()


def running() -> bool:
    """Whether a live run is in progress (``run``)."""
    return _COMPILED.get() is not None


def compiled(model, options: dict):
    """``torch.compile(model, **options)`` as torch runs it on the GPU, made once per live
    run: the model memcalc compiled for its traces (``session.compile``), with the options
    the code gave (``mode``, ``fullgraph``, ``dynamic``: ``session.check_options`` refused
    the rest)."""
    import torch._dynamo

    made = _COMPILED.get()
    key = id(model)
    if key not in made:
        made[key] = (model, torch._dynamo.optimize(
            "inductor", nopython=options.get("fullgraph", False),
            dynamic=options.get("dynamic"))(model))
    return made[key][1]
