"""The ``Sweep`` of ``memcalc.analysis.scaling``: series, growth, layouts, widths, exports and skips."""

import io
from fractions import Fraction

import pytest
from rich.console import Console

from memcalc.analysis.budget import Budget
from memcalc.config import make_config
from memcalc.output.render import text
from memcalc.analysis.scaling import sweep
from memcalc.engine.program import Program, Role, free, new, release

MiB = 1 << 20
TOY, LINEAR, PICKY, BROKEN = ("test-scaling-toy", "test-scaling-linear", "test-scaling-picky",
                              "test-scaling-broken")

# Figures of the toys, B = H = 1, fp32, by hand. Inputs q, k, v, grad_out and out are
# (1, 1, N, d): 4 N d B each; s is (1, 1, N, N): 4 N^2 B. Every size below is a multiple of
# 512 B, so each block is its request. TOY's peak is inputs + out + s = 20 N d + 4 N^2, in
# the forward and again at the backward's start (the release of s).
#   d = 16, N =  256: 5 x 16,384 + 262,144 = 344,064 (336 KiB)
#   d = 16, N =  512: 5 x 32,768 + 1,048,576 = 1,212,416 (1,184 KiB)
#   d = 16, N = 1024: 5 x 65,536 + 4,194,304 = 4,521,984 (4,416 KiB)
#   d = 32, N =  256: 5 x 32,768 + 262,144 = 425,984
#   d = 32, N =  512: 5 x 65,536 + 1,048,576 = 1,376,256
#   d = 32, N = 1024: 5 x 131,072 + 4,194,304 = 4,849,664
# Reserved: up to N = 512 every block is small (<= 1 MiB) and they total at most 1,376,256 B:
# one 2 MiB segment. At N = 1024 s (4 MiB) takes a 20 MiB segment too: 22 MiB.
# BUDGET is 3 MiB: the N = 1024 rows do not fit (their live blocks alone exceed it).
BUDGET = Budget(device="test GPU", memory_bytes=4 * MiB, reserve_bytes=MiB)
BUDGET_LINE = ("budget 3,145,728 B (3.00 MiB) = test GPU 4,194,304 B - reserve 1,048,576 B "
               "(1.00 MiB, CUDA context)")


def toy(d):
    """``s = q @ k^T``, saved for backward; ``out``; backward releases ``s``."""
    return Program((new("s", (d.B, d.H, d.N, d.M), d.dtype, Role.saved, "mm"),
                    new("out", (d.B, d.H, d.N, d.D), d.dtype, Role.output, "mm"), free("s")),
                   (release("s"),))


def linear(d):
    """``out`` only: peak 5 x 4 N d B, nothing saved, nothing N x N."""
    return Program((new("out", (d.B, d.H, d.N, d.D), d.dtype, Role.output, "mm"),), ())


def picky(d):
    if d.dtype != "float32":
        raise ValueError(f"{PICKY}: fp32 only")
    return toy(d)


def broken(d):
    raise RuntimeError("a bug in the model\nsecond line")


@pytest.fixture
def toys(scratch_register):
    for name, build in ((TOY, toy), (LINEAR, linear), (PICKY, picky), (BROKEN, broken)):
        scratch_register(name, build.__doc__ or name, build)


def base(**options):
    return make_config(**{"impl": TOY, "batch": 1, "heads": 1, "head_dim": 16, **options})


def test_growth_is_against_the_first_given_length_of_each_series(toys):
    """Series are (impl, dtype, batch, heads, head_dim); the first length is the first given,
    here the longer one, not the shortest."""
    s = sweep(base(), BUDGET, seq_len=(512, 256), head_dim=(16, 32))
    rows = [(r.head_dim, r.seq_len, r.peak_bytes, r.first_peak_bytes, r.growth) for r in s.rows]
    assert rows == [
        (16, 512, 1_212_416, 1_212_416, 1),
        (16, 256, 344_064, 1_212_416, Fraction(21, 74)),  # 344,064 / 1,212,416: both / 16,384
        (32, 512, 1_376_256, 1_376_256, 1),
        (32, 256, 425_984, 1_376_256, Fraction(13, 42)),  # 425,984 / 1,376,256: both / 32,768
    ]
    assert s.rows[3].series == (TOY, "fp32", 1, 1, 32, 1)  # ..., head_dim, cp
    table = s.tables()[0]
    at = [c.header for c in table.columns].index("x first")
    growth = [cells[at] for cells in table.cells()]
    assert growth == ["x1.00", "x0.28", "x1.00", "x0.31"]  # 21/74 = 0.2837..., 13/42 = 0.3095...


