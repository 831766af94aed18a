"""Functional collectives in a trace, as NCCL runs them (``memcalc.tracing.collectives``):
the async wrap makes no copy, and a collective's input lives until its output is read."""

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from memcalc.tracing.collectives import Collectives  # noqa: E402
from memcalc.tracing.context_parallel import Ranks, fake_group  # noqa: E402
from memcalc.tracing.tracer import Tracer  # noqa: E402

MiB = 1 << 20


def run(release, body):
    """``body(x)`` on a 1 MiB float32 ``x`` under a tracer as rank 0 of 2; the ledger's
    allocations and frees after ``x``, as (kind, bytes, op)."""
    tracer = Tracer(0, None, None)
    tracer.collectives.stash_inputs = release >= (2, 8)
    with fake_group(Ranks(2, 0)), tracer:
        x = torch.empty(MiB // 4, device="meta")
        body(x)
        del x
        tracer.collect_frees()
    start = [i for i, e in enumerate(tracer.ledger.history) if e.kind == "alloc"][0] + 1
    return [(e.kind, e.component.bytes, e.component.name.split(" (")[0])
            for e in tracer.ledger.history[start:] if e.kind in ("alloc", "free")]


def gather_then_read(x):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as ft_c

    sent = x * 2  # the collective's input, dropped at once by the caller
    gathered = ft_c.all_gather_single(sent, gather_dim=0, group=dist.group.WORLD)
    del sent
    y = torch.empty(MiB // 4, device="meta")  # made while the collective is in flight
    gathered[:1].sum()  # the first read: the wait
    del y, gathered


def test_an_async_collectives_input_lives_until_its_output_is_read():
    """torch 2.8 on (pytorch/pytorch#150398): ProcessGroupNCCL stashes the input until the
    wait. The gather's 2 MiB output is the only copy: the async wrap allocates nothing."""
    events = run((2, 13), gather_then_read)
    assert events[:4] == [("alloc", MiB, "mul"), ("alloc", 2 * MiB, "all_gather_into_tensor"),
                          ("alloc", MiB, "empty"), ("free", MiB, "mul")]


def test_before_2_8_record_stream_lets_the_input_go_with_its_last_reference():
    events = run((2, 7), gather_then_read)
    assert events[:4] == [("alloc", MiB, "mul"), ("alloc", 2 * MiB, "all_gather_into_tensor"),
                          ("free", MiB, "mul"), ("alloc", MiB, "empty")]


def test_log_sigmoid_keeps_no_buffer_on_cuda():
    """log_sigmoid_forward_cuda's buffer is empty ("only used by CPU dispatch"); meta makes
    it full size."""
    import torch.nn.functional as F

    tracer = Tracer(0, None, None)
    with tracer:
        x = torch.empty(MiB // 4, device="meta")
        y = F.logsigmoid(x)
        del x, y
        tracer.collect_frees()
    made = [e.component.bytes for e in tracer.ledger.history if e.kind == "alloc"]
    assert made == [MiB, MiB]  # x, the result


RESULTS = Path(__file__).resolve().parents[1] / "validation" / "results"


def test_the_stash_and_the_alias_as_an_h100_measured_them():
    """``validation/nccl_stash.py`` on an H100 (torch 2.11, NCCL 2.28, a group of one rank):
    a 4 MiB input dropped right after the call stays allocated with the 4 MiB output
    (4 + 4 = 8 MiB: the wrap copies nothing) a second later too, and goes at the wait
    (4 MiB left): the tracer's rules for that release."""
    report = json.loads((RESULTS / "nccl-stash-nvidia-h100-80gb-hbm3-2.11.0-cu130.json")
                        .read_text())
    release = tuple(int(p) for p in report["torch"].split("+")[0].split(".")[:2])
    assert Collectives(release).stash_inputs
    functional, synchronous = report["rows"][:2], report["rows"][2:]
    for row in functional:
        assert (row["after_call"], row["after_del_input"], row["after_1s"],
                row["after_wait"]) == (8 * MiB, 8 * MiB, 8 * MiB, 4 * MiB), row["collective"]
    # dist.all_to_all_single called synchronously, as DeepSpeed-Ulysses calls it: 4 + 4 MiB
    # after the call, the output's 4 alone once the input is dropped (the tracer holds
    # nothing for c10d's in-place collectives: memcalc/tracing/cuda_paths.py observe)
    assert [(r["collective"], r["after_call"], r["after_del_input"]) for r in synchronous] == [
        ("dist.all_to_all_single", 8 * MiB, 4 * MiB)]


def test_a_fake_group_stashes_nothing():
    """What ``validation/cp_one_gpu.py`` runs on: a fake process group keeps no input."""
    assert not Collectives((2, 13), "fake").stash_inputs
    assert Collectives((2, 13), "nccl").stash_inputs
