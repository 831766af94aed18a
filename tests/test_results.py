"""What a breakdown shows (``memcalc.output.results``): caveats, title, headline, its two tables."""

import csv
import io

import pytest
from rich.console import Console

import memcalc.output.results as R
from memcalc.analysis.breakdown import Breakdown
from memcalc.engine.component import Component
from memcalc.analysis.budget import Budget
from memcalc.config import make_config
from memcalc.output.legend import legend
from memcalc.output.render import text
from memcalc.output.results import (breakdown_headline, breakdown_tables, breakdown_title, caveats, component_columns)
from memcalc.engine.program import Role
from cli_helpers import csv_as_json

MiB = 1 << 20
ALLOCATOR = "the allocator model follows PyTorch's source and is not yet checked on a GPU"
H100 = "NVIDIA H100 80GB HBM3 (SXM)"


def component(name, role, op, shape, dtype="float32", nbytes=None, block=None, source=""):
    size = {"float32": 4, "uint8": 1}[dtype]
    nbytes = nbytes if nbytes is not None else size * shape[0] * shape[1] * shape[2] * shape[3]
    return Component(name=name, role=role, op=op, shape=shape, dtype=dtype, bytes=nbytes,
                     allocated=block if block is not None else nbytes, source=source)


# A breakdown made by hand (its figures are sums of these blocks), for naive at B=H=1 N=64 d=16:
# q, k, v, grad_out (1, 1, 64, 16) fp32: 4,096 B each; the 32 MiB workspace (33,554,432 B);
# exp_x and S0, S1, S2 (1, 1, 64, 64) fp32: 16,384 B each; row_sum (1, 1, 64, 1) fp32: 256 B
# requested, a 512 B block.
INPUTS = tuple(component(n, Role.input, "randn", (1, 1, 64, 16))
               for n in ("q", "k", "v", "grad_out"))
WS = component("cuBLAS workspace, main thread", Role.workspace, "cublas", (33_554_432,),
               "uint8", nbytes=33_554_432)
EXP_X = component("exp_x", Role.saved, "exp", (1, 1, 64, 64))
CHUNKS = tuple(component(f"S{i}", Role.saved, "tril", (1, 1, 64, 64)) for i in range(3))
ROW_SUM = component("row_sum", Role.saved, "sum", (1, 1, 64, 1), block=512)
FORWARD = 4 * 4096 + 33_554_432 + 16_384  # inputs, workspace, exp_x = 33,587,200
PEAK = FORWARD + 3 * 16_384 + 512  # + S0..S2, row_sum = 33,636,864 (backward)
RESERVED = 2 * MiB + 32 * MiB  # a small segment and the workspace's: 35,651,584


def made(**options) -> Breakdown:
    config = make_config(**{"impl": "naive", "seq_len": 64, "batch": 1, **options})
    return Breakdown(config=config, forward_live=(*INPUTS, WS, EXP_X),
                     backward_live=(*INPUTS, WS, EXP_X, *CHUNKS, ROW_SUM),
                     saved=(EXP_X, ROW_SUM), reserved_peak_bytes=RESERVED)


def test_caveats_name_each_untraced_model_once(monkeypatch):
    # the allocator model agreed with an H200: traced implementations carry no caveat
    assert caveats(["naive", "flash2"]) == []
    # in the order first given; a name no longer registered counts as traced
    assert caveats(["sdpa-flash", "naive", "sdpa-efficient", "sdpa-flash", "gone"]) == [
        "caveat: sdpa-flash, sdpa-efficient modelled from PyTorch's CUDA kernel sources, not "
        "traced."]
    monkeypatch.setattr(R, "ALLOCATOR_CHECKED_ON_GPU", False)  # as before the first GPU
    assert caveats(["naive"]) == [f"caveat: {ALLOCATOR}."]
    assert caveats(["sdpa-efficient"]) == [
        "caveat: sdpa-efficient modelled from PyTorch's CUDA kernel sources, not traced; "
        f"{ALLOCATOR}."]


def test_breakdown_title_shows_flags_and_key_value_sizes_only_when_set():
    assert breakdown_title(made()) == f"naive: B=1 H=1 N=64 d=16 fp32 on {H100}; peak in backward"
    assert breakdown_title(made(causal=True, forward_only=True, dtype="bf16")) == (
        f"naive: B=1 H=1 N=64 d=16 bf16 causal forward-only on {H100}; peak in backward")
    gqa = made(impl="sdpa-math", heads=4, kv_heads=2, kv_len=128, gpu="a100-80gb")
    assert breakdown_title(gqa) == (
        "sdpa-math: B=1 H=4 Hk=2 N=64 M=128 d=16 fp32 on NVIDIA A100-SXM4-80GB; peak in backward")
    forward = made().model_copy(update={"backward_live": INPUTS})  # 16,384 < 33,587,200
    assert breakdown_title(forward).endswith("; peak in forward")


