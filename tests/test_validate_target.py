"""``memcalc validate --trace FILE:NAME`` (``memcalc.validation.validate_target``): one
target's step, as ``oom --trace`` solves it, traced directly and run live."""

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import memcalc  # noqa: E402
from cli_helpers import assert_refused, run  # noqa: E402
from fake_gpu import FakeGpu  # noqa: E402
from memcalc.engine.inputs import inputs_of  # noqa: E402
from memcalc.tracing import Calling, load_function, register_function  # noqa: E402
from memcalc.tracing.optimizers import loop_of  # noqa: E402
from memcalc.validation import validate_target  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SLOW = f"{ROOT}/examples/training/gpt.py:SlowTinyGPT"
TARGET = (SLOW, "--input", "idx=B,N:int64", "--input", "targets=B,N:int64", "--seq", "300",
          "--batch", "2", "--optimizer", "adamw")


@pytest.mark.parametrize("width", [80, 120, None])  # None: piped
def test_the_program_and_the_trace_side_by_side(capsys, monkeypatch, width):
    if width:
        monkeypatch.setenv("COLUMNS", str(width))
    code, out, err = run(capsys, "validate", "--trace", *TARGET)
    assert code == 0, err
    assert "emulated: 1 configurations, 6 figures, 0 mismatches" in out and "…" not in out
    for row in ("saved for backward", "optimizer peak (step, zero_grad)",
                "reserved peak (max_memory_reserved)"):
        assert row in out
    assert "model: oom --trace's: its program fitted over lengths" in out


def test_its_json_is_the_report_of_one_check(capsys):
    code, out, _ = run(capsys, "validate", "--trace", *TARGET, "--json")
    (check,) = json.loads(out)["checks"]
    assert check["case"] == "trace" and check["ok"]
    assert check["predicted"] == check["measured"] and "optimizer_peak_bytes" in check["measured"]


@pytest.mark.parametrize("argv, option", [
    (("--backend", "cuda", "--trace", *TARGET), "--backend cuda: CUDA is not available"),
    (("--seq", "100"), "--seq: describes a traced target's step; give --trace"),
    (("--optimizer", "adamw"), "--optimizer: describes a traced target's step"),
    (("--trace", *TARGET, "--impl", "naive"), "--impl: checks the shipped cases"),
    (("--trace", f"{ROOT}/examples/training/gpt.py:Nope"), "has no function 'Nope'"),
])
def test_what_it_cannot_do_is_one_line(capsys, argv, option):
    assert_refused(*run(capsys, "validate", *argv), option)


def _target(spec="adamw:fused", accumulate=2):
    fn = load_function(SLOW)
    calling = Calling(inputs_of(["idx=B,N:int64", "targets=B,N:int64"]),
                      loop=loop_of(spec, accumulate))
    config = memcalc.make_config(impl=register_function(fn, "slow", calling), seq_len=300,
                                 batch=2)
    return fn, config, calling


def test_live_it_runs_the_loop_on_the_gpu_beside_the_trace():
    """Through a GPU whose kernels are those the tracer follows (a fake one, on the meta
    device): three columns, all equal, the optimizer's peak among them; the table has a
    column for the GPU."""
    report = validate_target(*_target(), backend="cuda", gpu=FakeGpu(cuda_paths=True))
    (check,) = report.checks
    assert check.predicted == check.emulated == check.measured and report.ok
    assert check.measured["optimizer_peak_bytes"] > 0
    (table,) = report.tables()
    assert [c.header for c in table.columns] == ["figure", "oom --trace's program",
                                                 "memcalc trace", "this GPU", "difference (B)",
                                                 "cause"]


def test_live_a_difference_is_attributed():
    """A GPU whose cuBLAS workspaces are twice the rule's: the optimizer's peak is two
    workspaces higher (main and autograd thread's), the trace agrees with the model, so
    the cause is the workspace rule, not the fitted program; the other peaks move by other
    amounts too (tensors land in other blocks beside larger workspaces)."""
    fn, config, calling = _target("adamw", 1)
    (check,) = validate_target(fn, config, calling, backend="cuda",
                               gpu=FakeGpu(cuda_paths=True, workspace_factor=2)).checks
    assert check.predicted == check.emulated and not check.ok
    # the fake GPU is sm80: 4096 KiB x 2 + 16 KiB x 8 = 8,519,680 B a workspace
    assert check.differences["optimizer_peak_bytes"] == 2 * 8_519_680
    assert check.attribution["optimizer_peak_bytes"] == "workspace"
    assert "fitted program" not in check.attribution.values()
