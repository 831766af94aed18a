"""The closed form of a step: the raw bytes alive at its peak as a quadratic in a field."""

from fractions import Fraction

from memcalc.config import Config
from memcalc.analysis.closed_form import live_polynomial
from memcalc.analysis.predict import predict


def test_closed_form_of_the_seeds_step():
    """Alive at the naive backward peak (B=8, H=1, d=16, fp32): six N x N fp32 tensors,
    8 x 4 x 6 = 192 B per N^2; argmax (8 x 8 B), row sum (8 x 4 B) and six (8, N, 16) fp32
    tensors (q, k, v, grad_out, out, dv: 6 x 512 B) = 3,168 B per N; two 32 MiB workspaces."""
    q = live_polynomial(Config(impl="naive", shape={"seq_len": 4096}), "seq_len")
    assert (q.a, q.b, q.c) == (192, 3168, 67_108_864) and q.exact
    assert q.text() == "192*N^2 + 3,168*N + 67,108,864"
    assert q(16384) == 51_658_620_928  # the peak at N=16384: every tensor a multiple of 512 B


def test_closed_form_of_a_loop_counts_the_chunks_it_adds():
    """linear-causal-chunked at 640 rows (10 chunks of 64): the polynomial is fitted on
    replays at 640, 1280 and 2560 rows and holds at 1920, where the step keeps 30 chunks'
    tensors, not the 10 whose names it had at 640."""
    config = Config(impl="linear-causal-chunked", shape={"seq_len": 640})
    q = live_polynomial(config, "seq_len")
    at_1920 = predict(config.replace(seq_len=1920))
    assert q.exact and q(1920) == sum(c.bytes for c in at_1920.components)
    assert q.a == 0  # linear: each chunk adds the same tensors


def test_text_leaves_out_zero_terms_exact_or_rounded():
    """A zero coefficient is no term (the oom report's rounded form printed ``0*d^2``); one
    that rounds to 0.00 stays, as its exact fraction (flex's BlockMask, 1/1,024 N^2, is
    gigabytes at a million rows: left out, the line did not add up to the answer)."""
    from memcalc.analysis.closed_form import Quadratic

    def form(a, b, c, exact=True):
        return Quadratic(symbol="d", a=a, b=b, c=c, exact=exact, at=64, points=(16, 32, 64),
                         components=())

    assert form(0, 28_836_096, 1_048_576).text() == "28,836,096*d + 1,048,576"
    fractional = form(0, Fraction(3, 2), -7, exact=False)
    assert fractional.text() == "3/2*d - 7 (fit)"
    assert fractional.text(places=2) == "1.50*d - 7"  # 3/2 = 1.50; no "0*d^2"
    # 1/1000 rounds to 0.00: its fraction; -1/3 = -0.33 keeps its sign in the operator
    assert form(Fraction(1, 1000), Fraction(-1, 3), 0).text(places=2) == "1/1,000*d^2 - 0.33*d"
    assert form(0, 0, 0).text() == "0"


def test_json_coefficients_are_integers_over_one_denominator():
    """Exact closed forms sum sizes that are products of the dimensions: integer
    coefficients, denominator 1. A fit's are fractions: -41/1,875, 790,568/125 and
    -128,128/3 over lcm(1,875, 125, 3) = 1,875 (3 x 5^4) are -41, 790,568 x 15 =
    11,858,520 and -128,128 x 625 = -80,080,000, exact."""
    from memcalc.analysis.closed_form import Quadratic

    naive = live_polynomial(Config(impl="naive", shape={"seq_len": 4096}), "seq_len")
    assert {k: naive.to_dict()[k] for k in ("a", "b", "c", "denominator", "exact")} == {
        "a": 192, "b": 3168, "c": 67_108_864, "denominator": 1, "exact": True}
    fit = Quadratic(symbol="N", a=Fraction(-41, 1875), b=Fraction(790_568, 125),
                    c=Fraction(-128_128, 3), exact=False, at=1000, points=(1000, 2000, 4000),
                    components=())
    assert fit.text() == "-41/1,875*N^2 + 790,568/125*N - 128,128/3 (fit)"
    assert fit.coefficients() == {"a": -41, "b": 11_858_520, "c": -80_080_000,
                                  "denominator": 1875}
    assert (-41 * 3000**2 + 11_858_520 * 3000 - 80_080_000) / Fraction(1875) == fit(3000)