def test_title_names_the_fixed_axes_the_flags_and_the_budget(toys):
    head = "memory scaling with sequence length: "
    one = sweep(base(), BUDGET, seq_len=(256,))
    assert one.title() == head + f"{TOY}: B=1 H=1 d=16 fp32\n" + BUDGET_LINE
    varied = sweep(base(causal=True, forward_only=True), BUDGET, seq_len=(256,),
                   head_dim=(16, 32), impls=(TOY, LINEAR))
    assert varied.title() == head + "B=1 H=1 fp32 causal forward-only\n" + BUDGET_LINE
    # the options every title shows (Config.label), not the sweep's own subset of them
    options = sweep(base(kv_len=512, loss="sum"), BUDGET, seq_len=(256,), dtypes=("fp32", "fp16"))
    assert options.title() == head + f"{TOY}: B=1 H=1 M=512 d=16 loss=sum\n" + BUDGET_LINE


def test_long_columns_show_the_axes_that_vary_and_the_unit(toys):
    one = sweep(base(), BUDGET, seq_len=(256,))
    assert [c.header for c in one.long_columns()] == [
        "seq_len", "peak (MiB)", "saved (MiB)", "reserved (MiB)", "x first", "N^2 share", "OOM?"]
    many = sweep(base(), BUDGET, seq_len=(256,), head_dim=(16, 32), batch=(1, 2),
                 impls=(TOY, LINEAR), unit="bytes")
    columns = many.long_columns()
    assert [c.header for c in columns] == [
        "impl", "batch", "seq_len", "head_dim", "peak (bytes)", "saved (bytes)",
        "reserved (bytes)", "x first", "N^2 share", "OOM?"]
    # the first row: TOY, batch 1, N = 256, d = 16; s is 262,144 / 344,064 = 76.19...% of it
    assert [c.cell(many.rows[0]) for c in columns] == [
        TOY, 1, 256, 16, 344_064, 262_144, 2 * MiB, "x1.00", "76.2%", "fits"]


# the N = 1024 row of sweep(seq_len=(256, 512, 1024)) at d = 16, MiB: peak 4,416 KiB =
# 4.3125 MiB -> 4.31; saved s = 4.00; reserved 22.00; growth 4,416 / 336 = 92/7 = 13.142...;
# N^2 share 4,096 / 4,416 = 92.75...%; OOM. Column widths (the longest cell or header
# word): seq_len 7, peak 5 ("(MiB)"), saved 5, reserved 8, x first 6 ("x13.14"), N^2 share
# 5, OOM? 4: 40, plus 2 between each of the 7 columns = 52. Narrower, the secondary columns
# go in rank order: N^2 share (45 left), x first (37), saved (30), reserved (20).
# seq_len 1024 is printed as a count is, "1,024".
FULL = ["1,024", "4.31", "4.00", "22.00", "x13.14", "92.8%", "OOM"]


@pytest.mark.parametrize("width, shown", [
    (120, FULL), (80, FULL), (60, FULL), (52, FULL),
    (51, ["1,024", "4.31", "4.00", "22.00", "x13.14", "OOM"]),
    (44, ["1,024", "4.31", "4.00", "22.00", "OOM"]),
    (36, ["1,024", "4.31", "22.00", "OOM"]),
    (29, ["1,024", "4.31", "OOM"]),
])
def test_long_table_at_each_width_drops_secondary_columns_in_rank_order(toys, width, shown):
    s = sweep(base(), BUDGET, seq_len=(256, 512, 1024))
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(s)
    out = console.export_text()
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= width
    assert [line.split() for line in lines if line.split()[:1] == ["1,024"]] == [shown]
    rows = [line.split()[0] for line in lines if line.split()[:1] in (["256"], ["512"])]
    assert rows == ["256", "512"]


def test_piped_text_is_plain_with_title_rows_and_notes(toys):
    s = sweep(base(), BUDGET, seq_len=(256, 512, 1024))
    out = text(s, width=200)  # what print() and a pipe get: no terminal, no colour
    assert "\x1b" not in out
    lines = out.splitlines()
    assert lines[:2] == [f"memory scaling with sequence length: {TOY}: B=1 H=1 d=16 fp32",
                         BUDGET_LINE]
    rows = [line.split() for line in lines if line.split()[:1] in (["256"], ["512"], ["1,024"])]
    assert rows == [
        # 336 KiB = 0.328 MiB; 0.25; 2.00; s 256 / 336 = 76.19%
        ["256", "0.33", "0.25", "2.00", "x1.00", "76.2%", "fits"],
        # 1,184 KiB = 1.15625 MiB, half up 1.16; growth 74/21 = 3.523...; 1,024 / 1,184 = 86.49%
        ["512", "1.16", "1.00", "2.00", "x3.52", "86.5%", "fits"],
        FULL,
    ]
    assert lines[-1] == f"caveat: {TOY} modelled from PyTorch's CUDA kernel sources, not traced."


