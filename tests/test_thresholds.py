"""The report over every implementation: what is solved, what is skipped and why."""

import csv
import inspect
import io

import pytest

from memcalc.impls.accepted import every
from memcalc.analysis.budget import Budget
from memcalc.config import Config, Device
from memcalc.analysis.closed_form import live_polynomial
from memcalc.output.render import text
from memcalc.analysis.solved import Solved, Unsolved
from memcalc.analysis.solver import max_fitting
from memcalc.analysis.thresholds import OomReport, PartialReport, Skipped, solve
from breakers import interrupt_after
from cli_helpers import csv_as_json
from toy_programs import one_event_pair_per_64_rows


@pytest.fixture
def growing_impl(scratch_register):
    scratch_register("test-growing", "one event per 64 rows", one_event_pair_per_64_rows)


def test_all_implementations_skip_growing_programs(growing_impl):
    budget = Budget.of(Device(), memory_gb=80)
    report = solve(Config(), budget, impls=None)
    skipped = {k.impl: k.reason for k in report.skipped}
    assert "events grow with seq_len" in skipped["test-growing"]
    assert "test-growing" not in {r.impl for r in report.results}
    small = Budget(device="test", memory_bytes=8 * 2**20, reserve_bytes=0)  # 8 MiB
    named = solve(Config(protocol={"forward_only": True}), small, impls=["test-growing"])
    n = named.results[0].max_value  # named: solved anyway; out (8, N, 16) fp32 is 512 B per row
    assert 512 * n <= 8 * 2**20 - 2 * 2**20 < 512 * (n + 1) + 2 * 2**20 + 20 * 2**20


def test_oom_shows_reserved_under_the_budget_and_a_readable_closed_form():
    """Every row: the reserved peak at N (replayed under the budget, with release-and-retry)
    is within the budget and what N+1 needs is over it; closed forms print no fractions."""
    import memcalc

    report = memcalc.oom(gpu_gb=80, impls=["naive", "linear", "sdpa-efficient"])
    budget = report.budget.budget_bytes  # 80 x 2^30 - 512 x 2^20 = 85,362,475,008
    assert budget == 85_362_475_008
    for r in report.to_dict()["results"]:
        assert r["reserved_bytes_at_max"] <= budget < r["needed_bytes_at_next"], r["impl"]
    out = text(report, 140)
    why = out[out.index("why"):]
    assert "/" not in why.split("caveat")[0]
    assert "naive: 192*N^2 + 3,168*N + 67,108,864" in why  # 6 N x N tensors x 8 x 4 B = 192


def test_the_api_has_the_commands_limits():
    """``memcalc.oom`` stops a search at ``work_limit`` events (``DEFAULT_WORK_LIMIT`` by
    default, as ``memcalc oom``) and, when given, at ``time_limit`` seconds (none by
    default, as the command: the answer would depend on the machine's load): a chunked
    loop's is listed unsolved, with what it found and which limit to raise."""
    import memcalc
    from memcalc.engine.deadline import DEFAULT_WORK_LIMIT

    parameters = inspect.signature(memcalc.oom).parameters
    assert parameters["time_limit"].default is None
    assert parameters["work_limit"].default == DEFAULT_WORK_LIMIT
    report = memcalc.oom(gpu_gb=0.75, impls=["linear-causal-chunked"], work_limit=1000)
    (unsolved,) = report.unsolved
    assert unsolved.reason == ("no exact answer within the work limit of 1,000 events "
                               "(nothing replayed within it); raise the work limit "
                               "(--work-limit, work_limit=)")
    for bad in (0, -1, 1.5, True, "1000", 10**19):
        with pytest.raises(ValueError, match="work_limit: a positive whole number of events"):
            memcalc.oom(impls=["naive"], work_limit=bad)
    # 0.75 GB: without the limit, an exact answer in seconds (28,672)
    report = memcalc.oom(gpu_gb=0.75, impls=["linear-causal-chunked"], time_limit=1)
    (unsolved,) = report.unsolved
    assert unsolved.reason.startswith(f"no exact answer within 1 s (fits at {unsolved.fits_at:,}")
    assert unsolved.reason.endswith("raise the time limit (--time-limit, time_limit=)")
    assert report.results == report.skipped == ()
    with pytest.raises(ValueError, match="time_limit: a positive number of seconds"):
        memcalc.oom(time_limit=0)


