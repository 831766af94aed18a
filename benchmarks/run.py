"""Every speed figure of memcalc in one run, as ratios measured side by side (no assertions).

1. Breakdown latency: ``memcalc.analysis.predict.predict`` per call, at the default shape.
2. Sweeps: ``memcalc.analysis.vectorized.evaluate`` against a ``predict`` loop (``bench_oom_sweep``).
3. OOM solve: ``memcalc.analysis.solver.max_fitting`` against ``bisect_max`` (``bench_oom_sweep``).
4. Emulated trace (``memcalc.tracing.tracer.measure``, the reference code on the meta
   device) against the analytical model (``predict``), per configuration of the shipped grid.
5. CLI start-up against importing pydantic and rich and building one model, and ``memcalc
   trace`` of the SDPA example against ``python -c "import torch"`` (``bench_startup``).
6. The engine's long cases (``bench_engine``): chunked programs at N = 1e4..1e6, their OOM
   solve under a time limit, ``compare`` against ``breakdown``, a 1e6 grid and sweep to 16M.
7. The figures memcalc holds itself to, each against its bound (``targets``), written to
   ``benchmarks/results.json``; ``--readme`` renders the README's table from that file.

Run from the repository root: ``python benchmarks/run.py`` (about eight minutes on 2 cores;
``--quick`` for smaller sweep grids; ``--targets`` for the bounded figures alone, about two
minutes, ``--suite`` to add the test suite's time).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import random
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_engine  # noqa: E402  (this folder's benchmarks, reused as they are)
import bench_oom_sweep  # noqa: E402
import bench_startup  # noqa: E402
import targets  # noqa: E402

from memcalc.config import Config  # noqa: E402
from memcalc.impls import impl_names  # noqa: E402
from memcalc.analysis.predict import predict  # noqa: E402


def machine() -> str:
    """nproc, CPU model, Python, torch, numpy and pydantic versions."""
    import numpy
    import pydantic
    import torch

    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"machine: nproc {cores}, {model}; Python {platform.python_version()}, "
            f"torch {torch.__version__}, numpy {numpy.__version__}, "
            f"pydantic {pydantic.__version__}; {platform.platform()}")


def per_call(fn, calls: int) -> float:
    """Median seconds per call of ``fn()`` over 5 batches of ``calls`` calls."""
    fn()  # warm: imports, caches
    batches = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        batches.append((time.perf_counter() - start) / calls)
    return statistics.median(batches)


def bench_breakdown() -> float:
    """``predict`` per call at the default shape (naive, B=8 H=1 N=16384 d=16 fp32)."""
    config = Config()
    seconds = per_call(lambda: predict(config), 50)
    print(f"breakdown latency: predict(naive, B=8 H=1 N=16384 d=16 fp32) "
          f"{seconds * 1e3:.2f} ms per call (median of 5 x 50)")
    return seconds


def tee(fn, *args) -> str:
    """Run ``fn(*args)``, printing its output as it goes, and return the output."""
    buffer = io.StringIO()

    class Both(io.TextIOBase):
        def write(self, text: str) -> int:
            buffer.write(text)
            return sys.__stdout__.write(text)

    with contextlib.redirect_stdout(Both()):
        fn(*args)
    return buffer.getvalue()


def bench_sweeps(quick: bool) -> list[float]:
    """``bench_oom_sweep.bench_grid`` on its grids; the warm/loop ratios it printed."""
    out = "".join(tee(bench_oom_sweep.bench_grid, *grid) for grid in bench_oom_sweep.grids(quick))
    return [float(x.replace(",", "")) for x in re.findall(r"ratio warm/loop\s+([\d,]+)x", out)]


def bench_oom() -> float | None:
    """``bench_oom_sweep.bench_oom``; the total bisection / model-guided ratio it printed."""
    found = re.search(r"total: .* ratio ([\d.]+)x", tee(bench_oom_sweep.bench_oom))
    return float(found.group(1)) if found else None


def emulation_configs(per_impl: int = 2, seed: int = 0) -> list[Config]:
    """A few configurations of each implementation from the shipped validation grid."""
    from memcalc.validation.grid import default_grid

    rng = random.Random(seed)
    picked = []
    for name in impl_names():
        configs = default_grid().expand([name])
        picked += rng.sample(configs, min(per_impl, len(configs)))
    return picked


def bench_emulated() -> float:
    """Emulated trace against ``predict``, per configuration; the median ratio."""
    from memcalc.validation.emulated import measure

    configs = emulation_configs()
    measure(configs[0])  # warm: torch's dispatch caches
    ratios, traced_total, model_total = [], 0.0, 0.0
    for config in configs:
        traced = per_call(lambda: measure(config), 1)
        model = per_call(lambda: predict(config), 5)
        ratios.append(traced / model)
        traced_total += traced
        model_total += model
    impls = len({c.impl for c in configs})
    print(f"emulated trace vs model: {len(configs)} configurations of the shipped grid "
          f"(random, {len(configs) // impls} of each of its {impls} implementations)")
    print(f"  emulated measure {traced_total / len(configs) * 1e3:8.1f} ms per configuration "
          f"(mean)\n  predict          {model_total / len(configs) * 1e3:8.2f} ms per "
          f"configuration (mean)\n  ratio            {statistics.median(ratios):8.0f}x "
          f"(median; range {min(ratios):.0f}x to {max(ratios):.0f}x)")
    return statistics.median(ratios)


def bench_trace(runs: int) -> float:
    """``memcalc trace`` of the SDPA example against ``import torch``: the factor."""
    result = bench_startup.measure(runs, bench_startup.TRACE_ARGS, bench_startup.TORCH_FLOOR)
    print(bench_startup.report(result, "Trace"))
    return result["factor"]


def bench_cli(runs: int) -> float:
    """``bench_startup.measure``; the factor over the floor."""
    result = bench_startup.measure(runs)
    print(bench_startup.report(result))
    return result["factor"]


def bench_engine_cases(quick: bool) -> None:
    """``bench_engine``'s cases, as that script runs them."""
    bench_engine.run_all(quick)