def test_pivot_tables_one_per_series_group_lengths_sorted_oom_marked(toys):
    s = sweep(base(), BUDGET, seq_len=(1024, 256, 512), head_dim=(32, 16), impls=(TOY, LINEAR),
              pivot="peak", unit="bytes")
    tables = s.tables()
    assert [t.title for t in tables] == [
        f"Peak, max_memory_allocated (bytes): {TOY}: B=1 H=1 fp32",  # Config.label
        f"Peak, max_memory_allocated (bytes): {LINEAR}: B=1 H=1 fp32"]
    assert [c.header for c in tables[0].columns] == ["seq_len \\ head_dim", "32", "16"]
    assert tables[0].cells() == [["256", "425,984", "344,064"],
                                 ["512", "1,376,256", "1,212,416"],
                                 ["1,024", "4,849,664 OOM", "4,521,984 OOM"]]
    # LINEAR: q, k, v, grad_out, out = 20 N d B; all in one 2 MiB segment: every row fits
    assert tables[1].cells() == [["256", "163,840", "81,920"],  # 20 x 256 x 32, 20 x 256 x 16
                                 ["512", "327,680", "163,840"],
                                 ["1,024", "655,360", "327,680"]]
    saved = s.model_copy(update={"pivot": "saved", "unit": "MiB"}).tables()[0]
    assert saved.title == f"Saved for backward (MiB): {TOY}: B=1 H=1 fp32"
    # s: 4 N^2 = 0.25, 1 and 4 MiB whatever d is
    assert saved.cells() == [["256", "0.25", "0.25"], ["512", "1.00", "1.00"],
                             ["1,024", "4.00 OOM", "4.00 OOM"]]


def test_csv_json_and_records_keep_bytes_and_the_growth_as_a_number_whatever_the_layout(toys):
    s = sweep(base(), BUDGET, seq_len=(512, 256), pivot="saved")  # MiB and a pivot: not in CSV
    # growth: 344,064 / 1,212,416 = 21/74 = 0.2837837..., to 6 decimals (the table: x0.28)
    assert s.to_csv() == (
        "impl,dtype,batch,heads,kv_heads,seq_len,head_dim,causal,peak_bytes,saved_bytes,"
        "forward_peak_bytes,backward_peak_bytes,reserved_peak_bytes,quadratic_bytes,growth,"
        "fits,status,reason\n"
        f"{TOY},fp32,1,1,1,512,16,False,1212416,1048576,1212416,1212416,2097152,1048576,1.0,"
        "True,computed,\n"
        f"{TOY},fp32,1,1,1,256,16,False,344064,262144,344064,344064,2097152,262144,0.283784,"
        "True,computed,\n")
    data = s.to_dict()
    assert data["budget_bytes"] == 3 * MiB  # 4 MiB - 1 MiB
    assert data["axes"] == {"impl": [TOY], "dtype": ["fp32"], "batch": [1], "heads": [1],
                            "head_dim": [16], "seq_len": [512, 256]}
    assert data["rows"][1] == {
        "impl": TOY, "dtype": "fp32", "batch": 1, "heads": 1, "kv_heads": 1, "causal": False,
        "seq_len": 256, "head_dim": 16,
        "saved_bytes": 262_144, "forward_peak_bytes": 344_064, "backward_peak_bytes": 344_064,
        "reserved_peak_bytes": 2 * MiB, "quadratic_bytes": 262_144, "fits": True,
        "peak_bytes": 344_064, "growth": 0.283784}
    # the records are the CSV's rows: the JSON's, with their status
    assert s.records() == [{**row, "status": "computed", "reason": None} for row in data["rows"]]


def test_headline_counts_configurations_and_those_that_fit(toys):
    assert sweep(base(), BUDGET, seq_len=(256, 512, 1024)).headline() == (
        f"3 configurations ({TOY}), 2 fit 3.00 MiB")  # N = 1024 reserves 22 MiB
    assert sweep(base(), BUDGET, seq_len=(256,), impls=(TOY, LINEAR)).headline() == (
        f"2 configurations ({TOY}, {LINEAR}), 2 fit 3.00 MiB")
    assert sweep(base(), BUDGET, seq_len=(1024,)).headline() == (
        f"1 configuration ({TOY}), 0 fit 3.00 MiB")


