"""The registry's programs: built once per implementation and sizes, long ones not kept."""

import dataclasses

from memcalc.impls import registry
from memcalc.config import Config
from memcalc.impls import get_impl


def test_a_small_program_is_built_once(monkeypatch):
    monkeypatch.setattr(registry, "_PROGRAMS", {})
    d = Config(impl="naive").dims
    impl = get_impl("naive")
    assert impl.program(d) is impl.program(d)


def test_a_long_program_is_not_kept(monkeypatch):
    """linear-causal-chunked at 65,536 rows: 1,024 chunks of 64, about 70,000 events, more
    than ``CACHED_EVENTS``: built again each time, so a million-row loop is not held."""
    monkeypatch.setattr(registry, "_PROGRAMS", {})
    d = Config(impl="linear-causal-chunked", shape={"seq_len": 65536}).dims
    impl = get_impl("linear-causal-chunked")
    first = impl.program(d)
    assert len(first.forward) + len(first.backward) > registry.CACHED_EVENTS
    assert impl.program(d) is not first and impl.program(d) == first


def test_another_builder_under_the_same_name_gets_its_own_program(monkeypatch):
    monkeypatch.setattr(registry, "_PROGRAMS", {})
    d = Config(impl="naive").dims
    naive = get_impl("naive")
    other = dataclasses.replace(naive, build=lambda dims: naive.build(dims.replace(N=dims.N // 2)))
    assert other.program(d) != naive.program(d)
