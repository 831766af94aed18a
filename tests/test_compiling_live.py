"""``memcalc.compiling.live``: compiled code in a live run (``validate --backend cuda``) runs
as torch compiles it, at the trace's budget, outside the trace's session; and the compiled
live cases (``memcalc/validation/compiled.py``) run beside their traces."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fake_gpu import FakeGpu  # noqa: E402
from memcalc.compiling import live, session  # noqa: E402
from memcalc.names import CASE_KINDS  # noqa: E402
from memcalc.tracing.errors import NotModelled  # noqa: E402
from memcalc.validation import cases, compiled  # noqa: E402
from memcalc.validation.cuda import environment  # noqa: E402

FAKE_ENV = environment(torch, FakeGpu().cuda)


def _doubled_sine(x):
    return x.sin() * 2


def test_outside_a_trace_a_live_run_compiles_with_torch_at_the_budget():
    """A function memcalc compiled for traces: refused outside a trace; inside ``live_run()``
    compiled by inductor for the tensors' device (here the CPU), once, with the trace's
    activation memory budget in force and the trace's session closed."""
    with session.calls(None, activation_budget=0.5):
        fn = session.compile(_doubled_sine, "_doubled_sine", {})
        session._OPEN.get()()  # a trace opened the session
        assert session._GENERATED.get() is not None
        with pytest.raises(NotModelled, match="or in the live run of validate"):
            fn(torch.ones(4))
        with session.live_run():
            assert session._GENERATED.get() is None
            assert torch._functorch.config.activation_memory_budget == 0.5
            x = torch.arange(4.0)
            assert torch.equal(fn(x), _doubled_sine(x)) and torch.equal(fn(x), fn(x))
            ((original, made),) = live._COMPILED.get().values()
            assert original is _doubled_sine and made is not fn
        assert not live.running()
    assert torch._functorch.config.activation_memory_budget == 1.0


def test_the_compiled_cases_are_the_ones_the_issue_asks_for():
    """A GPT block and (with transformers) a 2-layer Hugging Face Llama with AdamW, each
    compiled whole at budgets 1 and 0.5; blocks compiled in a constructor, as torchtitan's
    apply_compile does; two lengths each, taken after the training cases."""
    code = compiled.compiled_code()
    assert {(mode, budget) for _, mode, budget in code.values()} == {
        ("default", 1.0), ("default", 0.5), (None, None)}
    made = cases.compiled_cases(FAKE_ENV)
    assert len(made) == 2 * len(code) and {c.kind for c in made} == {"compiled"}
    assert {c.compile for c in made} == {("default", 1.0), ("default", 0.5), (None, None)}
    assert CASE_KINDS.index("compiled") == CASE_KINDS.index("training") + 1


def test_a_compiled_case_runs_live_beside_its_trace():
    """The GPT block compiled at budget 0.5, on a GPU whose kernels are those the tracer
    follows (a fake one on the meta device, where the live run's compiled code is the
    trace's own): the model column and the live one are equal figure by figure, the
    compiled step's live run made inside ``live_run()`` (the trace's session closed first and
    opened again by the fake GPU's trace)."""
    case = next(c for c in cases.compiled_cases(FAKE_ENV)
                if c.config.impl.endswith("gpt-block-budget-0.5"))
    case = cases.Case(case.kind, case.config.replace(seq_len=128), case.fn,
                      calling=case.calling, compile=case.compile)
    check = cases.run_case(case, FakeGpu(cuda_paths=True))
    assert check.outcome == "measured" and check.emulated_outcome == "absent"
    assert check.predicted == check.measured and check.ok, check.differences
    assert check.model_detail == "memcalc trace"


def test_a_recorded_compiled_case_is_given_back_by_the_trace():
    """``recorded.recheck`` compiles a recorded compiled case as the case says (mode and
    budget): the figures the live column measured on the fake GPU are given back, and one
    more block of 512 B at the peak is a difference of 512 B."""
    from memcalc.validation.recorded import recheck

    case = next(c for c in cases.compiled_cases(FAKE_ENV)
                if c.config.impl.endswith("gpt-block-budget-0.5")
                and c.config.shape.seq_len == 1024)
    check = cases.run_case(case, FakeGpu(cuda_paths=True))
    assert check.ok and check.measured == check.predicted
    report = {"environment": FAKE_ENV, "checks": [check.model_dump(mode="json")]}
    assert recheck(report) == []
    report["checks"][0]["measured"]["peak_bytes"] += 512
    assert recheck(report) == [("compiled", case.config.impl, {"peak_bytes": 512})]
