"""What ``memcalc trace`` reports: the traced breakdown, the trace's notes, its budget check."""

import json

import pytest

torch = pytest.importorskip("torch")
from memcalc.analysis.budget import Budget  # noqa: E402
from memcalc.cli import main
from memcalc.options import PIPED_WIDTH  # noqa: E402
from memcalc.config import make_config  # noqa: E402
from memcalc.tracing import register_function, trace, traced  # noqa: E402
from memcalc.tracing.report import Traced  # noqa: E402

H100 = "NVIDIA H100 80GB HBM3 (SXM)"  # the default GPU's label
FIRST = f"traced as on {H100}: CUDA code paths emulated (memcalc's docs, docs/guides/trace.md)"


def mul(q, k, v):
    return q * v


def mul_config():
    """B=1 H=1 N=8 d=16 fp32: every tensor of the step is a 512 B block (1 x 1 x 8 x 16 x
    4 B), all in one 2 MiB small-pool segment: reserved peak 2,097,152 B."""
    return make_config(impl=register_function(mul, "mul"), seq_len=8, batch=1, heads=1,
                       head_dim=16)


def budget_of(memory_bytes: int) -> Budget:
    return Budget(device="given", memory_bytes=memory_bytes, reserve_bytes=0)


def test_summary_names_the_gpu_then_each_note():
    b = trace(mul, mul_config())
    result = Traced(breakdown=b, gpu=H100, notes=("first note", "second note"))
    assert result.summary() == f"{FIRST}\n- first note\n- second note"


def test_summary_says_when_the_meta_devices_own_paths_were_traced():
    """``--meta-paths`` (``TraceOptions(cuda=False)``): no CUDA paths were followed."""
    b = trace(mul, mul_config())
    result = Traced(breakdown=b, gpu=H100, cuda_paths=False)
    assert result.summary() == ("traced on the meta device's own code paths (--meta-paths), "
                                f"not the CUDA paths of {H100}")


@pytest.mark.parametrize("memory_bytes, budget, verdict", [
    # the 2 MiB segment does not fit in 1 MiB: it is requested with nothing reserved yet
    (1_048_576,
     "budget 1,048,576 B (1.00 MiB) = given 1,048,576 B - reserve 0 B (0 B, CUDA context)",
     "OOM: a 2,097,152 B segment on top of 0 B reserved exceeds the budget of 1,048,576 B "
     "(unbounded, the step reserves 2,097,152 B)"),
    # 4 MiB - 2 MiB reserved = 2 MiB to spare
    (4_194_304,
     "budget 4,194,304 B (4.00 MiB) = given 4,194,304 B - reserve 0 B (0 B, CUDA context)",
     "fits: reserved peak 2,097,152 B <= budget 4,194,304 B (2.00 MiB to spare)"),
])
def test_summary_ends_with_the_budget_and_the_fit_when_checked(memory_bytes, budget, verdict):
    result = traced(mul, mul_config(), budget=budget_of(memory_bytes))
    # mul calls no SDPA and nothing unmodelled: no notes
    assert result.summary() == f"{FIRST}\n{budget}\n{verdict}"


def test_footnotes_are_the_summary_then_the_breakdowns_caveats():
    result = traced(mul, mul_config())
    assert result.footnotes() == [FIRST]  # traced, and the allocator agreed with a GPU


