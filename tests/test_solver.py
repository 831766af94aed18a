"""The threshold search: each answer fits and one more does not, by ``fits`` too."""

import re

import pytest

from memcalc.analysis import closed_form, solver
from memcalc.engine import status
from memcalc.analysis.budget import Budget, fits
from memcalc.analysis.closed_form import live_polynomial
from memcalc.config import Config, Device, make_config
from memcalc.analysis.probe import REACH, Probe, events_growth
from memcalc.analysis.solved import Interrupted, Unsolved
from memcalc.analysis.solver import (_climb, _closed_form, _estimate_again, _guess, _step_top, bisect_max, max_fitting)
from memcalc.analysis.predict import predict
from memcalc.engine.deadline import DEFAULT_WORK_LIMIT
from breakers import interrupt_after

GIB80 = 85_362_475_008  # 80 x 2^30 - 512 x 2^20: --gpu-gb 80 with the default reserve
MiB = 1 << 20


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


def test_bisection_finds_a_threshold_too():
    config = Config(impl="naive-softmax")
    s = bisect_max(config, GIB80)
    # 23,084: the warm-up reserves, in order, q, k, v, grad_out (8 x N x 16 x 4 B =
    # 11,819,008 B, >= 10 MiB: a segment rounded up to 2 MiB, 12,582,912 = 6 x 2 MiB), qk
    # (N x N: 8 x 23,084 x 23,084 x 4 B = 17,051,873,792 B, segment 8,131 x 2 MiB =
    # 17,051,942,912), the main thread's 32 MiB cuBLAS workspace, s, out (12,582,912), dp,
    # dscores and dscores tmp: 5 N x N segments + 5 of 12 MiB + 32 MiB = 85,356,183,552 B
    # <= GIB80. At 23,085 an N x N tensor is 17,053,351,200 B, segment 8,132 x 2 MiB =
    # 17,054,040,064: the fifth needs 4 of those + 5 x 12 MiB + 32 MiB + 1 more =
    # 85,366,669,312 B > GIB80, and none of the four is free to release.
    nn, nn_next, in12, ws = 8_131 * 2 * MiB, 8_132 * 2 * MiB, 6 * 2 * MiB, 32 * MiB
    assert (s.at_max.reserved_bytes, s.at_next.reserved_bytes) == (
        5 * nn + 5 * in12 + ws, 5 * nn_next + 5 * in12 + ws)  # 85,356,183,552; 85,366,669,312
    assert s.max_value == max_fitting(config, GIB80).max_value == 23084
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


def test_a_work_limit_stops_a_search_where_it_would_on_any_machine(monkeypatch):
    """The work limit counts replayed events, not seconds: the chunked loop in 268,435,456 B
    from 1,024 rows stops with the same bounds whether the clock runs as it does or an
    hour per reading (a machine thousands of times slower, or loaded): fits at 8,933, the
    estimate 21,773 not replayed, at most 29,502 (the ceiling of the test below)."""
    import time

    config, budget = Config(impl="linear-causal-chunked"), 268_435_456

    def stopped() -> str:
        with pytest.raises(Unsolved) as caught:
            max_fitting(config, budget, start=1024, work_limit=100_000)
        return str(caught.value)

    here = stopped()
    clock = iter(range(0, 10**9, 3600))
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(clock)))
    assert stopped() == here == (
        "no exact answer within the work limit of 100,000 events (fits at 8,933; the "
        "closed-form estimate, not replayed: 21,773; at most 29,502, past which the tensors "
        "alive at the peak alone exceed the budget)")


def test_a_work_limit_that_is_enough_finds_the_answer_without_one():
    """The search a work limit plans (4x steps up to a far estimate) ends where the
    unlimited one does when the work is enough: naive at 80 GiB, 19,511."""
    assert max_fitting(Config(impl="naive"), GIB80, work_limit=10**6).max_value == 19511


