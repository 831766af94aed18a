"""The reference code (``memcalc/validation/reference``): each computes the attention it claims."""

import math

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from memcalc.config import Config  # noqa: E402
from memcalc.validation.reference import REFERENCES, reference_fn  # noqa: E402
from memcalc.validation.reference import checkpoint as ckpt  # noqa: E402
from memcalc.validation.reference import flash2 as fl2  # noqa: E402
from memcalc.validation.reference.naive import causal_mask, naive  # noqa: E402
from memcalc.validation.reference.sdpa_math import gqa  # noqa: E402

B, H, N, M, D = 1, 2, 8, 6, 4  # M: key rows, fewer than the N query rows


def qkv(heads=H, kv_heads=H, kv_len=N, dtype=torch.float64, seed=0):
    """Leaf ``q`` of ``(B, heads, N, D)``, ``k``, ``v`` of ``(B, kv_heads, kv_len, D)``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, heads, N, D, generator=g, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(B, kv_heads, kv_len, D, generator=g, dtype=dtype, requires_grad=True)
            for _ in range(2))
    return q, k, v


def attention(q, k, v, causal):
    """softmax(q k^T / sqrt(d)) v, row i seeing keys j <= i when causal (top-left)."""
    s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    if causal:
        later = torch.arange(q.size(-2))[:, None] < torch.arange(k.size(-2))[None, :]
        s = s.masked_fill(later, -math.inf)
    return torch.softmax(s, dim=-1) @ v


def linear_formula(q, k, v, causal, eps=1e-6):
    """out_i = sum_j w_ij v_j / (sum_j w_ij + eps), w_ij = phi(q_i) . phi(k_j), phi = elu + 1,
    over j <= i when causal: the quadratic form of what the references compute by states."""
    w = (F.elu(q) + 1) @ (F.elu(k) + 1).transpose(-2, -1)
    if causal:
        w = w.tril()
    return (w @ v) / (w.sum(-1, keepdim=True) + eps)


class Ops(TorchDispatchMode):
    """Logs the names of the aten ops that run."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def saved_by(fn, *args, **kwargs):
    """``fn``'s output and the tensors autograd packs for its backward, in packing order."""
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        out = fn(*args, **kwargs)
    return out, packed


def test_reference_fn_binds_causal_and_chunk_only_where_declared(monkeypatch):
    # @reference registers the function itself, not a wrapper. Compared by its code: a
    # test that traces this file as user code (tests/test_tracing.py) runs it again under
    # another module name, registering a copy of the same function
    registered = REFERENCES["naive"]
    assert (registered.__qualname__, registered.__code__.co_code) == (
        naive.__qualname__, naive.__code__.co_code)
    calls = []

    def declares_causal(q, k, v, causal=False):
        calls.append({"causal": causal})

    def declares_both(q, k, v, causal=True, chunk=64):
        calls.append({"causal": causal, "chunk": chunk})

    def declares_none(q, k, v):
        calls.append({})

    monkeypatch.setitem(REFERENCES, "naive", declares_causal)
    monkeypatch.setitem(REFERENCES, "linear-causal-chunked", declares_both)
    monkeypatch.setitem(REFERENCES, "linear", declares_none)
    for impl in ("naive", "linear-causal-chunked", "linear"):
        reference_fn(Config(impl=impl, causal=impl != "linear", chunk=3))(*qkv())
    assert calls == [{"causal": True}, {"causal": True, "chunk": 3}, {}]


def test_causal_mask_is_true_above_the_diagonal():
    q, k, _ = qkv(kv_len=5)
    mask = causal_mask(q[..., :3, :], k)  # (3, 5): query i may not see key j > i
    assert mask.dtype == torch.bool
    assert mask.tolist() == [[False, True, True, True, True],
                             [False, False, True, True, True],
                             [False, False, False, True, True]]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("impl", ["naive", "naive-softmax", "naive-weights", "sdpa-math",
                                  "checkpoint-naive", "checkpoint-sdpa-math"])
