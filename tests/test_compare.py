"""memcalc compare (memcalc/commands/compare.py): its options, its output formats, refusals."""

import json
import re
from pathlib import Path

import pytest

import memcalc
from cli_helpers import assert_refused, csv_as_json, run
from memcalc.cli import build_parser
from memcalc.options import PIPED_WIDTH
from memcalc.analysis.comparison import ratio
from memcalc.config import make_config
from memcalc.analysis.predict import predict
from memcalc.engine.units import human

SMALL = ["--seq", "256", "--batch", "1"]
PAIR = ["--impl", "naive,naive-softmax"]
# one 256 x 256 fp32 tensor: 256 x 256 x 4 B = 262,144 B
NN = 262_144
# naive saves exp_x and p (2 x 262,144 B), its row sum (256 x 4 B = 1,024) and its int64
# argmax (256 x 8 B = 2,048): 524,288 + 1,024 + 2,048 = 527,360 B; naive-softmax saves p
NAIVE_SAVED = 2 * NN + 1_024 + 2_048
# naive's backward peak holds 6 N x N tensors (exp_x, dp and DivBackward0's four), the
# argmax and the row sum; naive-softmax's 4 (p, dp, the grad of the scores and CUDA's
# grad * p temporary inside _softmax_backward_data): 2 x 262,144 + 2,048 + 1,024 = 527,360 B
# = 515 x 1,024 B: "515.00 KiB"
PEAK_GAP = 2 * NN + 2_048 + 1_024


def whole(text: str, figure: str) -> bool:
    """``figure`` in ``text`` as a token of its own (not cut, not part of a longer one)."""
    return re.search(rf"(?<![\w,.-]){re.escape(figure)}(?![\w,.-])", text) is not None


def compared(capsys, *argv: str) -> str:
    """stdout of a ``memcalc compare`` that succeeds quietly."""
    code, out, err = run(capsys, "compare", *SMALL, *argv)
    assert (code, err) == (0, ""), err
    return out


def test_json_agrees_with_the_library_and_the_replay(capsys):
    """The command's JSON is ``memcalc.compare``'s at the same options; each row's figures
    are the replay's (``predict``) and its largest seq_len is ``memcalc.oom``'s."""
    argv = [*PAIR, "--gpu-gb", "8", "--reserve", "1GiB"]
    data = json.loads(compared(capsys, *argv, "--json"))
    api = memcalc.compare(seq_len=256, batch=1, impls=["naive", "naive-softmax"], gpu_gb=8,
                          reserve="1GiB")
    assert data == api.to_dict()
    assert data["baseline"] == "naive"  # the default
    assert data["budget_bytes"] == 7 * 2**30  # 8 GiB less 1 GiB reserved: 7,516,192,768 B
    rows = {r["impl"]: r for r in data["rows"]}
    assert list(rows) == ["naive", "naive-softmax"]  # as --impl lists them
    assert (rows["naive"]["saved_bytes"], rows["naive-softmax"]["saved_bytes"]) == (
        NAIVE_SAVED, NN)
    assert rows["naive"]["peak_bytes"] - rows["naive-softmax"]["peak_bytes"] == PEAK_GAP
    for impl, row in rows.items():
        replay = predict(make_config(impl=impl, seq_len=256, batch=1)).figures()
        assert {k: row[k] for k in replay} == replay, impl
        (solved,) = memcalc.oom(impls=[impl], seq_len=256, batch=1, gpu_gb=8,
                                reserve="1GiB").results
        assert row["max_seq_len"] == solved.max_value, impl


def test_csv_and_markdown_print_the_comparison(capsys):
    """--csv: the JSON's row keys as columns, exact bytes, the saving against naive as an
    integer and the factor as a number; --markdown: the bold title, then the table; both
    the library's own text."""
    api = memcalc.compare(seq_len=256, batch=1, impls=["naive", "naive-softmax"])
    base, soft = (r.breakdown for r in api.rows)
    out = compared(capsys, *PAIR, "--csv")
    assert out == api.to_csv()
    assert out.splitlines() == [
        "impl,status,quadratic_saved,saved_bytes,forward_peak_bytes,backward_peak_bytes,"
        "peak_bytes,reserved_peak_bytes,fits,saving_bytes,factor,max_seq_len,reason",
        f"naive,solved,2,{NAIVE_SAVED},{base.forward_peak_bytes},{base.backward_peak_bytes},"
        f"{base.peak_bytes},{base.reserved_peak_bytes},True,0,1.0,{api.rows[0].max_seq_len},",
        # 68,783,104 / 68,255,744 = 1.0077262..., to 6 decimals (the table: 1.01x)
        f"naive-softmax,solved,1,{NN},{soft.forward_peak_bytes},{soft.backward_peak_bytes},"
        f"{soft.peak_bytes},{soft.reserved_peak_bytes},True,{PEAK_GAP},1.007726,"
        f"{api.rows[1].max_seq_len},"]
    # 64 MiB of cuBLAS workspaces (67,108,864 B) + 1,674,240 B; PEAK_GAP less
    assert (base.peak_bytes, soft.peak_bytes) == (68_783_104, 68_783_104 - PEAK_GAP)
    assert csv_as_json(out) == json.loads(compared(capsys, *PAIR, "--json"))["rows"]
    out = compared(capsys, *PAIR, "--markdown")
    assert out == api.to_markdown()
    lines = out.splitlines()
    assert lines[0].startswith("**B=1 H=1 N=256 d=16 fp32; max seq_len within budget ")
    assert lines[2] == ("| implementation | N x M saved | saved | forward peak | backward peak "
                        "| peak | reserved peak | fits | saves vs naive | factor | max seq_len |")


