"""memcalc.validation.context_parallel: the ring as an H100 ran it, given back with no GPU.

``validation/cp_one_gpu.py`` on an H100 80GB HBM3 (torch 2.11.0+cu130): 232 rank steps
(``grid()``'s 204, and a Llama-style layer, 32 heads of 128, bf16, 16,384 rows a rank, at
P = 2, 4, 8, both K/V exchanges: 2 x (2 + 4 + 8) = 28), each rank in turn on a fake process
group through ``context_parallel``'s dispatcher, the kernels on the GPU. Every live figure
equals the tracer's with a fake group's collectives; the model equals the tracer's with
NCCL's; NCCL's stash, the only difference between the two, is measured by
``validation/nccl_stash.py`` (tests/test_tracing_collectives.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from memcalc.validation.context_parallel import grid, recheck  # noqa: E402

REPORT = Path(__file__).resolve().parents[1] / "validation" / "results" / \
    "cp-one-gpu-nvidia-h100-80gb-hbm3-2.11.0-cu130.json"


@pytest.fixture(scope="module")
def report() -> dict:
    return json.loads(REPORT.read_text())


def test_the_run_holds_what_the_docstring_says(report):
    rows = report["rows"]
    assert len(rows) == sum(c.cp for c in grid()) + 2 * (2 + 4 + 8) == 232
    assert all(r["ok"] and "error" not in r for r in rows)
    # NCCL's stash changes a figure of most rank steps: the fake group is not NCCL
    assert sum(r["trace"] != r["trace_fake"] for r in rows) == 137


def test_memcalc_gives_back_the_recorded_rank_steps(report):
    """Every 8th rank step (29 of 232; ``python -m memcalc.validation.context_parallel``
    rechecks all of them): the live figures are the fake-group trace's, the model's the
    NCCL trace's."""
    assert recheck(report, every=8) == []


ULYSSES = REPORT.with_name("cp-ulysses-one-gpu-nvidia-h100-80gb-hbm3-2.11.0-cu130.json")


def test_deepspeed_ulysses_as_the_h100_ran_it():
    """``validation/cp_one_gpu.py OUT 300 ulysses`` on the same H100: DeepSpeed 0.19.8's
    ``DistributedAttention`` around SDPA's flash, cuDNN and memory-efficient kernels, every
    rank in turn: ``ulysses_grid(SDPA_KERNELS)``'s 48 + 48 + 56 rank steps (the efficient
    kernel takes no grouped heads, and float32) and the Llama-style layer over flash at
    P = 2, 4, 8 (2 + 4 + 8 = 14). All equal to the trace, which equals the model; a
    synchronous all-to-all keeps no input past its call, so NCCL's and the fake group's
    traces are the same. Every 4th given back here."""
    pytest.importorskip("deepspeed")
    from memcalc.validation.context_parallel import SDPA_KERNELS, ulysses_grid

    report = json.loads(ULYSSES.read_text())
    rows = report["rows"]
    assert len(rows) == sum(c.cp for c in ulysses_grid(SDPA_KERNELS)) + 2 + 4 + 8 == 166
    assert all(r["ok"] and r["trace"] == r["trace_fake"] == r["model"] for r in rows)
    assert recheck(report, every=4) == []


def test_the_math_path_under_ulysses_as_the_h100_ran_it():
    """``validation/cp_one_gpu.py OUT 290 math`` on the same H100: DeepSpeed's
    ``DistributedAttention`` around the math path and the naive family on the (B, N, H / P,
    D) tensors' transposed views, whose matmuls copy by their layout: the Llama-style heads
    (32 of 128, bf16, 4,096 rows) for sdpa-math and naive-softmax at B = 1 and 2, P = 2, 4, 8
    (2 x 2 x 14 = 56), and ``ulysses_grid(WRITTEN_OUT)`` (68 + 3 x 56). All 292 live figures
    equal to the trace, which equals the model. Every 8th given back here."""
    pytest.importorskip("deepspeed")
    from memcalc.validation.context_parallel import WRITTEN_OUT, ulysses_grid

    report = json.loads(REPORT.with_name(
        "cp-ulysses-math-one-gpu-nvidia-h100-80gb-hbm3-2.11.0-cu130.json").read_text())
    rows = report["rows"]
    assert len(rows) == 2 * 2 * (2 + 4 + 8) + sum(c.cp for c in ulysses_grid(WRITTEN_OUT)) == 292
    assert all(r["ok"] and r["trace"] == r["trace_fake"] == r["model"] for r in rows)
    assert recheck(report, every=8) == []