def test_softmax_references_compute_attention(impl, causal):
    q, k, v = qkv(kv_len=M)  # M < N: a causal row i sees keys 0..min(i, M - 1)
    torch.testing.assert_close(REFERENCES[impl](q, k, v, causal=causal),
                               attention(q, k, v, causal))


@pytest.mark.parametrize("impl, options", [
    ("naive", {"causal": True}), ("naive-softmax", {"causal": True}),
    ("naive-weights", {"causal": True}), ("sdpa-math", {"causal": True}),
    ("linear-causal", {"causal": False}),  # causal whatever the option says
    ("linear-causal-chunked", {"causal": False, "chunk": 3}),  # position 5: mid chunk 3..5
])
def test_causal_rows_do_not_see_later_positions(impl, options):
    """Changing key and value 5 leaves rows 0..4 bit for bit and changes rows 5..7."""
    q, k, v = qkv()
    before = REFERENCES[impl](q, k, v, **options)
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[..., 5, :] += 1.0
    v2[..., 5, :] -= 1.0
    after = REFERENCES[impl](q, k2, v2, **options)
    assert torch.equal(before[..., :5, :], after[..., :5, :])
    assert not torch.equal(before[..., 5:, :], after[..., 5:, :])


def test_naive_keeps_exp_x_and_naive_softmax_the_weights():
    q, k, v = qkv(kv_len=M)
    s = q @ k.transpose(-2, -1) / math.sqrt(D)  # the same ops as ``scores``
    exp_x = torch.exp(s - s.max(dim=-1, keepdim=True).values)
    p = torch.softmax(s, dim=-1)
    _, packed = saved_by(naive, q, k, v)
    assert any(torch.equal(t, exp_x) for t in packed if t.shape == exp_x.shape)
    assert not any(torch.equal(t, p) for t in packed if t.shape == p.shape)
    _, packed = saved_by(REFERENCES["naive-softmax"], q, k, v)
    assert any(torch.equal(t, p) for t in packed if t.shape == p.shape)


