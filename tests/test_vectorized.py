"""The vectorized path equals ``predict`` to the byte, and says where it falls back."""

import numpy as np
import pytest

import memcalc.analysis.vectorized as V
from memcalc.config import Config
from memcalc.impls import impl_names
from memcalc.engine.program import Program, Role, new
from memcalc.analysis.predict import predict
from memcalc.analysis.vectorized import classify, evaluate
from toy_programs import one_event_pair_per_64_rows

FIGURES = ("saved_bytes", "forward_peak_bytes", "backward_peak_bytes", "peak_bytes",
           "reserved_peak_bytes")


@pytest.fixture
def eager(monkeypatch):
    """Record paths even for tiny grids (by default they take the scalar replay)."""
    monkeypatch.setattr(V, "SCALAR_BELOW", 2)
    monkeypatch.setattr(V, "SCALAR_TAIL", 0)
    V._EVALUATORS.clear()
    yield
    V._EVALUATORS.clear()


def at(config, **shape):
    return config.model_copy(update={"shape": config.shape.model_copy(update=shape)})


def assert_exact(base, figures, axes):
    for i in range(len(figures)):
        b = predict(at(base, **{k: int(np.ravel(v)[i]) for k, v in axes.items()}))
        assert {k: int(getattr(figures, k)[i]) for k in FIGURES} == b.figures(), (base.impl, i)


# --- exactness ----------------------------------------------------------------------------

@pytest.mark.parametrize("impl", impl_names())
def test_random_grid_equals_predict(eager, impl):
    """Every registered implementation (fp32, or bf16 if it has no fp32), random shapes (a
    masked one, flex, with a causal BlockMask, from 128 rows: its kernel's least)."""
    rng = np.random.default_rng(sum(map(ord, impl)))
    masked = impl == "flex"  # it needs a BlockMask
    axes = dict(seq_len=rng.integers(128 if masked else 1, 2500, 24), batch=rng.integers(1, 9, 24),
                heads=rng.choice([1, 2, 4], 24), head_dim=rng.choice([16, 32, 64, 128], 24))
    for dtype in ("fp32", "bf16"):
        base = Config(impl=impl, dtype=dtype, mask="causal" if masked else "none")
        try:
            figures = evaluate(base, **axes)
        except ValueError:
            continue  # this dtype is not supported: try the next
        assert "unmodelled" not in figures.fallback
        assert_exact(base, figures, axes)
        return
    pytest.fail(f"{impl} accepts neither fp32 nor bf16")


def test_large_lengths_follow_few_paths(eager):
    """The seeds' shape at every length from 16,000 to 16,640: every allocator decision
    (unsplit 2 MiB remainders, best fit among cached blocks) is a guard, so the lengths
    share a handful of recorded paths, all exact."""
    base = Config(impl="naive")
    n = np.arange(16000, 16641)
    figures = evaluate(base, seq_len=n)
    assert figures.fallback == {}
    assert len(set(figures.path.tolist())) <= 64
    sample = n[::37]
    assert_exact(base, evaluate(base, seq_len=sample), {"seq_len": sample})


def test_seeds_benchmark_figures():
    # B=8 H=1 N=16384 d=16 fp32: NN = 8 x 16384^2 x 4 = 8,589,934,592; ND = 8,388,608;
    # workspaces 2 x 32 MiB (H100); the same arithmetic as tests/test_replay.py
    NN, ND, ROW, IDX, WS = 8_589_934_592, 8_388_608, 524_288, 1_048_576, 33_554_432
    figures = evaluate(Config(impl="naive"), seq_len=[1024, 16384], head_dim=16)
    row = figures.row(1)
    assert row["saved_bytes"] == 2 * NN + ROW + IDX  # exp_x, p, row sum, argmax
    assert row["peak_bytes"] == 6 * NN + IDX + ROW + 2 * WS + 6 * ND  # 51,658,620,928
    assert row["quadratic_bytes"] == 6 * NN  # the six N x N tensors alive at the peak


def test_overflow_takes_python_integers():
    # p: 4096 x 1 x 2^22 x 2^22 x 4 B = 2^58, beyond what the int64 forms may sum
    figures = evaluate(Config(impl="naive-softmax"), seq_len=2**22, batch=4096)
    assert figures.fallback == {"small": 1}
    assert figures.row(0)["saved_bytes"] == 2**58