def test_a_model_that_refuses_or_breaks_is_skipped_unless_it_is_the_only_one(toys):
    s = sweep(base(), BUDGET, seq_len=(256,), impls=(PICKY, BROKEN), dtypes=("fp32", "bf16"))
    # the refusal without its leading name: the skip line names the implementation
    raised = "the model raised RuntimeError: a bug in the model"  # its first line only
    assert [(k.impl, k.dtype, k.sizes, k.reason) for k in s.skipped] == [
        (PICKY, "bf16", {}, "fp32 only"), (BROKEN, "fp32", {}, raised),
        (BROKEN, "bf16", {}, raised)]
    assert [(r.impl, r.dtype) for r in s.rows] == [(PICKY, "fp32")]
    assert s.footnotes()[0:3] == [f"{PICKY} bf16: skipped, fp32 only",
                                  f"{BROKEN} fp32: skipped, {raised}",
                                  f"{BROKEN} bf16: skipped, {raised}"]
    with pytest.raises(ValueError, match="fp32 only"):
        sweep(base(impl=PICKY), BUDGET, seq_len=(256,), dtypes=("bf16",))


def test_progress_wraps_the_loop_only_over_several_series(toys):
    calls = []

    def progress(items, total, description):
        calls.append((list(items), total, description))
        return items

    sweep(base(), BUDGET, seq_len=(256,), progress=progress)
    assert calls == []  # one implementation and dtype: nothing to show
    sweep(base(), BUDGET, seq_len=(256,), impls=(TOY, LINEAR), dtypes=("fp32", "fp16"),
          progress=progress)
    assert calls == [([(TOY, "fp32"), (TOY, "fp16"), (LINEAR, "fp32"), (LINEAR, "fp16")], 4,
                      "sweep")]


def test_an_axis_given_no_values_is_refused(toys):
    with pytest.raises(ValueError, match="^seq_len: no values$"):
        sweep(base(), BUDGET, seq_len=())


def test_the_caveat_names_only_implementations_shown():
    """sdpa-flash has no fp32: skipped, so no caveat about its kernel model."""
    from memcalc.config import Config

    s = sweep(Config(), BUDGET, seq_len=(256,), impls=("naive", "sdpa-flash"))
    assert [r.impl for r in s.rows] == ["naive"]
    assert not [line for line in s.footnotes() if line.startswith("caveat")]


def test_a_sweep_with_every_series_refused_is_an_error():
    """Both refuse the options: an empty table with exit status 0 said nothing was wrong."""
    from memcalc.config import Config

    with pytest.raises(ValueError, match="^no implementation has figures for these options: "
                                         "naive bf16: kv_heads: .*; sdpa-flash bf16: "):
        sweep(Config(impl="sdpa-flash", causal=True, shape={"heads": 2, "kv_heads": 1,
                                                             "kv_len": 128}),
              BUDGET, seq_len=(256,), impls=("naive", "sdpa-flash"), dtypes=("bf16",))


def test_a_refusal_of_some_sizes_skips_those_only():
    """FlashAttention refuses head_dim 512 but not 128: the sweep dropped every sdpa-flash
    row; causal linear attention with kv_len 64 refuses only seq_len 128. The other
    configurations stay, and each refusal names its sizes (in the CSV too)."""
    budget = Budget(device="test GPU", memory_bytes=80 << 30, reserve_bytes=0)
    s = sweep(make_config(impl="sdpa-flash", dtype="fp16"), budget, seq_len=(64,),
              head_dim=(128, 512), impls=("sdpa-flash", "naive"))
    assert [(r.impl, r.head_dim) for r in s.rows] == [
        ("sdpa-flash", 128), ("naive", 128), ("naive", 512)]
    assert [(k.impl, k.sizes) for k in s.skipped] == [("sdpa-flash", {"head_dim": 512})]
    assert s.skipped[0].who() == "sdpa-flash fp16 at head_dim 512"
    assert s.to_csv().splitlines()[-1].startswith("sdpa-flash,fp16,,,,,512,,,,,,,,,,skipped,")
    assert [r["status"] for r in s.records()] == ["computed"] * 3 + ["skipped"]  # a DataFrame's
    causal = sweep(make_config(impl="linear-causal", kv_len=64), budget, seq_len=(64, 128))
    assert [r.seq_len for r in causal.rows] == [64]
    assert [k.to_dict()["seq_len"] for k in causal.skipped] == [128]


