"""Context parallelism measured on one GPU: each rank's step of PyTorch's ring attention run
for real, rank after rank, in one process, on a fake process group.

    python validation/cp_one_gpu.py OUT.json [MAX_SECONDS [ring|ulysses|math|eager|hf]]

``cp_live.py`` needs P GPUs (NCCL will not put two ranks of a group on one device). Here one
process plays rank r of P in turn: a fake process group in which it is rank r
(``torch.testing._internal.distributed.fake_pg``), a device mesh over it, and
``context_parallel``'s dispatcher (``F.scaled_dot_product_attention`` on DTensors sharded on
the sequence, ``_sdpa_handler``, ``_templated_ring_attention`` and its backward), the kernels
running on the GPU. A fake group moves no data; the functional collectives still allocate
their outputs, and what the kernels and the merger allocate does not depend on the values.
So the live figures are rank r's under NCCL but for one thing: NCCL keeps an async
collective's inputs until it is waited on (``stashed_for_allocator_safety_``, torch 2.8 on,
pytorch/pytorch#150398), a fake group keeps nothing.

``ulysses`` (the third argument) runs DeepSpeed-Ulysses instead: DeepSpeed's own
``DistributedAttention`` around SDPA with its backend pinned on each rank's (B, N / P, H, D)
rows (``memcalc.validation.context_parallel.rank_call``), in the same fake group; ``math``
around the math path and the naive family on the (B, N, H / P, D) tensors' transposed views
(the matmuls' layout copies); ``eager`` around ``examples/attention/ulysses_eager.py``'s
attention written out, and ``hf`` DeepSpeed's Ulysses for Hugging Face models
(``examples/attention/ulysses_hf.py``, transformers installed): traced, no model column.

For each (configuration, rank), memcalc's protocol (``memcalc.validation.cuda.measure``) and
three columns beside it, each the five figures:

- ``trace_fake``: memcalc's tracer on the meta device with this torch, its collectives as a
  fake group runs them (no stash): must equal ``live``;
- ``trace``: the tracer as memcalc runs it (NCCL's stash);
- ``model``: ``memcalc.impls.ring`` (NCCL's stash): equals ``trace`` (``memcalc validate
  --cases cp`` checks it on every commit).

Where ``live`` differs from ``trace_fake``, the caching allocator's events of that rank's
measured step (``torch.cuda.memory._record_memory_history``, with each event's innermost
frames in torch and memcalc) are kept in the report to read the difference from. The report
is rewritten after every configuration; configurations start until MAX_SECONDS (default 240)
have passed.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from contextlib import contextmanager

import torch
from torch.distributed.device_mesh import init_device_mesh

from cp_live import cp_dispatch  # validation/ is the script's directory

from memcalc.config import make_config
from memcalc.tracing.context_parallel import Ranks, fake_group
from memcalc.validation import cuda
from memcalc.validation.compare import figures_of
from memcalc.validation.context_parallel import (SDPA_KERNELS, WRITTEN_OUT, columns, grid,
                                                 rank_call, ulysses_grid)


def llama_sized(methods=("allgather", "alltoall")) -> list:
    """A Llama-style layer (B = 1, 32 heads, d = 128, bf16) at 16,384 rows a rank."""
    return [make_config(impl="sdpa-flash", batch=1, heads=32, head_dim=128, dtype="bf16",
                        causal=True, seq_len=16384 * P, cp=P, cp_method=method)
            for P in (2, 4, 8) for method in methods]


def math_sized() -> list:
    """The math path and ``naive-softmax`` under DeepSpeed-Ulysses at a Llama-style layer's
    heads (32 of 128, bf16): B = 1 (the matmuls fold views) and 2 (they copy), 4,096 rows,
    P = 2, 4, 8."""
    return [make_config(impl=impl, batch=B, heads=32, head_dim=128, dtype="bf16",
                        causal=True, seq_len=4096, cp=P, cp_method="ulysses")
            for impl in ("sdpa-math", "naive-softmax") for B in (1, 2) for P in (2, 4, 8)]


def eager_sized() -> list:
    """DeepSpeed-Ulysses around attention written out (``EXAMPLES["eager"]``), traced:
    B = 2, 8 heads of 64, bf16, 1,024 and 4,096 rows, P = 2, 4, 8 (the impl named is a
    placeholder the configuration needs; the trace runs the file)."""
    return [make_config(impl="sdpa-flash", batch=2, heads=8, head_dim=64, dtype="bf16",
                        causal=True, seq_len=rows, cp=P, cp_method="ulysses")
            for rows in (1024, 4096) for P in (2, 4, 8)]


def hf_sized() -> list:
    """DeepSpeed's Ulysses for Hugging Face models (``EXAMPLES["hf"]``), traced: B = 1 and
    2, 8 heads of 64 (4 key/value heads too), bf16, 4,096 rows, P = 2, 4, 8 where P divides
    the key/value heads; and 32 heads of 128 at 16,384 rows, P = 4."""
    return [make_config(impl="sdpa-flash", batch=B, heads=8, kv_heads=Hk, head_dim=64,
                        dtype="bf16", causal=True, seq_len=4096, cp=P, cp_method="ulysses")
            for B in (1, 2) for Hk in (8, 4) for P in (2, 4, 8) if Hk % P == 0] + [
        make_config(impl="sdpa-flash", batch=1, heads=32, head_dim=128, dtype="bf16",
                    causal=True, seq_len=16384, cp=4, cp_method="ulysses")]


# the configurations of each kind of run: torch's ring, DeepSpeed-Ulysses over the fused
# kernels, DeepSpeed-Ulysses over attention written out
RUNS = {"ring": lambda: llama_sized()[:2] + grid() + llama_sized()[2:],
        "ulysses": lambda: ulysses_grid(SDPA_KERNELS) + llama_sized(("ulysses",)),
        "math": lambda: math_sized() + ulysses_grid(WRITTEN_OUT),
        "eager": eager_sized, "hf": hf_sized}
# the runs of an example traced (no model), and how it is called
EXAMPLES = {"eager": ("examples/attention/ulysses_eager.py:attn", ("q=B,N,H,D", "k=B,N,H,D",
                                                                   "v=B,N,H,D")),
            "hf": ("examples/attention/ulysses_hf.py:attn", ("q=B,H,N,D", "k=B,K,N,D",
                                                             "v=B,K,N,D"))}


def example_call(run: str) -> tuple:
    """The example of ``run`` and its inputs."""
    from memcalc.engine.inputs import parse_input
    from memcalc.tracing import load_function

    target, inputs = EXAMPLES[run]
    return load_function(target), tuple(map(parse_input, inputs))


def example_columns(config, rank: int, run: str) -> dict:
    """The trace of the example (a fake group's collectives: DeepSpeed's are synchronous,
    NCCL's stash changes nothing); no model."""
    from memcalc.tracing import TraceOptions, traced
    from memcalc.tracing.target import Calling

    fn, inputs = example_call(run)
    trace = figures_of(traced(fn, config, TraceOptions(group="fake"),
                              calling=Calling(inputs=inputs), rank=rank).breakdown)
    return {"trace_fake": trace, "trace": trace, "model": None}


@contextmanager
def as_rank(config, rank: int):
    """This process as ``rank`` of ``config.cp`` on a fake group, SDPA on the ring (under
    Ulysses, DeepSpeed's all-to-alls are in the rank's own code)."""
    with fake_group(Ranks(config.cp, rank, config.cp_method)):
        if config.cp_method == "ulysses":
            yield
            return
        mesh = init_device_mesh("cuda", (config.cp,))
        with cp_dispatch(mesh):
            yield


def measured(config, run: str = "ring"):
    """memcalc's protocol on the GPU for the rank's step (``rank_call``, or the run's
    example)."""
    fn, inputs = example_call(run) if run in EXAMPLES else rank_call(config)
    return cuda.measure(config, torch, fn=fn, inputs=inputs)


def live(config, rank: int, run: str = "ring") -> dict:
    """memcalc's protocol on the GPU for ``rank``'s shard."""
    with as_rank(config, rank):
        return figures_of(measured(config, run))


def events(config, rank: int, run: str = "ring") -> list:
    """The allocator's events of the measured step (the warm-up's cleared), each with its
    innermost frames in torch or memcalc."""
    with as_rank(config, rank):
        return allocator_events(lambda: measured(config, run))


def allocator_events(step) -> list:
    """The caching allocator's events while ``step()`` runs, each with its innermost frames
    in torch or memcalc (also ``fsdp_one_gpu.py``'s)."""
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc",
                                             stacks="python", max_entries=1_000_000)
    step()
    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    torch.cuda.memory._record_memory_history(enabled=None)
    return [[e["action"], e["size"], _frames(e)] for e in trace
            if e["action"] in ("alloc", "free_completed", "segment_alloc", "segment_free")]


