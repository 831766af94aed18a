"""``memcalc.tracing.tracer``: what a kernel allocates inside itself that the meta kernel
does not (``CUDA_TEMPORARIES``), checked against the installed torch's own CPU kernels."""

import pytest

torch = pytest.importorskip("torch")

from memcalc.config import make_config  # noqa: E402
from memcalc.tracing import trace  # noqa: E402
from memcalc.tracing.tracer import _reduced_input  # noqa: E402


def test_the_installed_torch_sums_a_bool_tensor_through_an_int64_copy():
    """torch.profiler on the CPU kernel (ReduceOpsUtils.h make_reduction_from_out_ty):
    ``sum`` of a bool tensor calls ``aten::to`` into int64; of a float one, no copy."""
    from torch.profiler import ProfilerActivity, profile

    def ops(x):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            x.sum(dim=-1)
        return {e.key for e in prof.key_averages()}

    assert "aten::_to_copy" in ops(torch.ones(64, 64, dtype=torch.bool))
    assert "aten::_to_copy" not in ops(torch.ones(64, 64))


def test_the_tracer_adds_the_copy_only_where_the_dtypes_differ():
    meta = dict(device="meta")
    summed = torch.empty(4, dtype=torch.int64, **meta)
    assert _reduced_input(summed, torch.empty(4, 8, dtype=torch.bool, **meta)).dtype == torch.int64
    assert _reduced_input(summed, torch.empty(4, 8, dtype=torch.int64, **meta)) is None
    # CUDA reads half and bfloat16 as they are into a float32 sum
    as_f32 = torch.empty(4, **meta)
    assert _reduced_input(as_f32, torch.empty(4, 8, dtype=torch.bfloat16, **meta)) is None


def _block_mask_step(q, k, v):
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    create_block_mask(causal, None, None, q.shape[2], k.shape[2], device=q.device)
    return q * 2


def test_eager_create_block_mask_holds_a_bool_mask_its_padded_copy_and_an_int64_copy():
    """N = 1,000: the forward peak is inside the block sum: q, k, v, grad_out (4 x 1,000 x
    16 x 4 = 256,000 B), the mask_mod's (1000, 1000) bool (1,000,000 B: a 1,000,448-B
    block), its pad to (1, 1, 1024, 1024) bool (1,048,576 B), that padded mask as int64
    (8 x 1,048,576 = 8,388,608 B) and the sums, (1, 1, 8, 8) int64 (512 B)."""
    config = make_config(impl="naive", seq_len=1000, batch=1, heads=1, head_dim=16)
    traced = trace(_block_mask_step, config)
    assert traced.forward_peak_bytes == 256_000 + 1_000_448 + 1_048_576 + 8_388_608 + 512
    copy = [c for c in traced.forward_live if c.dtype == "int64" and c.op == "to"]
    assert [c.shape for c in copy] == [(1, 1, 8, 8, 128, 128)]
