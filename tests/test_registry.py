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


def test_the_order_of_the_names_does_not_depend_on_what_loaded_first():
    """Implementation modules load when first needed; a module imported out of turn (the
    tracer imports cuDNN's, a command names FlexAttention) leaves every list of names in
    ``MODULES``' order, as a process that loads them all at once has it."""
    import subprocess
    import sys

    code = ("import {first}\nfrom memcalc.impls import impl_names\nprint(impl_names())")
    orders = {first: subprocess.run([sys.executable, "-c", code.format(first=first)],
                                    capture_output=True, text=True, check=True).stdout
              for first in ("memcalc.impls", "memcalc.impls.flex", "memcalc.impls.sdpa_cudnn",
                            "memcalc.impls.sdpa_efficient")}
    assert len(set(orders.values())) == 1, orders
    names = eval(orders["memcalc.impls"])  # noqa: S307 - a list of names this test printed
    assert names.index("sdpa-flash") < names.index("sdpa-efficient") < names.index("sdpa")
    assert names[-1].startswith("checkpoint-")
