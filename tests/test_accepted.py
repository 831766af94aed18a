"""The values of one size an implementation accepts: one rule for its check and the solver."""

import pytest

from memcalc.impls.accepted import Accepted, every
from memcalc.config import Config
from memcalc.impls import get_impl

EIGHTS = Accepted("head_dim", step=8, most=256, kernel="a kernel", step_source="s.cpp",
                  most_source="m.cpp")


def test_the_accepted_values_around_a_value():
    assert [EIGHTS.accepts(x) for x in (0, 8, 20, 256, 264)] == [False, True, False, True, False]
    assert (EIGHTS.floor(20), EIGHTS.floor(7), EIGHTS.floor(300)) == (16, 0, 256)  # 300 -> 256
    assert (EIGHTS.after(0), EIGHTS.after(20), EIGHTS.after(248), EIGHTS.after(256)) == (
        8, 24, 256, None)  # none past the largest
    assert every("seq_len").after(19511) == 19512 and every("seq_len").floor(10**18) == 10**18


def test_a_refusal_is_one_line_naming_the_option_the_rule_and_its_source():
    with pytest.raises(ValueError, match=r"^--head-dim: k: head_dim 20 is not a multiple of 8: a kernel "
                                         r"takes no other \(s.cpp\)$"):
        EIGHTS.refuse("k", 20)
    with pytest.raises(ValueError, match=r"^--head-dim: k: head_dim 264 > 256: the largest head_dim a "
                                         r"kernel supports \(m.cpp\)$"):
        EIGHTS.refuse("k", 264)
    EIGHTS.refuse("k", 256)  # accepted: nothing raised


def test_the_fused_kernels_declare_their_head_dims():
    """FlashAttention: up to 256; memory-efficient: multiples of 8 in fp16 (4 in fp32) up
    to the largest kMaxK of its kernels, 65,536; others: every value."""
    dims = Config(dtype="fp16").dims
    flash = get_impl("sdpa-flash").rule(dims, "head_dim")
    efficient = get_impl("sdpa-efficient").rule(dims, "head_dim")
    assert (flash.step, flash.most) == (1, 256)
    assert (efficient.step, efficient.most) == (8, 65536)
    assert get_impl("sdpa-efficient").rule(Config().dims, "head_dim").step == 4  # fp32
    assert get_impl("naive").rule(dims, "head_dim") == every("head_dim")
    assert get_impl("sdpa-flash").rule(dims, "seq_len") == every("seq_len")