def test_overflow_in_a_large_grid(eager):
    # p: 2^17 x 1 x 2^22 x 2^22 x 4 B = 2^63, more than int64 holds: Python ints, exact
    figures = evaluate(Config(impl="naive-softmax"), seq_len=[1024, 2**22], batch=[1, 2**17])
    assert figures.fallback == {}  # the same path as the int64 configuration, not a replay
    assert figures.saved_bytes.dtype == object and figures.saved_bytes[1] == 2**63
    assert figures.saved_bytes[0] == 4_194_304  # 1 x 1024^2 x 4 B, from the int64 path


# --- the fallbacks, with programs made for the purpose -------------------------------------

@pytest.fixture
def toy_impls(scratch_register):
    """Two programs: one loops over N // 64 chunks, one pads the head dim with max()."""
    def padded(d):
        width = max(d.D, 32)  # a decision on D only: the grid is split by D
        return Program((new("out", (d.B, d.N, width), d.dtype, Role.output, "mm"),), ())

    scratch_register("test-chunked", "loops over chunks", one_event_pair_per_64_rows)
    scratch_register("test-padded", "pads D to 32", padded)


def test_structure_depending_on_n_falls_back(eager, toy_impls):
    base = Config(impl="test-chunked", protocol={"forward_only": True})
    n = np.arange(64, 64 * 9, 64)
    figures = evaluate(base, seq_len=n)
    assert figures.fallback == {"structure": 8}
    assert_exact(base, figures, {"seq_len": n})


def test_decision_on_head_dim_splits_the_grid(eager, toy_impls):
    base = Config(impl="test-padded", protocol={"forward_only": True})
    nn, dd = np.meshgrid(np.arange(100, 140), [16, 64], indexing="ij")
    figures = evaluate(base, seq_len=nn, head_dim=dd)
    assert figures.fallback == {}
    assert_exact(base, figures, {"seq_len": nn, "head_dim": dd})


# --- classification -----------------------------------------------------------------------

def test_classify_decides_only_what_it_can(eager):
    from memcalc.analysis.budget import fits

    base = Config(impl="naive", shape={"batch": 1})
    n = np.arange(3000, 3400, 7)
    figures = evaluate(base, seq_len=n)
    budget = int(figures.reserved_peak_bytes[len(n) // 2])
    verdict = classify(figures, budget)
    assert set(verdict.tolist()) >= {0, 1}
    for i in range(len(n)):
        if verdict[i] >= 0:
            assert bool(verdict[i]) == fits(at(base, seq_len=int(n[i])), budget)


def test_bad_axes():
    with pytest.raises(ValueError, match="seq_len"):
        evaluate(Config(), seq_len=[0, 5])
    with pytest.raises(ValueError, match="unknown grid axis"):
        evaluate(Config(), depth=[3])
    with pytest.raises(ValueError, match="kv_heads"):
        evaluate(Config(), heads=4, kv_heads=3)


def test_an_evaluator_shared_by_bases_of_other_shapes_keeps_none_of_their_sizes():
    """Evaluators are cached by everything but the shape: one first built for a base with
    kv_len = 512 served a base without one that kv_len at every length, and causal
    sdpa-flash refused the lengths other than 512 (kv_len != seq_len)."""
    from memcalc.config import make_config

    options = dict(impl="sdpa-flash", dtype="bf16", causal=True, batch=1, heads=2, head_dim=64)
    evaluate(make_config(**options, seq_len=512, kv_len=512), seq_len=np.array([512]))
    base = make_config(**options, seq_len=512)
    figures = evaluate(base, seq_len=np.array([1024]))
    assert int(figures.peak_bytes[0]) == predict(base.replace(seq_len=1024)).peak_bytes


def test_forms_over_atoms_past_float_precision_are_exact_in_limbs():
    """Atoms of up to 2^54 B (a length of 16M: the scores' 2^53 B) under forms with
    coefficients up to 2^27 (constant bytes times the ones row): the limbs' float products
    recombined give exactly what Python integers give; where a result could pass 2^62 no
    limb product is offered."""
    import numpy as np

    from memcalc.analysis.vectorized import _limb_product

    rng = np.random.default_rng(0)
    matrix = rng.integers(-3, 4, size=(40, 9))
    matrix[:, -1] = rng.integers(-(1 << 27), 1 << 27, size=40)  # the constant column
    atoms = np.vstack([rng.integers(0, 1 << 54, size=(8, 500)), np.ones((1, 500), dtype=np.int64)])
    atoms = (atoms // 512 * 512).astype(object)  # rounded blocks, as Python integers
    atoms[-1] = 1
    exact = matrix.astype(object) @ atoms
    assert _limb_product(matrix, atoms, None).tolist() == exact.tolist()
    huge = atoms.copy()
    huge[0] = 1 << 61
    assert _limb_product(matrix, huge, None) is None
