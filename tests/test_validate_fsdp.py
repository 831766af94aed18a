"""The FSDP2 steps of validation (``memcalc/validation/fsdp.py``): every rank a case, its
fitted program (``oom --trace --fsdp``) equal to a direct trace of torch's FSDP2 code."""

import pytest

pytest.importorskip("torch")

from memcalc.validation import fsdp  # noqa: E402
from memcalc.validation.modelcode import fitted_checks  # noqa: E402


def test_every_rank_of_every_setup_is_a_case():
    codes = fsdp.fsdp_code()
    assert len(codes) == sum(s.world for _, s, _ in fsdp.SETUPS)  # 2 + 3 + 4 + 2 = 11
    assert codes["fsdp3-lm-adamw:r2"].calling.rank == 2


def test_the_uneven_last_rank_fitted_equals_its_trace():
    """Over 3 ranks the vocabulary's 1,024 rows shard as 342, 342, 340: rank 2 holds fewer,
    and its program, fitted at 61 to 257 rows, is its trace at 300 and 1,000, figure by
    figure (the allocator's per-stream pools included: without them its forward peak is
    off by the blocks FSDP's buffers share)."""
    key = "fsdp3-lm-adamw:r2"
    codes = {key: fsdp.fsdp_code()[key]}
    checks = fitted_checks(codes, {key: fsdp.register()[key]}, "fsdp")
    assert len(checks) == 2
    for check in checks:
        assert check.predicted == check.measured
