"""The hand counts' first question: what does one step of custom-softmax attention allocate at
seq_len 16384 (batch 8, 1 head, head_dim 16, fp32, H100), and what does torch.softmax or a
weights-only autograd Function change?  Run: ``python examples/breakdown_benchmark.py``."""

from rich.console import Console

from memcalc.config import Config
from memcalc.analysis.predict import predict
from memcalc.engine.units import human

console = Console(width=150)
console.print(predict(Config(impl="naive")))
for impl in ("naive", "naive-softmax", "naive-weights"):
    b = predict(Config(impl=impl))
    console.print(f"{impl:14} saved {human(b.saved_bytes):>10}   peak {human(b.peak_bytes):>10}"
                  f" ({b.peak_phase})   reserved {human(b.reserved_peak_bytes):>10}")
