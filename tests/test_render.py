"""Rendered output at a fixed console width, and the integer-only unit formatting."""

import io

from rich.console import Console

from memcalc.config import Config
from memcalc.analysis.predict import predict
from memcalc.engine.units import human, mib, share


def render(obj, width=200) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None)
    console.print(obj)
    return console.file.getvalue()


def test_breakdown_table_rows():
    text = render(predict(Config(impl="naive-softmax")))
    lines = text.splitlines()
    assert lines[0].startswith("naive-softmax: B=8 H=1 N=16384 d=16 fp32 on NVIDIA H100")
    row = next(line for line in lines if line.strip().startswith("p "))
    # p: 8 x 1 x 16384 x 16384 x 4 B = 8,589,934,592 = 8.00 GiB; share of the peak
    # 8,589,934,592 / 34,477,178,880 = 24.91...% -> 24.9%
    assert "8 x 1 x 16384 x 16384 x 4 B" in row and "8.00 GiB" in row and "24.9%" in row
    assert "8,589,934,592" in row  # a table's counts have separators, as prose's do
    saved = next(line for line in lines if "saved for backward" in line)
    assert "8,589,934,592" in saved and "8.00 GiB" in saved


def test_html_for_jupyter():
    assert "<pre" in predict(Config(shape={"seq_len": 256}))._repr_html_()


def test_units_are_exact():
    assert mib(8_589_934_592) == "8,192.00"
    assert mib(524_288) == "0.50"
    assert mib(1) == "0.00"
    assert human(512) == "512 B"
    assert human(25_887_244_288) == "24.11 GiB"  # 25,887,244,288 / 2^30 = 24.1093...
    assert share(1, 3) == "33.3%"
    assert share(2, 3) == "66.7%"


def test_every_column_is_named():
    """A column without a header leaves a CSV or Markdown reader guessing (the figures'
    human-readable sizes and the GPU presets' had none)."""
    from memcalc.output.render import Column

    with pytest.raises(ValueError, match="header"):
        Column("", str)


# --- every subcommand at every width: nothing cut ------------------------------------------

import json
import re

import pytest

from memcalc.cli import main
from memcalc.options import PIPED_WIDTH

WIDTHS = [60, 80, 100, 140, None]  # None: piped, no COLUMNS: PIPED_WIDTH
TRACE = "examples/custom_softmax/variants.py:reciprocal"


def run_at(capsys, monkeypatch, width, *argv) -> str:
    if width is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", str(width))
    assert main(list(argv)) in (0, 1)
    out = capsys.readouterr().out
    limit = width or PIPED_WIDTH
    assert "…" not in out and "..." not in out
    assert max(len(line) for line in out.splitlines()) <= limit
    assert not [line for line in out.splitlines() if line.endswith(" ")]  # no padding piped
    return out


def json_of(capsys, *argv) -> dict:
    assert main([*argv, "--json"]) in (0, 1)
    return json.loads(capsys.readouterr().out)


def whole(text: str, figure) -> bool:
    """``figure`` appears in ``text`` as a token of its own (not cut, not part of another);
    a count as the tables print it, with thousands separators."""
    shown = f"{figure:,}" if isinstance(figure, int) else str(figure)
    return re.search(rf"(?<![\d,.]){re.escape(shown)}(?![\d,.])", text) is not None


def flat(text: str) -> str:
    """``text`` with its lines joined: a name wrapped in a narrow column, whole again."""
    return " ".join(text.split())


@pytest.mark.parametrize("width", WIDTHS)
def test_breakdown_at_every_width(capsys, monkeypatch, width):
    data = json_of(capsys, "breakdown", "--seq", "4096")
    out = run_at(capsys, monkeypatch, width, "breakdown", "--seq", "4096")
    for c in data["components"]:  # every name and allocated block, whole, in its unit
        assert c["name"] in flat(out) and human(c["allocated"]) in out, (c["name"], width)
        if width is None or width >= 140:  # wide enough for the exact block as well
            assert whole(out, c["allocated"]), (c["name"], width)
    for key in ("saved_bytes", "peak_bytes", "reserved_peak_bytes"):
        assert whole(out, data[key])
    assert whole(out, data["budget_bytes"])


@pytest.mark.parametrize("width", WIDTHS)
def test_compare_at_every_width(capsys, monkeypatch, width):
    from memcalc.engine.units import human

    argv = ["compare", "--seq", "1024", "--impl", "naive,naive-softmax,flash2,sdpa-efficient,"
            "checkpoint-linear-causal-chunked"]
    data = json_of(capsys, *argv)
    out = run_at(capsys, monkeypatch, width, *argv)
    for r in data["rows"]:
        assert r["impl"] in out
        assert human(r["peak_bytes"]) in out
        if r["max_seq_len"] is not None:
            assert whole(out, r["max_seq_len"])
    assert "caveat: sdpa-efficient" in out.replace("\n", " ")


