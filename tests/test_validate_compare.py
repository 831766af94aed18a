"""Checks and reports: differences, verdicts, the cause of each difference, the summary."""

import pytest

from memcalc.analysis.breakdown import FIGURES
from memcalc.config import Config
from memcalc.validation.compare import (ALLOCATOR, KERNEL, RECORD_KEYS, RELEASE, UNTRACED,
                                        WORKSPACE, Check, Report, _label, case_key)
from cli_helpers import csv_as_json

SMALL = {"batch": 2, "heads": 1, "seq_len": 256, "head_dim": 16}
CONFIG = Config(impl="naive", shape=SMALL, protocol={"cublas_workspace_config": ":16:8"})
WS = 131_072  # one workspace of ":16:8": 16 KiB x 8 = 16 x 1024 x 8 B
MiB = 1 << 20


def figures(**changes) -> dict[str, int]:
    """Every figure 4,096 B, but those given."""
    return {**dict.fromkeys(FIGURES, 4096), **changes}


def check(seq_len=256, **fields) -> Check:
    return Check(config=CONFIG.replace(seq_len=seq_len), **fields)


def test_case_key_is_kind_capacity_and_configuration():
    assert case_key("grid", CONFIG, None) == "grid|None|" + CONFIG.model_dump_json()
    oom = check(predicted=None, case="oom-threshold", capacity_bytes=2 << 30)
    assert oom.key == "oom-threshold|2147483648|" + CONFIG.model_dump_json()  # 2 x 2^30
    assert check(257, predicted=None).key != check(predicted=None).key


def test_differences_are_measured_less_predicted_within_the_tolerance():
    c = check(predicted=figures(), measured=figures(saved_bytes=4096 - 1024,
                                                    peak_bytes=4096 + 512), tolerance=1024)
    assert c.differences == {**dict.fromkeys(FIGURES, 0), "saved_bytes": -1024,
                             "peak_bytes": 512}
    assert c.ok  # |-1024| <= 1024
    assert not c.model_copy(update={"tolerance": 1023}).ok
    assert check(predicted=figures(), outcome="oom").differences == {}  # nothing measured


@pytest.mark.parametrize("predicted, measured, outcome, ok, verdict", [
    (figures(), figures(), "measured", True, "ok"),
    (figures(), figures(peak_bytes=4097), "measured", False, "MISMATCH"),
    (figures(), None, "oom", True, "oom"),  # an OOM is a data point
    (figures(), None, "error", False, "error"),
    (None, figures(), "measured", True, "recorded"),  # no model: a record
    (None, None, "oom", True, "recorded"),
    (None, None, "error", False, "error"),
])
def test_an_oom_is_not_a_mismatch_an_error_is(predicted, measured, outcome, ok, verdict):
    c = check(predicted=predicted, measured=measured, outcome=outcome)
    assert (c.ok, c.verdict()) == (ok, verdict)


@pytest.mark.parametrize("expected, outcome, ok, verdict", [
    ("fits", "measured", True, "ok (fits)"),
    ("oom", "oom", True, "ok (oom)"),
    ("fits", "oom", False, "MISMATCH"),
    ("oom", "measured", False, "MISMATCH"),
])
def test_a_threshold_case_is_judged_by_its_verdict_not_its_figures(expected, outcome, ok,
                                                                   verdict):
    measured = figures(peak_bytes=4096 + 512) if outcome == "measured" else None
    c = check(predicted=figures(), measured=measured, outcome=outcome, case="oom-threshold",
              capacity_bytes=128 * MiB, expected=expected)
    assert (c.ok, c.verdict()) == (ok, verdict)


def test_attribution_is_for_the_live_backend_only():
    """Without an emulated column (the emulated backend) a difference has no cause."""
    c = check(predicted=figures(), measured=figures(backward_peak_bytes=4096 + WS))
    assert c.differences["backward_peak_bytes"] == WS and c.attribution == {}
    assert Report(backend="emulated", environment={}, checks=(c,)).causes == {}


def test_a_difference_in_both_columns_names_both_causes():
    """model != emulated is the release; emulated != live by whole workspaces the workspace
    rule, by anything else a kernel; the reserved peak follows the allocated figures."""
    c = check(predicted=figures(),
              emulated=figures(saved_bytes=4096 + 512, peak_bytes=4096 + 512),
              emulated_outcome="measured",
              measured=figures(saved_bytes=4096 + 512, forward_peak_bytes=4096 + 1024,
                               backward_peak_bytes=4096 + 2 * WS,
                               peak_bytes=4096 + 512 + 2 * WS, reserved_peak_bytes=4096 + 2 * MiB))
    assert c.attribution == {
        "saved_bytes": RELEASE,  # live = emulated != model
        "forward_peak_bytes": KERNEL,  # 1,024 B: not a multiple of 131,072
        "backward_peak_bytes": WORKSPACE,  # 2 x 131,072
        "peak_bytes": f"{RELEASE} + {WORKSPACE}",  # 512 B by the model, 2 workspaces live
        "reserved_peak_bytes": f"{KERNEL} / {WORKSPACE}",  # the allocated gaps' causes, sorted
    }
    alone = c.model_copy(update={"measured": figures(saved_bytes=4096 + 512,
                                                     peak_bytes=4096 + 512,
                                                     reserved_peak_bytes=4096 + 2 * MiB)})
    assert alone.attribution == {"saved_bytes": RELEASE, "peak_bytes": RELEASE,
                                 "reserved_peak_bytes": ALLOCATOR}


