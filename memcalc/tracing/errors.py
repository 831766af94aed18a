"""The errors of tracing: the function cannot be loaded or traced, or makes a call memcalc
does not model."""

from __future__ import annotations


class TraceError(ValueError):
    """The function cannot be loaded or traced; the message says where and why."""


class NotModelled(ValueError):
    """A call the GPU would run but memcalc does not model (a fused kernel's variant): the
    trace stops at the user's line with this reason, not a hint about the meta device."""


class RefusedOnGpu(ValueError):
    """A check the GPU makes and the meta device skips (the operands of a matmul in two
    dtypes): the trace stops at the user's line with the message the GPU would raise."""


class NotPolynomial(TraceError):
    """The step's sizes are not polynomials in seq_len at the lengths sampled: a padded
    buffer, or ops that change with the length (a kernel chosen by it). The traced step is
    then solved by other means (``memcalc.tracing.fitted.Programs``)."""