def test_a_limit_names_the_estimate_it_could_not_replay():
    """The chunked loop at 80 GiB: the estimate (millions of rows) is known after a few
    replays, its replay would take millions of events, so it is not started; the work left
    steps up from the largest length that fits while a replay is expected to end within it:
    fits at 171,983 (from 16,384, 4x steps planned by the events left), the estimate
    9,871,642 from 16,384 rows, at most 12,499,320 (the closed form's ceiling). (A 5 s time
    limit left no time for the estimate once, with other heavy processes on the machine's 2
    cores.)"""
    config = Config(impl="linear-causal-chunked")
    with pytest.raises(Unsolved) as caught:
        max_fitting(config, GIB80, work_limit=1_000_000)
    error = caught.value
    assert (error.lo, error.hi, error.estimate, error.ceiling) == (
        171_983, None, 9_871_642, 12_499_320)
    assert fits(config.replace(seq_len=error.lo), GIB80)
    assert str(error) == (
        "no exact answer within the work limit of 1,000,000 events (fits at 171,983; the "
        "closed-form estimate, not replayed: 9,871,642; at most 12,499,320, past which the "
        "tensors alive at the peak alone exceed the budget)")


def test_a_loop_is_timed_only_near_the_lengths_replayed():
    """A loop's time per event grows with its length, so its replay is expected to end in
    time only within ``REACH`` times the longest one timed, however much time is left;
    a program of constant length has no such bound."""
    chunked = Probe(Config(impl="linear-causal-chunked"), "seq_len", GIB80, time_limit=3600)
    chunked.fit(1024)  # timed: 1,024 rows
    assert chunked.affordable(REACH * 1024) and not chunked.affordable(REACH * 1024 + 1)
    assert chunked.affordable(10 * 1024, single=False)  # a closed form's worth of events
    naive = Probe(Config(impl="naive"), "seq_len", GIB80, time_limit=3600)
    naive.fit(1024)
    assert naive.affordable(1 << 20)


def test_a_climb_steps_up_to_the_reach_and_not_past_the_estimate():
    probe = Probe(Config(impl="naive"), "seq_len", GIB80)
    assert _step_top(probe, 1000, None) == REACH * 1000  # nothing known above
    probe.estimate = 2500
    assert _step_top(probe, 1000, None) == 2500  # the estimate first
    assert _step_top(probe, 3000, None) == REACH * 3000  # past the estimate: it was low
    assert _step_top(probe, 1000, 1301) == 1150  # halfway to a value that does not fit


def test_the_ceiling_is_where_the_bytes_alive_at_the_peak_exceed_the_budget():
    """Past the ceiling, the tensors alive at the peak alone exceed the budget, so no
    replay can fit: the exact answer is never above it. linear-causal-chunked in 0.75 GB
    less the 512 MiB reserve: 268,435,456 B; its closed form 6,824*N + 67,110,912 gives
    (268,435,456 - 67,110,912) // 6,824 = 29,502; the answer is 28,672."""
    config, budget = Config(impl="linear-causal-chunked"), 268_435_456
    probe = Probe(config, "seq_len", budget)
    probe.model = q = live_polynomial(config, "seq_len")  # fitted at 16,384, 32,768, 65,536
    assert q.text() == "6,824*N + 67,110,912"
    assert probe.ceiling() == 29502 and q(29502) <= budget < q(29503)
    assert max_fitting(config, budget).max_value == 28672 <= probe.ceiling()


def test_a_search_says_what_it_replays_and_what_it_knows():
    """On a terminal, ``memcalc oom`` shows a status line: each replay, with the bounds
    found so far and the seconds spent of the limit."""
    heard: list[str] = []
    with status.listen(heard.append):
        s = max_fitting(Config(impl="naive"), GIB80, time_limit=60)
    # without a replay's phase (" - measured forward ..."), and the clock's seconds
    said = [re.sub(r"; \d+ of 60 s$", "; _ of 60 s", h.split(" - ")[0]) for h in heard]
    said = [h for h in said if h != "building the program"]  # unless built before (cached)
    assert said[0] == "naive: trying seq_len=16,384; _ of 60 s"
    n = s.max_value
    assert f"naive: trying seq_len={n + 1:,}; fits at {n:,}; _ of 60 s" in said
    assert said[-1] == f"naive: closed form at seq_len={n:,}; fits at {n:,}; _ of 60 s"
    assert any(h.startswith("naive: closed form from seq_len=16,384; fits at 16,384; ")
               for h in said)


