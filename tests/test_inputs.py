"""What a step is called with (``memcalc/engine/inputs.py``): ``--input NAME=DIMS[:DTYPE[:FILL]]``."""

import pytest

from memcalc.engine.dims import Dims
from memcalc.engine.inputs import QKV, Input, input_tensors, inputs_of, parse_input, sizes_read
from memcalc.engine.program import Role

D = Dims(B=2, H=12, N=1024, M=512, D=64, dtype="bfloat16", causal=False, loss="grad", Hk=4,
         chunk=64)


def test_letters_and_products_take_the_steps_sizes():
    x = parse_input("x=B,N,H*D")
    assert x == Input("x", ("B", "N", "H*D"))
    assert x.shape(D) == (2, 1024, 768)  # H*D = 12 x 64
    assert parse_input("kv=B, K, M ,D").shape(D) == (2, 4, 512, 64)
    assert parse_input("w=1_024,3").shape(D) == (1024, 3)


def test_dtype_and_fill():
    mask = parse_input("mask=B,N:bool")
    assert (mask.dtype_in(D), mask.filled(D), mask.needs_grad(D)) == ("bool", "ones", False)
    ids = parse_input("ids=B,N:long:zeros")
    assert (ids.dtype, ids.filled(D)) == ("int64", "zeros")
    assert parse_input("position_ids=1,N:int64").filled(D) == "arange"  # by its name
    assert parse_input("x=B,N,768:fp32").dtype == "float32"
    x = parse_input("x=B,N,768")  # the step's dtype, random, needs grad
    assert (x.dtype_in(D), x.filled(D), x.needs_grad(D)) == ("bfloat16", "randn", True)
    assert not x.needs_grad(D.replace(forward_only=True))


@pytest.mark.parametrize("text, message", [
    ("x", "--input: 'x' is not NAME=DIMS[:DTYPE]"),
    ("1x=B", "--input: '1x=B' is not NAME=DIMS[:DTYPE]"),
    ("x=B,Q", "--input x: dim 'Q' is not a whole number above 0, one of the letters B, N, M, "
              "H, K, D or a product of them (H*D); letters: B --batch, N --seq, M --kv-len, "
              "H --heads, K --kv-heads, D --head-dim"),
    ("x=B,0", "--input x: dim '0' is not a whole number above 0"),
    ("x=B,-3", "--input x: dim '-3' is not a whole number above 0"),
    ("x=B:int65", "--input x: unknown dtype 'int65'"),
    ("x=B:int64:pad", "--input x: unknown fill 'pad' (did you mean 'padded'?)"),
])
def test_bad_inputs_are_one_line_naming_the_field(text, message):
    with pytest.raises(ValueError) as error:
        parse_input(text)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_api_mapping_reads_as_the_cli():
    assert inputs_of({"x": ("B", "N", 768), "mask": ("B", "N", "bool")}) == \
        inputs_of(["x=B,N,768", "mask=B,N:bool"])
    assert inputs_of({"x": "B,N,768:bf16"})[0].dtype == "bfloat16"
    with pytest.raises(ValueError, match="--input x: a tuple of dims"):
        inputs_of({"x": 768})


def test_no_grad_and_repeats():
    x, y = inputs_of(["x=B,N", "y=B,N"], no_grad=["y"])
    assert x.needs_grad(D) and not y.needs_grad(D)
    with pytest.raises(ValueError, match="--no-grad z: no input of that name; inputs: x"):
        inputs_of(["x=B"], no_grad=["z"])
    with pytest.raises(ValueError, match="--input: x is given twice"):
        inputs_of(["x=B", "x=N"])


def test_sizes_read_name_the_shape_fields():
    assert sizes_read(inputs_of(["x=B,N,768"])) == {"batch", "seq_len"}
    assert sizes_read(inputs_of(["k=B,K,M,D"])) == {"batch", "kv_heads", "heads", "kv_len",
                                                    "seq_len", "head_dim"}


def test_input_tensors_are_the_inputs_then_grad_out():
    tensors = input_tensors(D)  # q, k, v: (B, H, N, D), k and v (B, Hk, M, D); grad_out like q
    assert [(t.name, t.shape, t.role) for t in tensors] == [
        ("q", (2, 12, 1024, 64), Role.input), ("k", (2, 4, 512, 64), Role.input),
        ("v", (2, 4, 512, 64), Role.input), ("grad_out", (2, 12, 1024, 64), Role.input)]
    assert tensors[0].bytes == 2 * 12 * 1024 * 64 * 2  # bf16: 3,145,728
    loss = input_tensors(D, inputs_of(["x=B,N,768"]), out_like=((), "float32"))
    assert [t.name for t in loss] == ["x"]  # a 0-d output (a loss) needs no grad_out
    assert [t.name for t in input_tensors(D.replace(loss="sum"), QKV)] == ["q", "k", "v"]