def test_torchs_ring_over_one_nccl_rank_is_the_ring_model_at_one():
    """``torchrun --nproc-per-node 1 validation/cp_live.py 16384 allgather`` on the same
    H100: torch's ``context_parallel`` through a real NCCL group of one rank (B = 1, 32
    heads of 128, bf16, 16,384 rows). One rank still runs the ring: one step, the float32
    merge, the float32 accumulators, the dK/dV all-to-all; ``memcalc.impls.ring``'s program
    at P = 1 gives back all five figures (its report's ``predicted`` column, made before,
    holds ``--cp 1``'s one-GPU step, which is not the ring)."""
    from memcalc.analysis.predict import rank_breakdown
    from memcalc.config import make_config
    from memcalc.impls import ring
    from memcalc.validation.compare import figures_of
    from memcalc.validation.cuda import live_config

    live = json.loads(REPORT.with_name("cp-live-1-rank-nvidia-h100-80gb-hbm3-2.11.0-cu130.json")
                      .read_text())
    environment = json.loads(REPORT.read_text())["environment"]  # the same H100 and torch
    assert (live["device"], live["torch"]) == (environment["device"], environment["torch"])
    c = live_config(make_config(impl="sdpa-flash", batch=1, heads=32, head_dim=128,
                                dtype="bf16", causal=True, seq_len=16384), environment)
    ours = figures_of(rank_breakdown(c, 0, program=ring.program(c.dims)))
    assert ours == live["measured"][0]
    # 3,089,105,920: measured on the H100, not derived here (the recorded JSON's peak_bytes,
    # the backward's max_memory_allocated). Alive at the ring model's backward peak, summing
    # to it: dK/dV's cat and the block from rank 0, 2 x 32 x 16,384 x 128 x 4 B = 512 MiB
    # each; grad_query/key/value in float32, 1 x 32 x 16,384 x 128 x 4 B = 256 MiB each;
    # 9 bf16 tensors of 128 MiB (q, k, v, grad_out, out, step 0's dq, dk, dv, q.grad); lse
    # 32 x 16,384 x 4 B = 2 MiB; rng_state and philox_offset (16 B, 8 B), a 512 B block each:
    # 2 x 512 MiB + 3 x 256 MiB + 9 x 128 MiB + 2 MiB + 2 x 512 B.
    MiB = 1 << 20
    assert 2 * 512 * MiB + 3 * 256 * MiB + 9 * 128 * MiB + 2 * MiB + 2 * 512 == 3_089_105_920
    assert ours["peak_bytes"] == 3_089_105_920 > figures_of(rank_breakdown(c, 0))["peak_bytes"]


