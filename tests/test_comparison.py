"""memcalc compare: the seeds' comparison table, exact."""

import json

import pytest

from memcalc.analysis.budget import Budget
from memcalc.cli import main
from memcalc.analysis.comparison import compare, ratio
from memcalc.config import Device, make_config

NN = 8 * 16384 * 16384 * 4  # one N x N fp32 tensor of the seeds' benchmark: 8,589,934,592


def test_rows_count_quadratic_tensors_and_savings():
    base = make_config(seq_len=16384)
    result = compare(base, Budget.of(base.device), ["naive", "naive-softmax", "flash2"],
                     solve=False)
    rows = {r["impl"]: r for r in result.to_dict()["rows"]}
    assert rows["naive"]["quadratic_saved"] == 2  # exp_x and p
    assert rows["naive-softmax"]["quadratic_saved"] == 1  # p
    assert rows["flash2"]["quadratic_saved"] == 0
    # naive's backward peak holds 6 N x N tensors and its saved argmax (8 x 16384 x 8 B)
    # and row sum (8 x 16384 x 4 B); naive-softmax's holds 4 N x N tensors (p, dp, the
    # scores' grad and CUDA's grad * p inside _softmax_backward_data)
    assert rows["naive"]["peak_bytes"] - rows["naive-softmax"]["peak_bytes"] == (
        2 * NN + 1_048_576 + 524_288)


def test_rejected_options_are_a_note_not_a_crash():
    base = make_config(seq_len=1024)  # fp32: the flash kernel has none
    rows = compare(base, Budget.of(base.device), ["sdpa-flash", "flash2"], solve=False).rows
    assert rows[0].breakdown is None and "fp16 and bf16" in rows[0].note


def test_the_default_baseline_is_naive_else_the_first_with_figures():
    """No --baseline: naive when compared, else the first row with figures (sdpa-flash has
    none in fp32); one asked for without figures, or no row with any, says why."""
    base, budget = make_config(seq_len=256), Budget.of(Device())
    assert compare(base, budget, ["flash2", "naive"], solve=False).baseline == "naive"
    assert compare(base, budget, ["sdpa-flash", "flash2"], solve=False).baseline == "flash2"
    with pytest.raises(ValueError, match="^--baseline: sdpa-flash has no figures for these "
                                         "options: --dtype: FlashAttention supports fp16"):
        compare(base, budget, ["sdpa-flash", "flash2"], "sdpa-flash", solve=False)
    with pytest.raises(ValueError, match="^no implementation has figures for these options: "
                                         "sdpa-flash: --dtype: FlashAttention supports fp16"):
        compare(base, budget, ["sdpa-flash"], solve=False)


def test_ratio_is_exact():
    assert ratio(2, 1) == "2.00x"
    assert ratio(1, 3) == "0.33x"
    assert ratio(2, 3) == "0.67x"  # 0.666... rounds half up


def test_cli_json_with_thresholds(capsys):
    assert main(["compare", "--seq", "4096", "--only", "naive", "--gpu-gb", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["budget_bytes"] == 8 * 2**30 - 512 * 2**20  # 8 GiB less the 512 MiB reserve
    assert data["rows"][0]["max_seq_len"] > 4096


def test_a_dataframe_keeps_bytes_exact_and_absent_values_absent():
    """One row without figures made every byte column float64 (NaN): 2^53 and above lost
    their last bytes. The frame is typed from the Python integers: nullable Int64."""
    pd = pytest.importorskip("pandas")
    base = make_config(seq_len=2**20, batch=512)  # naive: 6 x 512 x 2^40 x 4 B > 2^53
    result = compare(base, Budget.of(Device()), ["naive", "sdpa-flash"], solve=False)
    frame = result.to_dataframe()
    naive = result.rows[0].breakdown.peak_bytes
    assert naive > 2**53 and str(frame["peak_bytes"].dtype) == "Int64"
    assert frame["peak_bytes"][0] == naive and frame["peak_bytes"][1] is pd.NA


def test_a_row_says_what_it_holds():
    """``repr`` of a row was ``<Row: Row>``."""
    base = make_config(seq_len=16384)
    naive, flash = compare(base, Budget.of(Device()), ["naive", "sdpa-flash"]).rows
    # naive at 16,384: 51,658,620,928 B = 48.11 GiB (the benchmark's peak); 19,402 fits, the
    # top of the fitting range (test_solver.py)
    assert repr(naive) == "<Row: naive: peak 48.11 GiB, max seq_len 19,402>"
    assert str(flash).startswith("sdpa-flash: no figures: --dtype: FlashAttention supports")


def test_the_other_baseline_is_suggested_only_when_it_was_compared():
    """"--baseline naive-softmax compares against ..." ended compare --impl naive,flash2,
    and that command then refused naive-softmax as not compared."""
    budget = Budget.of(Device())
    base = make_config(seq_len=1024)
    both = compare(base, budget, ["naive", "naive-softmax"], solve=False)
    assert any("--baseline naive-softmax" in n for n in both.footnotes())
    alone = compare(base, budget, ["naive", "flash2"], solve=False)
    assert not any("--baseline" in n for n in alone.footnotes())
