"""``memcalc.compiling.variants``: ``memcalc trace --compile eager,default`` and
``--compile-budget``: a row per step, the saved bytes falling with the budget, bad input in
one line."""

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from cli_helpers import assert_refused, run  # noqa: E402
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
    the block's matmuls, and their buffers say so."""
    monkeypatch.setenv("COLUMNS", "100")
    code, out, err = run(capsys, "trace", *BLOCK, "--compile-budget", "0")
    assert code == 0, err
    assert "saved for backward" in out and ", recomputed, at gpt_block.py:" in out


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