@pytest.mark.parametrize("run, example, inputs, rows", [
    # 2 x (2 + 4 + 8): B = 2, 8 heads of 64, bf16, 1,024 and 4,096 rows, P = 2, 4, 8
    ("eager", "ulysses_eager.py", ("q=B,N,H,D", "k=B,N,H,D", "v=B,N,H,D"), 28),
    # B = 1, 2 x (8 key/value heads: 2 + 4 + 8; 4: 2 + 4), and 32 heads at P = 4: 2 x 20 + 4
    ("hf", "ulysses_hf.py", ("q=B,H,N,D", "k=B,K,N,D", "v=B,K,N,D"), 44),
])
def test_examples_under_ulysses_as_the_h100_ran_them(run, example, inputs, rows):
    """``validation/cp_one_gpu.py OUT SECONDS eager|hf``: DeepSpeed's ``DistributedAttention``
    around ``examples/attention/ulysses_eager.py``'s attention written out, and DeepSpeed's
    Ulysses for Hugging Face models around transformers' SDPA attention
    (``ulysses_hf.py``), each traced (no model): every live figure equal to the trace
    today. The ``hf`` run differed when it was made, by the cuDNN kernel's grad copy
    (a (B, N, h, D)-strided grad, which cuDNN 9.5.1 on reads as it is:
    ``memcalc.impls.sdpa_cudnn.grad_copied``); fixed since. Every 4th traced again here."""
    pytest.importorskip("deepspeed")
    if run == "hf":
        pytest.importorskip("transformers")
    from memcalc.engine.inputs import parse_input
    from memcalc.tracing import TraceOptions, load_function, traced
    from memcalc.tracing.target import Calling
    from memcalc.validation.compare import figures_of
    from memcalc.validation.context_parallel import recorded_config

    report = json.loads(REPORT.with_name(
        f"cp-ulysses-{run}-one-gpu-nvidia-h100-80gb-hbm3-2.11.0-cu130.json").read_text())
    assert len(report["rows"]) == rows
    fn = load_function(f"examples/attention/{example}:attn")
    calling = Calling(inputs=tuple(map(parse_input, inputs)))
    for row in report["rows"][::4]:
        config = recorded_config(row, report["environment"])
        step = traced(fn, config, TraceOptions(group="fake"), calling=calling,
                      rank=row["rank"]).breakdown
        assert figures_of(step) == row["live"], row


def test_without_deepspeed_validate_says_the_ulysses_checks_did_not_run(monkeypatch, capsys):
    """``memcalc validate --cases cp`` where DeepSpeed is not installed: the ring's checks
    (here the grid's first configuration, 2 ranks), and one line on stderr saying the
    Ulysses ones were skipped; stdout stays the report."""
    import memcalc.validation.context_parallel as cp
    from memcalc.cli import main

    first = cp.grid()[:1]
    monkeypatch.setattr(cp, "grid", lambda: first)
    monkeypatch.setattr(cp, "ulysses_checked", lambda: False)
    assert main(["validate", "--cases", "cp"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[-1].startswith("emulated: 2 configurations, 10 figures, 0 mismatches")
    assert err == ("note: DeepSpeed is not installed: its Ulysses configurations were not "
                   "checked (pip install 'memcalc[deepspeed]')\n")


@pytest.mark.filterwarnings("ignore:.*found in sys.modules")  # run as python -m runs it
def test_a_ulysses_report_without_deepspeed_is_one_line_naming_the_extra(monkeypatch, capsys):
    """``python -m memcalc.validation.context_parallel cp-ulysses-...json`` without
    DeepSpeed ended in a traceback and ``TraceError ... No module named 'deepspeed'``: one
    line naming the extra, exit status 2, before any rank is traced."""
    import runpy
    import sys

    import memcalc.tracing.context_parallel as tracing_cp

    report = sorted(REPORT.parent.glob("cp-ulysses-one-gpu-*.json"))[0]
    monkeypatch.setattr(tracing_cp, "deepspeed_installed", lambda: False)
    monkeypatch.setattr(sys, "argv", ["context_parallel.py", str(report)])
    with pytest.raises(SystemExit) as done:
        runpy.run_module("memcalc.validation.context_parallel", run_name="__main__",
                         alter_sys=True)
    assert done.value.code == 2
    assert capsys.readouterr() == ("", (
        f"memcalc.validation.context_parallel: error: {report}: DeepSpeed-Ulysses' steps are "
        f"checked against DeepSpeed's own code, which is not installed: pip install "
        f"'memcalc[deepspeed]'\n"))