def test_climb_closes_in_on_a_threshold_with_time_left():
    """From a value that fits, ``_climb`` doubles, then halves the gap to the first value
    that does not, down to neighbours: a fitting value next to a failing one."""
    probe = Probe(Config(impl="naive"), "seq_len", GIB80)
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
    probe = Probe(Config(impl="naive"), "seq_len", GIB80)
    probe.model, probe.estimate = q, _guess(probe, 1024, q)
    assert probe(1024) and probe(2048)  # 2,048 is under a tenth of 20,951: no change
    _estimate_again(probe)
    assert probe.estimate == _guess(probe, 1024, q) == 20951
    assert probe(16384)
    _estimate_again(probe)
    assert probe.estimate == _guess(probe, 16384, q) == 19510


def test_closed_form_of_a_loop_at_the_answer_is_fitted_below_it(monkeypatch):
    """At the answer, a loop's closed form is fitted at n/4, n/2 and n (checked at 3n/4):
    replays of 1.5n rows, not 9n above it. The same line as fitted at 640, 1280, 2560."""
    config = Config(impl="linear-causal-chunked", shape={"seq_len": 640})
    up = live_polynomial(config, "seq_len")
    probe = Probe(config, "seq_len", GIB80)
    assert probe.grows() and not Probe(Config(impl="naive"), "seq_len", GIB80).grows()
    replayed = []
    monkeypatch.setattr(closed_form, "predict",
                        lambda c: replayed.append(c.shape.seq_len) or predict(c))
    below = _closed_form(probe, 2560, "seq_len")  # 640, 1280, 2560; checked at 1920
    assert sorted(replayed) == [640, 1280, 1920, 2560]
    assert below.exact and below.at == 2560 and below.points == (640, 1280, 2560)
    assert (below.a, below.b, below.c) == (up.a, up.b, up.c)


def test_a_closed_form_is_fitted_through_values_the_kernel_accepts(monkeypatch):
    """sdpa-efficient in fp32 takes head dims in multiples of 4: at 17,880 the points below
    it, 4,470 and 13,410 (3/4), are not; each is moved down to one (4,468, 13,408), where
    the fit had given up (the kernel refused 4,470). That fit is not exact (the kernel pads
    head dims to its tiles), so it is made again at multiples of 1,024 (4,096, 8,192,
    16,384 and 12,288, which the kernel takes), where no tile is padded. The report names
    the points."""
    replayed = []
    probe = Probe(Config(impl="sdpa-efficient"), "head_dim", GIB80)
    sizes = closed_form.tensor_sizes
    monkeypatch.setattr(closed_form, "tensor_sizes",
                        lambda c, rank: replayed.append(c.shape.head_dim) or sizes(c, rank))
    q = _closed_form(probe, 17_880, "head_dim")  # 17,880 x 4 > 65,536: fitted below it
    # the live set at 17,880, then 4,470 -> 4,468, 8,940 and 13,410 -> 13,408, then aligned
    assert replayed == [17_880, 4_468, 8_940, 13_408, 4_096, 8_192, 16_384, 12_288]
    assert q is not None and q.points == (4_096, 8_192, 16_384)
    assert not q.exact  # a fit, not the sizes' own polynomial at 17,880


def test_closed_form_is_left_out_when_no_time_is_left():
    """The answer stands without its closed form (a loop's is replayed at 2n, 3n and 4n);
    with time, the naive step's is the one above."""
    late = Probe(Config(impl="naive"), "seq_len", GIB80, time_limit=1e-9)
    assert _closed_form(late, 4096, "seq_len") is None
    q = _closed_form(Probe(Config(impl="naive"), "seq_len", GIB80), 4096, "seq_len")
    assert q.text() == "192*N^2 + 3,168*N + 67,108,864"


