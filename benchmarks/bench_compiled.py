"""Compiled steps: the wall time of ``memcalc trace --compile`` on Hugging Face's
Llama-3-8B with its loss and AdamW, at 2 layers and 32, each in a fresh process; the eager
trace of the same step beside each (what compiling adds). Speed only: nothing is asserted.

    python benchmarks/bench_compiled.py           # about 5 minutes on 2 cores
    python benchmarks/bench_compiled.py --quick   # 2 layers only
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP = ["trace", "examples/training/llama3_8b.py:model", "--input", "input_ids=B,N:int64",
        "--input", "labels=B,N:int64", "--seq", "4096", "--batch", "1", "--param-dtype",
        "bf16", "--optimizer", "adamw", "--gpu", "h100-80gb", "--json"]


def wall(layers: int, compiled: bool) -> float:
    """Seconds of one trace in a fresh process."""
    argv = [sys.executable, "-m", "memcalc.cli", *STEP, *(["--compile"] if compiled else [])]
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, cwd=ROOT,
                   env={**os.environ, "LAYERS": str(layers)})
    return time.perf_counter() - start


def main() -> None:
    depths = (2,) if "--quick" in sys.argv else (2, 32)
    print(f"nproc {os.cpu_count()}, python {sys.version.split()[0]}")
    for layers in depths:
        eager, compiled = wall(layers, False), wall(layers, True)
        print(f"Llama-3-8B, {layers} layers, AdamW, seq 4096: eager {eager:.1f} s, "
              f"compiled {compiled:.1f} s")


if __name__ == "__main__":
    main()