def test_headline_spells_out_the_peak_its_phase_and_the_verdict():
    # 33,636,864 B = 32 MiB + 82,432 B = 32.078... MiB; saved 16,384 + 512 = 16,896 B =
    # 16.50 KiB; reserved 34 MiB; the H100 budget: (81,004 - 512) MiB = 84,401,979,392 B =
    # 78.605... GiB, above the reserved peak: fits
    assert breakdown_headline(made()) == (
        "naive B=1 H=1 N=64 d=16 fp32: peak 33,636,864 B (32.08 MiB, backward), saved "
        f"16.50 KiB, reserved 34.00 MiB; fits in 78.61 GiB (the budget of {H100})")
    # 3 MiB (4 - 1): below the reserved peak, so the capped replay decides: naive's 32 MiB
    # workspace cannot be reserved
    small = made().with_budget(Budget(device="test GPU", memory_bytes=4 * MiB, reserve_bytes=MiB))
    assert breakdown_headline(small).endswith(
        "reserved 34.00 MiB; does not fit in 3.00 MiB (the budget of test GPU)")


def test_component_columns_cells_share_of_the_given_peak_and_drop_ranks():
    columns = component_columns(65_536)
    assert [(c.header, c.drop) for c in columns] == [
        ("component", 0), ("made by", 3), ("role", 4), ("dtype", 8),
        ("formula (shape x element)", 6), ("bytes", 7), ("allocated", 5), ("size", 0),
        ("share", 2)]
    assert [c.cell(ROW_SUM) for c in columns] == [
        "row_sum", "sum: r = e.sum(-1), kept by DivBackward0", "saved", "float32",
        "1 x 1 x 64 x 1 x 4 B", 256, 512,
        "512 B",  # the block, below 1 KiB: exact
        "0.8%"]  # 512 / 65,536 = 0.78125%
    assert [c.cell(WS) for c in columns][4:] == [
        "33,554,432 B", 33_554_432, 33_554_432, "32.00 MiB", "51,200.0%"]  # 2^25 / 2^16 = 512 x
    with_source = component_columns(65_536, with_source=True)
    source = with_source[-1]
    assert (source.header, source.drop, source.wrap) == ("source", 9, True)
    assert [c.header for c in with_source[:-1]] == [c.header for c in columns]


def test_breakdown_tables_show_a_loops_tensors_by_kind_then_the_figures():
    components, figures = breakdown_tables(made())
    assert components.title == (f"naive: B=1 H=1 N=64 d=16 fp32 on {H100}; peak in backward\n"
                                "alive at the peak")
    # the backward live set, largest block first; S0, S1, S2 as one row where S0 was
    assert [c[0] for c in components.cells()] == [
        "cuBLAS workspace, main thread", "exp_x", "S0..S2 (3)", "q", "k", "v", "grad_out",
        "row_sum"]
    # the legend of the short names shown (exp_x is one); no legend without them
    assert components.notes == legend([EXP_X]) != []
    plain = made().model_copy(update={"forward_live": (*INPUTS, WS), "backward_live": INPUTS})
    assert breakdown_tables(plain)[0].notes == []
    assert "source" not in [c.header for c in components.columns]  # no component has one
    assert figures.title is None
    assert figures.cells() == [
        ["saved for backward", "16,896", "0.02", "16.50 KiB"],  # 16,896 / 2^20 = 0.016
        ["forward peak", "33,587,200", "32.03", "32.03 MiB"],  # 32 MiB + 32,768 B
        ["backward peak", "33,636,864", "32.08", "32.08 MiB"],  # 32 MiB + 82,432 B
        ["peak (max_memory_allocated)", "33,636,864", "32.08", "32.08 MiB"],
        ["reserved peak (max_memory_reserved)", "35,651,584", "34.00", "34.00 MiB"],
        ["cuBLAS workspaces", "33,554,432", "32.00", "32.00 MiB"]]


def test_csv_keeps_one_row_per_tensor_and_a_source_column_when_one_has_a_source():
    traced = made().model_copy(update={"backward_live": (
        *INPUTS, WS, EXP_X, *CHUNKS, ROW_SUM.model_copy(update={"source": "model.py:12"}))})
    rows = list(csv.reader(io.StringIO(traced.to_csv())))
    assert rows[0][-2:] == ["share", "source"]
    assert [r[0] for r in rows[1:]] == ["cuBLAS workspace, main thread", "exp_x", "S0", "S1",
                                        "S2", "q", "k", "v", "grad_out", "row_sum"]
    assert rows[-1][-1] == "model.py:12" and rows[1][-1] == ""


