"""The live run without a GPU: three columns per case through a fake GPU (the meta device
with the allocator model as its counters), each attribution, OOM thresholds, the time
budget, resuming, and the output file's name."""

import dataclasses
import json

import pytest

torch = pytest.importorskip("torch")

from breakers import row_sum_as_int64  # noqa: E402
from fake_gpu import FakeGpu  # noqa: E402

from memcalc.config import Config  # noqa: E402
from memcalc.validation import cases, compare, session  # noqa: E402
from memcalc.validation.cases import Case, run_case  # noqa: E402

WS = 8_519_680  # one cuBLAS workspace at compute capability 8.0: :4096:2:16:8
SMALL = {"batch": 2, "heads": 1, "seq_len": 256, "head_dim": 16}


def env(gpu):
    return gpu.environment()


def grid_case(gpu, impl="naive", **shape):
    return cases.grid_cases([Config(impl=impl, shape={**SMALL, **shape})], env(gpu))[0]


def test_three_columns_agree_on_a_faithful_gpu():
    gpu = FakeGpu()
    check = run_case(grid_case(gpu), gpu)
    assert check.predicted == check.emulated == check.measured
    assert check.attribution == {} and check.ok and check.verdict() == "ok"
    assert check.config.device.spec.compute_capability == (8, 0)  # re-targeted


def test_model_vs_emulated_is_a_torch_release(monkeypatch):
    """The model declares the row sum as int64: the trace (and the GPU) disagree with it."""
    row_sum_as_int64(monkeypatch)
    gpu = FakeGpu()
    check = run_case(grid_case(gpu), gpu)
    # row sum 2 x 1 x 256 x 1: 2,048 B as fp32, 4,096 B as int64, both 512-multiples
    assert check.differences["saved_bytes"] == 2_048 - 4_096
    assert check.attribution["saved_bytes"] == compare.RELEASE
    assert not check.ok


def test_emulated_vs_live_workspace():
    gpu = FakeGpu(workspace_factor=2)  # the GPU's workspaces are twice the rule's
    check = run_case(grid_case(gpu), gpu)
    # naive: two workspaces (forward and autograd threads) alive at the backward peak
    assert check.differences["backward_peak_bytes"] == 2 * WS
    assert check.attribution["backward_peak_bytes"] == compare.WORKSPACE
    assert check.predicted == check.emulated


def test_emulated_vs_live_kernel_temporary():
    gpu = FakeGpu(forward_scratch=1000)  # a 1,000 B temporary alive through the forward
    check = run_case(grid_case(gpu), gpu)
    assert check.differences["forward_peak_bytes"] == 1024  # one 512-rounded block
    assert check.attribution["forward_peak_bytes"] == compare.KERNEL


def test_emulated_vs_live_allocator_segments():
    gpu = FakeGpu(extra_reserved=2 << 20)  # one more 2 MiB segment, the same tensors
    check = run_case(grid_case(gpu), gpu)
    assert check.differences == {**dict.fromkeys(check.differences, 0),
                                 "reserved_peak_bytes": 2 << 20}
    assert check.attribution == {"reserved_peak_bytes": compare.ALLOCATOR}


def test_fused_and_user_code_have_no_emulated_column():
    gpu = FakeGpu()
    fused = Case("fused", cases.grid_cases(
        [Config(impl="sdpa-efficient", shape=SMALL)], env(gpu))[0].config)
    check = run_case(fused, gpu)
    assert check.emulated is None and check.emulated_outcome == "absent"
    assert "meta device cannot run it" in check.emulated_detail
    user = [c for c in cases.usercode_cases(env(gpu)) if c.config.impl == "trace:float-softmax"]
    check = run_case(user[0], gpu)
    s = user[0].config.shape
    assert user[0].config.dtype.value == "fp16"
    # the model (memcalc trace) follows CUDA's half-to-float softmax; the fake GPU runs on
    # meta, which makes a float32 copy of the scores (B x H x N x N x 4 B): the "live" peak
    # is higher, and nothing in between says why
    assert 0 < check.differences["peak_bytes"] <= s.batch * s.heads * s.seq_len ** 2 * 4
    assert check.attribution["peak_bytes"] == compare.UNTRACED
    assert check.emulated_detail.startswith("user code")


