"""The recorded replay (``memcalc.engine.recorder``): allocator decisions as guards, figures as forms."""

import numpy as np
import pytest

from memcalc.engine.allocator import round_segment, round_size
from memcalc.config import make_config
from memcalc.engine.forms import Form, size_class
from memcalc.impls import get_impl
from memcalc.analysis.quadratic import quadratic_names
from memcalc.engine.recorder import FormSizes, Group, Path, record
from memcalc.engine.symbolic import Sym, evaluate_sym
from memcalc.engine.program import Program, Role, free, new, release
from memcalc.analysis.predict import predict

MiB = 1 << 20


# --- helpers: a group over a symbolic N, as the grid path builds one --------------------------

def group_of(config) -> Group:
    """``config``'s program built once over a placeholder ``N`` (``M`` follows it), as the
    grid path builds it."""
    d = config.dims.replace(N=Sym.leaf("N"), M=Sym.leaf("N"))
    return Group.build(get_impl(config.impl), d, frozenset({"N"}))


def classes_at(group: Group, n: int) -> list[int]:
    return [size_class(round_size(evaluate_sym(s, {"N": n}))) for s in group.sizes]


def record_at(config, group: Group | None = None, quadratic=None) -> Path:
    group = group or group_of(config)
    n = config.shape.seq_len
    quadratic = quadratic_names(config) if quadratic is None else quadratic
    return record(group, {"N": n}, config.workspace_bytes, quadratic, classes_at(group, n), None)


def atom_vector(path: Path, group: Group, n: int) -> np.ndarray:
    """The values of ``path``'s columns at ``N = n``: atom ``2i`` the rounded block of size
    ``i``, ``2i + 1`` its segment (rounded to 2 MiB), then 1 for the constant column."""
    values = []
    for s in group.sizes:
        r = round_size(evaluate_sym(s, {"N": n}))
        values += [r, round_segment(r)]
    return np.array([values[c] if c >= 0 else 1 for c in path.cols], dtype=np.int64)


def form_rows(path: Path, matrix: np.ndarray) -> list[dict]:
    """Each row of ``matrix`` as ``{atom: coefficient, "const": c}`` (zero terms left out)."""
    atoms = path.cols[:-1].tolist()
    return [{**{a: int(c) for a, c in zip(atoms, row[:-1]) if c}, "const": int(row[-1])}
            for row in matrix]


# --- FormSizes: the allocator's arithmetic over forms ----------------------------------------

def test_form_sizes_give_each_symbolic_size_two_atoms_and_constants_for_fixed_sizes():
    """Size ``i`` of the group is atom ``2i`` (its block) and ``2i + 1`` (its segment), valued
    at this configuration; a size that is a plain integer is a constant form."""
    group = group_of(make_config(impl="naive-softmax", seq_len=1700, batch=1))
    q_bytes, nn_bytes = group.sizes  # (1, 1, N, 16) fp32 inputs first, then (1, 1, N, N) fp32
    sizes = FormSizes(group, {"N": 1700})
    block = sizes.block(nn_bytes)
    # 4 x 1700^2 = 11,560,000 B -> ceil(/512) = 22,579 blocks of 512 = 11,560,448
    assert (block.terms, block.const, block.value) == ({2: 1}, 0, 11_560_448)
    segment = sizes.large_segment(nn_bytes, block)
    # 11,560,448 / 2 MiB = 5.51... -> 6 x 2,097,152 = 12,582,912
    assert (segment.terms, segment.const, segment.value) == ({3: 1}, 0, 12_582_912)
    q = sizes.block(q_bytes)
    # 64 x 1700 = 108,800 B -> ceil(108,800 / 512) = 213 -> 213 x 512 = 109,056
    assert (q.terms, q.value) == ({0: 1}, 109_056)
    fixed = sizes.block(1000)  # ceil(1000 / 512) = 2 -> 1,024
    assert (fixed.terms, fixed.const, fixed.value) == ({}, 1024, 1024)
    fixed_segment = sizes.large_segment(11_560_000, None)  # as above: 12,582,912
    assert (fixed_segment.terms, fixed_segment.value) == ({}, 12_582_912)
    assert sizes.values == {2: 11_560_448, 3: 12_582_912, 0: 109_056}  # atoms valued once


def test_ge0_records_each_decision_as_a_guard_that_holds_on_this_configuration():
    group = group_of(make_config(impl="naive-softmax", seq_len=1700, batch=1))
    sizes = FormSizes(group, {"N": 1700})
    block = sizes.block(group.sizes[1])  # atom 2 = 11,560,448
    assert sizes.ge0(block - 10 * MiB) is True  # 11,560,448 - 10,485,760 = 1,074,688 >= 0
    assert sizes.ge0(block - 12 * MiB) is False  # 11,560,448 - 12,582,912 = -1,022,464
    assert sizes.ge0(block - 10 * MiB) is True  # the same decision again: one guard
    assert sizes.ge0(Form({}, -5, -5)) is False and sizes.ge0(7) is True  # no atom: no guard
    guards = {g.signature: g.value for g in sizes.guards.values()}
    assert guards == {
        (((2, 1),), -10_485_760): 1_074_688,  # kept as it is: it holds
        # it fails, so its negation is kept: -(a2 - 12 MiB) - 1 = 12,582,911 - a2 >= 0,
        # 12,582,911 - 11,560,448 = 1,022,463
        (((2, -1),), 12_582_911): 1_022_463,
    }


