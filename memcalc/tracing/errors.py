"""The one error of tracing: the function cannot be loaded or traced."""

from __future__ import annotations


class TraceError(ValueError):
    """The function cannot be loaded or traced; the message says where and why."""
