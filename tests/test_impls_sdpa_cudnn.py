"""``memcalc.impls.sdpa_cudnn``: what PyTorch allocates around a cuDNN attention call."""

from memcalc.engine.dims import Dims
from memcalc.engine.program import Role, free, release
from memcalc.impls.sdpa_cudnn import Workspace, backward, forward

# B=2, H=4 query heads, Hk=2 key/value heads, N=8 query rows, M=24 key rows, d=16, bf16:
# query-side and key-side sizes differ (H x N = 32, Hk x M = 48), so a shape read from the
# wrong side is caught
D = Dims(B=2, H=4, N=8, M=24, D=16, dtype="bfloat16", causal=False, loss="grad", Hk=2,
         chunk=64)
BF16 = "bfloat16"
OUT = ("out", (2, 4, 8, 16), BF16, Role.output, "empty", 2048)  # 2 x 4 x 8 x 16 x 2 B
LSE = ("lse", (2, 4, 8, 1), "float32", Role.saved, "empty", 256)  # 2 x 4 x 8 x 1 x 4 B
SEED = ("seed", (), "int64", Role.saved, "empty", 8)  # one int64
OFFSET = ("offset", (), "int64", Role.saved, "empty", 8)
T = Role.temporary
DQ = ("dq", (2, 4, 8, 16), BF16, T, "empty_like", 2048)  # (B, H, N, d): 2 x 4 x 8 x 16 x 2 B
DK = ("dk", (2, 2, 24, 16), BF16, T, "empty_like", 3072)  # (B, Hk, M, d): 2 x 2 x 24 x 16 x 2 B
DV = ("dv", (2, 2, 24, 16), BF16, T, "empty_like", 3072)
# the default backward workspace: (B*H*N*d + B*H*N) x 4 B + 256 B
# = (2 x 4 x 8 x 16 + 2 x 4 x 8) x 4 + 256 = 4,608 B, as an H200 measured (torch 2.11),
# + dK and dV at the 4 query heads (grouped heads): 2 x (2 x 4 x 24 x 16) x 2 B = 12,288 B
WORK = 4608 + 12_288
DOUT_T = ("dout_t", (2, 4, 8, 16), BF16, T, "permute", 2048)  # o's layout, as dq


def workspace(nbytes: int) -> tuple:
    return ("cudnn_workspace", (nbytes,), "uint8", T, "allocate", nbytes)


def test_default_workspace_is_what_an_h200_measured():
    """256 B forward; (B*H*N*d + B*H*N) x 4 B + 256 B backward, over query heads and rows
    (dQ's shape), not the key/value ones: B=2, H=4, d=64, N=1,024 measured 256 B and
    (2 x 4 x 1024 x 64 + 2 x 4 x 1024) x 4 + 256 = 2,130,176 B on an H200 (torch 2.11)."""
    assert Workspace().forward_bytes(D.replace(Hk=4)) == 256
    # (2 x 4 x 8 x 16 + 2 x 4 x 8) x 4 + 256 B
    assert Workspace().backward_bytes(D.replace(Hk=4)) == 4608
    measured = Dims(B=2, H=4, N=1024, M=1024, D=64, dtype="bfloat16", causal=False,
                    loss="grad", Hk=4, chunk=64)
    assert Workspace().backward_bytes(measured) == 2_130_176


def test_grouped_heads_add_dk_and_dv_at_every_query_head():
    """cuDNN's dK_fullhead and dV_fullhead, (B, H, M, d) in q's dtype: Llama's 4 query heads
    over 2 key/value heads, d = 64, bf16, N = 1,024 measured 2,130,176 + 2 x (2 x 4 x 1024 x
    64) x 2 = 4,227,328 B on an H100 (torch 2.11); key rows, not query rows, in the term."""
    llama = Dims(B=2, H=4, N=1024, M=1024, D=64, dtype="bfloat16", causal=False,
                 loss="grad", Hk=2, chunk=64)
    assert Workspace().backward_bytes(llama) == 4_227_328
    assert Workspace().backward_bytes(D) == 4608 + 2 * (2 * 4 * 24 * 16) * 2 == 16_896


def test_given_workspace_sizes_replace_the_estimate_even_when_zero():
    assert Workspace(4096, 0).forward_bytes(D) == 4096
    assert Workspace(4096, 0).backward_bytes(D) == 0
    assert Workspace(None, 1 << 20).backward_bytes(D) == 1_048_576


