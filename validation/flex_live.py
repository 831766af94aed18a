"""Compiled FlexAttention on a GPU, its allocator events recorded (a first look, no model yet).

    python validation/flex_live.py OUT.json [DTYPE [HEAD_DIM]]
"""
import json
import sys

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

flex = torch.compile(flex_attention)


def causal(b, h, q, kv):
    return q >= kv


def events(start):
    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    return [(e["action"], e["size"], e["addr"]) for e in trace[start:]], len(trace)


def case(n, is_causal, dtype=torch.float16, b=2, h=4, d=64):
    mask = create_block_mask(causal, None, None, n, n, device="cuda") if is_causal else None
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, requires_grad=True)
               for _ in range(3))
    g = torch.randn(b, h, n, d, device="cuda", dtype=dtype)
    flex(q, k, v, block_mask=mask).backward(g)  # compile and warm up
    for t in (q, k, v):
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=100000, stacks="python")
    _, start = events(0)
    out = flex(q, k, v, block_mask=mask)
    fwd_peak = torch.cuda.max_memory_allocated()
    after_fwd = torch.cuda.memory_allocated()
    fwd, mid = events(start)
    torch.cuda.reset_peak_memory_stats()
    out.backward(g)
    bwd_peak = torch.cuda.max_memory_allocated()
    bwd, _ = events(mid)
    torch.cuda.memory._record_memory_history(enabled=None)
    row = dict(n=n, causal=is_causal, dtype=str(dtype), b=b, h=h, d=d, base=base,
               fwd_peak=fwd_peak, after_fwd=after_fwd, bwd_peak=bwd_peak,
               after_bwd=torch.cuda.memory_allocated(), fwd=fwd, bwd=bwd,
               mask_bytes=0 if mask is None else sum(
                   t.untyped_storage().nbytes() for t in mask.as_tuple()
                   if isinstance(t, torch.Tensor)))
    print(n, is_causal, base, fwd_peak, after_fwd, bwd_peak, len(fwd), len(bwd), flush=True)
    return row


rows = []
dtype = getattr(torch, sys.argv[2]) if len(sys.argv) > 2 else torch.float16
head_dim = int(sys.argv[3]) if len(sys.argv) > 3 else 64
for n in (1024, 4096):
    for c in (False, True):
        try:
            rows.append(case(n, c, dtype=dtype, d=head_dim))
        except Exception as e:  # noqa: BLE001
            rows.append(dict(n=n, causal=c, error=repr(e)))
            print(n, c, repr(e), flush=True)
        json.dump(dict(torch=torch.__version__, device=torch.cuda.get_device_name(), rows=rows),
                  open(sys.argv[1], "w"))