def test_csv_and_json_name_the_request_bytes_and_the_block_allocated():
    """The table's words in both formats: ``bytes`` is what a tensor asks for, ``allocated``
    the allocator's block (row_sum: 64 x 4 B = 256 B in a 512 B block); the CSV's rows are
    the JSON's components, every figure a number (``share``: a fraction of the peak)."""
    b = made()
    rows = csv_as_json(b.to_csv())
    assert list(rows[0]) == ["name", "made_by", "role", "op", "dtype", "formula", "bytes",
                             "allocated", "share"]
    assert rows == [{k: c[k] for k in rows[0]} for c in b.to_dict()["components"]]
    assert rows[0]["share"] == 0.997549  # 33,554,432 / 33,636,864 = 0.9975494...
    assert rows[-1] == {"name": "row_sum", "made_by": "sum: r = e.sum(-1), kept by DivBackward0",
                        "role": "saved", "op": "sum", "dtype": "float32",
                        "formula": "1 x 1 x 64 x 1 x 4 B", "bytes": 256, "allocated": 512,
                        "share": 0.000015}  # 512 / 33,636,864 = 0.0000152...
    assert sum(r["allocated"] for r in rows) == PEAK
    saved = b.to_dict()["saved"]
    assert [(c["name"], c["bytes"], c["allocated"]) for c in saved] == [
        ("exp_x", 16_384, 16_384), ("row_sum", 256, 512)]  # 64 x 64 x 4 B; 64 x 4 B


# Widths of the components table's columns (its longest cell, or header word; "made by"
# wraps at 24): component 29 ("cuBLAS workspace, main thread"), made by 24, role 9
# ("workspace"), dtype 7, formula 27 ("3 x (1 x 1 x 64 x 64 x 4 B)"), bytes 10 and
# allocated 10 ("33,554,432"), size 9 ("32.00 MiB"), share 5: 130, plus 2 between each of
# the 9 columns = 146. Narrower, by rank: dtype (137 left), bytes (125), formula (96),
# allocated (84), role (73), made by (47), share (40): component and size stay.
# q's row: 4,096 B = 4.00 KiB, 4,096 / 33,636,864 = 0.012% of the peak.
@pytest.mark.parametrize("width, q_row, chunk_row", [
    (146, "q input (randn) input float32 1 x 1 x 64 x 16 x 4 B 4,096 4,096 4.00 KiB 0.0%",
     "S0..S2 (3) tril saved float32 3 x (1 x 1 x 64 x 64 x 4 B) 49,152 49,152 48.00 KiB 0.1%"),
    (145, "q input (randn) input 1 x 1 x 64 x 16 x 4 B 4,096 4,096 4.00 KiB 0.0%", None),
    (136, "q input (randn) input 1 x 1 x 64 x 16 x 4 B 4,096 4.00 KiB 0.0%", None),
    (124, "q input (randn) input 4,096 4.00 KiB 0.0%", None),
    (95, "q input (randn) input 4.00 KiB 0.0%", None),
    (80, "q input (randn) 4.00 KiB 0.0%", None),  # 80 columns: what made it stays
    # 3 x 16,384 = 49,152 B = 48.00 KiB; 49,152 / 33,636,864 = 0.146%
    (60, "q 4.00 KiB 0.0%", "S0..S2 (3) 48.00 KiB 0.1%"),
    (40, "q 4.00 KiB", "S0..S2 (3) 48.00 KiB"),
])
def test_components_table_at_each_width_drops_columns_in_rank_order(width, q_row, chunk_row):
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(made())
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= width
    words = [" ".join(line.split()) for line in lines]
    assert [w for w in words if w.split()[:1] == ["q"]] == [q_row]
    if chunk_row:
        assert chunk_row in words


def test_below_the_essential_width_each_row_is_a_block_and_piped_text_is_plain():
    """At 39 columns even component and size (29 + 2 + 9 = 40) do not fit side by side."""
    console = Console(width=39, record=True, file=io.StringIO())
    console.print(made())
    words = [" ".join(line.split()) for line in console.export_text().splitlines()]
    at = words.index("q")  # the row's first cell on a line of its own, then header value pairs
    # packed into lines of 39: "  made by input (randn)" (23) + " · role input" (13) = 36;
    # the formula pair (2 + 47 characters) is wider than a line: it wraps onto two
    block = words[at:at + 7]
    assert block[:3] == ["q", "made by input (randn) · role input", "dtype float32"]
    assert " ".join(block[3:5]) == "formula (shape x element) 1 x 1 x 64 x 16 x 4 B"
    assert block[5:] == ["bytes 4,096 · allocated 4,096", "size 4.00 KiB · share 0.0%"]  # 31; 28
    piped = text(made(), width=200)  # print() and a pipe: plain, no terminal codes
    assert "\x1b" not in piped
    lines = [" ".join(line.split()) for line in piped.splitlines()]
    assert lines[:2] == [f"naive: B=1 H=1 N=64 d=16 fp32 on {H100}; peak in backward",
                         "alive at the peak"]
    # every column fits in 200 (146)
    assert "q input (randn) input float32 1 x 1 x 64 x 16 x 4 B 4,096 4,096 4.00 KiB 0.0%" in lines
    # naive is traced and the allocator model agreed with a GPU: no caveat line
    assert lines[-1] == "cuBLAS workspaces 33,554,432 32.00 32.00 MiB"