@pytest.mark.parametrize("width", [60, 100, 200])
def test_a_pivots_corner_stays_on_one_line_and_its_notes_explain_its_figure(toys, width):
    """At 100 columns the corner wrapped into ``seq_len`` / ``\\`` / ``head_dim``, which put
    head_dim over the lengths; the notes explained saved, x first, N^2 share, not shown."""
    s = sweep(base(), BUDGET, seq_len=(256, 512), head_dim=(16, 32), pivot="peak")
    out = text(s, width=width)
    header = next(line for line in out.splitlines() if "head_dim" in line)
    assert header.split() == ["seq_len", "\\", "head_dim", "16", "32"]
    assert "peak: max_memory_allocated over the step; OOM: replaying" in " ".join(out.split())
    assert "x first" not in out


def test_the_order_of_the_lists_does_not_decide_what_is_swept():
    """The base configuration took the first value of each list: ``--head-dim 512,128``
    with sdpa-flash dropped sdpa-flash at 128, ``--head-dim 12,16`` with sdpa-efficient
    refused the sweep; ``--head-dim 128,512`` worked. Both orders now sweep the same."""
    budget = Budget(device="test GPU", memory_bytes=80 << 30, reserve_bytes=0)
    for dims in ((512, 128), (128, 512)):
        s = sweep(make_config(impl="naive", dtype="fp16", head_dim=dims[0]), budget,
                  seq_len=(64, 128), head_dim=dims, impls=("sdpa-flash", "naive"))
        assert sorted((r.impl, r.head_dim, r.seq_len) for r in s.rows if r.impl != "naive") == [
            ("sdpa-flash", 128, 64), ("sdpa-flash", 128, 128)]
        assert [(k.impl, k.sizes) for k in s.skipped] == [("sdpa-flash", {"head_dim": 512})]


def test_a_long_sweep_table_shows_what_a_person_reads_and_says_where_the_rest_is():
    """2,000 lengths: the table shows every 10th (ceil(2,000 / 200) = 10: 1, 11, ..., 1,991,
    200 of them), the last, and both sides of the OOM threshold; CSV keeps every row.
    Rendering 100,000 rows took ten times the sweep."""
    import memcalc
    from memcalc.output.render import text as plain

    s = memcalc.sweep(seq_lens=range(1, 2001), gpu_gb=1)
    fits = dict(zip(s.columns["seq_len"], s.columns["fits"]))
    last_fit = max(n for n, ok in fits.items() if ok)
    assert all(fits[n] for n in range(1, last_fit + 1)) and not fits[last_fit + 1]
    shown = s.shown_lengths()
    evenly = set(range(1, 2001, 10)) | {2000}
    assert set(shown) == evenly | {last_fit, last_fit + 1}
    (table,) = s.tables()
    assert len(table.rows) == len(shown) and table.notes == [
        f"{len(shown):,} of 2,000 lengths shown (evenly spaced, the first and last, each side "
        f"of an OOM threshold): --csv or --json print all 2,000 rows"]
    assert len(s.to_csv().splitlines()) == 2001  # the header and every row
    out = " ".join(plain(s, 100).split())
    assert f" {last_fit:,} " in out and "--csv or --json print all 2,000 rows" in out
    short = memcalc.sweep(seq_lens=range(1, 201))  # 200 rows: all of them, no note
    assert short.shown_lengths() == tuple(range(1, 201)) and short.tables()[0].notes == []


def test_the_legend_explains_the_columns_shown_and_no_other(toys):
    """At 60 columns the legend still explained x first and N^2 share, which were dropped;
    narrow, it says what the table shows; Markdown, with every column, says all."""
    s = sweep(base(), BUDGET, seq_len=(256, 512, 1024))
    narrow = " ".join(text(s, width=36).split())  # FULL's widths: seq_len, peak, reserved, OOM?
    assert "peak: max_memory_allocated" in narrow and "OOM?: replaying" in narrow
    assert "x first:" not in narrow and "N^2 share:" not in narrow and "saved:" not in narrow
    wide = " ".join(text(s, width=120).split())
    assert all(f"{k}:" in wide for k in ("peak", "saved", "reserved", "x first", "N^2 share"))
    assert "x first: peak over the peak at the first length" in s.to_markdown()


def test_merged_sweeps_are_one_sweep_of_their_series_in_order():
    """``merged``: what ``sweep --compile-budget`` prints, one sweep per step: the same
    table as one sweep of all their implementations."""
    from memcalc.analysis.scaling import merged

    base = make_config(dtype="bf16")
    budget, lengths, impls = Budget.of(base.device), (256, 1024), ("naive", "sdpa-flash")
    apart = [sweep(base.replace(impl=impl), budget, lengths, impls=[impl]) for impl in impls]
    whole = sweep(base, budget, lengths, impls=list(impls))
    assert merged(apart).to_dict() == whole.to_dict()
