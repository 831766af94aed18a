"""OOM thresholds: each answer fits and one more does not, by ``memcalc breakdown`` too."""

import json
import re
import subprocess
import sys

import pytest

from memcalc import progress

from memcalc.budget import Budget, fits
from memcalc.cli import main
from memcalc.config import Config, Device
from memcalc.impls import IMPLS, impl_names, register
from memcalc import closed_form
from memcalc.closed_form import live_polynomial
from memcalc.solver import (Unsolved, _climb, _closed_form, _estimate_again, _guess, _Probe,
                            bisect_max, max_fitting)
from memcalc.thresholds import solve
from memcalc.tensors import Program, Role, free, new
from memcalc.timeline import predict

GIB80 = 85_362_475_008  # 80 x 2^30 - 512 x 2^20: --gpu-gb 80 with the default reserve


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_naive_threshold_at_80_gib():
    s = max_fitting(Config(impl="naive"), GIB80)
    n = s.max_value
    assert fits(Config(impl="naive").replace(seq_len=n), GIB80)
    assert not fits(Config(impl="naive").replace(seq_len=n + 1), GIB80)
    assert s.at_max.fits and not s.at_next.fits
    assert s.first_failing_power_of_two == 32768  # 2^15, the first power above 19,511
    assert n == 19511  # reserved peak 85,354,086,400 <= budget < 85,389,737,984 at 19,512


def test_fitting_is_not_monotone_near_the_threshold():
    """Why the answer is a threshold searched from the top: at 80 GiB the seeds' step fits
    at 19,509, not at 19,510, again at 19,511, and not at 19,512."""
    naive = Config(impl="naive")
    assert [fits(naive.replace(seq_len=n), GIB80) for n in range(19509, 19513)] == [
        True, False, True, False]
    assert bisect_max(naive, GIB80).max_value == 19509  # doubling then halving stops early


def test_closed_form_of_the_seeds_step():
    """Alive at the naive backward peak (B=8, H=1, d=16, fp32): six N x N fp32 tensors,
    8 x 4 x 6 = 192 B per N^2; argmax (8 x 8 B), row sum (8 x 4 B) and six (8, N, 16) fp32
    tensors (q, k, v, grad_out, out, dv: 6 x 512 B) = 3,168 B per N; two 32 MiB workspaces."""
    q = live_polynomial(Config(impl="naive", shape={"seq_len": 4096}), "seq_len")
    assert (q.a, q.b, q.c) == (192, 3168, 67_108_864) and q.exact
    assert q.text() == "192*N^2 + 3,168*N + 67,108,864"
    assert q(16384) == 51_658_620_928  # the peak at N=16384: every tensor a multiple of 512 B


def test_bisection_finds_a_threshold_too():
    config = Config(impl="naive-softmax")
    s = bisect_max(config, GIB80)
    assert s.max_value == max_fitting(config, GIB80).max_value == 25807
    assert s.evaluations > max_fitting(config, GIB80).evaluations


@pytest.mark.parametrize("field, fixed", [("batch", {"seq_len": 4096}),
                                          ("head_dim", {"seq_len": 4096, "batch": 1})])
def test_other_fields(field, fixed):
    config = Config(impl="naive-weights", shape=fixed)
    s = max_fitting(config, GIB80, field)
    assert fits(config.replace(**{field: s.max_value}), GIB80)
    assert not fits(config.replace(**{field: s.max_value + 1}), GIB80)


def test_nothing_fits():
    s = max_fitting(Config(impl="naive"), 1 << 20)  # 1 MiB: not even the workspaces
    assert s.max_value == 0 and s.at_max is None and s.first_failing_power_of_two == 1


def test_time_limit():
    with pytest.raises(Unsolved, match="no exact answer within"):
        max_fitting(Config(impl="naive"), GIB80, time_limit=1e-9)