def test_csv_and_json_give_every_implementation_its_status_bounds_and_reason():
    """One CSV row per implementation, named as the JSON's keys: naive solved in 8 GiB (the
    default 512 MiB reserve: 8,053,063,680 B) with its closed form's integer coefficients;
    naive-softmax's search stopped with bounds, each its own column (no figure in prose
    only); sdpa-flash skipped. Absent figures are empty, null in the JSON."""
    def solver(config, budget_bytes, field, **limits):
        if config.impl == "naive-softmax":
            raise Unsolved(1000, 1200, 5, estimate=1100)
        return max_fitting(config, budget_bytes, field, **limits)

    budget = Budget.of(Device(), memory_gb=8)
    report = solve(Config(), budget, impls=["naive", "naive-softmax"], solver=solver)
    report = report.model_copy(update={"skipped": (Skipped(impl="sdpa-flash", reason="fp16"),)})
    naive, softmax, flash = csv_as_json(report.to_csv())
    assert csv_as_json(report.to_csv()) == report.records()
    (solved,) = report.results
    # budget: 8 x 2^30 - 512 x 2^20 = 8,053,063,680 B. The warm-up reserves a 20 MiB
    # segment (q, k, v, grad_out, out, dv: 8 x N x 16 x 4 B = 3,056,640 B each at 5,970,
    # < 10 MiB: one 20 MiB segment holds all six), the main cuBLAS workspace's 32 MiB, a
    # 2 MiB small-pool one (row_max, row_sum, row_argmax) and one segment per N x N tensor
    # (qk, s, exp_x, dp, e/r/r, -dp, -dp*e/r/r: 7), 8 x N x N x 4 B rounded up to 2 MiB:
    # 8 x 5,970 x 5,970 x 4 = 1,140,508,800 -> 544 x 2 MiB; at 5,971 1,140,890,912 ->
    # 545 x 2 MiB, the seventh asked for on top of six and the 54 MiB, none free to release.
    # So max_seq_len 5,970: reserved 8,042,577,920 B <= budget 8,053,063,680 B; next_seq_len
    # 5,971: needs 8,057,257,984 B > budget.
    MiB = 1 << 20
    assert budget.budget_bytes == 8 * 1024 * MiB - 512 * MiB == 8_053_063_680
    assert (solved.at_max.reserved_bytes, solved.at_next.reserved_bytes) == (
        7 * 544 * 2 * MiB + (20 + 32 + 2) * MiB, 7 * 545 * 2 * MiB + (20 + 32 + 2) * MiB) == (
        8_042_577_920, 8_057_257_984)
    assert naive == {
        # 5,970 fits and 5,971 does not: the segments above
        "impl": "naive", "status": "solved", "max_seq_len": 5970, "next_seq_len": 5971,
        "limit": None, "accepted_step": 1, "accepted_most": None,  # naive takes every N
        "first_failing_power_of_two": 8192,  # 2^13, the first power above 5,970
        "peak_bytes_at_max": solved.at_max.peak_bytes,
        "reserved_bytes_at_max": solved.at_max.reserved_bytes,
        "spare_bytes_at_max": 10_485_760,  # 8,053,063,680 - 8,042,577,920 = 10 MiB
        "needed_bytes_at_next": solved.at_next.reserved_bytes,
        "peak_bytes_at_next": solved.at_next.peak_bytes,
        # 6 N x N fp32 tensors x 8 x 4 B = 192; 3,168 B per N; two 32 MiB workspaces
        "a": 192, "b": 3168, "c": 67_108_864, "denominator": 1, "exact": True,
        "fits_at": None, "fails_at": None, "estimate": None, "ceiling": None, "reason": None}
    reason = ("no exact answer within 5 s (fits at 1,000, not at 1,200; the closed-form "
              "estimate, not replayed: 1,100); raise the time limit (--time-limit, time_limit=)")
    assert {k: v for k, v in softmax.items() if v is not None} == {
        "impl": "naive-softmax", "status": "unsolved", "fits_at": 1000, "fails_at": 1200,
        "estimate": 1100, "reason": reason}
    assert {k: v for k, v in flash.items() if v is not None} == {
        "impl": "sdpa-flash", "status": "skipped", "reason": "fp16"}
    data = report.to_dict()
    assert data["unsolved"] == [{"impl": "naive-softmax", "fits_at": 1000, "fails_at": 1200,
                                 "estimate": 1100, "ceiling": None, "reason": reason}]
    assert data["skipped"] == [{"impl": "sdpa-flash", "reason": "fp16"}]
    assert data["results"][0]["approximation"]["a"] == 192  # a number, not "192"
    assert text(report, 200).splitlines()[-2:] == [  # no caveat line after them
        f"naive-softmax: not solved, {reason}", "sdpa-flash: skipped, fp16"]


