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


def _bias_grad_step(q, k, v):
    """A Linear's bias gradient in miniature: q (1, 1, 2048, 768) summed over its rows."""
    return q.sum(dim=(0, 1, 2)) * 1.0


def test_a_sum_split_across_blocks_holds_its_buffer_and_semaphores_at_the_peak():
    """q, k, v and the output grad (1 x 1 x 2,048 x 768 x 4 B = 6,291,456 B each, but the
    output's grad is (768,)): the sum over 2,048 rows of 768 features takes 768 x 32 blocks
    x 32 lanes x 4-wide x 4 B = 12,582,912 B of staging and 6 x 4 B of semaphores (a
    512-B block) beside its (768,) result (3,072 B), as an H200 measured (H100: the same
    132 SMs)."""
    config = make_config(impl="naive", seq_len=2048, batch=1, heads=1, head_dim=768,
                         loss="sum")
    traced = trace(_bias_grad_step, config)
    inputs = 3 * 6_291_456
    assert traced.forward_peak_bytes == inputs + 3_072 + 12_582_912 + 512
    names = sorted(c.name.split(" (")[0] for c in traced.forward_live)
    assert "sum split-reduction buffer" in names and "sum semaphores" in names


def test_bmm_clones_an_operand_cublas_cannot_read():
    """``prepare_batch_matrix_for_cublas`` (Blas.cpp): a stride-0 expand of k is cloned
    (1 x 16 x 8 x 4 B = 512 B) for the call, after the (1, 64, 8) result (2,048 B)."""
    from memcalc.tracing.tracer import _bmm_copies

    meta = dict(device="meta")
    a = torch.empty(1, 64, 16, **meta)
    b = torch.empty(1, 16, 1, **meta).expand(1, 16, 8)
    out = torch.empty(1, 64, 8, **meta)
    copies = _bmm_copies(None, out, a, b)
    assert [tuple(c.shape) for c in copies] == [(1, 16, 8)]
    assert _bmm_copies(None, out, a, torch.empty(1, 16, 8, **meta)) == []
    assert _bmm_copies(None, out, a, torch.empty(1, 8, 16, **meta).transpose(1, 2)) == []


def test_mm_clones_only_an_operand_neither_dense_nor_unit_strided():
    from memcalc.tracing.tracer import _mm_copies

    meta = dict(device="meta")
    a = torch.empty(64, 16, **meta)
    expanded = torch.empty(16, 1, **meta).expand(16, 8)  # strides (1, 0): neither
    assert [tuple(c.shape) for c in _mm_copies(None, None, a, expanded)] == [(16, 8)]
    assert _mm_copies(None, None, a, torch.empty(8, 16, **meta).t()) == []


def _linear_step(q, k, v):
    weight = torch.ones(64, 64, device=q.device)
    bias = torch.ones(64, device=q.device)
    return torch.nn.functional.linear(q.reshape(-1, 64), weight, bias).view(q.shape)


@pytest.mark.parametrize("release, lt_bytes", [("2.11", 1 << 20), ("2.13", 0)])
def test_addmm_with_a_bias_takes_a_cublaslt_workspace_of_its_own_through_2_11(release,
                                                                              lt_bytes):
    """Measured on an H200 with torch 2.11: the first addmm with a bias vector allocates
    1 MiB for cuBLASLt after the 32 MiB cuBLAS workspace; from 2.12 they are one."""
    from memcalc.tracing import TraceOptions
    from memcalc.impls.sdpa_select import Release

    config = make_config(impl="naive", seq_len=128, batch=1, heads=1, head_dim=64)
    traced = trace(_linear_step, config, TraceOptions(release=Release.of(release)))
    lt = [c for c in traced.forward_live if c.name.startswith("cuBLASLt workspace")]
    assert sum(c.bytes for c in lt) == lt_bytes


class Embedded(torch.nn.Module):
    """A token embedding of 1,000 rows of 64, summed: its backward is the embedding's."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(1000, 64)

    def forward(self, ids):
        return self.emb(ids).sum()


@pytest.mark.parametrize("rows, sorted_", [(1536, False), (1537, True)])
def test_the_embedding_backward_sorts_past_3072_indices(rows, sorted_):
    """Batch 2: 3,072 indices take CUDA's one-kernel path, 3,074 the sort and segment sums
    (``memcalc.impls.embedding``), whose buffers are alive at the backward's peak with
    the grad: 3,074 / 10 + 1,000 = 1,307 partial sums of 64 floats among them."""
    import memcalc

    b = memcalc.trace(Embedded(), inputs={"ids": ("B", "N", "int64")}, seq_len=rows, batch=2)
    names = {c.name.split(" (")[0]: c for c in b.backward_live}
    partial = names.get("embedding grad_weight_per_segment")
    assert (partial is not None) == sorted_
    if sorted_:
        assert partial.shape == (1307, 64) and partial.bytes == 1307 * 64 * 4
        assert "emb.weight.grad" in names
