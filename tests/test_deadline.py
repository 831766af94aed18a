"""A time limit holds inside one program build and one replay, not only between them."""

import time

import pytest

from memcalc.config import Config
from memcalc.engine.deadline import CHECK_EVERY, TimeUp, WorkUp, deadline, tick, work_done
from memcalc.impls import get_impl
from memcalc.engine.replay import Ledger, replay

# 4,096 chunks of 64 rows: tens of thousands of events, so the clock is read many times
CHUNKED = Config(impl="linear-causal-chunked", shape={"seq_len": 64 * 4096, "batch": 1})


def test_a_passed_deadline_stops_the_build():
    with deadline(time.perf_counter() - 1), pytest.raises(TimeUp):
        get_impl(CHUNKED.impl).build(CHUNKED.dims)


def test_a_passed_deadline_stops_the_replay():
    program = get_impl(CHUNKED.impl).build(CHUNKED.dims)  # built without a limit
    assert len(program.forward) > 2 * CHECK_EVERY
    ledger = Ledger(CHUNKED.workspace_bytes)
    with deadline(time.perf_counter() - 1), pytest.raises(TimeUp):
        replay(ledger, CHUNKED.dims, program)


def test_no_deadline_no_limit():
    """``deadline(None)`` sets no limit: a replay whose clock is read many times runs to
    its end."""
    program = get_impl(CHUNKED.impl).build(CHUNKED.dims)
    with deadline(None):
        replay(Ledger(CHUNKED.workspace_bytes), CHUNKED.dims, program)  # no TimeUp


def test_no_deadline_inside_one_keeps_the_enclosing_limit():
    """A build or replay without a limit of its own, inside a command's --time-limit, stops
    at the command's."""
    program = get_impl(CHUNKED.impl).build(CHUNKED.dims)
    with deadline(time.perf_counter() - 1), deadline(None), pytest.raises(TimeUp):
        replay(Ledger(CHUNKED.workspace_bytes), CHUNKED.dims, program)


def test_steps_counted_in_batches_still_reach_the_clock():
    """``tick(n)`` counts n steps at once (the replay's batches): the clock is read
    whenever a multiple of ``CHECK_EVERY`` is crossed, even when none is landed on."""
    with deadline(time.perf_counter() - 1), pytest.raises(TimeUp):
        for _ in range(3):
            tick(CHECK_EVERY - 1)


def test_a_work_limit_stops_the_replay_at_the_same_event():
    """The replay counts its events in batches of 1,024 and stops at the first batch past
    the limit: 5,000 events allowed, stopped once 5 x 1,024 = 5,120 are counted, on any
    machine."""
    program = get_impl(CHUNKED.impl).build(CHUNKED.dims)
    start = work_done()
    with deadline(None, start + 5000), pytest.raises(WorkUp):
        replay(Ledger(CHUNKED.workspace_bytes), CHUNKED.dims, program)
    assert work_done() - start == 5 * 1024


def test_a_build_is_not_work():
    """A program build ticks for the clock only: small programs are kept once built, so
    its steps would count or not by what ran before."""
    start = work_done()
    with deadline(None, start):  # no work left
        get_impl(CHUNKED.impl).build(CHUNKED.dims)
    assert work_done() == start
