"""FSDP2 measured on one GPU: each rank's training step of PyTorch's own ``fully_shard``
run for real, rank after rank, in one process, on a fake process group; and with a real
NCCL group of one.

    python validation/fsdp_one_gpu.py OUT.json [MAX_SECONDS]

NCCL will not put two ranks of a group on one GPU. Here one process plays rank r of P in
turn, as ``cp_one_gpu.py`` does for context parallelism: a fake process group in which it
is rank r (``torch.testing._internal.distributed.fake_pg``), a device mesh over it on
``cuda``, the model built on the meta device, sharded as ``memcalc trace --fsdp`` shards
it (``memcalc.tracing.fsdp.shard``: each repeated layer, then the root), then materialized
with ``to_empty`` (torchtitan's order: only the rank's shards are ever allocated), and
trained under memcalc's protocol (``memcalc.validation.cuda.measure``). A fake group moves
no data; FSDP2's collectives are synchronous and what its copies allocate does not depend
on the values, so the live figures are rank r's under NCCL. The NCCL group of one (P = 1,
backend ``nccl``) checks that a synchronous collective keeps nothing past its last
reference, as the fake group assumes.

For each (setup, length, rank) two columns, each the five figures: ``trace``, memcalc's
tracer on the meta device as that rank (``memcalc trace --fsdp P``), and ``live``; ``ok``
when they are equal. Where they differ, the caching allocator's events of the measured step
are kept (``torch.cuda.memory._record_memory_history``). The report is rewritten after every
case; cases start until MAX_SECONDS (default 240) have passed.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from cp_one_gpu import allocator_events, recorded, write_report  # validation/: this folder
from memcalc.compiling.session import calls, live_run
from memcalc.config import make_config
from memcalc.tracing import TraceOptions, bound, traced
from memcalc.tracing.context_parallel import Ranks, fake_group
from memcalc.tracing.fsdp import Sharding, shard
from memcalc.tracing.optimizers import loop_of
from memcalc.tracing.target import Calling
from memcalc.validation import cuda
from memcalc.validation.compare import figures_of
from memcalc.validation.compiled import BlockCompiledLM
from memcalc.validation.fsdp import SETUPS
from memcalc.validation.training import IDS, EagerTinyLM, TinyLM

LENGTHS = (1024, 4096)
# (name, module, sharding, optimizer): the emulated setups over the written-out model, then
# the SDPA one (its fused kernel modelled), the same with each block compiled in its
# constructor (torchtitan's apply_compile before fully_shard: traced compiled for the preset
# GPU, run as torch compiles it) and the NCCL group of one
CASES = ([(name, EagerTinyLM, sharding, optimizer) for name, sharding, optimizer in SETUPS]
         + [("fsdp2-lm-sdpa-adamw", TinyLM, Sharding(2), "adamw"),
            ("fsdp2-lm-blocks-compiled-adamw", BlockCompiledLM, Sharding(2), "adamw"),
            ("fsdp1-nccl-lm-adamw", EagerTinyLM, Sharding(1), "adamw")])


def calling_of(sharding: Sharding, optimizer: str, rank: int | None = None) -> Calling:
    return Calling(IDS, loop=loop_of(optimizer), fsdp=sharding, rank=rank)


def trace_column(module: type, config, sharding: Sharding, optimizer: str, rank: int) -> dict:
    """The tracer as ``rank``, on the meta device; torch.compile calls in the module's
    constructor (torchtitan's per-block compile) compiled for the preset GPU."""
    from memcalc.tracing import prepared

    with calls(None):
        fn = prepared(module, module.__name__)
        return figures_of(traced(fn, config, TraceOptions(), calling=calling_of(
            sharding, optimizer, rank)).breakdown)


def live_column(name: str, module: type, config, sharding: Sharding, optimizer: str,
                rank: int, record: bool = False):
    """The rank's step on the GPU: the fake group (or, P = 1 under NCCL, a real group of
    one), the model sharded on meta then materialized on cuda, the protocol run."""
    nccl = "nccl" in name
    if nccl:
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29517", rank=0,
                                world_size=1)
    try:
        with (_nothing() if nccl else fake_group(Ranks(sharding.world, rank))), live_run():
            with torch.device("meta"):  # a constructor's torch.compile: torch's own
                model = module()
            shard(model, sharding, device="cuda")
            model.to_empty(device="cuda")
            call = bound(model, config, calling_of(sharding, optimizer))
            step = lambda: cuda.measure(config, torch, fn=call, inputs=IDS,  # noqa: E731
                                        loop=call.loop)
            return allocator_events(step) if record else figures_of(step())
    finally:
        if nccl:
            dist.destroy_process_group()


def _nothing():
    from contextlib import nullcontext

    return nullcontext()


MAX_EVENT_ROWS, EVENTS_KEPT = 8, [0]


def case(name: str, module: type, config, sharding: Sharding, optimizer: str,
         rank: int) -> dict:
    row = {"case": name, "P": sharding.world, "rank": rank, "N": config.shape.seq_len,
           "batch": config.shape.batch, "optimizer": optimizer,
           "param_dtype": sharding.param_dtype, "reduce_dtype": sharding.reduce_dtype,
           "reshard_after_forward": sharding.reshard_after_forward}
    args = (module, config, sharding, optimizer, rank)
    if not recorded(row, "error", lambda: row.update(trace=trace_column(*args))):
        return row
    if recorded(row, "error", lambda: row.update(live=live_column(name, *args))):
        row["ok"] = row["live"] == row["trace"]
        if not row["ok"] and EVENTS_KEPT[0] < MAX_EVENT_ROWS:
            EVENTS_KEPT[0] += 1
            recorded(row, "events_error", lambda: row.update(
                events=live_column(name, *args, record=True)))
    return row


def main(out: str, max_seconds: float = 240) -> None:
    from memcalc.tracing import register_function, prepared

    start = time.monotonic()
    env = cuda.environment(torch)
    rows: list[dict] = []
    for name, module, sharding, optimizer in CASES:
        with calls(None):
            impl = register_function(prepared(module, name), f"fsdp-live:{name}",
                                     calling_of(sharding, optimizer))
        for n in LENGTHS:
            if time.monotonic() - start >= max_seconds:
                break
            config = cuda.live_config(make_config(impl=impl, batch=2, seq_len=n), env)
            rows += [case(name, module, config, sharding, optimizer, r)
                     for r in range(sharding.world)]
            write_report(out, env, rows, time.monotonic() - start)
    done = sum(r.get("ok", False) for r in rows)
    print(f"{len(rows)} rank steps: {done} equal to the trace, "
          f"{sum('error' in r for r in rows)} errors, {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 240)