@pytest.mark.parametrize("width", WIDTHS)
def test_sweep_at_every_width(capsys, monkeypatch, width):
    from memcalc.engine.units import mib

    argv = ["sweep", "--seq", "256,4096", "--head-dim", "16,128", "--impl", "naive,flash2"]
    data = json_of(capsys, *argv)
    out = run_at(capsys, monkeypatch, width, *argv)
    for r in data["rows"]:
        assert whole(out, mib(r["peak_bytes"]))


@pytest.mark.parametrize("width", WIDTHS)
def test_oom_at_every_width(capsys, monkeypatch, width):
    argv = ["oom", "--impl", "naive,flash2", "--gpu-gb", "16"]
    data = json_of(capsys, *argv)
    out = run_at(capsys, monkeypatch, width, *argv)
    for r in data["results"]:
        assert r["impl"] in out and whole(out, r["max_seq_len"])


@pytest.mark.parametrize("width", WIDTHS)
def test_lists_trace_and_validate_at_every_width(capsys, monkeypatch, width, tmp_path):
    from memcalc.gpus import gpu_presets
    from memcalc.names import impl_choices

    out = run_at(capsys, monkeypatch, width, "gpus")
    assert all(whole(out, g.memory_bytes) for g in gpu_presets().values())
    out = run_at(capsys, monkeypatch, width, "impls")
    assert all(n in out for n in impl_choices())
    data = json_of(capsys, "trace", TRACE, "--seq", "256")
    out = run_at(capsys, monkeypatch, width, "trace", TRACE, "--seq", "256")
    assert all(human(c["allocated"]) in out for c in data["components"])
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps({"name": "tiny", "products": [
        {"impl": ["naive-softmax"], "seq_len": [64, 100], "batch": [1]}]}))
    out = run_at(capsys, monkeypatch, width, "validate", "--grid", str(grid))
    assert "emulated: 2 configurations" in out.replace("\n", " ")


def test_narrow_tables_fall_back_to_blocks_not_cuts():
    """Below the width of the essential columns, each row becomes a block of pairs."""
    from memcalc.output.render import Column, Table
    from memcalc.output.result import Result

    class Wide(Result):
        def tables(self):
            cols = [Column("name", lambda r: r[0]), Column("bytes", lambda r: r[1], "right")]
            return [Table("t", cols, [("a-rather-long-name", 12345678901234567890)])]

    out = render(Wide(), width=34)  # the pair is 32 characters, the row's two columns 36
    assert "a-rather-long-name" in out and "bytes 12,345,678,901,234,567,890" in out


def test_print_and_repr_are_short():
    b = predict(Config(shape={"seq_len": 1024}))
    # naive, N = 1024: peak 259.09 MiB (the sweep's second row above), a one-line summary
    assert str(b).count("\n") == 0 and len(repr(b)) < 250
    assert "peak" in str(b) and "fits" in str(b)
    assert repr(b).startswith("<Breakdown: naive B=8 H=1 N=1024")


def test_markdown_shows_stars_and_bars_as_written():
    """``192*N^2 + 3,168*N`` rendered half in italics, and a ``|`` in a cell would split it;
    both are escaped, in cells, notes and titles. ``exp_x`` needs no escape (CommonMark
    leaves an underscore inside a word alone)."""
    from memcalc.output.render import Column, escaped, markdown_table

    assert escaped("naive: 192*N^2 + 3,168*N") == "naive: 192\\*N^2 + 3,168\\*N"
    assert escaped("a | b") == "a \\| b" and escaped("exp_x") == "exp_x"
    assert escaped("trace:<lambda>") == "trace:\\<lambda>"  # not an HTML tag
    table = markdown_table([Column("name", lambda r: r)], ["-dp*e/r/r"])
    assert table.splitlines()[-1] == "| -dp\\*e/r/r |"


def test_prose_takes_the_width_the_other_columns_leave():
    """A 60-character summary beside a 10-character name fits one 80-column line (it was
    wrapped at the prose column's 24 characters, the rest of the line left empty)."""
    from memcalc.output.render import Column, rich_table, text

    summary = "causal linear attention by cumsum: saves a (B, H, N, D, D) x"  # 60 characters
    table = rich_table(None, [Column("name", lambda r: r[0]),
                              Column("what it is", lambda r: r[1], wrap=True)],
                       [("linear", summary)])
    lines = text(table, 80).splitlines()
    assert lines[-1] == f"linear  {summary}"  # 6 + 2 + 60 = 68 <= 80: one line


def test_a_step_no_gpu_holds_reads_in_units_at_80_columns(capsys, monkeypatch):
    """At --seq 1e12 the 80-column table kept only 26-digit byte counts: now each block
    in its unit, with what made it. exp_x: 8 x 10^24 x 4 B = 3.2 x 10^25 B / 2^80 = 26.47 YiB."""
    out = run_at(capsys, monkeypatch, 80, "breakdown", "--seq", "1e12")
    row = next(line for line in out.splitlines() if line.startswith("exp_x "))
    assert "26.47 YiB" in row and "exp: e = exp(s - m)" in row
    assert not re.search(r"\d{16}", out)  # no bare run of digits; counts have separators
