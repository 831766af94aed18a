"""memcalc.analysis.quadratic: which tensors are N x M, read from how a program grows with length."""

import pytest

from memcalc.config import make_config
from memcalc.analysis.quadratic import quadratic_names, quadratic_saved
from memcalc.impls.registry import Impl, add
from memcalc.engine.program import Program, Role, free, new
from memcalc.analysis.predict import predict

T = Role.temporary


def test_naive_softmax_names_the_scores_and_their_grads():
    """(B, H, N, M) and (B*H, N, M) tensors quadruple when N and M double; the (B*H, N, D)
    output and grads, the (B, H, M, D) dk and the (B*H, D, M) dk_t only double."""
    assert quadratic_names(make_config(impl="naive-softmax")) == {
        "qk", "s", "p", "dp", "dscores", "dscores tmp", "ds"}


def test_causal_mask_counts_though_it_has_no_batch_or_heads():
    """The (N, M) bool ``ones`` and ``mask`` quadruple too: growth, not a 4-d shape, decides."""
    assert quadratic_names(make_config(impl="naive-softmax", causal=True)) == {
        "qk", "s", "ones", "mask", "s_masked", "p", "dp", "dscores", "dscores tmp", "ds_masked",
        "ds"}


def test_a_rank_under_ulysses_holds_every_rows_scores():
    """DeepSpeed-Ulysses' math path: each rank's local attention has every row of its heads,
    so its scores grow as the whole sequence's N x N (read from the rank's program, not
    one GPU's); under torch's ring the flash kernel makes none."""
    ulysses = make_config(impl="naive-softmax", heads=4, seq_len=8192, cp=2,
                          cp_method="ulysses")
    assert quadratic_names(ulysses) == {f"local: {n}" for n in (
        "qk", "s", "p", "dp", "dscores", "dscores tmp", "ds")}
    ring = make_config(impl="sdpa-flash", heads=4, seq_len=8192, cp=2, causal=True,
                       dtype="bf16")
    assert quadratic_names(ring) == frozenset()


def test_phi_q_is_not_n_x_m_when_head_dim_equals_the_probe_length():
    """linear at head_dim 4096: phi_q is (8, 1, 4096, 4096) at the probe, like an N x N
    tensor, but (8, 1, 8192, 4096) at twice the length: 2x, under the 3x rule."""
    assert quadratic_names(make_config(impl="linear", head_dim=4096)) == frozenset()


def test_the_answer_does_not_depend_on_the_configured_length():
    """Names are read at N = M = 4096 -> 8192 whatever the configuration's length. At 16
    rows linear-causal-chunked is one chunk (16, then 32 rows) whose (c, c) scores
    quadruple; at the probe it loops over 64, then 128 chunks of 64: names change, none count."""
    assert quadratic_names(make_config(impl="linear-causal-chunked", seq_len=16)) == frozenset()
    assert quadratic_names(make_config(impl="naive-softmax", seq_len=16, kv_len=48)) == (
        quadratic_names(make_config(impl="naive-softmax")))


@pytest.fixture
def toy_impls(scratch_register):
    """Two programs with an (N, M) ``scores``: one loops over 1,024-row chunks, one also
    allocates an empty tensor and a constant one."""
    def chunked(d):
        events = [new("scores", (d.N, d.M), "float32", T, "mm")]
        for i in range(d.N // 1024):
            events += [new(f"c{i}", (1024, d.D), "float32", T, "mm"), free(f"c{i}")]
        return Program(tuple(events + [free("scores")]), ())

    def with_empty(d):
        return Program((new("scores", (d.N, d.M), "float32", T, "mm"),
                        new("empty", (0, d.N, d.M), "float32", T, "new_empty"),
                        new("workspace", (1024,), "uint8", T, "empty"),
                        free("scores", "empty", "workspace")), ())

    scratch_register("test-quadratic-chunked", "an (N, M) tensor, then chunks", chunked)
    scratch_register("test-quadratic-empty", "(N, M), empty and constant", with_empty)


def test_a_loop_over_chunks_counts_nothing(toy_impls):
    """4 chunks at the probe, 8 at twice it: the names differ, so even ``scores`` is not
    counted (the docstring's rule: nothing is N x M when the tensors change with length)."""
    assert quadratic_names(make_config(impl="test-quadratic-chunked")) == frozenset()


def test_empty_and_constant_tensors_are_not_n_x_m(toy_impls):
    """``empty`` is 0 B at both lengths (0 <= 3 x 0 would pass without the 0 < guard);
    ``workspace`` stays 1,024 B (3 x 1,024 > 1,024)."""
    assert quadratic_names(make_config(impl="test-quadratic-empty")) == {"scores"}


def test_quadratic_saved_counts_the_saved_mask_and_weights():
    """Causal naive-softmax saves ``mask`` (for masked_fill) and ``p``: both N x M."""
    b = predict(make_config(impl="naive-softmax", causal=True, seq_len=64))
    assert sorted(c.name for c in b.saved) == ["mask", "p"]
    assert quadratic_saved(b) == 2  # mask and p


def test_quadratic_saved_ignores_phi_q_shaped_like_n_x_n():
    """linear at N = D = 64 saves phi_q and phi_k of (8, 1, 64, 64) and num (8, 64, 64):
    square like scores, but linear in N; none is counted."""
    b = predict(make_config(impl="linear", seq_len=64, head_dim=64))
    assert {"phi_q", "phi_k", "num"} <= {c.name for c in b.saved}
    assert quadratic_saved(b) == 0


def test_a_re_registered_implementation_is_read_anew(scratch_register):
    """A function traced again is registered anew under its name (``add(replace=True)``):
    its N x M tensors are those of the new program, not a cached answer for the name."""
    def program(shape):
        return lambda d: Program((new("x", shape(d), "float32", T, "mm"), free("x")), ())

    scratch_register("test-quadratic-retraced", "(N, M), then (N, 4)",
                     program(lambda d: (d.N, d.M)))
    config = make_config(impl="test-quadratic-retraced")
    assert quadratic_names(config) == {"x"}  # (N, M): 4x when both double
    add(Impl("test-quadratic-retraced", "(N, 4)", program(lambda d: (d.N, 4)), traced=False),
        replace=True)
    assert quadratic_names(config) == frozenset()  # (N, 4): 2x