def test_a_solved_row_without_its_figures_shows_dashes_and_says_why():
    """A search its time limit stopped at adjacent bounds is solved; the figures it had no
    time to replay in full are dashes in the table, empty in the CSV, and a note says so."""
    q = live_polynomial(Config(impl="naive", shape={"seq_len": 1024}), "seq_len")
    cut = Solved(impl="naive", field="seq_len", max_value=19511, next_value=19512,
                 first_failing_power_of_two=None, at_max=None, at_next=None,
                 accepted=every("seq_len"), approximation=q, evaluations=5)
    budget = Budget.of(Device(), memory_gb=80)
    report = OomReport(budget=budget, field="seq_len", base=Config(), results=(cut,))
    assert report.tables()[0].cells() == [["naive", "19,511", "-", "-", "-", "-"]]
    assert "naive: exact (19,511 fits, 19,512 does not), but the time limit left no time to " \
        "replay every figure in full (-: not known)" in text(report, 200)
    (row,) = csv_as_json(report.to_csv())
    assert (row["status"], row["max_seq_len"], row["peak_bytes_at_max"], row["a"]) == (
        "solved", 19511, None, 192)


def test_ctrl_c_keeps_the_implementations_solved_before_it(monkeypatch):
    """Interrupted in naive-softmax's search, after naive's: naive's row stays, and
    naive-softmax is listed unsolved with what its search knew (its first replay, at 16,384
    rows, fits). Still a KeyboardInterrupt for a caller that does not look."""
    budget = Budget.of(Device(), memory_gb=80)
    interrupt_after(monkeypatch, "naive-softmax", 1)
    with pytest.raises(KeyboardInterrupt) as caught:
        solve(Config(), budget, impls=["naive", "naive-softmax"])
    report = caught.value.report
    assert isinstance(caught.value, PartialReport)
    assert [r.impl for r in report.results] == ["naive"] and report.results[0].max_value == 19511
    (unsolved,) = report.unsolved
    assert (unsolved.impl, unsolved.fits_at, unsolved.fails_at) == ("naive-softmax", 16384, None)
    assert unsolved.reason.startswith("no exact answer: interrupted after ")
    assert "(fits at 16,384" in unsolved.reason


def test_ctrl_c_after_adjacent_bounds_reports_the_answer_solved(monkeypatch):
    """naive in 8 GiB: the search's 28th replay (the bisection's last, at 5,970, which fits;
    5,971 did not) proves the answer; Ctrl-C at the 29th (the full figures at 5,971) keeps
    it as solved, as a time limit there would, not as unsolved bounds."""
    budget = Budget.of(Device(), memory_gb=8)
    interrupt_after(monkeypatch, "naive", 28)
    with pytest.raises(PartialReport) as caught:
        solve(Config(), budget, impls=["naive"])
    report = caught.value.report
    (solved,) = report.results
    assert (solved.max_value, solved.next_value, report.unsolved) == (5970, 5971, ())
    assert solved.at_next is None  # its full figures were what Ctrl-C stopped


