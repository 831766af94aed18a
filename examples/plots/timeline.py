"""The benchmark step (naive, N=16384, batch 8, fp32, H100), allocation by allocation.

    python examples/plots/timeline.py [OUT.png]     (default: timeline.png in the current directory)

Same picture as ``memcalc breakdown --seq 16384 --plot OUT.png``.
"""

import sys

import memcalc
from memcalc.errors import run_main
from memcalc.plots import plot_timeline


def main(out: str) -> None:
    """Draw one training step's allocated and reserved memory to ``out``."""
    plot_timeline(memcalc.make_config(impl="naive", seq_len=16384), out)
    print(f"wrote {out}")


if __name__ == "__main__":  # a missing extra, bad input: one line, exit status 2
    run_main(main, sys.argv[1] if len(sys.argv) > 1 else "timeline.png")