def test_baseline_sets_what_the_savings_are_against(capsys):
    """--baseline naive-softmax: naive's saving is negative, -527,360 B; its factor is
    naive-softmax's peak over naive's (below 1)."""
    out = compared(capsys, *PAIR, "--baseline", "naive-softmax", "--csv")
    data = json.loads(compared(capsys, *PAIR, "--baseline", "naive-softmax", "--json"))
    assert data["baseline"] == "naive-softmax"
    naive, softmax = csv_as_json(out)
    # 68,255,744 / 68,783,104 = 0.99233301..., to 6 decimals (the table: 0.99x)
    assert (naive["saving_bytes"], naive["factor"]) == (-PEAK_GAP, 0.992333)
    assert (softmax["saving_bytes"], softmax["factor"]) == (0, 1.0)
    assert [naive, softmax] == data["rows"]


def test_rows_without_a_figure_have_empty_cells_and_say_why(capsys):
    """sdpa-flash has no fp32 kernel (skipped: no figures, as oom says), linear-causal-chunked's loop is
    not solved: their absent figures are empty in the CSV and null in the JSON, with the
    status and the reason beside them, never "n/a" or "not solved" in a number's column."""
    argv = ["--impl", "naive,sdpa-flash,linear-causal-chunked"]
    rows = csv_as_json(compared(capsys, *argv, "--csv"))
    assert rows == json.loads(compared(capsys, *argv, "--json"))["rows"]
    assert [(r["impl"], r["status"]) for r in rows] == [
        ("naive", "solved"), ("sdpa-flash", "skipped"), ("linear-causal-chunked", "unsolved")]
    naive, flash, chunked = rows
    assert naive["reason"] is None and naive["factor"] == 1.0
    assert {k for k, v in flash.items() if v is not None} == {"impl", "status", "reason"}
    assert flash["reason"].startswith("--dtype: FlashAttention supports fp16 and bf16 only")
    assert chunked["max_seq_len"] is None and chunked["peak_bytes"] > 0
    assert "its program's events grow with seq_len" in chunked["reason"]


@pytest.mark.parametrize("width", [60, 80, 120, None])  # None: piped, no COLUMNS
def test_the_table_fits_the_width_with_no_figure_cut(capsys, monkeypatch, width):
    """Each row's cells are its figures in order, whole; a narrow width drops secondary
    columns but keeps the peak, whether it fits, the saving, the factor and the largest
    seq_len; at 120 columns, or piped (200), all eleven are shown. The budget's figure is
    never cut."""
    from memcalc.gpus import gpu_preset

    data = json.loads(compared(capsys, *PAIR, "--json"))
    if width is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", str(width))
    out = compared(capsys, *PAIR)
    assert max(len(line) for line in out.splitlines()) <= (width or PIPED_WIDTH)
    assert "…" not in out and "..." not in out
    # the budget: the H100 preset's 84,938,850,304 B less the 512 MiB reserve 536,870,912 B
    budget = gpu_preset("h100-80gb").memory_bytes - 512 * 2**20
    assert data["budget_bytes"] == budget and whole(out, f"{budget:,}")
    assert out.startswith("B=1 H=1 N=256 d=16 fp32; max seq_len within budget")
    base = data["rows"][0]["peak_bytes"]
    savings = {"naive": "0 B", "naive-softmax": "515.00 KiB"}  # PEAK_GAP = 515 x 1,024 B
    for row in data["rows"]:
        full = [row["impl"], str(row["quadratic_saved"]), human(row["saved_bytes"]),
                human(row["forward_peak_bytes"]), human(row["backward_peak_bytes"]),
                human(row["peak_bytes"]), human(row["reserved_peak_bytes"]),
                "yes" if row["fits"] else "NO", savings[row["impl"]],
                ratio(base, row["peak_bytes"]), f"{row['max_seq_len']:,}"]
        (line,) = [line for line in out.splitlines() if line.split(" ")[0] == row["impl"]]
        cells = re.split(r" {2,}", line.strip())  # columns are 2 spaces apart at least
        kept = iter(full)
        assert all(cell in kept for cell in cells), (cells, full)  # in order, none cut
        assert set(full[5:6] + full[7:]) <= set(cells), cells
        assert cells == full or width in (60, 80), cells


