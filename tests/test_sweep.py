"""Scaling tables: the seeds' layouts with exact figures."""

import csv
import io
import json
from fractions import Fraction

import pytest

from memcalc.analysis.budget import Budget
from memcalc.config import Config, Device
from memcalc.analysis.scaling import sweep
from cli_helpers import assert_refused, run

SEQ = (256, 1024, 4096, 8192, 16384)
DIMS = (16, 32, 64, 128)
NN = 8_589_934_592  # 8 x 16384^2 x 4 B: one N x N fp32 tensor of the seeds' benchmark
ND = 8_388_608  # 8 x 16384 x 16 x 4 B
WS = 33_554_432  # one H100 cuBLAS workspace


def seeds(**kw):
    return sweep(Config(), Budget.of(Device(), **kw), SEQ, DIMS)


def test_rows_and_exact_figures():
    s = seeds()
    assert len(s.rows) == 20  # 5 lengths x 4 head dims
    last = next(r for r in s.rows if (r.seq_len, r.head_dim) == (16384, 16))
    # the DivBackward0 peak: six N x N tensors, argmax and row sum, 2 workspaces, 6 (8, N, 16)
    assert last.peak_bytes == 6 * NN + 1_048_576 + 524_288 + 2 * WS + 6 * ND  # 51,658,620,928
    assert last.saved_bytes == 2 * NN + 524_288 + 1_048_576  # exp_x, p, row sum, argmax
    assert last.quadratic_bytes == 6 * NN
    first = next(r for r in s.rows if (r.seq_len, r.head_dim) == (256, 16))
    # N=256: the same tensors at 256 (each N x N one 8 x 256^2 x 4 B = NN / 64^2 = 2 MiB,
    # argmax 8 x 256 x 8 B, row sum 8 x 256 x 4 B, ND / 64), all 512 B multiples; the
    # workspaces dominate: 12,582,912 + 16,384 + 8,192 + 67,108,864 + 786,432
    assert first.peak_bytes == 6 * NN // 4096 + 16_384 + 8_192 + 2 * WS + 6 * ND // 64 == (
        80_502_784)
    assert last.growth == Fraction(51_658_620_928, 80_502_784)  # x first row of its series
    assert first.growth == 1


def test_oom_mark_follows_the_budget():
    assert all(r.fits for r in seeds().rows)  # an H100 holds every row
    # 40 GiB: the N=16384 rows (reserved ~56 GiB) do not fit, N=8192 (~14 GiB) do
    s = seeds(memory_gb=40)
    assert {r.seq_len for r in s.rows if not r.fits} == {16384}


def test_long_table_markdown_layout(capsys):
    code, out, _ = run(capsys, "sweep", "--seq", "256,1024,4096,8192,16384", "--markdown")
    assert code == 0
    assert "| seq_len | peak (MiB) | saved (MiB) | reserved (MiB) | x first | N^2 share | OOM? |" in out
    assert "| 16,384 | 49,265.50 | 16,385.50 | 57,438.00 | " in out  # 51,658,620,928 B = 49,265.50 MiB


def test_pivot_is_the_seed_002_layout(capsys):
    code, out, _ = run(capsys, "sweep", "--seq", "256,1024,4096,8192,16384",
                       "--head-dim", "16,32,64,128", "--pivot", "saved", "--markdown")
    assert code == 0
    assert "| seq_len \\ head_dim | 16 | 32 | 64 | 128 |" in out
    assert "| 16,384 | 16,385.50 | 16,385.50 | 16,385.50 | 16,385.50 |" in out


def test_pivot_marks_oom(capsys):
    code, out, _ = run(capsys, "sweep", "--seq", "8192,16384", "--pivot", "peak", "--gpu-gb",
                       "40", "--bytes", "--markdown")
    assert "| 16,384 | 51,658,620,928 OOM |" in out


