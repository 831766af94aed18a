"""``flash2``: the model, derived by hand, and against the emulated trace of the user code.

Names at B=2, H=4, N=1000, D=64, fp16 (blocks from the small pool are the request rounded
up to 512 B): ND = 2 x 4 x 1000 x 64 x 2 B = 1,024,000 (a 512 multiple: q, k, v, grad_out,
out, one grad); ROW = 2 x 4 x 1000 x 4 B = 32,000 -> block 32,256 (63 x 512; the float32
logsumexp, delta).
"""

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest

from memcalc.config import Config, Protocol
from memcalc.impls import IMPLS, get_impl
from memcalc.engine.program import Tensor
from memcalc.analysis.predict import predict

ND, ROW = 1_024_000, 32_256
SHAPE = {"batch": 2, "heads": 4, "seq_len": 1000, "head_dim": 64}


def test_registered_as_traced():
    impl = get_impl("flash2")
    assert impl.traced and not impl.gqa


def test_saves_only_the_logsumexp():
    b = predict(Config(impl="flash2", dtype="fp16", shape=SHAPE))
    assert b.saved_bytes == ROW  # (B, H, N) float32 L: q, k, v are inputs, out is the output
    assert [c.name for c in b.saved] == ["lse"]


def test_peaks_by_hand():
    b = predict(Config(impl="flash2", dtype="fp16", shape=SHAPE))
    assert b.forward_peak_bytes == 5 * ND + ROW  # q, k, v, grad_out, out; L = 5,152,256
    # q, k, v, grad_out, out, L; dq, dk, dv, delta = 8 x ND + 2 x ROW = 8,256,512
    assert b.backward_peak_bytes == 8 * ND + 2 * ROW
    assert b.workspace_bytes == 0  # no op calls cuBLAS: no workspace on either thread


def test_sum_loss_copies_the_expanded_grad():
    b = predict(Config(impl="flash2", dtype="fp16", shape=SHAPE,
                       protocol=Protocol(loss="sum")))
    # q, k, v, out, L; loss, seed grad (0-d fp16: 512 B each); do.contiguous(), dq, dk, dv,
    # delta = 8 x ND + 2 x ROW + 2 x 512 = 8,257,536
    assert b.backward_peak_bytes == 8 * ND + 2 * ROW + 2 * 512


def test_forward_only_keeps_nothing():
    b = predict(Config(impl="flash2", dtype="fp16", shape=SHAPE,
                       protocol=Protocol(forward_only=True)))
    assert b.saved_bytes == 0
    assert b.forward_peak_bytes == 4 * ND + ROW  # q, k, v, out; L until forward() returns


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("loss", ["grad", "sum"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_model_equals_trace_with_odd_lengths(causal, loss, dtype):
    pytest.importorskip("torch")
    from memcalc.validation import figures_of
    from memcalc.validation.emulated import measure

    config = Config(impl="flash2", causal=causal, dtype=dtype, protocol=Protocol(loss=loss),
                    shape={"batch": 3, "heads": 5, "seq_len": 1051, "kv_len": 777,
                           "head_dim": 40})
    model, trace = predict(config), measure(config)
    assert figures_of(model) == figures_of(trace)
    assert sorted(c.allocated for c in model.saved) == sorted(c.allocated for c in trace.saved)


def test_a_missing_copy_is_caught(monkeypatch):
    """Drop the ``do.contiguous()`` copy of loss="sum": validation must fail."""
    pytest.importorskip("torch")
    from memcalc.validation import validate

    original = IMPLS["flash2"].build

    def broken(d):
        program = original(d)
        keep = [e for e in program.backward if not (isinstance(e, Tensor) and e.name == "do")]
        fix = [e for e in keep if not (hasattr(e, "names") and "do" in e.names)]
        return dataclasses.replace(program, backward=tuple(fix))

    monkeypatch.setitem(IMPLS, "flash2", dataclasses.replace(IMPLS["flash2"], build=broken))
    config = Config(impl="flash2", dtype="fp16", shape=SHAPE, protocol=Protocol(loss="sum"))
    report = validate(backend="emulated", configs=[config])
    assert report.mismatches == 1
    assert report.checks[0].differences["backward_peak_bytes"] == ND  # the missing copy


_NUMERICS = textwrap.dedent("""
    import math, torch
    from memcalc.validation.reference.flash2 import flash2

    def ref(q, k, v, causal):
        s = q.double() @ k.double().transpose(-2, -1) / math.sqrt(q.shape[-1])
        if causal:
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
        return torch.softmax(s, -1) @ v.double()

    torch.manual_seed(0)
    for dtype, n, d, causal, tol in [(torch.float32, 70, 20, True, 1e-4),
                                     (torch.float16, 100, 64, False, 1e-2)]:
        q, k, v = (torch.randn(2, 3, n, d, dtype=dtype, requires_grad=True) for _ in range(3))
        g = torch.randn(2, 3, n, d, dtype=dtype)
        out = flash2(q, k, v, causal)
        out.backward(g)
        mine = [out, q.grad, k.grad, v.grad]
        q.grad = k.grad = v.grad = None
        ref(q, k, v, causal).backward(g.double())
        for a, b in zip(mine, [ref(q, k, v, causal), q.grad, k.grad, v.grad]):
            assert (a.double() - b.double()).abs().max().item() < tol, (dtype, causal)
    print("ok")
""")


def test_kernels_compute_attention_in_the_triton_interpreter():
    """The live reference is real FlashAttention-2: forward and grads against float64
    softmax attention, on CPU through ``TRITON_INTERPRET=1`` (odd lengths, causal, a head
    dim that is not a power of two). bf16 is not checked here: the interpreter's own
    bf16 ``tl.dot`` is wrong (a 16 x 16 product is off by 1e10 in triton 3.9)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", _NUMERICS], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().endswith("ok")
