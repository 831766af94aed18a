"""Validation grids: how a product expands, how a grid file is read, what a bad one is told."""

import json
import re
from pathlib import Path

import pytest

from memcalc.config import Config, Device, Protocol, Shape
from memcalc.impls import impl_names
from memcalc.validation.grid import Grid, Product, default_grid, load_grid

GRIDS = Path(__file__).resolve().parents[1] / "memcalc" / "data" / "grids"


def write(tmp_path, data) -> Path:
    path = tmp_path / "grid.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_a_product_of_one_impl_is_one_configuration_of_the_defaults():
    """Each field left out has one default value: B=2 H=1 N=256 d=16 fp32, non-causal, on
    an H100 80GB, gradient loss, forward and backward."""
    assert Product(impl=["naive"]).configs() == [Config(
        impl="naive", causal=False, dtype="fp32",
        shape=Shape(batch=2, heads=1, seq_len=256, head_dim=16), device=Device(gpu="h100-80gb"),
        protocol=Protocol(loss="grad", forward_only=False))]


def test_a_product_varies_its_last_field_fastest():
    product = Product(impl=["naive", "naive-softmax"], causal=[False, True], seq_len=[8, 16],
                      forward_only=[False, True])
    got = [(c.impl, c.causal, c.shape.seq_len, c.protocol.forward_only)
           for c in product.configs()]
    # 2 impls x 2 causal x 2 lengths x 2 protocols = 16, in the fields' declared order
    assert len(got) == 2 * 2 * 2 * 2
    assert got[:4] == [("naive", False, 8, False), ("naive", False, 8, True),
                       ("naive", False, 16, False), ("naive", False, 16, True)]
    assert got[4] == ("naive", True, 8, False)
    assert got[8] == ("naive-softmax", False, 8, False)
    assert got[-1] == ("naive-softmax", True, 16, True)


def test_a_grid_file_expands_products_then_configs_filtered_by_impl(tmp_path):
    path = write(tmp_path, {"name": "g", "products": [
        {"impl": ["naive", "naive-softmax"], "seq_len": [8]},
        {"impl": ["naive"], "dtype": ["bf16"], "gpu": ["a100-40gb"]}],
        "configs": [{"impl": "naive-softmax", "shape": {"seq_len": 9, "kv_len": 11}}]})
    grid = load_grid(path)
    assert grid.name == "g"
    got = [(c.impl, c.shape.seq_len, c.shape.keys, c.dtype.value, c.device.gpu)
           for c in grid.expand()]
    # the first product's two, the second's one (seq_len 256 by default), then the config
    # as written (its device the Config default)
    assert got == [("naive", 8, 8, "fp32", "h100-80gb"), ("naive-softmax", 8, 8, "fp32",
                                                         "h100-80gb"),
                   ("naive", 256, 256, "bf16", "a100-40gb"),
                   ("naive-softmax", 9, 11, "fp32", "h100-80gb")]
    assert [c.impl for c in grid.expand(["naive-softmax"])] == ["naive-softmax"] * 2
    assert grid.expand([]) == []  # an empty selection selects nothing


def known_impls() -> str:
    return ", ".join(impl_names())


@pytest.mark.parametrize("content, message", [
    # a size of zero in a product: the product and the value are named
    ({"name": "g", "products": [{"impl": ["naive"], "seq_len": [0]}]},
     "products.0.seq_len.0: Input should be greater than or equal to 1 (got 0)"),
    ({"name": "g", "configs": [{"impl": "naive", "shape": {"batch": 0}}]},
     "configs.0.shape.batch: Input should be greater than or equal to 1 (got 0)"),
    ({"name": "g", "products": [{"impl": ["flashy"]}]},
     "impl: unknown implementation 'flashy' (did you mean 'flash2'?); known: {known} (got "
     "'flashy')"),
    ({"name": "g", "products": [{"impl": ["naive"], "sequence": [8]}]},
     "products.0.sequence: Extra inputs are not permitted (got [8])"),
    ({"name": "g", "products": [{"impl": ["naive"], "head_dim": []}]},
     "products.0.head_dim: List should have at least 1 item after validation, not 0 (got [])"),
    ({"products": []}, "name: Field required"),  # the input is the whole object: not shown
    ('{"name": "g", "products": [', "Expecting value: line 1 column 28 (char 27)"),
    ({"name": "g", "products": []},  # "0 configurations, 0 mismatches", exit 0, before
     "a grid needs at least one product or configuration (products, configs)"),
], ids=["zero size", "zero size in a config", "unknown impl", "unknown field", "empty list",
        "no name", "bad JSON", "nothing in it"])
def test_a_malformed_grid_is_one_line_naming_the_file_and_field(tmp_path, content, message):
    path = write(tmp_path, content)
    with pytest.raises(ValueError) as error:
        load_grid(path)
    text = str(error.value)
    assert text == f"--grid {path}: " + message.replace("{known}", known_impls())
    assert "\n" not in text


def test_every_configuration_is_checked_when_the_file_is_read(tmp_path):
    """An unknown GPU in a later product is refused by ``load_grid``, not when a run reaches
    it (the product itself takes any name: only its configurations check them)."""
    content = {"name": "g", "products": [{"impl": ["naive"]},
                                         {"impl": ["naive"], "gpu": ["h100-80gb", "tpu"]}]}
    Grid.model_validate(content)  # the file's structure is fine
    with pytest.raises(ValueError, match="unknown GPU 'tpu'"):
        load_grid(write(tmp_path, content))


@pytest.mark.parametrize("product, message", [
    ({"impl": []}, "products.0.impl: List should have at least 1 item"),
    ({"impl": ["naive"], "dtype": []}, "products.0.dtype: List should have at least 1 item"),
    ({"impl": ["naive"], "causal": []}, "products.0.causal: List should have at least 1 item"),
    ({"impl": ["naive"], "batch": [True]}, "products.0.batch.0: Input should be a valid integer"),
])
def test_a_product_refuses_what_would_silently_expand_to_nothing_or_to_a_guess(
        tmp_path, product, message):
    """An empty list made zero configurations, and ``true`` a batch of 1, without a word."""
    with pytest.raises(ValueError, match=re.escape(message)):
        load_grid(write(tmp_path, {"name": "g", "products": [product]}))


def test_a_missing_grid_file_is_a_value_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match=re.escape(f"--grid {tmp_path}/none.json: No such file")):
        load_grid(tmp_path / "none.json")


def test_default_grid_is_every_shipped_file_in_name_order():
    files = sorted(GRIDS.glob("*.json"))
    grids = [load_grid(p) for p in files]
    default = default_grid()
    assert default.name == "default"
    assert default.products == [p for g in grids for p in g.products]
    assert default.configs == [c for g in grids for c in g.configs]
    assert len(default.expand()) == sum(len(g.expand()) for g in grids)
    # the first product is the first file's by name: checkpoint.json before naive.json
    assert files[0].name == "checkpoint.json"
    assert default.products[0].impl[0] == "checkpoint-naive"
