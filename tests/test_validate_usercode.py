"""Attention as users write it: the four functions, what each runs, and their registration."""

import inspect
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from memcalc.config import Config  # noqa: E402
from memcalc.impls import IMPLS, get_impl  # noqa: E402
from memcalc.tracing import trace, traced  # noqa: E402
from memcalc.validation import usercode  # noqa: E402
from memcalc.validation.usercode import USER_CODE, register  # noqa: E402

B, H, N, D = 1, 2, 8, 4
FP16 = Config(impl="naive", dtype="fp16", shape={"batch": B, "heads": H, "seq_len": N,
                                                 "head_dim": D})


@pytest.fixture
def unregistered():
    """No ``trace:*`` user code in the registry during the test, the registry as it was
    after it."""
    before = dict(IMPLS)
    for key in USER_CODE:
        IMPLS.pop(f"trace:{key}", None)
    yield
    IMPLS.clear()
    IMPLS.update(before)


def qkv(dtype=torch.float32, n=3):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 1, n, 4, generator=g, dtype=dtype) for _ in range(3)]


def test_four_functions_in_order_each_taking_causal():
    assert list(USER_CODE) == ["sdpa-default", "sdpa-cudnn", "dropout", "float-softmax"]
    for fn in USER_CODE.values():
        assert inspect.signature(fn).parameters["causal"].default is False


def test_importing_the_module_imports_no_torch():
    code = ("import sys; import memcalc.validation.usercode; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_register_names_each_function_once(unregistered):
    names = register()
    assert names == {key: f"trace:{key}" for key in USER_CODE}
    first = {key: get_impl(name) for key, name in names.items()}
    assert register() == names
    assert all(get_impl(name) is first[key] for key, name in names.items())  # not replaced
    assert all(impl.traced and impl.gqa for impl in first.values())
    assert Config(impl="trace:float-softmax").impl == "trace:float-softmax"


@pytest.mark.parametrize("fn", [usercode.sdpa_default, usercode.dropout_attention,
                                usercode.float_softmax])
def test_causal_hides_the_later_keys(fn):
    """A change to the last key's value leaves every earlier row's output as it was when
    causal (its weight is exactly 0) and changes it otherwise; dropout draws the same mask
    for both runs (the same seed)."""
    q, k, v = qkv()
    later = v.clone()
    later[..., -1, :] += 1

    def rows(values, causal):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return fn(q, k, values, causal=causal)[..., :-1, :]

    assert torch.equal(rows(v, True), rows(later, True))
    assert not torch.equal(rows(v, False), rows(later, False))


def test_sdpa_cudnn_is_pinned_with_no_fallback():
    """On the CPU no cuDNN kernel can run: the call fails rather than taking math."""
    with pytest.raises(RuntimeError, match="No viable backend"):
        usercode.sdpa_cudnn(*qkv())


def test_sdpa_cudnn_without_the_backend_says_so(monkeypatch):
    import torch.nn.attention

    class Backends:  # a torch before cuDNN attention: no CUDNN_ATTENTION
        MATH = torch.nn.attention.SDPBackend.MATH

    monkeypatch.setattr(torch.nn.attention, "SDPBackend", Backends)
    with pytest.raises(RuntimeError) as error:
        usercode.sdpa_cudnn(*qkv())
    assert str(error.value) == "this torch has no SDPBackend.CUDNN_ATTENTION"


def test_dropout_is_training_dropout_that_saves_a_bool_mask():
    saved = trace(usercode.dropout_attention, FP16).saved
    masks = [c for c in saved if c.op == "native_dropout" and c.dtype == "bool"]
    # one mask per score: B x H x N x N = 1 x 2 x 8 x 8 = 128 bools, one 512 B block
    assert [(m.shape, m.allocated) for m in masks] == [((B, H, N, N), 512)]


def test_float_softmax_runs_in_float32_and_returns_the_input_dtype():
    result = traced(usercode.float_softmax, FP16)
    softmax = [c for c in result.breakdown.saved if c.op == "_softmax"]
    # the probabilities saved in float32: 1 x 2 x 8 x 8 x 4 B = 512 B
    assert [(c.dtype, c.shape, c.allocated) for c in softmax] == [
        ("float32", (B, H, N, N), 512)]
    assert any("half_to_float=True" in note for note in result.notes)
    assert usercode.float_softmax(*qkv(torch.float16)).dtype == torch.float16