def fused(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def test_a_fused_kernel_the_trace_ran_is_a_caveat():
    """A fused SDPA backend allocates what memcalc's model of its CUDA source declares: the
    trace says so, as a breakdown of sdpa-efficient does (fp32 on an H100: efficient)."""
    config = make_config(impl=register_function(fused, "fused"), seq_len=64, batch=1,
                         heads=1, head_dim=16)
    result = traced(fused, config)
    assert result.kernels == ("efficient",)
    assert result.footnotes()[-1] == (
        "caveat: scaled_dot_product_attention's efficient backend modelled from PyTorch's "
        "CUDA kernel sources, not traced.")
    assert json.loads(result.to_json())["kernels"] == ["efficient"]


def chain(q, k, v):
    out = q
    for _ in range(4):
        out = out * v
    return out


def test_tables_csv_records_and_headline_are_the_breakdowns():
    """The trace adds lines after the tables, nothing in them; its CSV is the breakdown's
    one row per tensor, not its first table (where a loop's products are one row)."""
    b = trace(chain, make_config(impl=register_function(chain, "chain"), seq_len=8, batch=1,
                                 heads=1, head_dim=16))
    result = Traced(breakdown=b, gpu=H100, notes=("a note",))
    assert result.to_csv() == b.to_csv() and result.records() == b.records()
    assert str(result) == b.headline() and repr(result) == f"<Traced: {b.headline()}>"
    summary = f"{FIRST}\n- a note"
    assert result.to_markdown() == f"{b.to_markdown()}\n{summary}\n"  # no caveat to precede


def test_json_without_a_budget_adds_only_the_gpu_its_paths_and_the_notes():
    b = trace(mul, mul_config())
    result = Traced(breakdown=b, gpu=H100, notes=("first note", "second note"))
    data = json.loads(result.to_json())
    assert data == {**b.to_dict(), "gpu": H100, "cuda_paths": True,
                    "notes": ["first note", "second note"], "kernels": [], "inputs": [],
                    "autocast": None, "param_dtype": None, "optimizer": None, "grad_accum": 1,
                    "clip_grad_norm": None}
    assert "budget_bytes" not in data and "fits" not in data


def test_json_with_a_budget_adds_its_figures_and_the_fit():
    budget = budget_of(1_048_576)
    result = traced(mul, mul_config(), budget=budget)
    data = json.loads(result.to_json())
    added = {k: v for k, v in data.items() if k not in result.breakdown.to_dict()}
    assert added == {
        "gpu": H100, "cuda_paths": True, "notes": [], "kernels": [], "inputs": [],
        "autocast": None, "param_dtype": None, "optimizer": None, "grad_accum": 1,
        "clip_grad_norm": None, "budget_bytes": 1_048_576,  # 1 MiB - reserve 0
        "fits": False,  # the first 2 MiB segment is over it
        "budget": {"device": "given", "memory_bytes": 1_048_576, "reserve_bytes": 0,
                   "memory_source": "", "memory_kind": "", "reserve_source": "",
                   "budget_bytes": 1_048_576},
        "fit": {"budget_bytes": 1_048_576,
                "peak_bytes": 3_584,  # 7 blocks of 512 B: q, k, v, grad_out, out, 2 grads
                "reserved_peak_bytes": 2_097_152,  # one 2 MiB small-pool segment
                "oom_request_bytes": 2_097_152, "oom_reserved_bytes": 0, "retried": False,
                "oom_rank": None,  # one GPU: no rank to name
                "capped_reserved_peak_bytes": None,
                "reserved_bytes": 2_097_152,  # 0 reserved + the 2 MiB request
                "fits": False,
                "headroom_bytes": -1_048_576}}  # 1 MiB - 2 MiB


@pytest.mark.parametrize("width", [60, 80, 100, 140, None])  # None: piped, PIPED_WIDTH
def test_trace_command_prints_notes_budget_and_fit_whole_at_every_width(
        capsys, monkeypatch, tmp_path, width):
    """After the tables: the summary, one bullet per note, the budget and the fit, wrapped
    at spaces to the width, never cut; then the caveat (the fused kernel's, the
    allocator's)."""
    (tmp_path / "user_sdpa.py").write_text(
        "import torch.nn.functional as F\n\n"
        "def attn(q, k, v):\n"
        "    return F.scaled_dot_product_attention(q, k, v, is_causal=True)\n")
    argv = ["trace", f"{tmp_path}/user_sdpa.py:attn", "--seq", "8", "--batch", "1",
            "--heads", "1", "--head-dim", "16", "--dtype", "fp16", "--gpu-gb", "1",
            "--reserve", "0"]
    assert main(argv + ["--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert len(notes) == 2  # the SDPA backend chosen (cuDNN on an H100), its workspace
    if width is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", str(width))
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= (width or PIPED_WIDTH)
    assert "…" not in out and "..." not in out
    flat = " ".join(out.split())
    lines = [FIRST, *(f"- {n}" for n in notes),
             # --gpu-gb 1: 1 x 2^30 B
             "budget 1,073,741,824 B (1.00 GiB) = 1 GiB (--gpu-gb; cuBLAS workspaces of "
             "h100-80gb, compute capability 9.0) 1,073,741,824 B - reserve 0 B (0 B, CUDA "
             "context)",
             # every block of B=1 H=1 N=8 d=16 is under 1 MiB: one 2 MiB small-pool segment;
             # 2^30 - 2,097,152 = 1,071,644,672 B = 1022 MiB = 1.00 GiB (rounded) to spare
             "fits: reserved peak 2,097,152 B <= budget 1,073,741,824 B (1.00 GiB to spare)",
             "caveat: scaled_dot_product_attention's cudnn backend modelled from PyTorch's "
             "CUDA kernel sources, not traced."]
    after_tables = flat.index("reserved peak (max_memory_reserved) 2,097,152")
    assert flat[after_tables:].endswith(" ".join(" ".join(line.split()) for line in lines))
