"""``memcalc oom``: each answer fits and one more does not, by ``memcalc breakdown`` too."""

import json
import subprocess
import sys

import pytest

from breakers import interrupt_after
from cli_helpers import assert_refused, csv_as_json, run

GIB80 = 85_362_475_008  # 80 x 2^30 - 512 x 2^20: --gpu-gb 80 with the default reserve


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
    assert code == 0 and "19,511" in out and "32,768" in out and "192*N^2" in out


@pytest.mark.parametrize("argv, option", [
    (["--solve", "depth"], "--solve"),
    (["--impl", "naive,,flash2"], "--impl"),
    (["--impl", "nope"], "--impl"),
    (["--time-limit", "-1"], "--time-limit"),
    (["--work-limit", "0"], "--work-limit"),
    (["--work-limit", "1.5"], "--work-limit"),
    (["--gpu-gb", "x"], "--gpu-gb"),
    (["--batch", "0"], "--batch"),
])
def test_oom_bad_input(capsys, argv, option):
    code, out, err = run(capsys, "oom", *argv)
    assert_refused(code, out, err, option)


def test_oom_and_sweep_import_no_torch():
    code = ("import sys; from memcalc.cli import main; main(['oom', '--impl', 'naive', '--json']);"
            " main(['sweep', '--seq', '256,512', '--json']); print(sorted(m for m in "
            "('torch', 'matplotlib', 'pandas') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_ctrl_c_prints_what_is_known_and_exits_130(capsys, monkeypatch):
    """Interrupted in the second implementation's search: the first's row, the second's
    bounds so far, no traceback, the shell's 130 (128 + SIGINT); the report is the answer,
    no "memcalc: interrupted" line beside it (as the README says)."""
    interrupt_after(monkeypatch, "naive-softmax", 1)
    code, out, err = run(capsys, "oom", "--gpu-gb", "80", "--impl", "naive,naive-softmax",
                         "--json")
    assert (code, err) == (130, "")
    data = json.loads(out)
    assert [r["impl"] for r in data["results"]] == ["naive"]
    assert data["results"][0]["max_seq_len"] == 19511
    (unsolved,) = data["unsolved"]
    assert unsolved["impl"] == "naive-softmax" and "interrupted after" in unsolved["reason"]
    # its first replay, at the default 16,384 rows, fits; nothing was seen not to
    assert (unsolved["fits_at"], unsolved["fails_at"]) == (16384, None)


def test_a_search_out_of_time_gives_its_bounds_as_csv_columns(capsys):
    """The chunked loop in 0.75 GB has no exact answer within 1 s: its row says so in
    ``status`` and ``reason``, with the largest length it replayed that fits in ``fits_at``
    (a number, as in the JSON), its maximum empty."""
    argv = ["oom", "--impl", "linear-causal-chunked", "--gpu-gb", "0.75", "--time-limit", "1"]
    code, out, _ = run(capsys, *argv, "--csv")
    (row,) = csv_as_json(out)
    assert code == 0 and (row["status"], row["max_seq_len"]) == ("unsolved", None)
    assert isinstance(row["fits_at"], int) and row["fits_at"] >= 1
    assert row["reason"].startswith(f"no exact answer within 1 s (fits at {row['fits_at']:,}")


def test_ctrl_c_elsewhere_is_one_line_and_exit_130(capsys, monkeypatch):
    from memcalc.commands import breakdown

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(breakdown, "run", interrupted)
    assert run(capsys, "breakdown") == (130, "", "memcalc: interrupted\n")


def test_oom_head_dim_of_the_fused_kernels_answers_and_checks_out(capsys):
    """The issue's command: no error but an answer, which `memcalc breakdown` confirms:
    sdpa-flash fits at its limit 256 and refuses 257 (exit 2, one line); sdpa-efficient
    fits at 2,944 and not at 2,952, the next multiple of 8 it takes."""
    options = ["--gpu-gb", "80", "--dtype", "fp16"]
    code, out, _ = run(capsys, "oom", "--impl", "sdpa-flash,sdpa-efficient", "--solve",
                       "head-dim", *options, "--json")
    assert code == 0
    flash, efficient = json.loads(out)["results"]
    assert (flash["max_head_dim"], flash["next_head_dim"]) == (256, None)
    assert (efficient["max_head_dim"], efficient["next_head_dim"]) == (2944, 2952)
    for impl, d, expected in (("sdpa-flash", 256, True), ("sdpa-efficient", 2944, True),
                              ("sdpa-efficient", 2952, False)):
        _, out, _ = run(capsys, "breakdown", "--impl", impl, "--head-dim", str(d), *options,
                        "--json")
        assert json.loads(out)["fits"] is expected, (impl, d)
    code, out, err = run(capsys, "breakdown", "--impl", "sdpa-flash", "--head-dim", "257",
                         *options)
    assert code == 2 and err == ("memcalc: error: --head-dim: sdpa-flash: head_dim 257 > 256: the largest "
                                 "head_dim FlashAttention supports (sdp_utils.cpp "
                                 "check_head_dim_size_flash)\n")


def test_oom_named_alone_a_refusal_is_one_line(capsys):
    """One implementation named: the options it refuses (fp32 FlashAttention) are bad input."""
    code, out, err = run(capsys, "oom", "--impl", "sdpa-flash", "--solve", "head-dim",
                         "--gpu-gb", "80")
    assert_refused(code, out, err, "sdpa-flash")
    assert "fp16 and bf16 only" in err


def test_a_first_implementation_refusing_the_options_does_not_refuse_the_others(capsys):
    """``--kv-heads 1 --heads 2`` with naive first (every implementation's list starts
    there) refused the whole command; compare listed naive as refused and solved the
    others. Now oom does too."""
    code, out, _ = run(capsys, "oom", "--gpu-gb", "16", "--heads", "2", "--kv-heads", "1",
                       "--head-dim", "64", "--impl", "naive,sdpa-math", "--csv")
    rows = {r.split(",")[0]: r.split(",")[1] for r in out.splitlines()[1:]}
    assert code == 0 and rows == {"sdpa-math": "solved", "naive": "skipped"}


def test_a_few_values_past_the_threshold_are_tried():
    """linear-causal's batch at 16 GiB: 181 fits, 182 does not, 183 does (fitting goes on
    by parity); the answer was 181. Nothing from 184 to 400 fits (checked one by one)."""
    import memcalc

    r = memcalc.oom(impl="checkpoint-linear-causal", gpu_gb=16, solve="batch").results[0]
    assert (r.max_value, r.at_max.fits, r.at_next.fits) == (183, True, False)
