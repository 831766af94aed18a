"""Speed of the grid and OOM paths against the obvious alternatives (no assertions).

1. Configurations per second: ``memcalc.analysis.vectorized.evaluate`` on large grids, cold (the
   first call records the allocator paths) and warm (paths cached), against ``predict`` in a
   loop (measured on a sample, extrapolated), and exactness on a random sample of the grid.
2. OOM solve time: ``memcalc.analysis.solver.max_fitting`` (model-guided) against ``bisect_max`` (double
   from 1, then bisect, every step a full prediction), per implementation, at the default
   shape (B=8, H=1, d=16, fp32) and an 80 GiB budget less the default reserve.

Run: ``python benchmarks/bench_oom_sweep.py`` (add ``--quick`` for smaller grids).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from memcalc.analysis.budget import Budget
from memcalc.config import Config, Device
from memcalc.impls import impl_names
from memcalc.analysis.solver import bisect_max, max_fitting
from memcalc.analysis.thresholds import _too_big
from memcalc.analysis.predict import predict
from memcalc.analysis.vectorized import evaluate, evaluator


def at(config: Config, **shape) -> Config:
    return config.model_copy(update={"shape": config.shape.model_copy(update=shape)})


def grids(quick: bool) -> list[tuple[str, Config, dict]]:
    step = 64 if quick else 16
    n = np.arange(step, step * 2**16 // (4 if quick else 1) + 1, step)
    d = np.array([16, 32, 64, 128])
    b = np.array([1, 2, 4, 8])
    bb, dd, nn = np.meshgrid(b, d, n, indexing="ij")
    default = dict(batch=bb, head_dim=dd, seq_len=nn)
    n2 = np.arange(1024, 131072 + 1, 64 if not quick else 256)
    bb2, hh2, dd2, nn2 = np.meshgrid(np.arange(1, 33), np.array([4, 8, 16, 32, 64]),
                                     np.array([64, 128]), n2, indexing="ij")
    wide = dict(batch=bb2, heads=hh2, head_dim=dd2, seq_len=nn2)
    return [
        ("flash2 fp32, seq 16..1M x d 4 x B 4", Config(impl="flash2"), default),
        ("naive fp32, seq 16..1M x d 4 x B 4", Config(impl="naive"), default),
        ("naive bf16, seq 1K..128K x d 2 x B 32 x H 5", Config(impl="naive", dtype="bf16"), wide),
    ]


def bench_grid(name: str, base: Config, axes: dict, samples: int = 100) -> None:
    size = next(iter(axes.values())).size
    t = time.perf_counter()
    figures = evaluate(base, **axes)
    cold = time.perf_counter() - t
    t = time.perf_counter()
    figures = evaluate(base, **axes)
    warm = time.perf_counter() - t
    rng = np.random.default_rng(0)
    picks = rng.choice(size, size=min(samples, size), replace=False)
    flat = {k: v.reshape(-1) for k, v in axes.items()}
    t = time.perf_counter()
    mismatches = 0
    for i in picks:
        b = predict(at(base, **{k: int(v[i]) for k, v in flat.items()}))
        mismatches += b.figures() != {k: int(getattr(figures, k)[i]) for k in b.figures()}
    scalar = (time.perf_counter() - t) / len(picks)
    print(f"{name}: {size:,} configurations, {evaluator(base).paths_recorded} paths, "
          f"fallback {figures.fallback or 'none'}")
    print(f"  vectorized cold {size / cold:12,.0f} configs/s ({cold:.2f} s)")
    print(f"  vectorized warm {size / warm:12,.0f} configs/s ({warm:.2f} s)")
    print(f"  predict loop    {1 / scalar:12,.0f} configs/s ({scalar * 1e3:.2f} ms each)")
    print(f"  ratio warm/loop {scalar * size / warm:12,.0f}x, cold/loop {scalar * size / cold:,.0f}x;"
          f" {mismatches} mismatches on {len(picks)} random samples")


def bench_oom() -> None:
    budget = Budget.of(Device(gpu="h100-80gb"), memory_gb=80).budget_bytes
    total_fast = total_bisect = 0.0
    print(f"OOM solve, seq_len, B=8 H=1 d=16 fp32, budget {budget:,} B")
    print(f"  {'implementation':26} {'max N':>9} {'evals':>5} {'ms':>7}   "
          f"{'bisect N':>9} {'evals':>5} {'ms':>7}   ratio")
    for name in impl_names():
        config = Config(impl=name)
        try:
            if _too_big(config, "seq_len"):
                print(f"  {name:26} skipped (events grow with seq_len)")
                continue
            predict(at(config, seq_len=1))
        except ValueError as error:
            print(f"  {name:26} skipped ({str(error).splitlines()[0][:40]})")
            continue
        t = time.perf_counter()
        fast = max_fitting(config, budget)
        t_fast = time.perf_counter() - t
        t = time.perf_counter()
        slow = bisect_max(config, budget)
        t_slow = time.perf_counter() - t
        total_fast += t_fast
        total_bisect += t_slow
        print(f"  {name:26} {fast.max_value:9} {fast.evaluations:5} {t_fast * 1e3:7.1f}   "
              f"{slow.max_value:9} {slow.evaluations:5} {t_slow * 1e3:7.1f}   "
              f"{t_slow / t_fast:5.1f}x")
    print(f"  total: model-guided {total_fast * 1e3:.0f} ms, bisection {total_bisect * 1e3:.0f} ms, "
          f"ratio {total_bisect / total_fast:.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller grids")
    args = parser.parse_args()
    for name, base, axes in grids(args.quick):
        bench_grid(name, base, axes)
    bench_oom()


if __name__ == "__main__":
    main()
