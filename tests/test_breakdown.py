"""The result model: totals summed from the live sets, kept once made, never stale."""

import pytest
from pydantic import ValidationError

from memcalc.engine.component import Component
from memcalc.config import Config
from memcalc.engine.program import Role
from memcalc.analysis.predict import predict

ND = 8_388_608  # 8 x 16384 x 16 x 4 B: q, k, v, grad_out, out at the default shape


def _naive():
    return predict(Config(impl="naive"))


def test_totals_are_the_sums_of_the_live_sets():
    b = _naive()
    assert b.forward_peak_bytes == sum(c.allocated for c in b.forward_live)
    assert b.backward_peak_bytes == sum(c.allocated for c in b.backward_live)
    assert b.saved_bytes == sum(c.allocated for c in b.saved)
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



def test_a_component_reads_back_under_its_json_names_and_refuses_the_old_ones():
    """JSON names a component's request ``bytes`` and its block ``allocated`` (as the
    tables do); it reads back. The old names (``raw_bytes`` the request, ``bytes`` the
    block) are refused rather than read with the meanings swapped."""
    row_sum = Component(name="row_sum", role=Role.saved, op="sum", shape=(1, 1, 64, 1),
                        dtype="float32", bytes=256, allocated=512)  # 64 x 4 B; a 512 B block
    data = row_sum.to_dict()
    assert (data["bytes"], data["allocated"]) == (256, 512) and "raw_bytes" not in data
    assert Component.model_validate(data) == row_sum
    old = {k: v for k, v in data.items() if k not in ("bytes", "allocated", "formula")}
    with pytest.raises(ValidationError, match="raw_bytes"):
        Component.model_validate({**old, "raw_bytes": 256, "bytes": 512})


def test_a_component_has_one_name_per_figure_and_prints_them_labelled():
    """Python's attributes are the JSON's and CSV's keys and the tables' headings (they
    were ``nbytes`` and ``block_bytes``); ``str`` labels the block it prints."""
    c = Component(name="row_sum", role=Role.saved, op="sum", shape=(1, 1, 64, 1),
                  dtype="float32", bytes=256, allocated=512)  # 64 x 4 B; a 512 B block
    assert (c.bytes, c.allocated) == (c.to_dict()["bytes"], c.to_dict()["allocated"])
    assert str(c) == "row_sum (saved, sum): 1 x 1 x 64 x 1 x 4 B = 256 B, allocated 512 B"
    assert not hasattr(c, "nbytes") and not hasattr(c, "block_bytes")