def test_csv_and_json_carry_bytes(capsys):
    _, out, _ = run(capsys, "sweep", "--seq", "1024,16384", "--impl", "naive,naive-softmax",
                    "--csv")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert len(rows) == 4
    assert rows[1]["peak_bytes"] == "51658620928" and rows[1]["fits"] == "True"
    _, out, _ = run(capsys, "sweep", "--seq", "1024,16384", "--json")
    data = json.loads(out)
    assert data["budget_bytes"] == 84_401_979_392  # h100-80gb: (81004 - 512) x 2^20
    assert data["rows"][1]["saved_bytes"] == 17_181_442_048


def test_all_implementations_skip_unsupported_dtypes(capsys):
    code, out, _ = run(capsys, "sweep", "--seq", "256,512", "--impl", "all", "--dtype",
                       "fp32,bf16", "--json")
    data = json.loads(out)
    assert code == 0
    done = {(r["impl"], r["dtype"]) for r in data["rows"]}
    skipped = {s["impl"] for s in data["skipped"]}
    assert ("naive", "fp32") in done and ("naive", "bf16") in done
    assert all(f"{i} {d}" in skipped or (i, d) in done for i, d in done)


@pytest.mark.parametrize("argv, option", [
    (["--seq", "1,,x"], "--seq"),
    (["--seq", "0,256"], "--seq"),
    (["--head-dim", "16;32"], "--head-dim"),
    (["--batch", "4:2:1"], "--batch"),
    (["--impl", "naive,"], "--impl"),
    (["--impl", "flashy"], "--impl"),
    (["--dtype", "fp8"], "--dtype"),
    (["--pivot", "everything"], "--pivot"),
    (["--reserve", "lots"], "--reserve"),
])
def test_bad_input(capsys, argv, option):
    code, out, err = run(capsys, "sweep", *argv)
    assert_refused(code, out, err, option)


def test_ranges(capsys):
    code, out, _ = run(capsys, "sweep", "--seq", "256:1024:256", "--json")
    assert [r["seq_len"] for r in json.loads(out)["rows"]] == [256, 512, 768, 1024]


def test_a_list_of_context_parallel_ranks_is_one_series_each():
    """sweep --cp 1,4: each number of ranks its own series (the busiest rank's figures, as
    breakdown --cp gives them); a length not a multiple of 2P is skipped for that P."""
    from memcalc.analysis.predict import predict
    from memcalc.config import make_config

    base = make_config(impl="sdpa-flash", batch=1, heads=8, head_dim=64, dtype="bf16",
                       causal=True, seq_len=4096)
    s = sweep(base, Budget.of(Device()), (4096, 8192, 8196), cps=(1, 4))
    rows = {(r.cp, r.seq_len): r for r in s.rows}
    assert set(rows) == {(1, 4096), (1, 8192), (1, 8196), (4, 4096), (4, 8192)}, s.skipped
    for (cp, n), row in rows.items():
        b = predict(base.replace(seq_len=n, cp=cp))
        assert (row.peak_bytes, row.reserved_peak_bytes) == (b.peak_bytes, b.reserved_peak_bytes)
    assert [(k.sizes, k.reason.split(":")[0]) for k in s.skipped] == \
        [({"cp": 4, "seq_len": 8196}, "seq_len")]  # 8196 = 8 x 1024 + 4
    assert "cp" in [c.header for c in s.long_columns()]


@pytest.mark.parametrize("argv, option", [
    (("--optimizer", "adamw"), "--optimizer adamw"),
    (("--compile-budget", "0.5"), "--compile-budget 0.5"),
    (("--input", "x=B,N,64"), "--input x=B,N,64")])
def test_a_traced_targets_option_without_one_is_refused(capsys, argv, option):
    """Without --trace the sweep runs memcalc's implementations, which have no optimizer nor
    compiled step: the option is refused in one line (it was ignored, the table printed)."""
    assert_refused(*run(capsys, "sweep", "--seq", "256", *argv), f"{option}: an option of a "
                                                                 f"traced target")