def test_free_block_keys_compare_sizes_as_guards_and_equal_sizes_by_address():
    group = group_of(make_config(impl="naive-softmax", seq_len=1700, batch=1))
    sizes = FormSizes(group, {"N": 1700})
    block, segment = sizes.block(group.sizes[1]), sizes.large_segment(group.sizes[1], None)
    small_high, small_low = sizes.key(block, 4096), sizes.key(block, 0)
    assert small_low < small_high and not small_high < small_low  # equal sizes: by address
    assert sizes.guards == {}  # a2 - a2 has no atom: deciding it records nothing
    big = sizes.key(segment, 0)
    assert small_high < big  # a2 <= a3 - 1: 11,560,448 <= 12,582,911, whatever the address
    assert not big < small_low
    signatures = {g.signature for g in sizes.guards.values()}
    # small < big: gap a3 - a2 >= 0, then a3 - a2 - 1 >= 0; big < small: a2 - a3 < 0, kept
    # negated as a3 - a2 - 1 >= 0 (the same guard)
    assert signatures == {(((2, -1), (3, 1)), 0), (((2, -1), (3, 1)), -1)}


def test_path_coef_sum_is_the_largest_row_sum_of_coefficients_plus_one():
    """The constant column does not count, nor does an empty matrix (a path with no guards)."""
    row = lambda *values: np.array([values], dtype=np.int64)  # noqa: E731
    empty = np.zeros((0, 3), dtype=np.int64)
    path = Path(None, np.array([0, 2, -1]), guards=empty, saved=row(1, 0, 0),
                reserved=row(0, 2, 2_097_152), forward=row(4, -3, 0), backward=row(0, 0, 0),
                floor=np.array([[4, 0, 0], [0, 0, 9]]), forward_quad=row(0, 1, 0),
                backward_quad=row(0, 0, 0), figures={})
    assert path.coef_sum == 8  # forward's |4| + |-3| = 7, plus one


# --- a toy step whose every allocation can be counted by hand ---------------------------------

def toy(d):
    """``s`` (N x N, saved) and a transient ``t``, then ``out``; backward makes ``ds`` (N x N)
    and releases ``s``. At N = 1700 (B = H = 1, d = 16, fp32):
    a0 = block of a (1, N, 16) tensor = 109,056 (64 x 1700 = 108,800 -> 213 x 512);
    a2 = block of s = 11,560,448 (4 x 1700^2 = 11,560,000 -> 22,579 x 512);
    a3 = its segment, 12,582,912 (6 x 2 MiB): the rest, 1,022,464, is not > 1 MiB, so the
    whole segment is the block (allocated a3, requested a2)."""
    T, S, O = Role.temporary, Role.saved, Role.output
    forward = (new("s", (d.B, d.N, d.M), d.dtype, S, "mm"),
               new("t", (d.B, d.N, d.D), d.dtype, T, "mm"),
               free("t"), new("out", (d.B, d.N, d.D), d.dtype, O, "mm"), free("s"))
    backward = (new("ds", (d.B, d.N, d.M), d.dtype, T, "mm"), release("s"), free("ds"))
    return Program(forward, backward)


A0, A2, A3 = 109_056, 11_560_448, 12_582_912


@pytest.fixture
def toy_impl(scratch_register):
    scratch_register("test-recorder-toy", "s, t, out; ds", toy)
    return "test-recorder-toy"


