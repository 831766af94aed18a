"""``memcalc.compiling.variants``: ``memcalc trace --compile eager,default`` and
``--compile-budget``: a row per step, the saved bytes falling with the budget, bad input in
one line."""

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from cli_helpers import assert_refused, run  # noqa: E402
from test_tracing_compiled import PLAIN  # noqa: E402
from memcalc.compiling.variants import parse_budgets, parse_modes  # noqa: E402

BLOCK = ("examples/attention/gpt_block.py:Block", "--input", "x=B,N,768", "--seq", "256",
         "--batch", "2")


def test_the_variants_asked_for_in_order():
    assert parse_modes("eager,default", (0.0, 1.0)) == (("eager", None), ("default", 0.0),
                                                        ("default", 1.0))
    assert parse_modes(None, (0.5,)) == (("default", 0.5),)
    assert parse_modes("eager,default", ()) == (("eager", None), ("default", None))


@pytest.mark.parametrize("text", ["2", "-0.1", "half", "0,,1"])
def test_a_budget_outside_0_to_1_is_refused_naming_the_option(text):
    with pytest.raises(ValueError, match=r"^--compile-budget .*: each budget a fraction"):
        parse_budgets(text)


def test_a_bad_budget_is_one_line_from_the_command(capsys):
    code, out, err = run(capsys, "trace", *BLOCK, "--compile-budget", "1.5")
    assert_refused(code, out, err, "--compile-budget 1.5")


def test_eager_beside_the_compiled_step_at_each_budget(capsys):
    """A row each; the partitioner keeps less as the budget falls (never more), and at 0
    nothing the forward made is kept; the first row is the reference of the last column."""
    code, out, err = run(capsys, "trace", *BLOCK, "--compile", "eager,default",
                         "--compile-budget", "0,0.5,1", "--json")
    assert code == 0, err
    rows = json.loads(out)["rows"]
    assert [r["variant"] for r in rows] == ["eager", "compiled, budget 0",
                                            "compiled, budget 0.5", "compiled, budget 1"]
    saved = [r["saved_bytes"] for r in rows[1:]]
    assert saved[0] == 0 and saved == sorted(saved) and saved[0] < saved[-1]
    assert rows[0]["peak_vs_first_bytes"] == 0
    assert all(r["peak_vs_first_bytes"] == r["peak_bytes"] - rows[0]["peak_bytes"]
               for r in rows)


def test_the_table_fits_80_columns_and_a_pipe(capsys, monkeypatch):
    for width in ("80", "200"):
        monkeypatch.setenv("COLUMNS", width)
        code, out, err = run(capsys, "trace", *BLOCK, "--compile", "eager,default")
        assert code == 0, err
        assert max(len(line) for line in out.splitlines()) <= int(width)
        assert "compiled" in out and "eager" in out


def test_one_budget_is_that_steps_breakdown_naming_what_it_recomputes(capsys, monkeypatch):
    """At budget 0 the partitioner keeps nothing the forward made: the backward recomputes
    the block's forward up to its last matmul, each buffer in the role ``recomputed``, and
    the step's figures total them."""
    code, out, err = run(capsys, "trace", *BLOCK, "--compile-budget", "0", "--json")
    assert code == 0, err
    step = json.loads(out)
    recomputed = step["recomputed"]
    assert step["saved_bytes"] == 0
    assert {r["role"] for r in recomputed} == {"recomputed"}
    # B=2, N=256, fp32: ln_1's mean and rstd and ln_2's rstd 2*256*4 = 2,048 each; ln_1,
    # ln_2 and c_proj's outputs and attention's 2*256*768*4 = 1,572,864 each; c_attn's
    # 512*2304*4 = 4,718,592; the efficient kernel's lse 2*12*256*4 = 24,576; c_fc's
    # 512*3072*4 = 6,291,456
    assert sorted(r["bytes"] for r in recomputed) == sorted(
        [2048] * 3 + [1572864] * 4 + [4718592, 24576, 6291456])
    assert step["recomputed_bytes"] == sum(r["allocated"] for r in recomputed)
    monkeypatch.setenv("COLUMNS", "100")
    code, out, err = run(capsys, "trace", *BLOCK, "--compile-budget", "0")
    assert code == 0 and "recomputed in backward (compiled)" in out


def test_a_step_over_the_budget_is_judged_by_its_own_trace(capsys):
    """Over the budget, whether a step fits is decided by replaying it capped at the budget,
    which for traced code traces it again: inside the compiler's session, not after it
    (the table used to judge its rows once the session had closed)."""
    code, out, err = run(capsys, "trace", *BLOCK, "--compile", "eager,default",
                         "--gpu-gb", "0.6", "--json")
    assert code == 0, err
    assert [r["fits"] for r in json.loads(out)["rows"]] == [False, False]


def test_each_steps_peak_by_role(capsys):
    """Beside the figures, what is alive at each step's peak by role, in the JSON too: the
    roles of a row add up to its peak."""
    code, out, err = run(capsys, "trace", *BLOCK, "--compile", "eager,default", "--json")
    assert code == 0, err
    for row in json.loads(out)["rows"]:
        assert sum(row["at_peak_by_role"].values()) == row["peak_bytes"]
    code, out, err = run(capsys, "trace", *BLOCK, "--compile", "eager,default")
    assert "alive at each step's peak, by role" in out


def test_a_budget_without_the_compiled_step_is_one_line(capsys):
    code, out, err = run(capsys, "trace", *BLOCK, "--compile", "eager", "--compile-budget",
                         "0.5")
    assert_refused(code, out, err, "--compile-budget 0.5: the budget is the compiled step's")