def _frames(event: dict) -> list[str]:
    kept = [f"{f['filename'].rsplit('site-packages/', 1)[-1]}:{f['line']} {f['name']}"
            for f in event.get("frames", ())
            if "torch/" in f["filename"] or "memcalc" in f["filename"]]
    return kept[:4]


# the allocator's events are kept for the first few differing rank steps only (a few
# hundred events each, with frames)
MAX_EVENT_ROWS, EVENTS_KEPT = 12, [0]


def case(config, rank: int, run: str = "ring") -> dict:
    """One (configuration, rank): the columns, the live figures, the events on a difference."""
    row = {"impl": config.impl, "dtype": config.dtype.value, "P": config.cp,
           "N": config.shape.seq_len, "batch": config.shape.batch, "heads": config.shape.heads,
           "kv_heads": config.shape.key_heads, "head_dim": config.shape.head_dim,
           "causal": config.causal, "method": config.cp_method, "rank": rank}
    columns_of = ((lambda c, r: example_columns(c, r, run)) if run in EXAMPLES
                  else columns)
    if not recorded(row, "error", lambda: row.update(columns_of(config, rank))):
        return row
    if recorded(row, "error", lambda: row.update(live=live(config, rank, run))):
        row["ok"] = row["live"] == row["trace_fake"]
        if not row["ok"] and EVENTS_KEPT[0] < MAX_EVENT_ROWS:
            EVENTS_KEPT[0] += 1
            recorded(row, "events_error",
                      lambda: row.update(events=events(config, rank, run)))
    return row


