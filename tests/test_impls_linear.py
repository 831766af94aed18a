"""The linear-attention family, figures derived by hand.

Config of the hand counts: the seeds' notebook, B=4, H=8, d=64, fp16, N=1024, H100.
Names: ND = 4 x 8 x 1024 x 64 x 2 B = 4,194,304 (one (B, H, N, d) tensor);
NDD = 4 x 8 x 1024 x 64 x 64 x 2 B = 268,435,456 (one (B, H, N, d, d) tensor);
ROW = 4 x 8 x 1024 x 2 B = 65,536 (one (B, H, N, 1) tensor); DD = 4 x 8 x 64 x 64 x 2 B
= 262,144 (one (B, H, d, d) state); KS = 4 x 8 x 64 x 2 B = 4,096 (one key sum).
"""

import pytest

from memcalc.config import Config
from memcalc.impls import IMPLS, get_impl
from memcalc.analysis.predict import predict
from memcalc.validation import figures_of

ND, NDD, ROW, DD, KS = 4_194_304, 268_435_456, 65_536, 262_144, 4_096
SEEDS = {"batch": 4, "heads": 8, "seq_len": 1024, "head_dim": 64}


def test_linear_saves_the_d_by_d_state():
    b = predict(Config(impl="linear", dtype="fp16", shape=SEEDS))
    # phi(q), phi(k), the numerator phi(q) @ kv; kv; k_sum; norm + eps
    assert b.saved_bytes == 3 * ND + DD + KS + ROW  # 12,914,688


def test_linear_causal_saves_the_cumsum():
    b = predict(Config(impl="linear-causal", dtype="fp16", causal=True, shape=SEEDS))
    # the (B, H, N, d, d) cumsum of phi(k) v^T; phi(q), phi(k), the cumsum of phi(k),
    # the numerator; norm + eps
    assert b.saved_bytes == NDD + 4 * ND + ROW  # 285,278,208
    # at the output's div: the outer product phi(k) v^T and its cumsum (2 NDD); 2
    # workspaces; q, k, v, grad_out, phi(q), phi(k), the cumsum of phi(k), the numerator,
    # the output (9 ND); norm and norm + eps (2 ROW)
    assert b.forward_peak_bytes == 2 * NDD + 2 * 33_554_432 + 9 * ND + 2 * ROW  # 641,859,584
    # CumsumBackward0 of the (N, d, d) cumsum, flip(cumsum(flip(grad))): the grad and its
    # three transforms (4 NDD); 2 workspaces; q, k, v, grad_out, phi(k), out, phi(q)'s
    # grad, the key cumsum's grad (8 ND)
    assert b.backward_peak_bytes == 4 * NDD + 2 * 33_554_432 + 8 * ND  # 1,174,405,120


def test_chunked_saves_one_state_per_chunk():
    b = predict(Config(impl="linear-causal-chunked", dtype="fp16", chunk=256, shape=SEEDS))
    # 4 chunks of 256 rows: phi(q), phi(k); 4 score blocks 4 x 8 x 256 x 256 x 2 B;
    # the 4 numerators (one ND together); 4 x (norm + eps) of 4 x 8 x 256 x 2 B = 16,384;
    # the zero state and 3 updates: 4 DD and 4 KS
    assert b.saved_bytes == 2 * ND + 4 * 4_194_304 + ND + 4 * 16_384 + 4 * DD + 4 * KS  # 30,490,624


def test_causal_flag():
    with pytest.raises(ValueError, match="--causal: linear is bidirectional"):
        predict(Config(impl="linear", causal=True, shape=SEEDS))
    with pytest.raises(ValueError, match="--kv-len"):
        predict(Config(impl="linear-causal", shape={**SEEDS, "kv_len": 1000}))
    for impl in ("linear-causal", "linear-causal-chunked"):  # causal by construction
        on, off = (predict(Config(impl=impl, causal=c, shape=SEEDS)) for c in (True, False))
        assert figures_of(on) == figures_of(off)