def test_a_report_with_nothing_solved_shows_its_question_and_the_reasons():
    """No empty table, no explanation of its columns: the title, then why each is skipped."""
    budget = Budget(device="test", memory_bytes=8 * 2**20, reserve_bytes=0)  # 8 MiB
    report = OomReport(budget=budget, field="seq_len", base=Config(), results=(),
                       skipped=(Skipped(impl="naive", reason="no exact answer (fits at 1)"),))
    assert report.tables() == []
    lines = text(report, 200).splitlines()
    assert lines[0] == "largest seq_len that fits, B=8 H=1 d=16 fp32"
    assert lines[1].startswith("budget 8,388,608 B (8.00 MiB) = test 8,388,608 B")
    assert lines[2] == "naive: skipped, no exact answer (fits at 1)"
    assert not any(line.startswith(("fits:", "why")) for line in lines)


def test_head_dims_over_every_implementation_answer_each_fused_kernel():
    """--solve head-dim without --impl (fp16, 80 GiB): FlashAttention's answer is its limit,
    the memory-efficient kernel's a multiple of 8, and neither is skipped for a value the
    search itself chose (before: "head_dim 512 > 256", from the event count at 512)."""
    from memcalc.output.render import text

    budget = Budget.of(Device(), memory_gb=80)
    report = solve(Config(dtype="fp16"), budget, "head_dim")
    solved = {r.impl: r for r in report.results}
    assert (solved["sdpa-flash"].max_value, solved["sdpa-flash"].next_value) == (256, None)
    assert (solved["sdpa-efficient"].max_value, solved["sdpa-efficient"].next_value) == (
        2944, 2952)
    assert {k.impl for k in report.skipped} == {"linear-causal-chunked",
                                                "checkpoint-linear-causal-chunked"}  # slow
    assert "flex" in solved  # without --mask: the compiled graph's default mask
    out = text(report, 400)
    assert "needs at next d" in out  # 2,952 is 2,944 + 8, not + 1
    # spare: 85,362,475,008 - 673,185,792 reserved at 256 (test_solver.py)
    assert ("sdpa-flash: 256, the largest head_dim FlashAttention supports (sdp_utils.cpp "
            "check_head_dim_size_flash); fits with 84,689,289,216 B (78.87 GiB) to spare: "
            "memory does not bound it") in out
    assert ("sdpa-efficient: the memory-efficient kernel takes head_dim in multiples of 8 only "
            "(sdp_utils.cpp check_head_dim_size_mem_efficient): 2,944 fits, 2,952, the next it "
            "takes, does not") in out


def test_several_named_implementations_skip_a_refusal_one_alone_raises():
    """fp32 has no FlashAttention: named with others, sdpa-flash is a skip with the
    check's reason and the others are solved; named alone, its refusal is the answer."""
    budget = Budget.of(Device(), memory_gb=80)
    report = solve(Config(), budget, "head_dim", impls=["sdpa-flash", "sdpa-efficient"])
    (skipped,) = report.skipped
    assert skipped.impl == "sdpa-flash" and "fp16 and bf16 only" in skipped.reason
    assert [r.impl for r in report.results] == ["sdpa-efficient"]
    assert report.results[0].max_value % 4 == 0  # fp32: multiples of 4
    with pytest.raises(ValueError, match="fp16 and bf16 only"):
        solve(Config(), budget, "head_dim", impls=["sdpa-flash"])


def test_the_json_and_csv_carry_the_kernels_rule():
    """Each row: the next accepted value (none at the limit), the limit in words, the
    accepted step and largest value, the bytes to spare at the answer."""
    budget = Budget.of(Device(), memory_gb=80)
    report = solve(Config(dtype="fp16"), budget, "head_dim",
                   impls=["sdpa-flash", "sdpa-efficient"])
    assert report.headline().endswith("sdpa-flash d=256 (its limit), sdpa-efficient d=2,944")
    flash, efficient = report.to_dict()["results"]
    assert (flash["max_head_dim"], flash["next_head_dim"], flash["accepted_step"],
            flash["accepted_most"], flash["needed_bytes_at_next"]) == (256, None, 1, 256, None)
    assert flash["limit"].startswith("the largest head_dim FlashAttention supports")
    assert flash["spare_bytes_at_max"] == 84_689_289_216  # 85,362,475,008 - 673,185,792
    assert (efficient["next_head_dim"], efficient["limit"], efficient["accepted_step"],
            efficient["accepted_most"]) == (2952, None, 8, 65536)
    flash_row, efficient_row = csv.DictReader(io.StringIO(report.to_csv()))
    assert (flash_row["next_head_dim"], flash_row["limit"], flash_row["accepted_most"],
            flash_row["spare_bytes_at_max"]) == ("", flash["limit"], "256", "84689289216")
    assert (efficient_row["next_head_dim"], efficient_row["limit"],
            efficient_row["accepted_step"]) == ("2952", "", "8")