def summary(latency: float, sweeps: list[float], oom: float | None, emulated: float,
            startup: float, trace: float) -> str:
    """The ratios, one line each."""
    sweep = (f"{min(sweeps):,.0f}x to {max(sweeps):,.0f}x" if sweeps else "see above")
    return "\n".join([
        "summary (all measured in this run):",
        f"  breakdown latency, predict at the default shape       {latency * 1e3:8.2f} ms per call",
        f"  sweep, vectorized (warm) vs predict loop             {sweep} configurations/s",
        f"  OOM solve, bisect_max time / max_fitting time        "
        f"{f'{oom:.1f}x' if oom else 'see above'}",
        f"  emulated trace time / analytical model time          {emulated:,.0f}x (median)",
        f"  CLI start-up / import pydantic, rich; one model      {startup:.2f}x",
        f"  memcalc trace (SDPA example) / python -c 'import torch' {trace:.2f}x",
    ])


def bench_targets(runs: int, with_suite: bool, readme: bool) -> None:
    """The bounded figures (``targets``), recorded in ``benchmarks/results.json``."""
    results = targets.record(targets.measure(runs, with_suite), machine())
    targets.save(results)
    print("the figures and their bounds (benchmarks/results.json):")
    print(targets.report(results))
    if readme:
        targets.rewrite_readme(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sweep grids")
    parser.add_argument("--runs", type=int, default=10, help="CLI start-up runs (default 10)")
    parser.add_argument("--targets", action="store_true",
                        help="only the bounded figures, recorded in benchmarks/results.json")
    parser.add_argument("--suite", action="store_true", help="time the test suite too")
    parser.add_argument("--readme", action="store_true",
                        help="render README's performance table from the record")
    args = parser.parse_args()
    start = time.perf_counter()
    os.chdir(targets.ROOT)
    print(machine())
    print()
    if args.targets:
        return bench_targets(max(3, args.runs // 2), args.suite, args.readme)
    latency = bench_breakdown()
    print()
    sweeps = bench_sweeps(args.quick)
    print()
    oom = bench_oom()
    print()
    emulated = bench_emulated()
    print()
    startup = bench_cli(args.runs)
    print()
    trace = bench_trace(args.runs)
    print()
    bench_engine_cases(args.quick)
    print()
    print(summary(latency, sweeps, oom, emulated, startup, trace))
    print()
    bench_targets(max(3, args.runs // 2), args.suite, args.readme)
    print(f"(total {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
