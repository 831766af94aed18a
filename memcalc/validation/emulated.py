"""The emulated backend of ``memcalc validate``: the model against the protocol run on
PyTorch's meta device (``memcalc.tracing.tracer``), memory from the model of the caching
allocator, for the reference code of each implementation (``memcalc.validation.reference``).
"""

from __future__ import annotations

from typing import Callable

import torch

from memcalc.analysis.breakdown import Breakdown
from memcalc.analysis.predict import predict
from memcalc.config import Config
from memcalc.tracing import tracer
from memcalc.validation.compare import Check, figures_of
from memcalc.validation.reference import reference_fn


def measure(config: Config, fn: Callable | None = None, *args, **options) -> Breakdown:
    """The protocol on the meta device (``memcalc.tracing.tracer.measure``) for ``fn``, by
    default the reference code of ``config.impl``."""
    return tracer.measure(config, fn or reference_fn(config), *args, **options)


def check(config: Config) -> Check:
    """The model against the trace for one configuration; tolerance 0."""
    predicted = figures_of(predict(config))
    return Check(config=config, predicted=predicted, measured=figures_of(measure(config)))


def environment() -> dict[str, str]:
    return {"torch": torch.__version__, "device": "emulated",
            "how": "meta device, allocator model"}
