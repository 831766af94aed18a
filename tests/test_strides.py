"""memcalc.engine.strides: whether torch copies a permuted view, read against torch itself
on the meta device (its strides are the real ones; no memory is touched)."""

import pytest

from memcalc.engine.strides import contiguous_after, merges, permuted


@pytest.mark.parametrize("shape, order, contiguous", [
    ((2, 3, 4, 5, 6), (2, 0, 1, 3, 4), False),
    ((1, 1, 4, 5, 6), (2, 0, 1, 3, 4), True),  # B = n = 1: P moves over sizes of 1
    ((1, 4, 3, 5, 6), (1, 0, 2, 3, 4), True),  # B = 1
    ((4, 1, 3, 5, 6), (1, 2, 0, 3, 4), False),
    ((4, 1, 1, 5, 6), (1, 2, 0, 3, 4), True),
    ((2, 1, 7, 8), (0, 2, 1, 3), True),  # one head: (B, H, N, D) seen (B, N, H, D)
    ((2, 3, 8, 7), (0, 3, 1, 2), False),  # k^T's grad memory (B, H, D, M) seen (B, M, H, D)
])
def test_a_permute_is_contiguous_as_torch_says(shape, order, contiguous):
    torch = pytest.importorskip("torch")
    assert torch.empty(shape, device="meta").permute(order).is_contiguous() == contiguous
    assert contiguous_after(shape, order) == contiguous


# (B, N, H, D) memory seen (B, H, N, D) (q after .transpose(1, 2)) or (B, H, D, N) (k^T)
@pytest.mark.parametrize("shape", [(2, 5, 3, 4), (1, 5, 3, 4), (2, 1, 3, 4), (2, 5, 1, 4),
                                   (3, 7, 2, 8)])
@pytest.mark.parametrize("order", [(0, 2, 1, 3), (0, 2, 3, 1), (0, 1, 2, 3)])
def test_merging_batch_and_heads_is_a_view_where_torch_views(shape, order):
    """``view`` succeeds exactly where ``merges`` says reshape needs no copy."""
    torch = pytest.importorskip("torch")
    seen = torch.empty(shape, device="meta").permute(order)
    b, h, x, y = seen.shape
    try:
        seen.view(b * h, x, y)
        viewed = True
    except RuntimeError:
        viewed = False
    assert merges(shape, order, 0) == viewed
    assert permuted(shape, order) == tuple(seen.shape)
