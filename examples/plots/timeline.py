"""The seeds' benchmark step (naive, N=16384, batch 8, fp32, H100), allocation by allocation.

    python examples/plots/timeline.py [OUT.png]     (default: timeline.png next to this file)

Same picture as ``memcalc breakdown --seq 16384 --plot OUT.png``.
"""

import sys
from pathlib import Path

import memcalc
from memcalc.plots import plot_timeline


def main(out: str) -> None:
    """Draw one training step's allocated and reserved memory to ``out``."""
    plot_timeline(memcalc.make_config(impl="naive", seq_len=16384), out)
    print(out)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).with_name("timeline.png")))
