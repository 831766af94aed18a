"""Trace the four variants of ``variants.py`` and print their figures side by side.

Run: ``python examples/custom_softmax/compare.py`` (seq 16384, batch 8, fp32, H100).
"""

from pathlib import Path

from rich.console import Console
from rich.table import Table

from memcalc.config import Config
from memcalc.errors import run_main
from memcalc.engine.units import human

HERE = Path(__file__).parent


def main() -> None:
    """Trace each variant and print their figures side by side (needs torch)."""
    from memcalc.tracing import load_function, register_function, trace

    table = Table("variant", "saved", "forward peak", "backward peak", "reserved peak")
    for name in ("divide", "reciprocal", "detached_max", "in_place"):
        spec = f"{HERE / 'variants.py'}:{name}"
        fn = load_function(spec)
        b = trace(fn, Config(impl=register_function(fn, name)))
        table.add_row(name, *(human(x) for x in (b.saved_bytes, b.forward_peak_bytes,
                                                 b.backward_peak_bytes, b.reserved_peak_bytes)))
    Console(width=120).print(table)


if __name__ == "__main__":  # torch missing: one line saying how to install it, exit 2
    run_main(main)
