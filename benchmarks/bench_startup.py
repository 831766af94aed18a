"""Cold start of the CLI against the floor it cannot go below (no assertions).

``memcalc breakdown --seq 16384 --json`` as a user runs it (the installed console script,
a fresh process each time, bytecode cached) against importing pydantic and rich, the two
libraries every run needs, and building one model; and ``memcalc trace`` of the SDPA example (a file that imports torch only)
against ``python -c "import torch"``. Median of ``--runs`` runs each, interleaved so that
both see the same machine load.

Run: ``python benchmarks/bench_startup.py`` (``--runs 20`` for steadier medians).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import sysconfig
import time

FLOOR = [sys.executable, "-c", "import pydantic, rich; "
         "M = type('M', (pydantic.BaseModel,), {'__annotations__': {'x': int}, 'x': 1}); M()"]
"""Importing pydantic and rich and building one model: what every run needs at least."""
ARGS = ["breakdown", "--seq", "16384", "--json"]
TORCH_FLOOR = [sys.executable, "-c", "import torch"]
TRACE_ARGS = ["trace", "examples/attention/sdpa.py:attn", "--batch", "4", "--heads", "32",
              "--seq", "8192", "--head-dim", "128", "--dtype", "bf16", "--gpu", "a100-40gb",
              "--json"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli_command(args: list[str] = ARGS) -> list[str]:
    """The installed ``memcalc`` script run by this interpreter (not a pyenv or shell shim),
    or ``python -m memcalc.cli`` when there is none."""
    script = os.path.join(sysconfig.get_path("scripts"), "memcalc")
    if os.path.isfile(script):
        return [sys.executable, script, *args]
    return [sys.executable, "-m", "memcalc.cli", *args]


ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
"""Bytecode cached, as ``pip install`` leaves it: where PYTHONDONTWRITEBYTECODE is set (as
on this project's machine) every run compiled memcalc's sources, a sixth of its start-up."""


def wall(command: list[str]) -> float:
    """Seconds for one run of ``command`` in a fresh process (it must succeed), from the
    repository's root (where the trace's example is)."""
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=ROOT, env=ENV)
    return time.perf_counter() - start


def measure(runs: int = 10, args: list[str] = ARGS, floor: list[str] = FLOOR) -> dict:
    """Median wall times of the CLI with ``args`` and of ``floor``, and their ratio."""
    cli = cli_command(args)
    wall(cli), wall(floor)  # warm the file cache (bytecode, shared libraries)
    cli_times, floor_times = [], []
    for _ in range(runs):
        cli_times.append(wall(cli))
        floor_times.append(wall(floor))
    cli_median, floor_median = statistics.median(cli_times), statistics.median(floor_times)
    return {"runs": runs, "cli": cli, "args": args, "floor": floor, "cli_s": cli_median,
            "floor_s": floor_median, "factor": cli_median / floor_median}


def report(result: dict, what: str = "CLI start-up") -> str:
    """The measurement as text."""
    shown = " ".join(["memcalc", *result["args"]])
    floor = "floor: " + ("import pydantic, rich; one model" if result["floor"] == FLOOR
                         else result["floor"][-1])
    return (f"{what}, median of {result['runs']} fresh processes each:\n"
            f"  {shown}\n  {'':44} {result['cli_s'] * 1e3:7.0f} ms\n"
            f"  {floor:44} {result['floor_s'] * 1e3:7.0f} ms\n"
            f"  factor {result['factor']:.2f}x the floor "
            f"(+{(result['cli_s'] - result['floor_s']) * 1e3:.0f} ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="runs of each (default 10)")
    runs = parser.parse_args().runs
    print(report(measure(runs)))
    print(report(measure(runs, TRACE_ARGS, TORCH_FLOOR), "Trace"))


if __name__ == "__main__":
    main()