def test_forward_allocates_seed_offset_output_and_float32_statistics_when_a_grad_is_needed():
    """attention.cu: the philox seed and offset first, with or without dropout (an H200 with
    torch 2.11 allocated both, 8 B each, before o; the meta registration of 2.12 and 2.13
    does too), o with q's layout, softmax stats (B, H, N, 1) float32 for training, the
    forward workspace; then the references die (the saved tensors live on)."""
    assert forward(D, grad=True, ws=Workspace(0, 0)) == [
        SEED, OFFSET, OUT, LSE, free("lse", "seed", "offset")]
    assert forward(D, grad=False, ws=Workspace(0, 0)) == [
        SEED, OFFSET, OUT, free("seed", "offset")]
    events = backward(D, grad_copy=False, ws=Workspace(0, 0))
    assert events[-1] == release("lse", "seed", "offset")


def test_a_forward_workspace_lives_only_inside_the_call():
    """Allocated after the outputs and freed before autograd takes the saved tensors."""
    assert forward(D, grad=True, ws=Workspace(forward=1024)) == [
        SEED, OFFSET, OUT, LSE, workspace(1024), free("cudnn_workspace"),
        free("lse", "seed", "offset")]


def test_backward_allocates_dq_dk_dv_in_q_k_v_shapes_then_the_workspace():
    """_cudnn_attention_backward: dq, dk, dv (empty_like q, k, v), the workspace, then
    autograd releases the statistics, seed and offset."""
    assert backward(D, grad_copy=False, ws=Workspace()) == [
        DQ, DK, DV, workspace(WORK), free("cudnn_workspace"), release("lse", "seed", "offset")]


def test_a_grad_copy_comes_first_and_dies_with_the_workspace():
    """grad_out permuted to o's layout when its strides differ: a (B, H, N, d) copy."""
    done = release("lse", "seed", "offset")
    assert backward(D, grad_copy=True, ws=Workspace()) == [
        DOUT_T, DQ, DK, DV, workspace(WORK), free("dout_t", "cudnn_workspace"), done]
    assert backward(D, grad_copy=True, ws=Workspace(0, 0)) == [
        DOUT_T, DQ, DK, DV, free("dout_t"), done]
    assert backward(D, grad_copy=False, ws=Workspace(0, 0)) == [
        DQ, DK, DV, done]  # nothing of its own to free


# --- sdpa-cudnn: the protocol's step on the cuDNN backend --------------------------------------

import pytest  # noqa: E402

from memcalc.analysis.predict import predict  # noqa: E402
from memcalc.config import make_config  # noqa: E402


def cudnn_config(**options):
    sizes = dict(impl="sdpa-cudnn", seq_len=1000, heads=8, head_dim=64, dtype="bf16", batch=2)
    return make_config(**{**sizes, **options})


def test_the_step_saves_the_statistics_and_keeps_the_grads():
    """Saved: (B, H, N, 1) float32 = 2 x 8 x 1000 x 4 = 64,000 B (a 64,000-B block: a
    multiple of 512) and the seed and offset (a 512-B block each). The backward's workspace
    is the measured formula: (B H N d + B H N) x 4 + 256 = (1,024,000 + 16,000) x 4 + 256
    = 4,160,256 B."""
    b = predict(cudnn_config())
    assert b.saved_bytes == 64_000 + 2 * 512
    live = {c.name: c for c in b.backward_live}
    assert live["cudnn_workspace"].bytes == 4_160_256
    assert live["dq"].role.value == "gradient"


@pytest.mark.parametrize("options", [{}, {"causal": True}, {"loss": "sum"},
                                     {"forward_only": True}, {"head_dim": 256}])
def test_it_equals_the_trace_of_sdpa_on_the_h100_preset(options):
    """The SDPA example on the H100 preset: torch 2.13's rules pick cuDNN (preferred on sm90
    with cuDNN > 9.15), and the trace allocates what the implementation declares. The
    kernel's allocations are the model's on both sides (the tracer replays this module's
    events for the call): it checks the choice and what surrounds the call; the kernel's
    hand counts are the tests above."""
    pytest.importorskip("torch")
    from memcalc.tracing import load_function, trace
    from memcalc.validation.compare import figures_of

    c = cudnn_config(**options)
    fn = load_function("examples/attention/sdpa.py:attn")
    assert figures_of(trace(fn, c)) == figures_of(predict(c))


@pytest.mark.parametrize("options, refused", [
    (dict(dtype="fp32"), "--dtype: sdpa-cudnn: cuDNN attention takes fp16 and bf16 only"),
    (dict(deterministic=True), "--deterministic: sdpa-cudnn: torch"),
    (dict(head_dim=264), "--head-dim: sdpa-cudnn: head_dim 264 > 256"),
    (dict(head_dim=192, gpu="a100-80gb"), "--head-dim: sdpa-cudnn: head_dim 192 > 128"),
    (dict(gpu="t4"), "--gpu: sdpa-cudnn: cuDNN attention needs compute capability 8.0"),
])
def test_what_cudnn_refuses_is_one_line(options, refused):
    with pytest.raises(ValueError, match=refused):
        predict(cudnn_config(**options))
