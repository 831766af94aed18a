"""memcalc.tracing.deferred: a trace imports neither ``torch._dynamo`` nor sympy, and
leaves torch as it found it."""

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from memcalc.tracing.deferred import StandIn, deferred  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

_TRACE = f"""
import sys
import torch
import memcalc
from memcalc.tracing import Calling, load_function, traced
from memcalc.config import make_config
from memcalc.engine.inputs import inputs_of

fn = load_function("{ROOT}/examples/training/gpt.py:GPT")  # built on the meta device
config = make_config(seq_len=64, batch=2, gpu="a100-40gb")
calling = Calling(inputs_of(["idx=B,N:int64", "targets=B,N:int64"]), "bfloat16")
result = traced(fn, config, calling=calling)
print(sorted(m for m in ("torch._dynamo", "sympy", "torch.fx.experimental.symbolic_shapes")
             if m in sys.modules))
print(type(torch.add(torch.ones(2, device="meta"), 1)).__name__)  # torch's refs, after
print(sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules))
print(result.breakdown.peak_bytes)
"""


def test_a_module_trace_under_autocast_imports_neither_dynamo_nor_sympy():
    """A GPT with Linear layers, a loss and LayerNorm under autocast, built and traced in a
    fresh process: none of the three modules is imported; torch's own Python kernels
    import them as before once the trace is over."""
    out = subprocess.run([sys.executable, "-c", _TRACE], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.splitlines()
    assert out[0] == "[]"
    assert out[1] == "Tensor" and out[2] == "['sympy', 'torch._dynamo']"
    assert int(out[3]) > 0


def test_the_stand_ins_leave_and_torch_forgets_them():
    before = {name: sys.modules.get(name) for name in ("torch._dynamo", "sympy")}
    with deferred():
        torch.add(torch.ones(2, device="meta"), 1)
    assert {name: sys.modules.get(name) for name in before} == before
    assert not any(isinstance(m, StandIn) for m in list(sys.modules.values()))


def test_asked_for_more_a_stand_in_becomes_the_real_module():
    """A name the stand-in does not hold imports the real module, which then answers
    through the stand-in too."""
    stand_in = StandIn("json", {"dumps": None})
    assert stand_in.loads("[1]") == [1]  # the real module's
    assert stand_in.dumps([1]) == "[1]"  # its own name, now the real one's


@pytest.mark.filterwarnings("ignore:guard_size_oblivious will be removed:FutureWarning")
@pytest.mark.parametrize("name, values", [
    ("expect_true", [True, False]), ("guard_or_false", [True, False]),
    ("guard_or_true", [True, False]), ("statically_known_true", [True, False]),
    ("statically_known_false", [True, False]), ("guard_size_oblivious", [True, False]),
    ("guarding_hint_or_throw", [True, 7]), ("has_guarding_hint", [True, 7, 1.5]),
    ("is_nested_int", [7, 1.5]),
])
def test_the_stand_in_answers_plain_values_as_symbolic_shapes_does(name, values):
    from torch.fx.experimental import symbolic_shapes as real

    from memcalc.tracing.deferred import _symbolic_shapes_names

    mine = _symbolic_shapes_names()[name]
    for value in values:
        assert mine(value) == getattr(real, name)(value), (name, value)


def test_the_stand_ins_joins_and_comparisons_are_symbolic_shapes():
    from torch.fx.experimental import symbolic_shapes as real

    from memcalc.tracing.deferred import _symbolic_shapes_names

    mine = _symbolic_shapes_names()
    for a in (True, False):
        for b in (True, False):
            assert mine["sym_and"](a, b) == real.sym_and(a, b)
            assert mine["sym_or"](a, b) == real.sym_or(a, b)
    for x, y in [((2, 3), (2, 3)), ((2, 3), (2, 4)), ((2,), (2, 1)), (5, 5), (5, 6), ([], ())]:
        assert mine["sym_eq"](x, y) == real.sym_eq(x, y), (x, y)
    with pytest.raises(AssertionError):  # not a bool: the real function's error
        mine["expect_true"](1)


def test_a_later_class_is_the_real_one_once_its_module_is_imported():
    from memcalc.tracing.deferred import _later

    if "wave" in sys.modules:
        pytest.skip("wave already imported")
    Error = _later("wave", "Error")
    assert not isinstance(ValueError("x"), Error)  # nothing is, before the import
    made = Error("x")  # calling it imports wave
    assert type(made) is sys.modules["wave"].Error and isinstance(made, Error)