@pytest.fixture
def growing_impl():
    before = set(impl_names())  # every module loaded first: nothing wraps the test program
    @register("test-growing", "one event per 64 rows", traced=False)
    def growing(d):
        events = []
        for i in range(d.N // 64):
            events += [new(f"c{i}", (d.B, 64, d.D), d.dtype, Role.temporary, "mm"), free(f"c{i}")]
        return Program(tuple(events + [new("out", (d.B, d.N, d.D), d.dtype, Role.output, "mm")]), ())

    yield
    for name in set(IMPLS) - before:
        IMPLS.pop(name)


def test_all_implementations_skip_growing_programs(growing_impl):
    budget = Budget.of(Device(), memory_bytes=80 * 2**30)
    report = solve(Config(), budget, impls=None)
    skipped = {k.impl: k.reason for k in report.skipped}
    assert "events grow with seq_len" in skipped["test-growing"]
    assert "test-growing" not in {r.impl for r in report.results}
    small = Budget(device="test", memory_bytes=8 * 2**20, reserve_bytes=0)  # 8 MiB
    named = solve(Config(protocol={"forward_only": True}), small, impls=["test-growing"])
    n = named.results[0].max_value  # named: solved anyway; out (8, N, 16) fp32 is 512 B per row
    assert 512 * n <= 8 * 2**20 - 2 * 2**20 < 512 * (n + 1) + 2 * 2**20 + 20 * 2**20


# --- the command --------------------------------------------------------------------------

def test_oom_json_rows_check_out_with_breakdown(capsys):
    """The "done when" of the issue: for every row, `memcalc breakdown` with the same
    options says it fits at max_seq_len and not one above."""
    code, out, _ = run(capsys, "oom", "--gpu-gb", "80", "--json")
    data = json.loads(out)
    assert code == 0 and data["budget_bytes"] == GIB80
    assert data["results"]
    for row in data["results"]:
        n = row["max_seq_len"]
        assert {"impl", "peak_bytes_at_max", "peak_bytes_at_next"} <= set(row)
        for seq, expected, peak in ((n, True, row["peak_bytes_at_max"]),
                                    (n + 1, False, row["peak_bytes_at_next"])):
            _, out, _ = run(capsys, "breakdown", "--impl", row["impl"], "--seq", str(seq),
                            "--gpu-gb", "80", "--json")
            b = json.loads(out)
            assert (b["fits"], b["peak_bytes"]) == (expected, peak), (row["impl"], seq)


def test_oom_solve_batch_and_markdown(capsys):
    code, out, _ = run(capsys, "oom", "--gpu", "a100-80gb", "--impl", "naive,naive-softmax",
                       "--solve", "batch", "--seq", "4096", "--markdown")
    assert code == 0
    assert "| implementation | max B |" in out and "| naive-softmax |" in out


def test_oom_table_in_a_terminal(capsys):
    code, out, _ = run(capsys, "oom", "--gpu-gb", "80", "--impl", "naive")
    assert code == 0 and "19511" in out and "32768" in out and "192*N^2" in out


@pytest.mark.parametrize("argv, option", [
    (["--solve", "depth"], "--solve"),
    (["--impl", "naive,,flash2"], "--impl"),
    (["--impl", "nope"], "--impl"),
    (["--time-limit", "-1"], "--time-limit"),
    (["--gpu-gb", "x"], "--gpu-gb"),
    (["--batch", "0"], "--batch"),
])
def test_oom_bad_input(capsys, argv, option):
    code, out, err = run(capsys, "oom", *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and option in err and "Traceback" not in err


def test_oom_and_sweep_import_no_torch():
    code = ("import sys; from memcalc.cli import main; main(['oom', '--impl', 'naive', '--json']);"
            " main(['sweep', '--seq', '256,512', '--json']); print(sorted(m for m in "
            "('torch', 'matplotlib', 'pandas') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_oom_shows_reserved_under_the_budget_and_a_readable_closed_form():
    """Every row: the reserved peak at N (replayed under the budget, with release-and-retry)
    is within the budget and what N+1 needs is over it; closed forms print no fractions."""
    import memcalc
    from memcalc.render import text

    report = memcalc.oom(gpu_gb=80, impls=["naive", "linear", "sdpa-efficient"])
    budget = report.budget.budget_bytes  # 80 x 2^30 - 512 x 2^20 = 85,362,475,008
    assert budget == 85_362_475_008
    for r in report.to_dict()["results"]:
        assert r["reserved_bytes_at_max"] <= budget < r["needed_bytes_at_next"], r["impl"]
    out = text(report, 140)
    why = out[out.index("why"):]
    assert "/" not in why.split("caveat")[0]
    assert "naive: 192*N^2 + 3,168*N + 67,108,864" in why  # 6 N x N tensors x 8 x 4 B = 192


def test_time_limit_names_the_estimate_it_could_not_replay():
    """The chunked loop at 80 GiB: the estimate (millions of rows) is known within a
    second, its replay would take minutes, so it is not started; the time left doubles the
    largest length that fits while a replay is expected to end in time."""
    config = Config(impl="linear-causal-chunked")
    with pytest.raises(Unsolved) as caught:
        max_fitting(config, GIB80, time_limit=3)
    error = caught.value
    assert error.hi is None and error.lo % 16384 == 0  # the start, doubled 0 or more times
    assert fits(config.replace(seq_len=error.lo), GIB80)
    assert error.estimate > 100 * 16384
    assert f"fits at {error.lo}; the closed-form estimate, not replayed: {error.estimate:,}" \
        in str(error)


def test_a_search_says_what_it_replays_and_what_it_knows():
    """On a terminal, ``memcalc oom`` shows a status line: each replay, with the bounds
    found so far and the seconds spent of the limit."""
    heard: list[str] = []
    with progress.listen(heard.append):
        s = max_fitting(Config(impl="naive"), GIB80, time_limit=60)
    # without a replay's phase (" - measured forward ..."), and the clock's seconds
    said = [re.sub(r"; \d+ of 60 s$", "; _ of 60 s", h.split(" - ")[0]) for h in heard]
    assert said[0] == "naive: trying seq_len=16,384; _ of 60 s"
    n = s.max_value
    assert f"naive: trying seq_len={n + 1:,}; fits at {n:,}; _ of 60 s" in said
    assert said[-1] == f"naive: closed form at seq_len={n:,}; fits at {n:,}; _ of 60 s"
    assert any(h.startswith("naive: closed form from seq_len=16,384; fits at 16,384; ")
               for h in said)


def test_climb_closes_in_on_a_threshold_with_time_left():
    """From a value that fits, ``_climb`` doubles, then halves the gap to the first value
    that does not, down to neighbours: a fitting value next to a failing one."""
    probe = _Probe(Config(impl="naive"), "seq_len", GIB80)
    assert probe(16384)  # the default step fits in 80 GiB
    error = _climb(probe)
    assert error.hi == error.lo + 1
    assert fits(Config(impl="naive", shape={"seq_len": error.lo}), GIB80)
    assert not fits(Config(impl="naive", shape={"seq_len": error.hi}), GIB80)


def test_a_climb_estimates_again_from_the_largest_value_that_fits():
    """The estimate scales the closed form by the reserved/raw ratio measured at one
    value; after a climb it is taken again at the largest value that fits, once that is a
    tenth of the estimate or more (naive at 80 GiB: 20,951 from 1,024; 19,510 from 16,384,
    where 19,511 is the answer)."""
    q = live_polynomial(Config(impl="naive", shape={"seq_len": 1024}), "seq_len")
    probe = _Probe(Config(impl="naive"), "seq_len", GIB80)
    probe.model, probe.estimate = q, _guess(probe, 1024, q)
    assert probe(1024) and probe(2048)  # 2,048 is under a tenth of 20,951: no change
    _estimate_again(probe)
    assert probe.estimate == _guess(probe, 1024, q) == 20951
    assert probe(16384)
    _estimate_again(probe)
    assert probe.estimate == _guess(probe, 16384, q) == 19510


def test_closed_form_of_a_loop_counts_the_chunks_it_adds():
    """linear-causal-chunked at 640 rows (10 chunks of 64): the polynomial is fitted on
    replays at 640, 1280 and 2560 rows and holds at 1920, where the step keeps 30 chunks'
    tensors, not the 10 whose names it had at 640."""
    config = Config(impl="linear-causal-chunked", shape={"seq_len": 640})
    q = live_polynomial(config, "seq_len")
    at_1920 = predict(config.replace(seq_len=1920))
    assert q.exact and q(1920) == sum(c.nbytes for c in at_1920.components)
    assert q.a == 0  # linear: each chunk adds the same tensors


def test_closed_form_of_a_loop_at_the_answer_is_fitted_below_it(monkeypatch):
    """At the answer, a loop's closed form is fitted at n/4, n/2 and n (checked at 3n/4):
    replays of 1.5n rows, not 9n above it. The same line as fitted at 640, 1280, 2560."""
    config = Config(impl="linear-causal-chunked", shape={"seq_len": 640})
    up = live_polynomial(config, "seq_len")
    probe = _Probe(config, "seq_len", GIB80)
    assert probe.grows() and not _Probe(Config(impl="naive"), "seq_len", GIB80).grows()
    replayed = []
    monkeypatch.setattr(closed_form, "predict",
                        lambda c: replayed.append(c.shape.seq_len) or predict(c))
    below = _closed_form(probe, 2560, "seq_len")  # 640, 1280, 2560; checked at 1920
    assert sorted(replayed) == [640, 1280, 1920, 2560]
    assert below.exact and below.at == 2560
    assert (below.a, below.b, below.c) == (up.a, up.b, up.c)


def test_closed_form_is_left_out_when_no_time_is_left():
    """The answer stands without its closed form (a loop's is replayed at 2n, 3n and 4n);
    with time, the naive step's is the one above."""
    late = _Probe(Config(impl="naive"), "seq_len", GIB80, time_limit=1e-9)
    assert _closed_form(late, 4096, "seq_len") is None
    q = _closed_form(_Probe(Config(impl="naive"), "seq_len", GIB80), 4096, "seq_len")
    assert q.text() == "192*N^2 + 3,168*N + 67,108,864"


def test_an_estimate_that_was_replayed_is_not_called_unreplayed():
    probe = _Probe(Config(impl="naive"), "seq_len", GIB80, time_limit=60)
    probe.estimate = 16384
    assert probe(16384)
    assert probe.unsolved().estimate is None and "estimate" not in str(probe.unsolved())
    probe.estimate = 19000
    assert probe.unsolved().estimate == 19000