def test_a_fitted_closed_form_names_the_points_it_went_through():
    """Fitted below the answer (x/4, x/2, x, each a head dim the kernel takes), the note
    names those points; it said x, 2x, 4x whatever the fit used."""
    budget = Budget.of(Device())  # the H100 preset, as memcalc oom --solve head-dim
    report = solve(Config(), budget, "head_dim", impls=["sdpa-efficient"])
    (r,) = report.results
    assert (r.max_value, r.next_value) == (17_880, 17_884)  # fp32: multiples of 4
    assert "(fitted through d=4,096, 8,192, 16,384)" in text(report, 400)


def test_when_nothing_fits_the_report_says_what_the_smallest_needs():
    """naive at a million rows: not one batch fits. The note gives what batch 1 needs, and
    the closed form is taken there (it said "none" at batch 0)."""
    budget = Budget.of(Device())
    report = solve(Config(shape={"seq_len": 10**6}), budget, "batch", impls=["naive"])
    (r,) = report.results
    assert (r.max_value, r.next_value) == (0, 1)
    q = r.approximation
    # per batch: six N x N fp32 tensors, 6 x 10^12 x 4 B, and 396 B per row (3,168 / 8) x
    # 10^6; the two 32 MiB workspaces
    assert (q.a, q.b, q.c) == (0, 24_000_396_000_000, 67_108_864)
    needs = r.at_next.reserved_bytes
    # 4,000,260,816,896 B / 2^40 = 3.638... TiB
    assert (f"naive: even batch = 1 does not fit: it needs {needs:,} B (3.64 TiB) against "
            f"the budget of 84,401,979,392 B (78.61 GiB)") in text(report, 400)


def test_a_report_with_nothing_solved_says_what_is_known():
    """``largest seq_len within 79.50 GiB: `` with nothing after it, when the one search
    asked for ran out of work: it names the search and what it found (its first replay, at
    16,384 rows, fits within the 100,000 events)."""
    report = solve(Config(impl="linear-causal-chunked"), Budget.of(Device(), memory_gb=80),
                   "seq_len", ["linear-causal-chunked"], work_limit=100_000)
    assert not report.results and report.unsolved
    assert str(report).startswith("largest seq_len within 79.50 GiB: linear-causal-chunked "
                                  "not solved (fits at ")


def test_what_a_step_needs_over_the_budget_never_reads_as_the_budget():
    """sdpa-efficient at 80 GiB: 13,745,025 rows need 85,364,572,160 B against a budget
    of 85,362,475,008 B (79.50 GiB): 79.50195... GiB read 79.50, as if it fitted."""
    from memcalc.analysis.thresholds import gib, gib_up

    assert gib(85_364_572_160) == "79.50" and gib_up(85_364_572_160) == "79.51"
    assert gib_up(85_362_475_008) == "79.50"  # 79.5 x 2^30 exactly: no rounding


def test_reports_of_several_steps_merge_in_order():
    """``oom --compile eager,default``: a report per step, shown as one, rows in order."""
    from memcalc.analysis.thresholds import merged

    budget = Budget.of(Device(), memory_gb=8)
    first = solve(Config(), budget, impls=["naive"])
    second = OomReport(budget=budget, field="seq_len", base=Config(), results=(),
                       skipped=(Skipped(impl="other", reason="why"),))
    both = merged([first, second])
    assert [r.impl for r in both.results] == ["naive"] and both.results == first.results
    assert [k.impl for k in both.skipped] == ["other"] and both.base == first.base
