"""The result model: totals summed from the live sets, kept once made, never stale."""

from memcalc.config import Config
from memcalc.timeline import predict

ND = 8_388_608  # 8 x 16384 x 16 x 4 B: q, k, v, grad_out, out at the default shape


def _naive():
    return predict(Config(impl="naive"))


def test_totals_are_the_sums_of_the_live_sets():
    b = _naive()
    assert b.forward_peak_bytes == sum(c.block_bytes for c in b.forward_live)
    assert b.backward_peak_bytes == sum(c.block_bytes for c in b.backward_live)
    assert b.saved_bytes == sum(c.block_bytes for c in b.saved)
    assert b.peak_bytes == max(b.forward_peak_bytes, b.backward_peak_bytes)


def test_a_copy_with_other_live_sets_sums_its_own():
    b = _naive()
    assert b.forward_peak_bytes > ND  # read: now kept by b
    q = next(c for c in b.forward_live if c.name == "q")
    copy = b.model_copy(update={"forward_live": (q,), "saved": ()})
    assert (copy.forward_peak_bytes, copy.saved_bytes) == (ND, 0)  # q alone; nothing saved
    assert copy.backward_peak_bytes == b.backward_peak_bytes  # the same backward live set
    assert b.model_copy().forward_peak_bytes == b.forward_peak_bytes  # a plain copy keeps them


def test_kept_sums_change_neither_equality_nor_output():
    read, fresh = _naive(), _naive()
    assert read.peak_bytes > 0  # sums kept by ``read`` only
    assert read == fresh and hash(read) == hash(fresh)
    assert read.to_dict() == fresh.to_dict()