def test_uncovered_case_is_recorded_not_failed():
    gpu = FakeGpu()
    case = grid_case(gpu)
    check = run_case(dataclasses.replace(case, fn=lambda q, k, v: 1 / 0), gpu)
    assert check.outcome == "error" and check.detail.startswith("ZeroDivisionError")
    assert check.predicted is None and check.model_detail.startswith("TraceError")
    assert check.verdict() == "error" and not check.ok


def test_oom_threshold_is_run_at_n_and_n_plus_1():
    gpu = FakeGpu()
    capacity = 128 << 20
    oom = cases.oom_cases(env(gpu), capacity)
    assert [c.expected for c in oom] == ["fits", "oom"] * len(cases.OOM_IMPLS)
    assert [c.config.shape.seq_len for c in oom[1::2]] == [
        c.config.shape.seq_len + 1 for c in oom[::2]]
    checks = [run_case(c, gpu) for c in oom[:2]]
    assert [c.outcome for c in checks] == ["measured", "oom"]
    assert all(c.ok for c in checks) and checks[1].emulated_outcome == "oom"
    assert gpu.cuda.fractions == [capacity / gpu.cuda.props.total_memory, 1.0] * 2


def test_wrong_oom_verdict_is_attributed():
    gpu = FakeGpu(workspace_factor=2)  # workspaces the rule does not know: N no longer fits
    first = cases.oom_cases(env(gpu), 128 << 20)[0]
    check = run_case(first, gpu)
    assert check.outcome == "oom" and not check.ok
    assert check.attribution == {"fits": compare.KERNEL}


class Clock:
    """A clock that advances one second per reading."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 1.0
        return self.now


def few_cases(n=3):
    def build(env, calibration):
        configs = [Config(impl="naive", shape={**SMALL, "seq_len": 100 + i}) for i in range(n)]
        return cases.grid_cases(configs, env)

    return build


def test_session_writes_calibration_and_resumes(tmp_path):
    gpu = FakeGpu()
    first = session.run(gpu, few_cases(), (512 << 20, "nvml"), tmp_path, max_seconds=2,
                        clock=Clock())
    # clock readings: 1 at the start; 2 before case 1 (1 s elapsed < 2: run it); 3 before
    # case 2 (2 s elapsed: stop)
    assert len(first.checks) == 1 and not first.complete and len(gpu.runs) == 1
    path = tmp_path / f"fake-gpu-{torch.__version__.replace('+', '-')}.json"
    saved = json.loads(path.read_text())
    assert len(saved["checks"]) == 1 and saved["complete"] is False
    assert saved["calibrations"][0]["largest_allocation_bytes"] == gpu.cuda.largest

    again = FakeGpu()
    second = session.run(again, few_cases(), (512 << 20, "nvml"), tmp_path)
    assert len(again.runs) == 2  # the first case was skipped
    assert second.complete and len(second.checks) == 3 and second.ok
    assert len(second.calibrations) == 2
    assert second.calibrations[1].free_after_run_bytes == gpu.cuda.free - (600 << 20)
    reloaded = compare.Report.model_validate_json(path.read_text())
    assert [c.key for c in reloaded.checks] == [c.key for c in second.checks]

    third = FakeGpu()
    session.run(third, few_cases(), (None, "unavailable"), tmp_path)
    assert third.runs == []  # nothing left to do


def test_session_refuses_a_file_from_another_environment(tmp_path):
    session.run(FakeGpu(), few_cases(1), (0, "nvml"), tmp_path / "r.json")
    other = FakeGpu()
    other.cuda.props.name = "Other GPU"
    with pytest.raises(ValueError, match="another environment \\(device differ"):
        session.run(other, few_cases(1), (0, "nvml"), tmp_path / "r.json")


def test_report_file_name():
    environment = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130"}
    assert session.report_path("validation/results/", environment).as_posix() == \
        "validation/results/nvidia-h100-80gb-hbm3-2.11.0-cu130.json"
    assert session.report_path("x.json", environment).as_posix() == "x.json"


def test_three_way_report_renders_each_column():
    gpu = FakeGpu(workspace_factor=2)
    report = compare.Report(backend="cuda", environment=env(gpu),
                            checks=(run_case(grid_case(gpu), gpu),))
    text = report.to_markdown()
    for header in ("model peak", "emulated peak", "live peak", "attribution"):
        assert header in text
    assert "backward_peak: workspace" in text
    assert report.causes == {compare.WORKSPACE: 1}
    assert report.summary().endswith("differences by cause: workspace 1")