def test_naive_weights_saves_q_k_v_and_the_weights_and_backpropagates_attention():
    q, k, v = qkv(kv_len=M)
    out, packed = saved_by(REFERENCES["naive-weights"], q, k, v, causal=True)
    assert [t is x for t, x in zip(packed[:3], (q, k, v))] == [True] * 3 and len(packed) == 4
    s = (q @ k.transpose(-2, -1) / math.sqrt(D)).masked_fill(causal_mask(q, k), -math.inf)
    assert torch.equal(packed[3], torch.softmax(s, dim=-1))  # p, (B, H, N, M)
    g = torch.randn(B, H, N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mine = torch.autograd.grad(out, (q, k, v), g)  # the hand-written backward
    want = torch.autograd.grad(attention(q, k, v, True), (q, k, v), g)
    for a, b in zip(mine, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("impl, options, kv_len", [
    ("linear", {}, M),
    ("linear-causal", {}, N),
    ("linear-causal-chunked", {"chunk": 1}, N),
    ("linear-causal-chunked", {"chunk": 3}, N),  # chunks of 3, 3, 2 rows
    ("linear-causal-chunked", {"chunk": 64}, N),  # one chunk
    ("checkpoint-linear-causal-chunked", {"chunk": 3}, N),
])
def test_linear_references_compute_their_formula(impl, options, kv_len):
    q, k, v = qkv(kv_len=kv_len)
    torch.testing.assert_close(REFERENCES[impl](q, k, v, **options),
                               linear_formula(q, k, v, causal=impl != "linear"))


def test_linear_references_reject_what_they_cannot_run():
    with pytest.raises(ValueError, match="^--causal: linear is bidirectional"):
        REFERENCES["linear"](*qkv(), causal=True)
    for impl in ("linear-causal", "linear-causal-chunked"):
        with pytest.raises(ValueError, match="^--kv-len: causal linear attention needs"):
            REFERENCES[impl](*qkv(kv_len=M))


def test_sdpa_math_runs_the_math_backend_with_grouped_query_heads():
    """On CPU sdpa would pick its flash kernel; forced to math it runs the composite. With
    2 key heads for 4 query heads, query heads 2h, 2h + 1 share key head h."""
    q, k, v = qkv(heads=4, kv_heads=2, dtype=torch.float32)
    with Ops() as seen:
        out = REFERENCES["sdpa-math"](q, k, v, causal=True)
    assert "bmm" in seen.ops  # the composite: q k^T and p v as batched matmuls
    assert not [op for op in seen.ops if op.startswith("_scaled_dot_product")]
    want = attention(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), True)
    torch.testing.assert_close(out, want)
    assert gqa(q, k) == {"enable_gqa": True} and gqa(q, q) == {}  # {}: torch 2.4 has no flag


def test_sdpa_fused_references_pin_their_backend():
    """sdpa-flash runs the flash kernel (CPU has one); sdpa-efficient, which CPU lacks, is an
    error rather than a fall back to another backend."""
    q, k, v = qkv(dtype=torch.float32)
    with Ops() as seen:
        out = REFERENCES["sdpa-flash"](q, k, v, causal=True)
    assert "_scaled_dot_product_flash_attention_for_cpu" in seen.ops
    torch.testing.assert_close(out, attention(q, k, v, True))
    with pytest.raises(RuntimeError, match="No viable backend"):
        REFERENCES["sdpa-efficient"](q, k, v)


def test_flash2_saves_q_k_v_out_and_the_logsumexp(monkeypatch):
    """On the meta device no kernel runs: the allocations and what autograd keeps."""
    q, k, v = (t.detach().to("meta").requires_grad_() for t in qkv(kv_len=M))
    out, packed = saved_by(REFERENCES["flash2"], q, k, v, causal=True)
    assert (out.shape, out.dtype) == ((B, H, N, D), torch.float64)
    assert [t is x for t, x in zip(packed, (q, k, v, out))] == [True] * 4 and len(packed) == 5
    assert (packed[4].shape, packed[4].dtype) == ((B, H, N), torch.float32)  # row logsumexp
    out.backward(torch.empty_like(out))
    assert [t.grad.shape for t in (q, k, v)] == [(B, H, N, D), (B, H, M, D), (B, H, M, D)]
    # tiles: 64 rows, BLOCK_D the head dim's power of two (at least 16); 32 rows past 128
    assert [fl2._blocks(d) for d in (4, 40, 128, 129)] == [
        (64, 64, 16), (64, 64, 64), (64, 64, 128), (32, 32, 256)]
    monkeypatch.setattr(fl2, "triton", None)
    with pytest.raises(RuntimeError, match="flash2 needs Triton"):
        REFERENCES["flash2"](*qkv(dtype=torch.float32))


def test_checkpointed_recomputes_with_the_options_fn_declares(monkeypatch):
    calls, recorded = [], []

    def inner(q, k, v, causal=False):
        calls.append(causal)
        return attention(q, k, v, causal)

    def spy(fn, *args, **kwargs):
        recorded.append(dict(kwargs))
        return torch.utils.checkpoint.checkpoint(fn, *args, **kwargs)

    monkeypatch.setattr(ckpt, "checkpoint", spy)
    q, k, v = qkv(kv_len=M)
    out = ckpt.checkpointed(inner)(q, k, v, causal=True, chunk=3)
    assert recorded == [{"use_reentrant": False, "causal": True}]  # no chunk: not declared
    assert torch.equal(out, attention(q, k, v, True))
    g = torch.ones_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    assert calls == [True, True]  # the forward, then its recomputation in backward
    for a, b in zip(grads, torch.autograd.grad(attention(q, k, v, True), (q, k, v), g)):
        assert torch.equal(a, b)
