"""The guard on the work a request implies (``memcalc.engine.work``): refused before it is done."""

import subprocess
import sys
import time

import pytest

import memcalc
from memcalc.config import make_config
from memcalc.analysis.probe import program_events
from memcalc.engine.work import (EVENT_BYTES, ROW_BYTES, TooMuchWork, check_rows, estimated_events, memory_limit)
from cli_helpers import run

GiB = 2**30


@pytest.mark.parametrize("impl, events", [
    # 64-row chunks: a loop's events are affine in the chunk count, exact at multiples of
    # 2,048 rows (the two lengths the estimate is made from)
    ("linear-causal-chunked", 139_261),
    ("checkpoint-linear-causal-chunked", 182_268),
    ("naive", 52),  # no loop: as many events at every length
])
def test_the_estimate_is_the_programs_event_count_where_the_loop_is_affine(impl, events):
    config = make_config(impl=impl, seq_len=131_072)
    events_at = lambda n: program_events(config.replace(seq_len=n))  # noqa: E731
    assert estimated_events(131_072, events_at) == program_events(config) == events


def test_a_program_over_the_limit_is_refused_before_it_is_built():
    """A hundred million rows of a chunked loop: 106 million events, ~44 GiB; built, it ran
    until MemoryError. The estimate (at 2,048 and 4,096 rows) refuses it at once."""
    started = time.perf_counter()
    with pytest.raises(TooMuchWork) as refused:
        memcalc.breakdown(impl="linear-causal-chunked", seq_len=10**8)
    assert time.perf_counter() - started < 5
    # events: e(4096) + (e(4096) - e(2048)) x (10^8 - 4,096) / 2,048 = 106,249,997;
    # x 440 B = 46,749,998,680 B = 43.54 GiB, rounded up to 44 GiB
    assert str(refused.value) == (
        "memory_limit: linear-causal-chunked: at seq_len 100,000,000, about 106,249,997 "
        "events to build and replay would take about 43.54 GiB of this machine's memory "
        "(and some 7 min), over the limit of 8.00 GiB; raise the limit to 44GiB to run it "
        "anyway")
    assert 106_249_997 * EVENT_BYTES == 46_749_998_680


def test_the_limit_can_be_raised_or_lifted():
    with memory_limit(GiB):
        with pytest.raises(TooMuchWork, match="over the limit of 1.00 GiB"):
            memcalc.breakdown(impl="linear-causal-chunked", seq_len=4 * 10**6)
    with memory_limit(None):  # no limit: a long but small enough step runs
        b = memcalc.breakdown(impl="linear-causal-chunked", seq_len=70_000)
    assert b.peak_bytes > 0
    with pytest.raises(ValueError, match="memory_limit: a positive number of bytes"):
        with memory_limit(0):
            pass


def test_a_sweep_is_sized_before_its_lengths_are_made():
    """A range of a hundred million lengths was made (4.7 GB, 23 s) before anything was
    judged: its length is read instead. 99,999,999 x 1,700 B = 169,999,998,300 B."""
    assert 99_999_999 * ROW_BYTES == 169_999_998_300
    started = time.perf_counter()
    with pytest.raises(TooMuchWork, match="a sweep of 99,999,999 configurations would take "
                                          "about 158.32 GiB"):
        memcalc.sweep(seq_lens=range(1, 10**8))
    assert time.perf_counter() - started < 5
    check_rows(1000)  # 1.7 MB: within any limit


def test_the_cli_refuses_in_one_line_with_the_option_and_exit_2(capsys):
    code, out, err = run(capsys, "breakdown", "--impl", "linear-causal-chunked", "--seq", "1e8")
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert err.startswith("memcalc: error: --memory-limit: linear-causal-chunked: at seq_len "
                          "100,000,000, about 106,249,997 events")
    code, out, err = run(capsys, "sweep", "--seq", "1:100000000:1")
    assert (code, out) == (2, "")
    assert "a sweep of 100,000,000 configurations" in err
    code, _, err = run(capsys, "breakdown", "--memory-limit", "0")
    assert (code, err) == (2, "memcalc: error: --memory-limit: a positive size such as 16GiB, "
                              "or none (got '0')\n")


def test_compare_lists_what_it_refuses_and_shows_the_rest(capsys):
    """compare --seq 1e8 printed a MemoryError traceback after 19 s: the chunked loops are
    rows with the refusal, the others have figures."""
    code, out, _ = run(capsys, "compare", "--seq", "1e8", "--impl",
                       "naive,flash2,linear-causal-chunked", "--json")
    assert code == 0
    import json

    rows = {r["impl"]: r for r in json.loads(out)["rows"]}
    assert rows["naive"]["peak_bytes"] > 0 and rows["flash2"]["peak_bytes"] > 0
    assert rows["linear-causal-chunked"]["peak_bytes"] is None
    assert rows["linear-causal-chunked"]["status"] == "skipped"
    assert "about 106,249,997 events" in rows["linear-causal-chunked"]["reason"]


def test_the_time_limit_stops_a_replay_with_one_line(capsys):
    code, out, err = run(capsys, "breakdown", "--impl", "linear-causal-chunked", "--seq",
                         "4000000", "--time-limit", "0.2")
    assert (code, out) == (2, "")
    assert err == ("memcalc: error: --time-limit: breakdown ran past 0.2 s and stopped; raise "
                   "the limit to let it finish\n")


def test_a_refused_sweep_does_not_grow():
    """In a process of its own: the refusal comes before any list of lengths is made."""
    # VmHWM: the process's peak resident memory since its exec (ru_maxrss may carry the
    # forking parent's, pytest's)
    code = ("import re; from memcalc.cli import main; "
            "rc = main(['sweep', '--seq', '1:100000000:1']); "
            "print(rc, re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[0] == "2" and int(out[1]) < 200_000  # KiB: under 200 MB (importing: ~50 MB)
