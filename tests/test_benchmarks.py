"""The benchmarks still run against the library as it is (they are not in the suite
otherwise, and an API change broke them silently: ``Budget.of`` read 80 << 30 as GB). No
timing is asserted: speed is measured in ``benchmarks/``, not in tests."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

bench_engine = pytest.importorskip("bench_engine")
bench_oom_sweep = pytest.importorskip("bench_oom_sweep")


def test_the_engine_benchmarks_run_a_small_case(capsys):
    bench_engine.bench_chunked_oom(0.5)
    bench_engine.bench_chunked([640], repeat=1)
    out = capsys.readouterr().out
    # 80 GiB less the 512 MiB reserve: the chunked loop is not solved in half a second
    assert "chunked OOM at 80 GiB (time limit 0.5 s)" in out
    assert "chunked breakdown, N =       640" in out


def test_the_oom_benchmark_runs(capsys):
    bench_oom_sweep.bench_oom()  # max_fitting against bisect_max, every implementation
    assert "total: model-guided" in capsys.readouterr().out


def test_the_loop_state_diagnostic_runs(capsys):
    """``loop_state``: 40 chunks of 64 rows (2,560), too few for the forward to repeat."""
    loop_state = pytest.importorskip("loop_state")
    assert loop_state.main(["--seq", "2560"]) == 0
    out = capsys.readouterr().out
    assert "40 chunks of 64" in out and "forward: no chunk's small pool repeats" in out
    # one row a slice of the 40 backward chunks, last chunk first: 5 each
    assert out.splitlines()[-8].split()[0] == "5"


def test_the_startup_benchmark_measures_the_trace(capsys):
    """One run of each: the trace of the SDPA example and its floor, import torch."""
    bench_startup = pytest.importorskip("bench_startup")
    result = bench_startup.measure(1, bench_startup.TRACE_ARGS, bench_startup.TORCH_FLOOR)
    text = bench_startup.report(result, "Trace")
    assert text.startswith("Trace, median of 1 fresh processes each:")
    assert "floor: import torch " in text and result["factor"] > 0


def test_the_readmes_performance_table_is_the_record():
    """README's table is ``targets.render`` of ``benchmarks/results.json``, as ``run.py
    --targets --readme`` writes it (whether each figure is within its bound is the
    benchmark's to say: speed is not asserted here)."""
    import json

    targets = pytest.importorskip("targets")
    results = json.loads(targets.RESULTS.read_text())
    for page in targets.PAGES:
        table = page.read_text().split(targets.README_START)[1].split(targets.README_END)[0]
        assert table.strip() == targets.render(results).strip(), page
    assert {k for k, *_ in targets.FIGURES} <= set(results["figures"])