def test_an_estimate_that_was_replayed_is_not_called_unreplayed():
    probe = Probe(Config(impl="naive"), "seq_len", GIB80, time_limit=60)
    probe.estimate = 16384
    assert probe(16384)
    assert probe.unsolved().estimate is None and "estimate" not in str(probe.unsolved())
    probe.estimate = 19000
    assert probe.unsolved().estimate == 19000


def test_an_unsolved_search_writes_its_bounds_as_the_other_figures():
    """The bounds in thousands like the estimate and the ceiling beside them (the hour-long
    chunked search at 80 GiB ended between these two)."""
    message = str(Unsolved(11_587_487, 11_587_611, 3600))
    assert message == "no exact answer within 3600 s (fits at 11,587,487, not at 11,587,611)"


def test_the_size_of_a_judged_prediction_needs_no_second_replay():
    """A value judged by ``fit`` (an unbounded prediction, capped only above the budget)
    steers the search with the figure a capped replay would give: no replay more."""
    probe = Probe(Config(impl="naive"), "seq_len", GIB80)
    fitted = probe.fit(16384)  # fits, reserved peak below the budget: no capped replay
    assert probe.evaluations == 1
    assert probe.size(16384) == fitted.reserved_peak_bytes == probe.full[16384].reserved_bytes
    assert probe.evaluations == 1
    assert probe(16384) and probe.known[16384][1] == fitted.reserved_peak_bytes  # the same


def test_a_climb_of_predictions_estimates_again_too():
    """The climb steps with ``fit`` (predictions judged against the budget): the estimate
    is taken again from the largest of those as well (naive at 80 GiB: 19,510 from
    16,384, as from a capped replay there)."""
    q = live_polynomial(Config(impl="naive", shape={"seq_len": 1024}), "seq_len")
    probe = Probe(Config(impl="naive"), "seq_len", GIB80)
    probe.model, probe.estimate = q, 20951
    assert probe.fit(16384).fits and 16384 not in probe.known
    _estimate_again(probe)
    assert probe.estimate == 19510


def test_a_search_cut_short_at_adjacent_bounds_is_solved(monkeypatch):
    """The time limit stops the naive search at 80 GiB after its bisection replayed 19,511
    fitting and 19,512 not, as it would replay both in full for their figures: that is the
    exact answer, Solved, with what it had time for (here no figures: None; the first
    power of two that does not fit, 32,768, looked for before), not Unsolved (fitting is
    not monotone: 19,510 was replayed too and does not fit)."""
    def stopped(probe, n, field, approximate=True):
        raise probe.unsolved()  # what the deadline raises inside probe.fit(n + 1)

    monkeypatch.setattr(solver, "_solved", stopped)
    s = max_fitting(Config(impl="naive"), GIB80, time_limit=600)
    assert (s.max_value, s.at_max, s.at_next, s.first_failing_power_of_two) == (
        19511, None, None, 32768)
    assert s.approximation.text() == "192*N^2 + 3,168*N + 67,108,864"  # from the start
    assert s.approximation.at == 16384
    assert s.to_dict()["peak_bytes_at_next"] is None


def test_a_search_cut_short_keeps_the_figures_it_replayed_in_full(monkeypatch):
    """Stopped while looking for the first power of two that fails (fits(32,768) replayed,
    above it nothing), before the full replays at the answer: solved from its adjacent
    bounds, the figures not replayed, the power not known."""
    real = Probe.__call__

    def stopped(probe, x):
        if x == 32768:
            raise probe.unsolved()
        return real(probe, x)

    monkeypatch.setattr(Probe, "__call__", stopped)
    s = max_fitting(Config(impl="naive"), GIB80, time_limit=600)
    assert s.max_value == 19511 and s.first_failing_power_of_two is None
    assert s.at_max is None and s.at_next is None and s.peak_bytes_at_max is None


