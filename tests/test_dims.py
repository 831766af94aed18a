"""memcalc.engine.dims: the sizes read from a configuration, and their replacement."""

import dataclasses

import pytest

from memcalc.config import make_config
from memcalc.engine.dims import Dims


def test_of_reads_every_size_and_option_from_a_config():
    """Every field differs from the defaults, so a field read from the wrong place shows.
    sdpa-math supports fewer key/value heads; the a100-80gb preset has 108 SMs, cc 8.0."""
    config = make_config(impl="sdpa-math", batch=3, heads=4, kv_heads=2, seq_len=100,
                         kv_len=77, head_dim=32, dtype="bf16", causal=True, chunk=32,
                         gpu="a100-80gb", loss="sum", forward_only=True)
    expected = Dims(B=3, H=4, N=100, M=77, D=32, dtype="bfloat16", causal=True, loss="sum",
                    Hk=2, chunk=32, forward_only=True, sm_count=108,
                    compute_capability=(8, 0))
    assert Dims.of(config) == expected
    assert config.dims == expected  # Config.dims is Dims.of


def test_keys_and_key_heads_follow_the_queries_unless_given():
    d = Dims.of(make_config(seq_len=100, heads=4))
    assert (d.N, d.M, d.H, d.Hk) == (100, 100, 4, 4)


def test_replace_changes_only_the_given_sizes():
    d = Dims.of(make_config(seq_len=100, gpu="a100-80gb"))
    longer = d.replace(N=4096, M=8192)
    assert (longer.N, longer.M) == (4096, 8192)
    assert longer == dataclasses.replace(d, N=4096, M=8192)  # every other field kept
    assert (longer.sm_count, longer.compute_capability) == (108, (8, 0))  # a100-80gb's
    assert (d.N, d.M) == (100, 100)  # the original is untouched
    assert d.replace() == d


def test_replace_refuses_an_unknown_size():
    """A misspelt size is an error, not a silently ignored keyword."""
    with pytest.raises(TypeError, match="seq_len"):
        Dims.of(make_config()).replace(seq_len=4096)


def test_dims_are_frozen_values_usable_as_cache_keys():
    """Programs and the N x M names are cached by Dims: equal sizes, equal keys."""
    a, b = Dims.of(make_config(seq_len=64)), Dims.of(make_config(seq_len=64))
    assert a == b and hash(a) == hash(b)
    assert {a: "kept"}[b] == "kept"
    assert a.replace(N=65) != a
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.N = 128
