"""Developer aid: diff the model's event history against the emulated trace, event by event.

    python tools_compare_trace.py IMPL [causal 0/1] [loss grad/sum] [forward_only 0/1] [N]
"""
import itertools
import sys

from memcalc.config import Config, Protocol, Shape
from memcalc.engine.replay import Ledger
from memcalc.analysis.predict import predict
from memcalc.tracing.tracer import Tracer, TracerProbe  # noqa: F401
from memcalc.validation.emulated import measure

impl = sys.argv[1]
causal = len(sys.argv) > 2 and sys.argv[2] == "1"
loss = sys.argv[3] if len(sys.argv) > 3 else "grad"
fo = len(sys.argv) > 4 and sys.argv[4] == "1"
N = int(sys.argv[5]) if len(sys.argv) > 5 else 1000
cfg = Config(impl=impl, shape=Shape(batch=2, heads=3, seq_len=N, head_dim=16), dtype="fp16",
             causal=causal, protocol=Protocol(loss=loss, forward_only=fo))
model_ledger = Ledger(cfg.workspace_bytes, record=True)
model = predict(cfg, ledger=model_ledger)
import memcalc.tracing.tracer as em  # noqa: E402

traced_ledgers = []
orig = em.Tracer.__init__


def init(self, *a, **k):
    orig(self, *a, **k)
    traced_ledgers.append(self.ledger)


em.Tracer.__init__ = init
trace = measure(cfg)
print("model ", model.figures())
print("traced", trace.figures())
model_events = [e for e in model_ledger.history if e.kind != "phase"]
traced_events = [e for e in traced_ledgers[0].history if e.kind != "phase"]  # both: no marks
for i, (x, y) in enumerate(itertools.zip_longest(model_events, traced_events)):
    fx = (x[0], x[1].bytes) if x else None
    fy = (y[0], y[1].bytes) if y else None
    mark = "  " if fx == fy else "!!"
    left = f"{x[0]:5} {x[1].name:16} {str(x[1].shape):18}" if x else " " * 41
    right = f"{y[0]:5} {y[1].op:14} {str(y[1].shape):18} {y[1].source[:50]}" if y else ""
    print(f"{i:3} {mark} {left} | {right}")
