"""``memcalc.tracing.cudnn``: what PyTorch allocates around a cuDNN attention call."""

from memcalc.engine.dims import Dims
from memcalc.engine.program import Role, free, release
from memcalc.tracing.cudnn import Workspace, backward, forward

# B=2, H=4 query heads, Hk=2 key/value heads, N=8 query rows, M=24 key rows, d=16, bf16:
# query-side and key-side sizes differ (H x N = 32, Hk x M = 48), so a shape read from the
# wrong side is caught
D = Dims(B=2, H=4, N=8, M=24, D=16, dtype="bfloat16", causal=False, loss="grad", Hk=2,
         chunk=64)
BF16 = "bfloat16"
OUT = ("out", (2, 4, 8, 16), BF16, Role.output, "empty", 2048)  # 2 x 4 x 8 x 16 x 2 B
LSE = ("lse", (2, 4, 8, 1), "float32", Role.saved, "empty", 256)  # 2 x 4 x 8 x 1 x 4 B
SEED = ("seed", (1,), "int64", Role.saved, "empty", 8)  # one int64
OFFSET = ("offset", (1,), "int64", Role.saved, "empty", 8)
T = Role.temporary
DQ = ("dq", (2, 4, 8, 16), BF16, T, "empty_like", 2048)  # (B, H, N, d): 2 x 4 x 8 x 16 x 2 B
DK = ("dk", (2, 2, 24, 16), BF16, T, "empty_like", 3072)  # (B, Hk, M, d): 2 x 2 x 24 x 16 x 2 B
DV = ("dv", (2, 2, 24, 16), BF16, T, "empty_like", 3072)
# the default backward workspace: (B*H*N*d + B*H*N) x 4 B = (2 x 4 x 8 x 16 + 2 x 4 x 8) x 4 B
WORK = 4352
DOUT_T = ("dout_t", (2, 4, 8, 16), BF16, T, "permute", 2048)  # o's layout, as dq


def workspace(nbytes: int) -> tuple:
    return ("cudnn_workspace", (nbytes,), "uint8", T, "allocate", nbytes)


def test_default_workspace_is_none_forward_and_a_float32_dq_accumulator_backward():
    """The stated estimate: 0 B forward; (B*H*N*d + B*H*N) x 4 B backward, over query
    heads and rows (dQ's shape), not the key/value ones."""
    assert Workspace().forward_bytes(D) == 0
    assert Workspace().backward_bytes(D) == 4352  # (2 x 4 x 8 x 16 + 2 x 4 x 8) x 4 B


def test_given_workspace_sizes_replace_the_estimate_even_when_zero():
    assert Workspace(4096, 0).forward_bytes(D) == 4096
    assert Workspace(4096, 0).backward_bytes(D) == 0
    assert Workspace(None, 1 << 20).backward_bytes(D) == 1_048_576


def test_forward_allocates_the_output_and_float32_statistics_only_when_a_grad_is_needed():
    """attention.cu: o with q's layout; softmax stats (B, H, N, 1) float32 for training,
    handed to autograd (free: the Python reference dies, the saved tensor lives on)."""
    assert forward(D, grad=True, dropout=False, ws=Workspace()) == [OUT, LSE, free("lse")]
    assert forward(D, grad=False, dropout=False, ws=Workspace()) == [OUT]


def test_dropout_adds_a_philox_seed_and_offset_saved_until_the_backward_releases_them():
    assert forward(D, grad=True, dropout=True, ws=Workspace()) == [
        OUT, LSE, SEED, OFFSET, free("lse", "seed", "offset")]
    assert forward(D, grad=False, dropout=True, ws=Workspace()) == [
        OUT, SEED, OFFSET, free("seed", "offset")]
    events = backward(D, grad_copy=False, dropout=True, ws=Workspace(0, 0))
    assert events[-1] == release("lse", "seed", "offset")


def test_a_forward_workspace_lives_only_inside_the_call():
    """Allocated after the outputs and freed before autograd takes the saved tensors."""
    assert forward(D, grad=True, dropout=False, ws=Workspace(forward=1024)) == [
        OUT, LSE, workspace(1024), free("cudnn_workspace"), free("lse")]


def test_backward_allocates_dq_dk_dv_in_q_k_v_shapes_then_the_workspace():
    """_cudnn_attention_backward: dq, dk, dv (empty_like q, k, v), the workspace, then
    autograd releases the statistics."""
    assert backward(D, grad_copy=False, dropout=False, ws=Workspace()) == [
        DQ, DK, DV, workspace(WORK), free("cudnn_workspace"), release("lse")]


def test_a_grad_copy_comes_first_and_dies_with_the_workspace():
    """grad_out permuted to o's layout when its strides differ: a (B, H, N, d) copy."""
    assert backward(D, grad_copy=True, dropout=False, ws=Workspace()) == [
        DOUT_T, DQ, DK, DV, workspace(WORK), free("dout_t", "cudnn_workspace"), release("lse")]
    assert backward(D, grad_copy=True, dropout=False, ws=Workspace(0, 0)) == [
        DOUT_T, DQ, DK, DV, free("dout_t"), release("lse")]
    assert backward(D, grad_copy=False, dropout=False, ws=Workspace(0, 0)) == [
        DQ, DK, DV, release("lse")]  # nothing of its own to free
