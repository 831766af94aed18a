"""The engine's long cases: chunked programs, their OOM solve, compare, a 1e6 grid to 16M.

Each case prints wall seconds (median of ``--repeat`` runs where cheap). Run from the
repository root: ``python benchmarks/bench_engine.py`` (about two minutes on 2 cores;
``--quick`` skips N = 1e6 and shrinks the grid).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import numpy as np

from memcalc.analysis.budget import Budget
from memcalc.config import Config, make_config
from memcalc.analysis.solved import Unsolved
from memcalc.analysis.solver import max_fitting
from memcalc.analysis.predict import predict
from memcalc.analysis.vectorized import evaluate


def seconds(fn, repeat: int = 1) -> float:
    """Median wall seconds of ``fn()`` over ``repeat`` runs."""
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def runs(fn, repeat: int) -> list[float]:
    """Wall seconds of each of ``repeat`` runs of ``fn()``."""
    return [seconds(fn) for _ in range(repeat)]


def spread(times: list[float], unit: str = "s", scale: float = 1.0, digits: int = 2) -> str:
    """"median M, best B of R": targets are medians; the best shows how much
    of a run was the machine (single runs of the same replay here spread over +-30 %)."""
    median, fastest = statistics.median(times) * scale, min(times) * scale
    return f"median {median:.{digits}f} {unit}, best {fastest:.{digits}f} {unit} of {len(times)}"


def bench_chunked(lengths: list[int], repeat: int = 5, impl: str = "linear-causal-chunked",
                  label: str = "chunked breakdown") -> None:
    """``predict`` of a chunked implementation (chunks of 64) at each length, ``repeat``
    runs."""
    for n in lengths:
        config = make_config(impl=impl, seq_len=n)
        print(f"{label}, N = {n:>9,}: {spread(runs(lambda: predict(config), repeat))}")


def bench_trace_chunked(lengths: list[int]) -> None:
    """The emulated trace (the reference code on the meta device, through the tracer) of
    linear-causal-chunked at each length, one run: its time grows with the loop's ops."""
    from memcalc.validation.emulated import measure

    measure(make_config(impl="linear-causal-chunked", seq_len=256))  # torch's first calls
    for n in lengths:
        config = make_config(impl="linear-causal-chunked", seq_len=n)
        print(f"chunked emulated trace, N = {n:>9,}: {seconds(lambda: measure(config)):.2f} s")


def bench_chunked_oom(time_limit: float) -> None:
    """The OOM solve of linear-causal-chunked at 80 GiB, under ``time_limit``."""
    config = Config(impl="linear-causal-chunked")
    budget = Budget.of(config.device, memory_gb=80).budget_bytes
    start = time.perf_counter()
    try:
        answer = f"max N = {max_fitting(config, budget, time_limit=time_limit).max_value:,}"
    except Unsolved as error:
        answer = str(error)
    print(f"chunked OOM at 80 GiB (time limit {time_limit:g} s): "
          f"{time.perf_counter() - start:.2f} s, {answer}")


def bench_cli(repeat: int) -> None:
    """``memcalc compare --seq 16384`` against ``memcalc breakdown --seq 16384``, fresh
    processes, wall time: ``repeat`` runs each, interleaved, and the ratio of the medians."""
    def run(*argv):
        return lambda: subprocess.run([sys.executable, "-m", "memcalc.cli", *argv],
                                      capture_output=True, check=True)

    cases = {"breakdown": run("breakdown", "--seq", "16384"),
             "compare": run("compare", "--seq", "16384")}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeat):
        for name, fn in cases.items():
            times[name].append(seconds(fn))
    ratio = statistics.median(times["compare"]) / statistics.median(times["breakdown"])
    print(f"CLI: breakdown {spread(times['breakdown'])}; compare {spread(times['compare'])}; "
          f"{ratio:.1f}x")


def bench_grid(count: int) -> None:
    """``evaluate`` (naive) over ``count`` lengths spread up to 16M: the largest sizes pass
    int64 and take Python integers."""
    lengths = np.unique(np.linspace(1, 16 << 20, count).astype(np.int64))
    config = Config(impl="naive")
    cold = seconds(lambda: evaluate(config, seq_len=lengths))
    warm = seconds(lambda: evaluate(config, seq_len=lengths))
    print(f"grid, naive, {len(lengths):,} lengths to 16M: first call {cold:.2f} s, "
          f"again {warm:.2f} s")


def bench_sweep(count: int) -> None:
    """``memcalc.sweep`` (the API, with the fits verdicts and the result object) over
    ``count`` lengths spread up to 16M, first call in the process."""
    import memcalc

    lengths = np.unique(np.linspace(1, 16 << 20, count).astype(np.int64)).tolist()
    print(f"memcalc.sweep, naive, {len(lengths):,} lengths to 16M: "
          f"{seconds(lambda: memcalc.sweep(seq_lens=lengths)):.2f} s")


def bench_latency() -> None:
    """``predict`` and ``memcalc.breakdown()`` at the default shape, warm, CPU time per call
    (7 batches of 200)."""
    import memcalc

    config = Config()
    for label, fn in [("predict(naive, B=8 H=1 N=16384 d=16 fp32)", lambda: predict(config)),
                      ("memcalc.breakdown(), the same step", memcalc.breakdown)]:
        fn()
        per_call = [_cpu(fn, 200) for _ in range(7)]
        print(f"{label}: {spread(per_call, 'ms', 1e3, 3)} CPU per call")


def bench_cli_chunked(n: int, repeat: int = 3) -> None:
    """``memcalc breakdown --impl linear-causal-chunked --seq n`` in a fresh process, wall
    time, the table rendered to a pipe, ``repeat`` runs."""
    argv = [sys.executable, "-m", "memcalc.cli", "breakdown", "--impl",
            "linear-causal-chunked", "--seq", str(n)]
    walls = runs(lambda: subprocess.run(argv, capture_output=True, check=True), repeat)
    print(f"CLI: chunked breakdown, N = {n:,}, rendered: {spread(walls)}")


def _cpu(fn, calls: int) -> float:
    start = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip N = 1e6, smaller grid")
    parser.add_argument("--repeat", type=int, default=7, help="runs of the CLI cases")
    args = parser.parse_args()
    run_all(args.quick, args.repeat)


def run_all(quick: bool, repeat: int = 7) -> None:
    """Every case, in order (``benchmarks/run.py`` runs them too)."""
    bench_latency()
    bench_chunked([10_000, 100_000] + ([] if quick else [1_000_000]))
    bench_chunked([100_000 if quick else 1_000_000], 3, "checkpoint-linear-causal-chunked",
                  "checkpointed chunked breakdown")
    if not quick:
        bench_cli_chunked(1_000_000)
    bench_trace_chunked([4096, 16384] + ([] if quick else [65536]))
    bench_chunked_oom(5.0)
    bench_cli(repeat)
    bench_sweep(100_000 if quick else 1_000_000)  # first: a cold evaluator
    bench_grid(100_000 if quick else 1_000_000)


if __name__ == "__main__":
    main()
