"""``sdpa-math``: F.scaled_dot_product_attention on the math backend, figures derived by hand.

Config of the hand counts: B=2, H=4, N=1024, d=16, H100 (32 MiB workspaces). Names:
ND = 2 x 4 x 1024 x 16 x 4 B = 524,288 (one (B, H, N, d) float32 tensor);
NN = 2 x 4 x 1024 x 1024 x 4 B = 33,554,432 (one (B, H, N, N) float32 tensor);
WS = 33,554,432 (one cuBLAS workspace; the forward and the autograd thread hold one each).
The math backend computes in float32 whatever the input dtype.
"""

import dataclasses

import pytest

from memcalc.config import Config
from memcalc.impls import IMPLS, get_impl
from memcalc.engine.program import Tensor
from memcalc.analysis.predict import predict
from memcalc.validation import figures_of

ND, NN, WS = 524_288, 33_554_432, 33_554_432
SHAPE = {"batch": 2, "heads": 4, "seq_len": 1024, "head_dim": 16}


def test_fp16_saves_float32_copies():
    b = predict(Config(impl="sdpa-math", dtype="fp16", shape=SHAPE))
    # q * sqrt(scale), k^T * sqrt(scale), v.float() (all float32) and the float32 weights
    assert b.saved_bytes == 3 * ND + NN  # 35,127,296
    assert sorted(c.name for c in b.saved) == ["ks", "p", "qs", "v32"]
    assert {c.dtype for c in b.saved} == {"float32"}


def test_fp32_peaks():
    b = predict(Config(impl="sdpa-math", dtype="fp32", shape=SHAPE))
    assert b.saved_bytes == 2 * ND + NN  # qs, ks, p (v is the input) = 34,603,008
    # at the where inside _safe_softmax (torch 2.13: written into the softmax): q, k, v,
    # grad_out; qs, ks; the scores and the softmax; the isneginf bool mask (2 x 4 x 1024 x
    # 1024 x 1 B), the row mask (2 x 4 x 1024 x 1 B = 8,192), a 512-B zero; 2 workspaces
    assert b.forward_peak_bytes == 6 * ND + 2 * NN + NN // 4 + 8_192 + 512 + 2 * WS  # 145,760,768
    # in _softmax_backward_data: inputs, qs, ks, out, dv; p, dp, ds and its grad * p
    # temporary (SoftMax.cu); 2 workspaces
    assert b.backward_peak_bytes == 8 * ND + 4 * NN + 2 * WS  # 205,520,896


def test_gqa_saves_the_repeated_values():
    shape = {**SHAPE, "heads": 8, "kv_heads": 2}
    b = predict(Config(impl="sdpa-math", dtype="bf16", shape=shape))
    v_rep = next(c for c in b.saved if c.name == "v_rep")
    assert v_rep.shape == (2, 2, 4, 1024, 16)  # repeat_interleave: (B, Hk, H/Hk, N, d)
    # qs, ks, v_rep: 2 x 8 x 1024 x 16 x 4 B each; p: 2 x 8 x 1024 x 1024 x 4 B
    assert b.saved_bytes == 3 * 1_048_576 + 67_108_864  # 70,254,592


def test_causal_mask_is_float32_and_not_saved():
    b = predict(Config(impl="sdpa-math", dtype="fp16", causal=True, shape=SHAPE))
    assert b.saved_bytes == 3 * ND + NN  # the additive mask dies with the forward
    plain = predict(Config(impl="sdpa-math", dtype="fp16", shape=SHAPE))
    # two (B, H, N, N) float32 tensors at the peak either way (scores and their masked
    # copy: the traced out-of-place add; or scores and weights), plus the (N, N) float32
    # mask: 1024 x 1024 x 4 B = 4,194,304
    assert b.forward_peak_bytes - plain.forward_peak_bytes == 4_194_304


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq_len,kv_len,heads,kv_heads",
                         [(1000, None, 3, None), (1050, 1057, 2, None), (3001, None, 6, 2)])
def test_equals_trace(dtype, causal, seq_len, kv_len, heads, kv_heads):
    from memcalc.validation.emulated import measure

    config = Config(impl="sdpa-math", dtype=dtype, causal=causal,
                    shape={"batch": 2, "heads": heads, "kv_heads": kv_heads, "seq_len": seq_len,
                           "kv_len": kv_len, "head_dim": 16})
    model, trace = predict(config), measure(config)
    assert figures_of(model) == figures_of(trace)
    assert sorted(c.allocated for c in model.saved) == sorted(c.allocated for c in trace.saved)


def test_a_missing_upcast_is_caught(monkeypatch):
    """Declare the saved weights in the input dtype: the trace must disagree."""
    original = get_impl("sdpa-math").build

    def broken(d):
        program = original(d)
        fix = lambda e: Tensor(e.name, e.shape, d.dtype, e.role, e.op) if (
            isinstance(e, Tensor) and e.name == "p") else e
        return type(program)(tuple(map(fix, program.forward)), program.backward)

    monkeypatch.setitem(IMPLS, "sdpa-math", dataclasses.replace(IMPLS["sdpa-math"], build=broken))
    from memcalc.validation import validate

    report = validate(backend="emulated",
                      configs=[Config(impl="sdpa-math", dtype="fp16", shape=SHAPE)])
    # p: 2 x 4 x 1024 x 1024 x 2 B = 16 MiB as fp16 instead of 32 MiB as float32
    assert report.checks[0].differences["saved_bytes"] == NN - NN // 2  # traced - model


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("causal,kv_heads,loss", [(False, None, "grad"), (True, None, "sum"),
                                                  (True, 2, "grad"), (False, 1, "sum")])
def test_equals_trace_event_by_event(dtype, causal, kv_heads, loss):
    """Every allocation in the trace's order, with what was freed before it."""
    from test_impls_checkpoint import model_steps, traced_steps

    config = Config(impl="sdpa-math", dtype=dtype, causal=causal, protocol={"loss": loss},
                    shape={"batch": 2, "heads": 4, "kv_heads": kv_heads, "seq_len": 1050,
                           "head_dim": 16})
    assert model_steps(config) == traced_steps(config)