def test_a_time_limited_search_approaches_a_far_estimate():
    """A loop started far below its estimate times replays at 4x steps up to it, then
    searches from it: with time enough, the exact answer, as without a limit (chunked in
    268,435,456 B: 28,672, estimated at about 28,900 from 1,024 rows)."""
    config, budget = Config(impl="linear-causal-chunked"), 268_435_456
    s = max_fitting(config, budget, start=1024, time_limit=600)
    assert s.max_value == 28_672  # the unlimited search's (the ceiling's test above)


def test_ctrl_c_stops_a_search_with_what_it_knows(monkeypatch):
    """Still a KeyboardInterrupt, carrying the bounds: the search's first replay, at the
    configuration's 16,384 rows, fits (reserved peak 60,228,108,288 B <= 85,362,475,008)."""
    interrupt_after(monkeypatch, "naive", 1)
    with pytest.raises(KeyboardInterrupt) as caught:
        max_fitting(Config(impl="naive"), GIB80, time_limit=600)
    known = caught.value.known
    assert isinstance(caught.value, Interrupted) and (known.lo, known.hi) == (16384, None)
    assert re.match(r"no exact answer: interrupted after \d+ s \(fits at 16,384", str(known))


def _tried(heard: list[str], field: str) -> set[int]:
    """The values a search replayed, from its status lines (``... trying head_dim=2,944``)."""
    found = (re.search(rf"trying {field}=([\d,]+)", h) for h in heard)
    return {int(m.group(1).replace(",", "")) for m in found if m}


def test_flash_head_dim_is_bounded_by_the_kernel_not_memory():
    """FlashAttention takes head dims up to 256; at 80 GiB (B=8 N=16384 fp16) 256 fits with
    room to spare, so the answer is 256, with no next value, no failing power of two, and
    no value above 256 tried. Reserved at 256: q, k, v, grad_out, out, dq, dk, dv (8 x
    8 x 16384 x 256 x 2 B = 8 x 64 MiB) and dq_accum (8 x 16384 x 256 x 4 B = 128 MiB) in
    640 MiB of segments, lse and softmax_d (512 KiB each) in one 2 MiB small segment:
    673,185,792 B; spare 85,362,475,008 - 673,185,792 = 84,689,289,216."""
    heard: list[str] = []
    with status.listen(heard.append):
        s = max_fitting(Config(impl="sdpa-flash", dtype="fp16"), GIB80, "head_dim",
                        time_limit=60)
    assert (s.max_value, s.next_value, s.at_next, s.first_failing_power_of_two) == (
        256, None, None, None)
    assert s.at_max.reserved_bytes == 673_185_792 and s.spare_bytes_at_max == 84_689_289_216
    assert s.limit == ("the largest head_dim FlashAttention supports "
                       "(sdp_utils.cpp check_head_dim_size_flash)")
    assert max(_tried(heard, "head_dim")) == 256
    assert bisect_max(Config(impl="sdpa-flash", dtype="fp16"), GIB80, "head_dim").max_value == 256


