"""Values of small integer and bool tensors in a trace (``memcalc/tracing/shadows.py``):
reads that code makes on the way (a mask's ``.all()``) answered as on a GPU."""

import pytest

torch = pytest.importorskip("torch")

from memcalc.tracing.tracer import Tracer  # noqa: E402
from memcalc.tracing.shadows import LIMIT  # noqa: E402


def traced(fn):
    """``fn()`` run under a tracer on the meta device, its result."""
    with Tracer(0):
        return fn()


def test_a_mask_made_on_the_way_is_read_as_it_would_be():
    def padded():
        mask = torch.ones(2, 8, dtype=torch.int64, device="meta")
        mask[0, 6:] = 0  # in place on a shadowed tensor: followed
        return bool(mask.bool().all()), int(mask.sum()), mask.sum().item() == mask.numel()

    assert traced(padded) == (False, 14, False)
    ones = lambda: bool(torch.ones(2, 8, dtype=torch.bool, device="meta").all())  # noqa: E731
    assert traced(ones) is True


def test_position_ids_and_their_differences():
    """transformers' find_packed_sequence_indices: one sequence when the position ids step
    by one (``(diff != 1).cumsum(-1)``'s last is 0)."""
    def packed():
        pos = torch.arange(16, device="meta").unsqueeze(0)
        first = (pos[:, 1:] - pos[:, :-1]) != 1
        return bool((first.cumsum(-1)[:, -1] == 0).all())

    assert traced(packed) is True


def test_floating_data_has_no_values():
    def read():
        return torch.randn(4, device="meta").sum().item()

    with pytest.raises(RuntimeError, match="cannot be called on meta tensors"):
        traced(read)


def test_a_copy_to_the_host_holds_the_values():
    host = traced(lambda: torch.arange(5, device="meta").cpu())
    assert host.device.type == "cpu" and host.tolist() == [0, 1, 2, 3, 4]


def test_large_tensors_are_not_shadowed():
    def read():
        return bool(torch.ones(LIMIT + 1, dtype=torch.bool, device="meta").all())

    with pytest.raises(RuntimeError, match="cannot be called on meta tensors"):
        traced(read)


def test_an_in_place_write_of_unknown_values_forgets():
    def write():
        mask = torch.ones(8, dtype=torch.bool, device="meta")
        mask &= torch.randn(8, device="meta") > 0  # floats: no values
        return bool(mask.all())

    with pytest.raises(RuntimeError, match="cannot be called on meta tensors"):
        traced(write)
