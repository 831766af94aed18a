"""Context parallelism on several GPUs, live: each rank's step measured by torch.cuda.

    torchrun --nproc-per-node P validation/cp_live.py [N] [allgather|alltoall] [OUT.json]

Each rank calls ``F.scaled_dot_product_attention`` (flash backend, causal) on its own
(B, H, N / P, D) shard of q, k, v inside PyTorch's ``context_parallel`` (ring attention),
under memcalc's protocol: the inputs and ``grad_out``, a warm-up step, then the forward and
the backward each from reset peaks (``max_memory_allocated``, ``max_memory_reserved``).
Rank 0 gathers every rank's figures and writes them to OUT.json (default
``cp-<P>-<method>.json``) with the model's (``memcalc.analysis.predict.rank_breakdown``)
when memcalc imports; ``memcalc validate --cases cp`` checks the same model without a GPU.
Sizes: B = 1, H = 32, D = 128, bf16 (a Llama-style layer); N defaults to 8,192 x P.
"""

import json
import sys
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.attention import SDPBackend, sdpa_kernel

B, H, D, DTYPE = 1, 32, 128, torch.bfloat16


def _attention():
    """Torch's context-parallel module (``_context_parallel/_attention.py``, or
    ``experimental/_attention.py`` in older releases)."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention
    except ImportError:
        from torch.distributed.tensor.experimental import _attention
    return _attention


def set_rotate_method(method: str) -> None:
    _attention().set_rotate_method(method)


@contextmanager
def cp_dispatch(mesh):
    """SDPA on the ring, over tensors that are already this rank's shards: what
    ``context_parallel(mesh, buffers=...)`` turns on after sharding its buffers
    (``_enable_context_parallel_dispatcher_impl``). ``context_parallel(mesh)`` with no buffers
    reads ``buffers[0]`` and raises IndexError (torch 2.11 to 2.13), and buffers given to it are
    cloned, which would sit outside the measured step."""
    cp = _attention()
    cp._dispatch_mode = cp._DispatchMode.MONKEY_PATCH
    cp._enable_context_parallel_dispatcher_impl(seq_dim=2, mesh=mesh)
    try:
        yield
    finally:
        cp._disable_context_parallel_dispatcher_impl()


def ring(mesh):
    """The flash backend under context parallelism, for a forward and its backward both."""
    from contextlib import ExitStack

    stack = ExitStack()
    stack.enter_context(sdpa_kernel(SDPBackend.FLASH_ATTENTION))
    stack.enter_context(cp_dispatch(mesh))
    return stack


def measure(mesh, n: int) -> dict:
    """memcalc's protocol on this rank's shard of n rows."""
    q, k, v = (torch.randn(B, H, n, D, device="cuda", dtype=DTYPE, requires_grad=True)
               for _ in range(3))
    grad_out = torch.randn(B, H, n, D, device="cuda", dtype=DTYPE)
    with ring(mesh):  # the warm-up step
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad_out)
    for t in (q, k, v):
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with ring(mesh):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.cuda.synchronize()
        forward_peak = torch.cuda.max_memory_allocated()
        saved = torch.cuda.memory_allocated() - before - out.untyped_storage().nbytes()
        reserved = torch.cuda.max_memory_reserved()
        torch.cuda.reset_peak_memory_stats()
        out.backward(grad_out)
        torch.cuda.synchronize()
    backward_peak = torch.cuda.max_memory_allocated()
    return {"saved_bytes": saved, "forward_peak_bytes": forward_peak,
            "backward_peak_bytes": backward_peak,
            "peak_bytes": max(forward_peak, backward_peak),
            "reserved_peak_bytes": max(reserved, torch.cuda.max_memory_reserved())}


def model(P: int, N: int, method: str) -> list:
    """memcalc's figures for each rank, or [] where memcalc does not import. One rank
    (``--nproc-per-node 1``) still runs torch's ring, its float32 merge and accumulators,
    which ``--cp 1`` (one GPU, no ring) is not: its model is the ring's program at P = 1."""
    try:
        from memcalc.analysis.predict import rank_breakdown
        from memcalc.config import make_config
        from memcalc.impls import ring
        from memcalc.validation.compare import figures_of
        from memcalc.validation.cuda import environment, live_config
    except ImportError:
        return []
    c = live_config(make_config(impl="sdpa-flash", batch=B, heads=H, head_dim=D, dtype="bf16",
                                causal=True, seq_len=N, cp=P, cp_method=method),
                    environment(torch))
    program = ring.program(c.dims) if P == 1 else None
    return [figures_of(rank_breakdown(c, r, program=program)) for r in range(P)]


def main() -> None:
    dist.init_process_group("nccl")
    P, rank = dist.get_world_size(), dist.get_rank()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    N = int(sys.argv[1]) if len(sys.argv) > 1 else 8192 * P
    method = sys.argv[2] if len(sys.argv) > 2 else "allgather"
    set_rotate_method(method)
    mesh = init_device_mesh("cuda", (P,))
    figures = measure(mesh, N // P)
    every = [None] * P
    dist.all_gather_object(every, figures)
    if rank == 0:
        predicted = model(P, N, method)
        report = {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
                  "P": P, "N": N, "method": method, "B": B, "H": H, "D": D, "dtype": "bf16",
                  "measured": every, "predicted": predicted}
        out = sys.argv[3] if len(sys.argv) > 3 else f"cp-{P}-{method}.json"
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
        for r, figures in enumerate(every):
            model_peak = predicted[r]["peak_bytes"] if predicted else "-"
            print(f"rank {r}: peak {figures['peak_bytes']:,} B (model {model_peak})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