def test_efficient_head_dim_is_the_largest_multiple_of_8_that_fits():
    """The memory-efficient kernel takes multiples of 8 in fp16: only those are tried, and
    the next one is the value shown failing. At 80 GiB: 28,836,096 x 2,944 + 1,048,576 =
    84,894,515,200 B alive at the peak, reserved 84,896,907,264 <= 85,362,475,008; at
    2,952 the replay needs 88,302,682,112 B."""
    config = Config(impl="sdpa-efficient", dtype="fp16")
    heard: list[str] = []
    with status.listen(heard.append):
        s = max_fitting(config, GIB80, "head_dim", time_limit=60)
    assert (s.max_value, s.next_value) == (2944, 2952)  # 2,944 = 23 x 128; 2,944 + 8
    # Alive at the peak, per d: 8 (B, N, d) fp16 tensors (q, k, v, grad_out, out, dq, dk,
    # dv), 8 x 16,384 x 2 B = 262,144 B each, and the backward's float32 workspace, 8 x 4 B
    # x (dK/dV accumulators: 2 x 25 key splits (min(16,384 / 64, 200 // 8)) x 16,384 rows
    # + dQ tiles: 16,384 / 128 x (4 + 128 x 64) / 64) = 26,738,944 B (exact when d is a
    # multiple of 128); constant: lse and delta, 2 x 8 x 16,384 x 4 B = 1,048,576.
    per_d = 8 * 8 * 16384 * 2 + 8 * 4 * (2 * 25 * 16384 + 16384 // 128 * (4 + 128 * 64) // 64)
    assert per_d == 28_836_096 and 2 * 8 * 16384 * 4 == 1_048_576
    assert s.approximation.text() == "28,836,096*d + 1,048,576"
    # Reserved at d: one 2 MiB small-pool segment (lse, delta: 512 KiB each); q, k, v,
    # grad_out, out, dv: 6 segments of t = 8 x 16,384 x d x 2 B (736 MiB at 2,944, 738 MiB
    # at 2,952: whole 2 MiB multiples); the forward's float32 out_accum, 2t, reused by two
    # grads; the workspace 8 x 4 x (2 x 25 x 16,384 x ceil128(d) + 128 x ceil(d / 64) x
    # 8,196) B rounded up to 2 MiB: 78,719,451,136 -> 37,537 x 2 MiB at 2,944, so
    # 84,896,907,264 <= GIB80; 82,108,465,152 -> 39,153 x 2 MiB at 2,952 (ceil128 = 3,072),
    # requested on top of 6,192,889,856 reserved: needs 88,302,682,112 > GIB80.
    def reserved(d: int, workspace: int) -> int:
        return 2 * MiB + 8 * (8 * 16384 * d * 2) + -(-workspace // (2 * MiB)) * 2 * MiB
    work = 8 * 4 * (2 * 25 * 16384 * 2944 + 128 * 46 * 8196)  # 78,719,451,136
    work_next = 8 * 4 * (2 * 25 * 16384 * 3072 + 128 * 47 * 8196)  # 82,108,465,152
    assert (s.at_max.reserved_bytes, s.at_next.reserved_bytes) == (
        reserved(2944, work), reserved(2952, work_next)) == (84_896_907_264, 88_302_682_112)
    # 2,048 fits; 4,096 needs about 28,836,096 x 4,096 = 118 GB alive
    assert s.limit is None and s.first_failing_power_of_two == 4096
    assert all(x % 8 == 0 for x in _tried(heard, "head_dim"))
    assert fits(config.replace(head_dim=2944), GIB80)
    assert not fits(config.replace(head_dim=2952), GIB80)
    assert bisect_max(config, GIB80, "head_dim").next_value == 2952


def test_a_start_the_kernel_refuses_moves_to_one_it_accepts():
    """The value given is only where the search starts: --head-dim 20 starts the
    memory-efficient search at 16, 300 FlashAttention's at 256, 3 either at its smallest."""
    efficient = Probe(Config(impl="sdpa-efficient", dtype="fp16"), "head_dim", GIB80)
    flash = Probe(Config(impl="sdpa-flash", dtype="fp16"), "head_dim", GIB80)
    assert (efficient.snap(20), efficient.snap(3), flash.snap(300), flash.snap(3)) == (
        16, 8, 256, 3)
    s = max_fitting(Config(impl="sdpa-efficient", dtype="fp16", shape={"head_dim": 20}),
                    GIB80, "head_dim")
    assert s.max_value == 2944


def test_a_rule_across_sizes_stops_the_search_in_one_line():
    """Causal linear attention needs kv_len == seq_len: with --kv-len 4096 it accepts
    seq_len 4,096 only, which no per-size rule says; the search's first step up, 4,096 +
    4,096 // 64 = 4,160, is refused with both values named."""
    config = Config(impl="linear-causal", shape={"seq_len": 4096, "kv_len": 4096})
    with pytest.raises(ValueError, match=r"^--kv-len: causal linear attention needs kv_len == "
                                         r"seq_len \(4096 != 4160\); solving seq_len from "
                                         r"4,096, linear-causal refuses 4,160$"):
        max_fitting(config, GIB80)


def test_a_loop_grows_at_every_doubling_a_split_heuristic_does_not():
    """FlashAttention's program has 15 events at 1,024 rows and 12 from 2,048 (its split
    count, chosen by length, changes which accumulators it allocates): not a loop. It was
    taken for one from 12 at 256 to 15 at 512, and its search was planned as a loop's:
    "no exact answer within 60 s" after 0.4 s. The chunked loop: 64 rows a chunk, 1,085,
    2,173, 4,349 events at 1,024, 2,048 and 4,096 rows (about 34 a chunk)."""
    flash = Config(impl="sdpa-flash", dtype="fp16")
    assert events_growth(flash, "seq_len") == (15, 15)  # the most of 15, 12, 12
    assert not Probe(flash, "seq_len", GIB80).grows()
    chunked = Config(impl="linear-causal-chunked")
    assert events_growth(chunked, "seq_len") == (2173, 4349)
    s = max_fitting(flash, GIB80, work_limit=DEFAULT_WORK_LIMIT // 10)  # planned as a loop's: none
    assert s.max_value > 0 and s.next_value == s.max_value + 1


def test_the_answer_does_not_depend_on_the_length_given():
    """Near a threshold fitting is not monotone (at the H100 preset 19,398, 19,400 and
    19,402 fit, 19,399, 19,401 and nothing from 19,403 on do not): the search started from
    the configuration's length, so oom --seq 1024 said 19,400 and oom 19,398. It starts
    from the default length whatever is given, and goes on to the top: 19,402."""
    budget = Budget.of(Device()).budget_bytes
    answers = {max_fitting(Config(shape={"seq_len": n}), budget).max_value
               for n in (256, 1024, 16384, 30000)}
    assert answers == {19402}


def test_the_answer_is_not_below_a_value_the_search_saw_fit():
    """For naive in fp16 at 80 GiB the estimate led to head_dim 28,880 (28,881 does not
    fit) while 32,768, the power of two the report looks at, fits: and so does every value
    up to 34,344, the answer now. Every value above it up to 37,344 was checked not to fit
    (``memcalc.breakdown`` in a loop, 3,000 replays)."""
    s = max_fitting(make_config(dtype="fp16"), GIB80, "head_dim")
    assert (s.max_value, s.first_failing_power_of_two) == (34344, 65536)


def test_aligned_values_above_a_threshold_are_tried():
    """linear in bf16, 4,096 rows, 80 GiB: head_dim 40,021 fits, 40,022 does not, but
    40,032 and 40,960 do (sizes aligned to 32 share cached blocks exactly), up to 41,568;
    nothing from 41,569 to 42,500 fits (checked one by one), past the ceiling nothing can."""
    s = max_fitting(make_config(impl="linear", dtype="bf16", seq_len=4096), GIB80, "head_dim")
    assert s.max_value == 41568 and not s.at_next.fits


def test_a_threshold_answers_to_its_json_keys_and_prints_a_sentence():
    """``results[0].max_seq_len`` as the JSON and the CSV name it (``max_value`` alone
    raised AttributeError under that name); ``str`` is a sentence, not pydantic's fields."""
    s = max_fitting(Config(impl="naive"), GIB80)
    assert (s.max_seq_len, s.next_seq_len) == (s.max_value, s.next_value) == (19511, 19512)
    assert s.needed_bytes_at_next == s.to_dict()["needed_bytes_at_next"] == s.at_next.reserved_bytes
    assert str(s) == "naive: max seq_len 19,511 (19,512 does not fit)"
    with pytest.raises(AttributeError, match="max_batch"):
        s.max_batch  # a search over seq_len has no max_batch