def test_toy_step_moments_floor_and_quadratic_blocks(toy_impl):
    """Forward, from the reset (q, k, v, grad_out: 4 a0): s, t, then t's free: the moment
    4 a0 + a0 + a3; out replaces t, so the phase's end repeats it and is kept once.
    Backward, from 5 a0 + a3 (inputs, out, s): ds, then s's release: 5 a0 + 2 a3."""
    config = make_config(impl=toy_impl, seq_len=1700, batch=1)
    path = record_at(config, quadratic=frozenset({"s", "ds"}))
    assert path.cols.tolist() == [0, 2, 3, -1]
    assert form_rows(path, path.forward) == [{0: 5, 3: 1, "const": 0}]
    assert form_rows(path, path.backward) == [{0: 5, 3: 2, "const": 0}]
    # the rounded requests alive: s and ds count a2, not the segment they were given
    assert form_rows(path, path.floor) == [{0: 5, 2: 1, "const": 0}, {0: 5, 2: 2, "const": 0}]
    assert form_rows(path, path.forward_quad) == [{3: 1, "const": 0}]
    assert form_rows(path, path.backward_quad) == [{3: 2, "const": 0}]
    assert form_rows(path, path.saved) == [{3: 1, "const": 0}]  # s's block
    # one 2 MiB small segment (5 a0 = 545,280 at most), s's and ds's 12 MiB segments
    assert form_rows(path, path.reserved) == [{3: 2, "const": 2 * MiB}]
    assert path.figures == {
        "saved_bytes": A3,  # 12,582,912
        "forward_peak_bytes": 5 * A0 + A3,  # 545,280 + 12,582,912 = 13,128,192
        "backward_peak_bytes": 5 * A0 + 2 * A3,  # 545,280 + 25,165,824 = 25,711,104
        "peak_bytes": 5 * A0 + 2 * A3,
        "reserved_peak_bytes": 2 * MiB + 2 * A3,  # 2,097,152 + 25,165,824 = 27,262,976
    }
    assert path.figures == predict(config).figures()  # the scalar replay agrees


def test_forward_only_path_has_one_zero_backward_row(toy_impl):
    """No backward phase: its figures are one row of zeros. Under no_grad ``s`` dies at its
    free, so nothing is saved; from q, k, v (3 a0): s, t, free t -> 4 a0 + a3."""
    config = make_config(impl=toy_impl, seq_len=1700, batch=1, forward_only=True)
    path = record_at(config, quadratic=frozenset({"s"}))
    assert form_rows(path, path.forward) == [{0: 4, 3: 1, "const": 0}]
    assert form_rows(path, path.backward) == [{"const": 0}]
    assert form_rows(path, path.backward_quad) == [{"const": 0}]
    assert path.figures == {
        "saved_bytes": 0, "backward_peak_bytes": 0,
        "forward_peak_bytes": 4 * A0 + A3,  # 436,224 + 12,582,912 = 13,019,136
        "peak_bytes": 4 * A0 + A3,
        "reserved_peak_bytes": 2 * MiB + A3,  # 2,097,152 + 12,582,912 = 14,680,064
    }
    assert path.figures == predict(config).figures()


# --- real programs: the recorded path against the scalar replay -----------------------------

def evaluated(path: Path, group: Group, n: int) -> dict[str, int]:
    """The path's figures at ``N = n``, from its forms alone (a peak: the largest moment)."""
    v = atom_vector(path, group, n)
    forward, backward = path.forward @ v, path.backward @ v
    return {"saved_bytes": int((path.saved @ v)[0]), "forward_peak_bytes": int(forward.max()),
            "backward_peak_bytes": int(backward.max()),
            "peak_bytes": int(max(forward.max(), backward.max())),
            "reserved_peak_bytes": int((path.reserved @ v)[0])}


@pytest.mark.parametrize("options", [
    dict(impl="naive", seq_len=300),
    dict(impl="naive", seq_len=1500, causal=True, heads=2),
    dict(impl="naive-softmax", seq_len=100, loss="sum"),  # 0-d loss tensors: constant sizes
    dict(impl="flash2", seq_len=300, dtype="fp16"),
    dict(impl="sdpa-math", seq_len=1500, forward_only=True),
])
def test_recorded_figures_are_predicts_and_its_guards_hold_there(options):
    config = make_config(batch=1, **options)
    group = group_of(config)
    path = record_at(config, group)
    b = predict(config)
    assert path.figures == b.figures()
    n = config.shape.seq_len
    assert evaluated(path, group, n) == b.figures()  # the forms, evaluated, give them too
    assert (path.guards @ atom_vector(path, group, n) >= 0).all()


def test_a_path_gives_predicts_figures_wherever_its_guards_hold():
    """Recorded once at N = 1500, naive's path serves every length of the same size classes
    whose outcomes on its guards are the same, with exact figures, and N x M blocks at the
    peak; lengths where a guard fails (they take another path) exist on both sides."""
    config = make_config(impl="naive", seq_len=1500, batch=1)
    group = group_of(config)
    quadratic = quadratic_names(config)
    path = record_at(config, group)
    held, failed = [], []
    for n in range(1300, 1600, 7):
        if classes_at(group, n) != classes_at(group, 1500):
            continue
        v = atom_vector(path, group, n)
        if not (path.guards @ v >= 0).all():
            failed.append(n)
            continue
        held.append(n)
        b = predict(config.replace(seq_len=n))
        assert evaluated(path, group, n) == b.figures(), n
        quad = path.backward_quad if b.peak_phase == "backward" else path.forward_quad
        moments = path.backward if b.peak_phase == "backward" else path.forward
        at_peak = int(np.argmax(moments @ v))
        assert int(quad[at_peak] @ v) == sum(c.allocated for c in b.components
                                             if c.name in quadratic), n
    assert len(held) >= 10 and min(failed) < min(held) and max(failed) > max(held)
