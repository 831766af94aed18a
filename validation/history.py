"""The CUDA caching allocator's own record of chosen live cases, op by op: what to read when
a live figure differs from the model and the op scratch does not say why.

    python validation/history.py OUT.json REPORT.json   # on a GPU

For each case that differs in REPORT.json (a live run's report, ``memcalc validate
--backend cuda --out``), the protocol runs once under
``torch.cuda.memory._record_memory_history`` (no stacks), with every aten op bracketed by a
dispatch mode that notes which of the allocator's events (alloc, free, segment alloc/free,
by requested size and address) fell inside it; events between ops (a tensor dying in
Python) are listed under the op ``-``. Then ``REDUCTIONS``: each sum alone, its events. Compare with the
emulated trace of the same case (``memcalc.validation.emulated``) on this machine.
"""

from __future__ import annotations

import json
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memcalc.validation.cases import all_cases
from memcalc.validation.cuda import LiveGpu, _release, environment
from memcalc.validation.grid import default_grid

# (shape, dtype, dims) of sums seen in the cases: the loss, linear attention's k.sum(-2),
# a Linear's bias gradient (sum over every dim but the last)
REDUCTIONS = [((8, 8, 2047, 64), "float16", None), ((8, 8, 2047, 128), "float16", None),
              ((1, 8, 2047, 128), "float16", None), ((2, 4, 1050, 16), "float16", (-2,)),
              ((2, 4, 1050, 16), "float32", (-2,)), ((2, 4, 3001, 16), "float16", (-2,)),
              ((4, 8, 16384, 64), "float16", (-2,)), ((2, 1024, 768), "float32", (0, 1)),
              ((2, 4096, 768), "float32", (0, 1)), ((2, 1024, 256), "float32", (0, 1)),
              ((2048, 768), "float32", (0,)), ((2, 1024, 768), "bfloat16", (0, 1)),
              ((1 << 20,), "float32", None), ((1 << 24,), "float32", None),
              ((1000, 1000), "float32", (1,)), ((1000, 1000), "float32", (0,))]


def _events(start: int) -> tuple[list, int]:
    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    return [(e["action"], e["size"], e["addr"]) for e in trace[start:]
            if e["action"] in ("alloc", "free_completed", "segment_alloc", "segment_free")], \
        len(trace)


class OpEvents(TorchDispatchMode):
    """Each op's allocator events, and those between ops."""

    def __init__(self):
        super().__init__()
        self.log: list = []
        self.seen = len(torch.cuda.memory._snapshot()["device_traces"][0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        torch.cuda.synchronize()
        between, self.seen = _events(self.seen)
        if between:
            self.log.append(["-", [], between])
        out = func(*args, **(kwargs or {}))
        torch.cuda.synchronize()
        inside, self.seen = _events(self.seen)
        shapes = [list(a.shape) + [str(a.dtype)] for a in args if isinstance(a, torch.Tensor)]
        self.log.append([func.__name__, shapes, inside])
        return out


def record(run) -> list:
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                             max_entries=1_000_000)
    mode = OpEvents()
    with mode:
        run()
    torch.cuda.synchronize()
    tail, _ = _events(mode.seen)
    torch.cuda.memory._record_memory_history(enabled=None)
    return mode.log + ([["-", [], tail]] if tail else [])


def differing(report: str) -> set[str]:
    """The keys of the cases that differ (or failed) in a live report."""
    checks = json.load(open(report))["checks"]
    return {_key(c["case"], c["config"]) for c in checks if not c["ok"]}


def _key(kind: str, config: dict) -> str:
    return kind + json.dumps(config, sort_keys=True)


def main(out: str, report: str) -> None:
    wanted = differing(report)
    gpu = LiveGpu()
    env = environment()
    props = torch.cuda.get_device_properties(0)
    result = {"environment": env, "props": {
        "max_threads_per_multi_processor": props.max_threads_per_multi_processor,
        "multi_processor_count": props.multi_processor_count, "warp_size": props.warp_size},
        "cases": {}, "reductions": []}
    for shape, dtype, dims in REDUCTIONS:
        x = torch.ones(shape, dtype=getattr(torch, dtype), device=gpu.device)
        log = record(lambda: x.sum() if dims is None else x.sum(dims))
        result["reductions"].append([shape, dtype, dims, log])
        _release(torch)
    _write(out, result)
    cases = all_cases(("usercode", "modelcode", "grid"), default_grid().expand(), env, 0)
    for case in cases:
        if _key(case.kind, json.loads(case.config.model_dump_json())) not in wanted:
            continue
        try:
            fn = case.code(gpu.device)
            result["cases"][case.key] = record(lambda: gpu.measure(case.config, fn,
                                                                   inputs=case.inputs))
        except Exception as error:  # noqa: BLE001 - a diagnostic: note it, go on
            result["cases"][case.key] = f"{type(error).__name__}: {error}"
        _release(torch)
        _write(out, result)
        print(case.key[:120], flush=True)


def _write(out: str, result: dict) -> None:
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