def recorded(row: dict, key: str, run) -> bool:
    """``run()`` (also ``fsdp_one_gpu.py``'s); an exception is recorded in ``row`` under ``key`` (its last frames under
    ``key`` + ``_where``) and the run goes on. True when it raised none."""
    try:
        run()
        return True
    except Exception as error:
        row[key] = "".join(traceback.format_exception_only(error)).strip()
        row[key + "_where"] = traceback.format_exc().splitlines()[-12:]
        return False


def main(out: str, max_seconds: float = 240, run: str = "ring") -> None:
    start = time.monotonic()
    env = cuda.environment(torch)
    rows: list[dict] = []
    for config in RUNS[run]():
        if time.monotonic() - start >= max_seconds:
            break
        config = cuda.live_config(config, env)
        rows += [case(config, rank, run) for rank in range(config.cp)]
        write_report(out, env, rows, time.monotonic() - start)
    done = sum(r.get("ok", False) for r in rows)
    print(f"{len(rows)} rank steps: {done} equal to the fake-group trace, "
          f"{sum('error' in r for r in rows)} errors, {time.monotonic() - start:.0f} s")


def write_report(out: str, env: dict, rows: list, seconds: float) -> None:
    with open(out, "w") as f:
        json.dump({"environment": env, "seconds": round(seconds), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 240,
         sys.argv[3] if len(sys.argv) > 3 else "ring")