@pytest.mark.parametrize("expected, emulated_outcome, outcome, cause", [
    ("fits", "oom", "oom", RELEASE),  # the trace fails where the model said it fits
    ("oom", "oom", "measured", KERNEL),  # the trace agrees with the model, the GPU does not
    ("fits", "error", "oom", UNTRACED),
    ("fits", "absent", "oom", UNTRACED),
    ("oom", "measured", "oom", None),  # the verdict holds: nothing to attribute
])
def test_a_wrong_oom_verdict_is_attributed_by_the_emulated_verdict(expected, emulated_outcome,
                                                                  outcome, cause):
    c = check(predicted=figures(), measured=figures() if outcome == "measured" else None,
              outcome=outcome, emulated=figures() if emulated_outcome == "measured" else None,
              emulated_outcome=emulated_outcome, case="oom-threshold",
              capacity_bytes=128 * MiB, expected=expected)
    assert c.attribution.get("fits") == cause


def live_checks() -> tuple[Check, ...]:
    """An agreeing grid case, a workspace difference, and a threshold the model got wrong."""
    good = check(predicted=figures(), measured=figures(), emulated=figures(),
                 emulated_outcome="measured")
    workspace = check(300, predicted=figures(), emulated=figures(), emulated_outcome="measured",
                      measured=figures(backward_peak_bytes=4096 + WS))
    threshold = check(301, predicted=figures(), outcome="oom", emulated_outcome="oom",
                      case="oom-threshold", capacity_bytes=128 * MiB, expected="fits")
    return good, workspace, threshold


def test_report_summary_counts_configurations_mismatches_and_causes():
    report = Report(backend="cuda", environment={}, checks=live_checks(), complete=False)
    assert report.mismatches == 2 and not report.ok
    assert report.causes == {WORKSPACE: 1, RELEASE: 1}  # in the order the checks show them
    assert report.summary() == (
        "cuda: 3 configurations, 15 figures, 2 mismatches"  # 3 checks x 5 figures
        "; differences by cause: workspace 1, torch release 1"
        "; stopped at --max-seconds: run again to resume")


def test_report_shows_mismatches_first_and_says_how_many_are_hidden():
    good = [check(100 + i, predicted=figures(), measured=figures()) for i in range(22)]
    bad = [check(200 + i, predicted=figures(), outcome="error") for i in range(3)]
    report = Report(backend="emulated", environment={}, checks=(*good, *bad))
    assert list(report.tables()[0].rows) == bad + good[:17]  # 20 rows: 3 mismatches, 17 others
    assert report.footnotes()[0] == ("20 of 25 configurations shown (mismatches first); "
                                     "--json, --csv or --out give them all")
    rows = report.csv_table().rows  # the CSV has every row, in order
    assert [r["seq_len"] for r in rows] == [*range(100, 122), *range(200, 203)]
    many = Report(backend="emulated", environment={}, checks=(*good[:5], *bad * 20))
    assert list(many.tables()[0].rows) == (bad * 20)[:50]  # 60 mismatches: the first 50 only


def test_records_hold_each_difference_and_cause_by_figure():
    """One row per check, the CSV's columns exactly (``RECORD_KEYS``): every figure's
    difference and cause has its own column, None where it has none."""
    workspace = live_checks()[1]
    report = Report(backend="cuda", environment={}, checks=(workspace,))
    (record,) = report.records()
    assert record == {"case": "grid", "configuration": _label(workspace), "impl": "naive",
                      "batch": 2, "heads": 1, "seq_len": 300, "head_dim": 16,  # SMALL
                      "dtype": "fp32", "causal": False, "gpu": "h100-80gb", "outcome": "measured",
                      "verdict": "MISMATCH", "ok": False,
                      "predicted_peak_bytes": 4096, "emulated_peak_bytes": 4096,  # figures()
                      "measured_peak_bytes": 4096,  # only the backward peak differs
                      "diff_saved_bytes": 0, "diff_forward_peak_bytes": 0,
                      "diff_backward_peak_bytes": WS, "diff_peak_bytes": 0,
                      "diff_reserved_peak_bytes": 0,
                      "diff_optimizer_peak_bytes": None,  # no optimizer: no such figure
                      "cause_saved_bytes": None, "cause_forward_peak_bytes": None,
                      "cause_backward_peak_bytes": WORKSPACE, "cause_peak_bytes": None,
                      "cause_reserved_peak_bytes": None, "cause_optimizer_peak_bytes": None}
    assert list(record) == list(RECORD_KEYS)
    assert csv_as_json(report.to_csv()) == [record]  # the CSV holds the same, cell by cell