def test_a_step_that_fits_only_by_release_and_retry_shows_both_reserved_peaks():
    """sdpa-efficient at 13,745,024 rows in 80 GiB less 512 MiB: unbounded it would reserve
    92,400,517,120 B (86.05 GiB), which the table called max_memory_reserved beside "fits";
    on the device release-and-retry keeps it at the budget, 85,362,475,008 B."""
    import memcalc
    from memcalc.output.results import figure_rows

    b = memcalc.breakdown(impl="sdpa-efficient", seq_len=13_745_024, gpu_gb=80)
    rows = {row[0]: row for row in figure_rows(b)}
    # B=8 H=1 d=16 fp32, N = 13,745,024 = 64 x 214,766. Unbounded, the step reserves 9
    # (B, N, 16) segments (q, k, v, grad_out, out, dq, dk, dv and the backward's do*o),
    # 8 x N x 16 x 4 B = 7,037,452,288 B rounded up to 2 MiB = 3,356 x 2 MiB; 2 (B, N)
    # ones (lse, rowsum), 8 x N x 4 B = 439,840,768 -> 210 x 2 MiB; and the workspace's,
    # 8 x 4 B x 214,766 dQ tiles x (4 + 64 x 64) = 28,177,299,200 -> 13,436 x 2 MiB.
    # Capped, do*o's segment (free by then) is released before the workspace's: 8 of 9.
    row, small, work = 3_356 * 2 * MiB, 210 * 2 * MiB, 13_436 * 2 * MiB
    assert 8 * 4 * (13_745_024 // 64) * (4 + 64 * 64) == 28_177_299_200
    assert 9 * row + 2 * small + work == 92_400_517_120
    assert 8 * row + 2 * small + work == 85_362_475_008  # exactly the budget
    assert rows["reserved_peak_bytes"][1:] == (92_400_517_120, "reserved peak, unbounded device")
    assert rows["capped_reserved_peak_bytes"][1] == 85_362_475_008  # 80 x 2^30 - 512 x 2^20
    assert "max_memory_reserved) in the budget" in b.to_markdown()
    plain = memcalc.breakdown(impl="sdpa-efficient", seq_len=13_745_024)  # no budget given
    assert [r[0] for r in figure_rows(plain)].count("capped_reserved_peak_bytes") == 0


@pytest.mark.parametrize("release, busiest", [
    ("2.13", "rank 1 of 4 shown, the busiest: the highest max_memory_reserved"),
    # the first step's philox tensors kept (memcalc.impls.ring.FIRST_STEP_REST): ranks 2
    # and 3 reach rank 1's allocated peak too
    ("2.15", "rank 1 of 4 shown, the busiest (as busy: ranks 2, 3): the highest "
             "max_memory_reserved"),
])
def test_the_rank_note_names_the_busiest_rank_or_says_every_rank_is_the_same(
        monkeypatch, release, busiest):
    """Torch's ring: rank 1 of 4 is the busiest (it reserves the most at this size), under
    each release's ring; DeepSpeed-Ulysses: every rank's step the same, said once with its
    figures (4 ranks of 2,048 rows)."""
    from memcalc.analysis.predict import predict
    from memcalc.impls import sdpa
    from memcalc.impls.sdpa_select import Release

    monkeypatch.setattr(sdpa, "installed_release", lambda: Release.of(release))
    sizes = dict(impl="sdpa-flash", batch=1, heads=8, head_dim=64, dtype="bf16", causal=True,
                 seq_len=8192, cp=4)
    ring = R.rank_note(predict(make_config(**sizes)))[0]
    assert ring.startswith(busiest)
    b = predict(make_config(**sizes, cp_method="ulysses"))
    assert R.rank_note(b) == [
        f"rank 0 of 4 shown: every rank's step is the same (each rank holds 2,048 of the "
        f"8,192 rows; reserved {b.reserved_peak_bytes:,} B, allocated {b.peak_bytes:,} B)"]
