"""What is alive at each implementation's peak, by role (saved, temporary, ...), N=16384.

    python examples/plots/components.py [OUT.png]   (default: components.png in the current directory)

Same picture as ``memcalc compare --seq 16384 --plot OUT.png`` for these implementations.
"""

import sys

import memcalc
from memcalc.errors import run_main
from memcalc.plots import plot_components

IMPLS = ["naive", "naive-softmax", "naive-weights", "sdpa-math", "checkpoint-naive",
         "flash2", "sdpa-efficient", "linear", "linear-causal"]


def main(out: str) -> None:
    """Draw the live set at each implementation's peak to ``out``."""
    plot_components([memcalc.breakdown(impl=name, seq_len=16384) for name in IMPLS], out)
    print(f"wrote {out}")


if __name__ == "__main__":  # a missing extra, bad input: one line, exit status 2
    run_main(main, sys.argv[1] if len(sys.argv) > 1 else "components.png")