def test_only_is_the_old_spelling_of_impl_and_is_not_listed(capsys):
    """--only adds to --impl's list (the two may be mixed); --help no longer shows it."""
    data = json.loads(compared(capsys, "--only", "naive", "--impl", "naive-softmax", "--json"))
    assert [r["impl"] for r in data["rows"]] == ["naive", "naive-softmax"]
    code, out, _ = run(capsys, "compare", "--help")
    assert code == 0 and "--only" not in out and "--impl IMPL[,IMPL]" in out


def test_base_config_is_the_first_implementation_accepting_the_options():
    """--heads 4 --kv-heads 2: naive (no GQA) cannot hold them, sdpa-math can; with no --impl,
    the registry's first with GQA: flash2, linear(-causal(-chunked)), naive(-softmax,
    -weights) have none, sdpa-flash (8th) has it."""
    from memcalc.commands.compare import base_config

    args = build_parser().parse_args(["compare", *SMALL, "--heads", "4", "--kv-heads", "2"])
    assert base_config(args, ["naive", "sdpa-math", "checkpoint-sdpa-math"]).impl == "sdpa-math"
    assert base_config(args, None).impl == "sdpa-flash"
    config = base_config(args, ["flash2", "sdpa-math"])
    assert (config.shape.heads, config.shape.key_heads, config.shape.seq_len) == (4, 2, 256)


def refusals(tmp_path) -> dict[str, tuple[list[str], str]]:
    """Bad options of compare and the one line each must get."""
    from memcalc.names import impl_choices

    missing = tmp_path / "no" / "x.png"
    return {
        "unknown baseline": (["--baseline", "flashy"], "--baseline: unknown implementation "
                             f"'flashy' (did you mean 'flash2'?); known: "
                             f"{', '.join(impl_choices())} (memcalc impls describes them)"),
        "baseline not compared": (["--impl", "naive,sdpa-math", "--baseline", "flash2"],
                                  "--baseline: 'flash2' is not among the compared "
                                  "implementations (--impl naive,sdpa-math); add it to --impl"),
        "plot is a directory": (["--plot", str(tmp_path)],
                                f"--plot: {str(tmp_path)!r} is a directory, not a file"),
        "plot has no directory": (["--plot", str(missing)], f"--plot: {str(missing)!r}: no "
                                  f"directory {str(missing.parent)!r} to write it into"),
        "no implementation takes the options": (  # the first implementation's reason
            [*PAIR, "--heads", "4", "--kv-heads", "2"],
            "--kv-heads: implementation naive needs kv_heads == heads (2 != 4)"),
        "two formats": (["--json", "--csv"], "--csv: not allowed with --json"),
    }


@pytest.mark.parametrize("case", list(refusals(Path("/tmp"))))
def test_bad_input_is_refused_in_one_line_before_any_work(capsys, monkeypatch, tmp_path, case):
    """Exit 2 and one line naming the option and what it allows; nothing compared."""
    def no_work(*args, **kwargs):
        raise AssertionError("compared before the options were checked")

    monkeypatch.setattr("memcalc.analysis.comparison.compare", no_work)
    argv, line = refusals(tmp_path)[case]
    code, out, err = run(capsys, "compare", *SMALL, *argv)
    assert_refused(code, out, err, line.split(":")[0].split()[-1])
    assert err == f"memcalc: error: {line}\n"


def test_plot_draws_only_the_rows_with_figures(capsys, tmp_path):
    """sdpa-flash has no fp32 kernel: its row is a note, left out of the plot."""
    pytest.importorskip("matplotlib")
    path = tmp_path / "peaks.png"
    code, out, err = run(capsys, "compare", *SMALL, "--impl", "naive,sdpa-flash", "--plot",
                         str(path))
    assert (code, err) == (0, f"memcalc: wrote {path}: what is alive at each implementation's "
                              f"peak\n")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert re.search(r"^sdpa-flash .* n/a$", out, re.M) and "sdpa-flash:" in out


def test_without_naive_the_baseline_is_the_first_implementation(capsys):
    """``--impl flash2,linear`` alone compared nothing: the default baseline, naive, was not
    among them. Now the first of them is the baseline (its saving 0, its factor 1)."""
    code, out, _ = run(capsys, "compare", "--seq", "256", "--batch", "1", "--impl",
                       "flash2,linear", "--json")
    data = json.loads(out)
    assert code == 0 and data["baseline"] == "flash2"


def test_a_baseline_without_figures_is_one_line(capsys):
    """sdpa-flash has no fp32 kernel: every saving against it would be a dash."""
    code, out, err = run(capsys, "compare", "--seq", "256", "--batch", "1", "--impl",
                         "naive,sdpa-flash", "--baseline", "sdpa-flash")
    assert_refused(code, out, err, "--baseline")
    assert "sdpa-flash has no figures for these options" in err
