"""Config models: defaults, validation, JSON round trip, workspace rules."""

import pytest
from pydantic import ValidationError

from memcalc.config import Config, Device, Protocol, Shape


def test_defaults_are_the_seeds_benchmark():
    c = Config()
    assert (c.shape.batch, c.shape.heads, c.shape.seq_len, c.shape.head_dim) == (8, 1, 16384, 16)
    assert (c.dtype.value, c.impl, c.device.gpu) == ("fp32", "naive", "h100-80gb")


def test_json_round_trip():
    c = Config(impl="naive-weights", causal=True, dtype="bf16", shape=Shape(kv_len=77),
               protocol=Protocol(loss="sum", cublas_workspace_config=":16:8"))
    assert Config.model_validate_json(c.model_dump_json()) == c


@pytest.mark.parametrize("config, expected", [
    (Config(), 32 * 1024 * 1024),  # H100, cc 9.0: 32 MiB
    (Config(device=Device(gpu="a100-80gb")), 4096 * 1024 * 2 + 16 * 1024 * 8),  # 8,519,680
    (Config(device=Device(gpu="rtx-5090")), 32 * 1024 * 1024),  # cc 12.0 is "9.x and newer"
    (Config(protocol=Protocol(cublas_workspace_config=":4096:8")), 4096 * 1024 * 8),
    (Config(protocol=Protocol(cublas_workspace_config=":16:8:4096:2")), 16 * 1024 * 8 + 4096 * 1024 * 2),
])
def test_workspace_bytes(config, expected):
    assert config.workspace_bytes == expected


def test_explicit_device():
    d = Device(gpu=None, memory_bytes=10**10, compute_capability=(8, 6))
    assert d.spec.memory_bytes == 10**10
    with pytest.raises(ValidationError):
        Device(gpu=None, memory_bytes=10**10)


@pytest.mark.parametrize("kwargs", [
    {"impl": "nope"}, {"shape": {"seq_len": 0}}, {"shape": {"head_dim": -1}},
    {"dtype": "fp64"}, {"device": {"gpu": "v100"}}, {"protocol": {"loss": "mean"}},
    {"shape": {"batch": 1, "unknown": 3}},
])
def test_rejects_bad_values(kwargs):
    with pytest.raises(ValidationError):
        Config(**kwargs)


def test_frozen():
    with pytest.raises(ValidationError):
        Config().causal = True
