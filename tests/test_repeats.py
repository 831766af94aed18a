"""A loop's tensors as one row a kind in the tables; one row a tensor in CSV."""

import csv
import io

import memcalc
from memcalc.engine.component import Component
from memcalc.output.repeats import FEW, Repeated, collapse
from memcalc.engine.program import Role


def tensor(name: str, shape=(8, 1, 64, 64), role=Role.saved, op="tril") -> Component:
    nbytes = 4 * shape[0] * shape[1] * shape[2] * shape[3]
    return Component(name=name, role=role, op=op, shape=shape, dtype="float32",
                     bytes=nbytes, allocated=nbytes)


def test_numbered_tensors_of_one_kind_become_one_row_where_the_first_was():
    rows = collapse([tensor("q", role=Role.input, op="randn"), tensor("S0"), tensor("o0", (8, 1, 64, 16)),
                     tensor("S1"), tensor("o1", (8, 1, 64, 16)), tensor("S2")])
    assert [r.name for r in rows] == ["q", "S0..S2 (3)", "o0", "o1"]  # two o's: fewer than FEW
    group = rows[1]
    assert isinstance(group, Repeated) and FEW == 3
    assert group.allocated == 3 * 131072  # 3 x (8 x 1 x 64 x 64 x 4 B)
    assert group.bytes == 3 * 131072
    assert group.formula == "3 x (8 x 1 x 64 x 64 x 4 B)"
    assert (group.role, group.op, group.dtype) == (Role.saved, "tril", "float32")


def test_tensors_of_one_name_are_counted_not_ranged():
    """A traced loop's tensors share their name (op and source line): ``4 x mul (user.py:7)``,
    not ``mul (user.py:7)..mul (user.py:7) (4)``."""
    (row,) = collapse([tensor("mul (user.py:7)", op="mul") for _ in range(4)])
    assert row.name == "4 x mul (user.py:7)"
    assert row.allocated == 4 * 131072  # 4 x (8 x 1 x 64 x 64 x 4 B)


def test_a_number_inside_the_names_is_ranged_in_place():
    """A model's layers: ``model.layers.{0..31}.mlp.weight (32)``, not the long first and
    last names in full; a number at the end keeps ``S0..S2``; two numbers that vary, the
    full names."""
    layers = [tensor(f"model.layers.{i}.mlp.weight", role=Role.parameter) for i in range(32)]
    assert collapse(layers)[0].name == "model.layers.{0..31}.mlp.weight (32)"
    grid = [tensor(f"b{i}.h{i}.w") for i in range(3)]
    assert collapse(grid)[0].name == "b0.h0.w..b2.h2.w (3)"


def test_a_different_shape_or_role_is_another_kind():
    rows = collapse([tensor("S0"), tensor("S1"), tensor("S2", (8, 1, 32, 64)),
                     tensor("S3", role=Role.temporary), tensor("S4")])
    # S0, S1, S4 are one kind (the count tells the gap); S2 and S3 are kinds of one each
    assert [r.name for r in rows] == ["S0..S4 (3)", "S2", "S3"]


def test_chunked_breakdown_table_shows_kinds_and_its_csv_every_tensor():
    b = memcalc.breakdown(impl="linear-causal-chunked", seq_len=640)  # 10 chunks of 64
    table = b.tables()[0]
    cells = {row[0]: row for row in table.cells()}
    allocated = [c.header for c in table.columns].index("allocated")
    assert cells["S0..S9 (10)"][allocated] == f"{10 * 131072:,}"  # 10 x (8 x 1 x 64 x 64 x 4 B)
    assert sum(r.allocated for r in table.rows) == b.peak_bytes
    rows = list(csv.reader(io.StringIO(b.to_csv())))
    assert len(rows) == 1 + len(b.components)  # a header, then one row per tensor
    assert {"S0", "S9"} <= {r[0] for r in rows}


def test_two_tensors_of_one_name_are_one_row():
    """A traced backward's two ``mul (MulBackward0)`` of the same size: two identical rows no
    reader could tell apart, now ``2 x mul (MulBackward0)``; two numbered names stay two."""
    from memcalc.engine.component import Component
    from memcalc.output.repeats import collapse
    from memcalc.engine.program import Role

    def c(name):
        return Component(name=name, role=Role.temporary, op="mul", shape=(4, 4),
                         dtype="float32", bytes=64, allocated=512)  # 4 x 4 x 4 B

    rows = collapse([c("mul (MulBackward0)"), c("x1"), c("mul (MulBackward0)"), c("x2")])
    assert [r.name for r in rows] == ["2 x mul (MulBackward0)", "x1", "x2"]
    assert rows[0].allocated == 1024  # 2 x 512
