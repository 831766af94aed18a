"""Peak memory against seq_len, log-log, on an 80 GB card, with each implementation's
largest fitting seq_len marked.

    python examples/plots/peaks.py [OUT.png]        (default: peaks.png in the current directory)

Same picture as ``memcalc sweep --impl naive,naive-softmax,... --gpu-gb 80 --plot OUT.png``.
"""

import sys

import memcalc
from memcalc.errors import run_main
from memcalc.plots import plot_peaks

IMPLS = ["naive", "naive-softmax", "sdpa-math", "flash2", "linear", "linear-causal"]


def main(out: str) -> None:
    """Sweep seq_len 256 to 16384, solve each threshold, draw both to ``out``."""
    table = memcalc.sweep(seq_lens=(256, 1024, 2048, 4096, 8192, 16384), impls=IMPLS, gpu_gb=80)
    plot_peaks(table, memcalc.oom(gpu_gb=80, impls=IMPLS), out)
    print(f"wrote {out}")


if __name__ == "__main__":  # a missing extra, bad input: one line, exit status 2
    run_main(main, sys.argv[1] if len(sys.argv) > 1 else "peaks.png")
