"""Ctrl-C during a trace, held until the tracer's next op (``memcalc/tracing/interrupt.py``)."""

import os
import signal

import pytest

torch = pytest.importorskip("torch")

from cli_helpers import run  # noqa: E402
from memcalc.tracing import interrupt  # noqa: E402


def test_inside_a_ctrl_c_waits_for_the_next_check_and_is_raised_there():
    before = signal.getsignal(signal.SIGINT)  # Python's default_int_handler, or SIG_IGN
    with pytest.raises(KeyboardInterrupt):
        with interrupt.held():
            os.kill(os.getpid(), signal.SIGINT)  # no exception here: a flag
            reached = True
            interrupt.check()
            reached_after = True  # noqa: F841 - never
    assert reached and "reached_after" not in locals()
    assert not interrupt._PENDING
    assert signal.getsignal(signal.SIGINT) is before  # put back as it was


def test_pending_at_the_end_of_the_block_is_raised_there():
    with pytest.raises(KeyboardInterrupt):
        with interrupt.held():
            os.kill(os.getpid(), signal.SIGINT)
    interrupt.check()  # nothing left


INTERRUPTED = '''
import os
import signal


def attn(q, k, v):
    s = q @ k.transpose(-2, -1)
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C half-way through the forward
    return s.softmax(-1) @ v
'''


def test_a_trace_interrupted_says_so_in_one_line(tmp_path, capsys):
    """The command stops at the op after Ctrl-C, prints one line and exits 130 (before,
    the signal landed in a weakref callback, was ignored, and the whole output followed)."""
    (tmp_path / "stopped.py").write_text(INTERRUPTED)
    code, out, err = run(capsys, "trace", f"{tmp_path}/stopped.py:attn", "--seq", "64")
    assert (code, out, err) == (130, "", "memcalc: interrupted\n")
