"""Model code for validation (``memcalc/validation/modelcode.py``): the modules, their
cases for a live run, and the emulated check of their fitted programs."""

import pytest

torch = pytest.importorskip("torch")

from fake_gpu import FakeGpu  # noqa: E402
from memcalc.validation import cases, modelcode  # noqa: E402
from memcalc.validation.cuda import environment  # noqa: E402


def test_each_module_runs_from_hidden_states_on_any_device():
    x = torch.randn(2, 16, modelcode.WIDTH, requires_grad=True)
    for module in (modelcode.FusedQKV, modelcode.ManualCausal):
        out = module()(x)
        assert out.shape == x.shape
        out.sum().backward()


def test_fitted_programs_equal_direct_traces():
    """What ``memcalc oom --trace`` solves (the program fitted on six short lengths) equals
    a direct trace at 300 and 1,000 rows, for each module without a fused kernel."""
    checks = modelcode.fitted_checks()
    assert len(checks) >= 4 and {c.case for c in checks} == {"modelcode"}
    assert [c.config.impl for c in checks if not c.ok] == []


def test_live_cases_run_each_module_built_on_the_device():
    gpu = FakeGpu()
    env = environment(torch, gpu.cuda)
    made = cases.modelcode_cases(env)
    assert {c.kind for c in made} == {"modelcode"}
    assert [c.config.shape.seq_len for c in made[:2]] == [1024, 4096]
    case = next(c for c in made if c.config.impl == "trace:model:manual-causal")
    check = cases.run_case(case.__class__(**{**case.__dict__, "config": case.config.replace(
        seq_len=64)}), gpu)
    assert check.outcome == "measured" and check.model_detail == "memcalc trace"
    assert check.predicted is not None and check.measured is not None
