"""Training steps for validation (``memcalc/validation/training.py``): the modules, their
live cases, and the emulated check of their fitted programs."""

import importlib.util

import pytest

torch = pytest.importorskip("torch")

from fake_gpu import FakeGpu  # noqa: E402
from memcalc.names import CASE_KINDS  # noqa: E402
from memcalc.validation import cases, training  # noqa: E402
from memcalc.validation.cuda import environment  # noqa: E402
from memcalc.validation.modelcode import fitted_checks  # noqa: E402

HF = importlib.util.find_spec("transformers") is not None
FAKE_ENV = environment(torch, FakeGpu().cuda)


def test_each_module_trains_from_token_ids_on_any_device():
    """Real values on the CPU: a 0-d loss, a grad for every parameter, an AdamW step."""
    ids = torch.randint(0, training.VOCAB, (2, 16))
    modules = [training.TinyLM, training.EagerTinyLM] + ([training._hf_llama_lm()] if HF else [])
    for cls in modules:
        model = cls()
        out = model(ids, ids)
        loss = getattr(out, "loss", out)
        assert loss.dim() == 0
        loss.backward()
        assert all(p.grad is not None for p in model.parameters())
        torch.optim.AdamW(model.parameters(), foreach=True).step()


def test_the_cases_train_as_the_issue_asks():
    """AdamW on the foreach path and fused, SGD, accumulated micro-steps, autocast over
    float32 weights and pure bf16; the Hugging Face Llama where transformers is there."""
    code = training.training_code()
    loops = {(c.calling.loop.optimizer.text(), c.calling.loop.accumulate, c.calling.autocast,
              c.calling.param_dtype) for c in code.values()}
    assert {("adamw", 1, None, None), ("adamw:fused", 1, "bfloat16", None),
            ("adamw", 1, None, "bfloat16"), ("adamw", 2, "bfloat16", None),
            ("sgd", 1, None, None)} <= loops
    assert ("hf-llama-lm-adamw-fused-bf16" in code) == HF
    made = cases.training_cases(FAKE_ENV)
    assert len(made) == 2 * len(code) and {c.kind for c in made} == {"training"}
    assert CASE_KINDS.index("training") == CASE_KINDS.index("modelcode") + 1


def _run(key: str, gpu: FakeGpu, n: int = 1024):
    case = next(c for c in cases.training_cases(FAKE_ENV)
                if c.config.impl == f"trace:training:{key}" and c.config.shape.seq_len == n)
    return cases.run_case(case, gpu)


@pytest.mark.parametrize("key", ["eager-lm-adamw", "lm-adamw-fused-autocast",
                                 "lm-adamw-accum2-autocast"])
def test_a_live_run_of_the_loop_equals_its_trace(key):
    """The live harness runs the same loop as the tracer: on a GPU whose kernels are the
    ones the tracer follows (a fake one on the meta device), every figure, the optimizer's
    peak included, equals the trace's; the model column is the fitted program where the
    sizes are polynomials in N (attention written out); a fused kernel's padded buffers are
    fitted at multiples of 256 rows only, and 1,024 is traced directly."""
    check = _run(key, FakeGpu(cuda_paths=True))
    assert check.outcome == "measured" and check.emulated_outcome == "measured"
    assert check.measured == check.emulated and "optimizer_peak_bytes" in check.measured
    assert check.ok, check.differences
    fitted = key == "eager-lm-adamw"  # else at multiples of 256 from 15,616: 1,024 traced
    assert check.model_detail.startswith("oom --trace's: its program fitted over lengths"
                                         if fitted else "oom --trace's: its program fitted at "
                                         "multiples of 256 rows from 15,616 (")


def test_a_gpu_with_larger_workspaces_is_told_apart():
    """Twice the cuBLAS workspaces: every allocated figure two more workspaces, blamed on
    the workspace rule, not the model (the emulated trace agrees with it)."""
    check = _run("eager-lm-adamw", FakeGpu(cuda_paths=True, workspace_factor=2))
    assert not check.ok
    # the fake GPU is sm80: a workspace is 4096 KiB x 2 + 16 KiB x 8 = 8,519,680 B, one for
    # each thread that ran cuBLAS (main and autograd's)
    assert check.differences["peak_bytes"] == 2 * 8_519_680
    assert check.attribution["optimizer_peak_bytes"] == "workspace"


def test_fitted_training_programs_equal_direct_traces():
    checks = fitted_checks(training.training_code(), training.register(), "training")
    assert [c.config.impl for c in checks] == ["trace:training:eager-lm-adamw"] * 2
    assert all(c.ok and "optimizer_peak_bytes" in c.predicted for c in checks)
