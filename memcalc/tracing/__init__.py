"""Bring your own attention: trace a user's function or model on the meta device and treat
it like a built-in implementation.

``trace(fn, config, calling=...)`` runs the protocol (DESIGN.md section 1) for ``fn``
called as ``calling`` says (``target.py``: ``q, k, v``, or the inputs of ``--input``; an
autocast region; the module's dtype) on the emulated backend and returns the same
``Breakdown`` as ``predict``, its components named by the op that allocated them and the
user's source line. It follows the code paths of the configured GPU, not the meta device's,
where they allocate differently (``cuda_paths.py``: SDPA backend choice and fused kernels,
half-to-float softmax, fused dropout, the matmul dtype check; ``autocast.py``: CUDA's
autocast); ``grad_out`` is shaped like the function's output (learnt from a scratch
forward first); a module's parameters and buffers, and a function's module-level tensors,
are resident, and state built on the first call is left to the warm-up (``state.py``).
``traced`` adds what the trace took or could not see (``report.Traced``).

``traced_program(fn, config, calling)`` turns the function into a program of the kind
built-in implementations declare, resident state and inputs included: it traces at a few
sequence lengths, checks that the op sequence does not change, and recovers every
allocation's size as an exact polynomial in seq_len (fitted with fractions on four lengths,
verified on two more). Registered under a name (``register_function``), the traced code
then works everywhere a built-in does: ``predict``, OOM solving, sweeps.

The user's file is imported, so it runs as code: only what the user names is imported.

Modules, in the order the data flows: ``target.py`` (what is called, and how), ``state.py``
(what it keeps resident), ``tracer.py`` and ``protocol.py`` (the run on the meta device),
``direct.py`` (one trace), ``segments.py`` (its log as program events), ``fitted.py`` (a
program at any length), ``explain.py`` (a failure in one line), ``report.py`` (what
``memcalc trace`` prints).

The tracer itself (``tracer.py``) runs the measurement protocol (``protocol.py``) on the
meta device. May import: everything but ``validation``, ``plots``, ``cli`` and ``commands``.
"""

from memcalc.tracing.direct import (TraceOptions, installed_release, output_like,
                                    paths_for, trace, traced)
from memcalc.tracing.errors import NotModelled, RefusedOnGpu, TraceError
from memcalc.tracing.fitted import (SAMPLE_LENGTHS, Poly, fit, register_function,
                                    traced_program)
from memcalc.tracing.segments import step_events
from memcalc.tracing.target import (Bound, Calling, bound, check_causal,
                                    check_inputs, label_of, load_function, prepared,
                                    takes_causal)

__all__ = ["Bound", "Calling", "NotModelled", "Poly", "RefusedOnGpu", "SAMPLE_LENGTHS",
           "TraceError", "TraceOptions", "bound", "check_causal", "check_inputs", "fit",
           "installed_release", "label_of", "load_function", "output_like", "paths_for",
           "prepared", "register_function", "step_events", "takes_causal", "trace",
           "traced", "traced_program"]