def test_chunk_of_the_whole_sequence_is_one_chunk():
    b = predict(Config(impl="linear-causal-chunked", dtype="fp16", chunk=1024, shape=SEEDS))
    # one chunk: phi(q), phi(k); the (B, H, N, N) scores 4 x 8 x 1024 x 1024 x 2 B;
    # the numerator; norm + eps; the zero state and key sum
    assert b.saved_bytes == 2 * ND + 67_108_864 + ND + ROW + DD + KS  # 80,023,552


def test_crossover_with_naive():
    """The seeds say causal linear attention costs more than softmax attention while
    d^2 > N (4096 here). With every tensor of the step counted, linear-causal's peak is
    the larger up to N = 2751 and naive's from N = 2752 on."""
    def peak(impl, n, causal):
        shape = {**SEEDS, "seq_len": n}
        return predict(Config(impl=impl, dtype="fp16", causal=causal, shape=shape)).peak_bytes

    # 3,042,934,784 > 3,042,250,752, then 3,042,967,552 < 3,043,848,192
    assert peak("linear-causal", 2751, True) > peak("naive", 2751, False)
    assert peak("linear-causal", 2752, True) < peak("naive", 2752, False)


@pytest.mark.parametrize("impl,chunk", [("linear", 64), ("linear-causal", 64),
                                        ("linear-causal-chunked", 64),
                                        ("linear-causal-chunked", 100)])
@pytest.mark.parametrize("dtype,loss", [("fp32", "grad"), ("bf16", "sum")])
@pytest.mark.parametrize("seq_len", [1000, 1050, 3001])
def test_equals_trace(impl, chunk, dtype, loss, seq_len):
    from memcalc.validation.emulated import measure

    config = Config(impl=impl, dtype=dtype, chunk=chunk, causal=impl != "linear",
                    shape={"batch": 2, "heads": 3, "seq_len": seq_len, "head_dim": 16},
                    protocol={"loss": loss})
    model, trace = predict(config), measure(config)
    assert figures_of(model) == figures_of(trace)
    assert sorted(c.allocated for c in model.saved) == sorted(c.allocated for c in trace.saved)


def test_a_wrong_state_shape_is_caught(monkeypatch):
    """Declare each chunk's ``(d, d)`` state update as ``(d, 1)``, like the key sum: the
    trace must disagree."""
    import dataclasses

    from memcalc.engine.program import Tensor
    from memcalc.validation import validate

    original = get_impl("linear-causal-chunked").build

    def broken(d):
        program = original(d)
        fix = lambda e: Tensor(e.name, (d.B, d.H, d.D, 1), e.dtype, e.role, e.op) if (
            isinstance(e, Tensor) and e.name in ("kv0", "kv1", "kv2")) else e
        return type(program)(tuple(map(fix, program.forward)), program.backward)

    monkeypatch.setitem(IMPLS, "linear-causal-chunked",
                        dataclasses.replace(IMPLS["linear-causal-chunked"], build=broken))
    report = validate(backend="emulated", configs=[
        Config(impl="linear-causal-chunked", dtype="fp16", chunk=256, shape=SEEDS)])
    # 3 updates (4 chunks of 256 rows) saved as KS instead of DD: traced - model
    assert report.checks[0].differences["saved_bytes"] == 3 * (DD - KS)  # 774,144


@pytest.mark.parametrize("impl,seq_len,chunk", [("linear", 1050, 64), ("linear-causal", 1050, 64),
                                                ("linear-causal-chunked", 200, 64),
                                                ("linear-causal-chunked", 1000, 100),
                                                ("linear-causal-chunked", 40, 64)])
@pytest.mark.parametrize("loss", ["grad", "sum"])
def test_equals_trace_event_by_event(impl, seq_len, chunk, loss):
    """Every allocation in the trace's order, with what was freed before it."""
    from test_impls_checkpoint import model_steps, traced_steps

    config = Config(impl=impl, dtype="fp16", chunk=chunk, causal=impl != "linear",
                    shape={"batch": 2, "heads": 3, "seq_len": seq_len, "head_dim": 16},
                    protocol={"loss": loss})
    assert model_steps(config) == traced_steps(config)
