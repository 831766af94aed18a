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


def test_label_shows_the_sizes_then_what_differs_from_the_defaults():
    """One definition of the options every title shows (breakdown, compare, oom): a search's
    own size left out."""
    assert Config().label() == "B=8 H=1 N=16384 d=16 fp32"
    assert Config().label(leave_out="seq_len") == "B=8 H=1 d=16 fp32"
    changed = Config(impl="sdpa-math", causal=True, chunk=32, dtype="fp16",
                     shape=Shape(heads=4, kv_heads=2, kv_len=4096, seq_len=1024),
                     protocol=Protocol(loss="sum", forward_only=True,
                                       cublas_workspace_config=":4096:8"))
    assert changed.label(leave_out="batch") == (
        "H=4 Hk=2 N=1024 M=4096 d=16 fp16 causal forward-only loss=sum chunk=32 "
        "CUBLAS_WORKSPACE_CONFIG=:4096:8")


def test_explicit_device():
    d = Device(gpu=None, memory_bytes=10**10, compute_capability=(8, 6))
    assert d.spec.memory_bytes == 10**10
    with pytest.raises(ValidationError):
        Device(gpu=None, memory_bytes=10**10)


def test_a_preset_spec_is_the_preset_under_its_own_name():
    """Any spelling of a preset names the preset; its figures and their kind stay
    (memcalc/data/gpus.json: h100-80gb's 84,938,850,304 B is torch's total capacity)."""
    spec = Device(gpu="H100_80GB").spec
    assert (spec.name, spec.memory_bytes, spec.memory_kind) == ("h100-80gb", 84_938_850_304, "torch")
    assert spec.smi_memory_bytes == 85_520_809_984  # nvidia-smi's total: 81,559 x 2^20 B


def test_explicit_fields_override_the_preset_and_memory_is_then_given():
    spec = Device(gpu="a100-80gb", memory_bytes=10**10, sm_count=100).spec
    assert (spec.name, spec.memory_bytes, spec.sm_count) == ("a100-80gb", 10**10, 100)
    assert (spec.memory_kind, spec.smi_memory_bytes, spec.compute_capability) == (
        "given", None, (8, 0))  # the preset's compute capability stays
    custom = Device(gpu=None, memory_bytes=10**10, compute_capability=(8, 6)).spec
    assert (custom.name, custom.memory_kind, custom.sm_count) == ("custom", "given", None)


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


def test_a_mesh_lays_its_ranks_out_as_torchtitan_does():
    """Row-major over (dp_replicate, dp_shard, cp, tp): cp varies faster than dp_shard, so
    FSDP's dp_shard x cp index of a rank is dp_shard * cp + its cp index."""
    from memcalc.config import Mesh

    mesh = Mesh.parse("dp_replicate=2,dp_shard=2,cp=2")
    assert (mesh.ranks, mesh.shards) == (8, 4)  # 2 x 2 x 2; 2 x 2
    assert mesh.coordinates(5) == {"dp_replicate": 1, "dp_shard": 0, "cp": 1, "tp": 0}
    assert [mesh.shard_index(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert mesh.axes() == (("dp_replicate", 2), ("dp_shard", 2), ("cp", 2))
    assert Mesh(cp=4).axes() == (("dp_shard", 1), ("cp", 4))  # FSDP's axis is always there
    assert mesh.text() == "dp_replicate=2,dp_shard=2,cp=2"


@pytest.mark.parametrize("text, message", [
    ("dp_shard=2,dp_shard=4", "--mesh: dp_shard given twice"),
    ("pp=2", "--mesh: unknown axis 'pp'"),
    ("cp", "--mesh: cp takes a whole number of ranks"),
])
def test_a_mesh_badly_written_is_refused_naming_the_option(text, message):
    from memcalc.config import Mesh

    with pytest.raises(ValueError, match=message):
        Mesh.parse(text)