def test_saved_and_recomputed_bytes_by_the_users_line(capsys, monkeypatch):
    """Each step's saved tensors, and each compiled step's recomputed ones, by the line of
    the block that made them: at budget 1 the partitioner keeps what eager keeps at the
    attention's lines, at budget 0 it keeps nothing and recomputes them."""
    code, out, err = run(capsys, "trace", *BLOCK, "--compile", "eager,default",
                         "--compile-budget", "0,1", "--json")
    assert code == 0, err
    eager, none, whole = json.loads(out)["rows"]
    # line 25, ln_1 and c_attn (B=2, N=256, fp32): the normalized x 2*256*768*4 =
    # 1,572,864, its mean and rstd 2*256*4 = 2,048 each, q, k, v 512*2304*4 = 4,718,592;
    # line 26, the efficient kernel's output 1,572,864 and lse 2*12*256*4 = 24,576
    line_25, line_26 = 1572864 + 2 * 2048 + 4718592, 1572864 + 24576
    for step in (eager, whole):
        assert step["saved_by_line"]["gpt_block.py:25"] == line_25
        assert step["saved_by_line"]["gpt_block.py:26"] == line_26
    assert none["saved_by_line"] == {} and whole["recomputed_by_line"] == {}
    assert none["recomputed_by_line"]["gpt_block.py:25"] == line_25
    assert eager["recomputed_bytes"] is None and whole["recomputed_bytes"] == 0
    assert none["recomputed_bytes"] == sum(none["recomputed_by_line"].values())
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = run(capsys, "trace", *BLOCK, "--compile", "eager,default",
                         "--compile-budget", "0,1")
    assert "saved for the backward, by line of your code" in out
    assert "recomputed in the backward, by line of your code" in out
    assert max(len(line) for line in out.splitlines()) <= 80


@pytest.mark.parametrize("argv, option", [
    (("oom", "--impl", "naive", "--compile-budget", "0.5"), "--compile-budget 0.5"),
    (("oom", "--trace", BLOCK[0], *BLOCK[1:3], "--compile", "eager", "--compile-budget",
      "0.5"), "--compile-budget 0.5"),
    (("oom", "--trace", BLOCK[0], *BLOCK[1:3], "--compile-budget", "2"),
     "--compile-budget 2")])
def test_oom_refuses_a_budget_it_cannot_use_in_one_line(capsys, argv, option):
    code, out, err = run(capsys, *argv)
    assert_refused(code, out, err, option)


@pytest.mark.slow  # each length the searches try is compiled: about a minute in all
def test_oom_gives_a_longest_length_per_step(tmp_path, capsys):
    """``oom --trace --compile eager,default --compile-budget 0,1``: a row per step, named
    by it, each answer checked by tracing that step at it and one row past it."""
    path = tmp_path / "tiny.py"
    path.write_text(PLAIN)  # Linear(64, 64), then relu
    target = f"{path}:Model"
    code, out, err = run(capsys, "oom", "--trace", target, "--input", "x=B,N,64",
                         "--batch", "1", "--gpu-gb", "0.6", "--compile", "eager,default",
                         "--compile-budget", "0,1", "--json")
    assert code == 0, err
    results = json.loads(out)["results"]
    assert [r["impl"] for r in results] == [f"trace:{target} ({step})" for step in (
        "eager", "compiled, budget 0", "compiled, budget 1")]
    for r, compile, budget in zip(results, ("eager", "default", "default"), (None, "0", "1")):
        extra = ("--compile-budget", budget) if budget else ()
        for n, fits in ((r["max_seq_len"], True), (r["max_seq_len"] + 1, False)):
            code, out, err = run(capsys, "trace", target, "--input", "x=B,N,64", "--batch",
                                 "1", "--seq", str(n), "--gpu-gb", "0.6", "--compile",
                                 compile, *extra, "--json")
            assert code == 0, err
            assert json.loads(out)["fits"] is fits, (r["impl"], n)


@pytest.mark.slow  # each step's program is fitted from compiles at 6 to 12 lengths: 50 s
def test_sweep_gives_a_series_per_step(tmp_path, capsys, monkeypatch):
    """``sweep --trace --compile eager,default --compile-budget 0,1``: a series per step,
    named by it, each figure the trace of that step at that length gives (checked at the
    longer one)."""
    path = tmp_path / "tiny.py"
    path.write_text(PLAIN)  # Linear(64, 64), then relu
    target = f"{path}:Model"
    steps = (("eager", None), ("default", "0"), ("default", "1"))
    code, out, err = run(capsys, "sweep", "--trace", target, "--input", "x=B,N,64", "--batch",
                         "1", "--seq", "64,128", "--compile", "eager,default",
                         "--compile-budget", "0,1", "--json")
    assert code == 0, err
    rows = json.loads(out)["rows"]
    assert [(r["impl"], r["seq_len"]) for r in rows] == [
        (f"trace:{target} ({step})", n) for step in ("eager", "compiled, budget 0",
                                                      "compiled, budget 1") for n in (64, 128)]
    for row, (compile, budget) in zip(rows[1::2], steps):  # each step's at 128 rows
        extra = ("--compile-budget", budget) if budget else ()
        code, out, err = run(capsys, "trace", target, "--input", "x=B,N,64", "--batch", "1",
                             "--seq", str(row["seq_len"]), "--compile", compile, *extra,
                             "--json")
        traced = json.loads(out)
        assert (row["peak_bytes"], row["saved_bytes"], row["reserved_peak_bytes"]) == (
            traced["peak_bytes"], traced["saved_bytes"], traced["reserved_peak_bytes"])
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = run(capsys, "sweep", "--trace", target, "--input", "x=B,N,64",
                         "--batch", "1", "--seq", "64", "--compile-budget", "0.5")
    assert code == 0 and "(compiled, budget 0.5)" in out, err
    assert max(len(line) for line in out.splitlines()) <= 80
