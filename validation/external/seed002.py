"""External case: the A800 "Memory Before Backward (MB)" table of seed 002.

../shared/seeds/002_c8ec1a9cbadc5a10.txt reports `torch.cuda.memory_allocated()` after the
forward of a custom-softmax attention, batch 8, 1 head, fp32, on an 80GB A800, for
seq_len 256..16384 and d_model 16..128, in MiB (their "MB": 3 N^2 fp32 tensors at
N=16384 are 24,576 MiB, more than the 24,897.3 "MB" would leave if MB were 10^6 B).

Reconstruction, from the differences between cells (see validation/README.md):
* the step is causal: the N^2 term is 3 fp32 N x N tensors plus exactly N^2 bytes, a bool
  mask built in the step and saved by ``masked_fill``;
* three N x N tensors stay alive after the forward: the masked scores, ``exp_x`` and the
  weights. ``x.max(dim)`` would save int64 indices, not the scores; ``x.amax(dim)`` saves
  its input and result (tools/autograd/derivatives.yaml), which gives both the third N x N
  tensor and the two fp32 row vectors (1 MiB at N=16384) the table shows;
* the slope in d is six (B, N, d) fp32 tensors, and a small term growing as d^2 shows at
  d=64 and d=128 (0.25 MiB at d=128, for every N): a "d_model" attention block with four
  ``nn.Linear(d, d)`` projections (weights 4 x d^2 x 4 B, biases 4 blocks of 512 B). Its
  input ``x`` (their accounting lists "Input data B x S x D"), the projections q, k, v,
  the attention output and the output projection are the six (B, N, d) tensors;
* two A800 cuBLAS workspaces (8,519,680 B each: forward thread and autograd thread) exist
  because the timing runs before the measurement did forward and backward.

Run: ``python validation/external/seed002.py`` (meta device; no GPU needed).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from memcalc.engine.allocator import MiB
from memcalc.config import Config, Device
from memcalc.tracing.tracer import Tracer, TracerProbe

B = 8
SEQ = [256, 1024, 4096, 8192, 16384]
DIMS = [16, 32, 64, 128]
# the seed's table, MiB with one decimal, rows seq_len, columns d_model
PUBLISHED = {
    256: [23.1, 23.8, 25.4, 28.6],
    1024: [116.3, 119.3, 125.4, 137.6],
    4096: [1580.5, 1592.5, 1616.6, 1664.8],
    8192: [6248.8, 6272.8, 6320.8, 6417.0],
    16384: [24897.3, 24945.3, 25041.3, 25233.5],
}


def custom_softmax(x):
    """The seed's custom softmax that keeps ``exp_x``, with ``amax`` for the row max."""
    exp_x = torch.exp(x - x.amax(dim=-1, keepdim=True))
    return exp_x / exp_x.sum(dim=-1, keepdim=True)


def attention(q, k, v):
    """Causal attention with the mask built in the step."""
    n = q.size(-2)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=q.device), diagonal=1)
    scores = scores.masked_fill(mask, float("-inf"))
    return custom_softmax(scores) @ v


class Block(torch.nn.Module):
    """Single-head attention over ``x`` (B, N, d_model) with four projections."""

    def __init__(self, d: int):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d, device="meta") for _ in range(4))

    def forward(self, x):
        return self.o(attention(self.q(x), self.k(x), self.v(x)))


def memory_before_backward(n: int, d: int) -> int:
    """``memory_allocated()`` after the forward, in bytes, traced on the meta device."""
    workspace = Config(device=Device(gpu="a800-80gb")).workspace_bytes
    tracer = Tracer(workspace)
    probe = TracerProbe(tracer)
    with tracer:
        block = Block(d)
        x = torch.randn(B, n, d, device="meta")  # "Input data"
        out = block(x)  # the timing runs: forward and backward before the measurement
        out.sum().backward()
        del out
        block.zero_grad(set_to_none=True)
        out = block(x)  # noqa: F841
        return probe.allocated()


def rows() -> list[dict]:
    """Predicted against published, per cell."""
    table = []
    for n in SEQ:
        for d, published in zip(DIMS, PUBLISHED[n]):
            predicted = memory_before_backward(n, d)
            tenths = (predicted * 10 * 2 + MiB) // (2 * MiB)  # MiB, one decimal, half up
            table.append({"seq_len": n, "d_model": d, "predicted_bytes": predicted,
                          "predicted_mib": f"{tenths // 10}.{tenths % 10}",
                          "published_mib": f"{published:.1f}",
                          "difference_tenths_mib": round(published * 10) - tenths})
    return table


if __name__ == "__main__":
    result = rows()
    out = Path(__file__).with_name("seed002.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    for r in result:
        print(r["seq_len"], r["d_model"], r["predicted_mib"], r["published_mib"],
              r["difference_tenths_mib"], file=sys.stdout)