def test_a_padded_kernel_is_fitted_where_its_padding_is_none():
    """sdpa-efficient at 1,000 rows (B=8, H=1, d=16, fp32) pads its logsumexp to 32 rows and
    its dQ tiles to 64: the quadratic through 1,000, 2,000 and 4,000 rows was
    -41/1,875*N^2 + 790,568/125*N - 128,128/3, a negative N^2 on a kernel with no N^2
    memory. Refitted at multiples of 512 (512, 1,024, 2,048; exact there and at 1,536) it
    is the kernel's bytes per row: q, k, v, grad_out, out, dq, dk, dv 8 x (8 x 16 x 4) =
    4,096, lse and the delta rowsum 2 x 8 x 4 = 64, the dQ tiles' workspace
    8 x 4 x (4 + 64 x 64) / 64 = 2,050: 6,210*N, marked a fit (at 1,000 rows the padding
    adds 6,259,968 - 6,210,000 = 49,968 B: workspace 2,099,200 (16 tiles) + 8 x 512,000
    + lse 32,768 (1,024 rows) + rowsum 32,000)."""
    fit = live_polynomial(Config(impl="sdpa-efficient", shape={"seq_len": 1000}), "seq_len")
    assert (fit.a, fit.b, fit.c, fit.exact, fit.points) == (0, 6210, 0, False, (512, 1024, 2048))
    assert fit.text() == "6,210*N (fit)"
    at_1000 = predict(Config(impl="sdpa-efficient", shape={"seq_len": 1000}))
    assert sum(c.bytes for c in at_1000.components) - fit(1000) == 49_968


def test_a_negative_square_term_is_never_fitted():
    """Sizes are never negative, so no sum of them has a negative N^2 term: a size padded to
    128 rows (4 B a row) through 1,100, 2,200 and 4,400 rows (1,152, 2,304 and 4,480 rows:
    4,608, 9,216 and 17,920 B) bends down, (17,920 - 9,216) / 2,200 < (9,216 - 4,608) /
    1,100; the fit is the line through the outermost points instead: (17,920 - 4,608) /
    3,300 = 3,328/825 B a row, and 4,608 - 3,328/825 x 1,100 = (13,824 - 13,312)/3 = 512/3 B,
    a fit (it misses 2,200)."""
    from math import ceil

    from memcalc.analysis.closed_form import _fitted

    (a, b, c), exact, points = _fitted(lambda x: 4 * ceil(x / 128) * 128,
                                       (1100, 2200, 4400), 3300, None)
    assert (a, b, c, exact, points) == (0, Fraction(3328, 825), Fraction(512, 3), False,
                                        (1100, 2200, 4400))


def test_a_name_declared_twice_counts_the_declaration_alive_at_the_peak():
    """cuDNN's workspace is declared in the forward (256 B) and again in the backward (the
    float32 dQ accumulator and statistics): the closed form followed the first and left
    the backward's out, 41,088*N + 272 where the step needs 73,984*N + 272 (B=1, 32 heads
    of 128 over 8, bf16: q, out, grad_out, dq 4 x 32 x 128 x 2 = 32,768; k, v, dk, dv
    4 x 8 x 128 x 2 = 8,192; lse 32 x 4 = 128; the workspace 32 x 128 x 4 + 32 x 4 =
    16,512, plus 2 x 32 x 128 x 2 = 16,384 for the grouped heads, dK and dV at every
    query head: 73,984 per row)."""
    import memcalc
    from memcalc.analysis.closed_form import live_polynomial

    c = memcalc.make_config(impl="sdpa-cudnn", batch=1, heads=32, kv_heads=8, head_dim=128,
                            dtype="bf16", causal=True, seq_len=65_536)
    q = live_polynomial(c, "seq_len")
    assert (q.a, q.b, q.exact) == (0, 32_768 + 8_192 + 128 + 16_512 + 16_384, True)


def test_under_context_parallelism_it_is_the_busiest_ranks():
    """cuDNN's ring over 8 ranks, grouped heads, causal: rank 1's step is the busiest, and
    its ring steps hold other blocks than rank 0's (its step-1 workspace, dq, dk, dv are
    another size). Fitted on rank 0's declarations the form had no match for them and the
    oom report printed none; on the shown rank's it holds at N and at 3N (a replay)."""
    from memcalc.config import make_config

    config = make_config(impl="sdpa-cudnn", dtype="bf16", heads=32, kv_heads=8, head_dim=128,
                         batch=1, causal=True, cp=8, seq_len=65_536)
    b = predict(config)
    assert b.rank == 1
    q = live_polynomial(config, "seq_len", b)
    assert q is not None and q.exact
    assert q(65_536) == sum(c.bytes for c in b.components)
    at_3n = predict(config.replace(seq_len=3 * 65_536))
    assert at_3n.rank == 1 and q(3 * 65_536) == sum(c.bytes for c in at_3n.components)
