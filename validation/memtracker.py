"""memcalc's trace of torchtitan's Llama 3 step beside PyTorch's own FSDPMemTracker, with the
difference listed by cause. No GPU: both run on the meta device.

    python validation/memtracker.py [FLAVOR LAYERS RANKS BATCH SEQ]   # default: 8B 32 8 2 8192

FSDPMemTracker (``torch/distributed/_tools/fsdp2_mem_tracker.py``, the estimator torchtitan
used) knows nothing of memcalc: it runs the step under a ``TorchDispatchMode`` and counts
every live storage, rounded to 512 B as the caching allocator rounds. It cannot run on
fake CUDA tensors here (the autograd engine asks CUDA for a context), so both sides follow
the meta device's code paths (``memcalc trace --meta-paths``): SDPA there is the math
backend, whose N x N scores make the peak far larger than a GPU's, the same on both sides.
The step is ``examples/training/torchtitan_llama3.py``'s: torchtitan's model, its
``SelectiveAC`` and ``apply_fsdp_to_decoder``, rank 0 of RANKS on a fake process group,
AdamW (foreach), warm-up step, then the measured one.

What memcalc counts and the tracker does not, each found in memcalc's breakdown at its peak:

* the cuBLAS workspaces of the main and autograd threads (2 x 32 MiB on an H100);
* CUDA-only temporaries: ``softmax_backward_cuda`` computes ``grad * output`` into a
  tensor of its own (``aten/src/ATen/native/cuda/SoftMax.cu``), B x H x N x N float32 here;
* the caching allocator's blocks: a large request is served by a block up to 1 MiB larger
  when the remainder is too small to split (``CUDACachingAllocator.cpp``, ``should_split``);
* the norm and output's reduce-scatter input: their group (``fully_shard([norm,
  lm_head])``) reduce-scatters both weights' grads at once, in float32, and torch 2.15's
  ``FSDPCommContext.reduce_scatter_states`` holds that buffer through the next block's
  backward. Under the tracker's hooks the group's post-backward runs once per module, so
  the tracker reduce-scatters lm_head alone, then the norm, and holds only the norm's.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples/training/torchtitan_llama3.py"
INPUTS = ["tokens=B,N:int64", "labels=B,N:int64"]


def titan():
    """The example's module (torchtitan's model and sharding)."""
    spec = importlib.util.spec_from_file_location("torchtitan_llama3", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sharding(world: int, apply):
    from memcalc.tracing.fsdp import sharding_of

    return sharding_of(world, "default", None, None, "fsdp", apply, apply.__name__, 1, None)


def memcalc_traced(flavor: str, layers: int, world: int, batch: int, seq: int):
    """memcalc's breakdown of rank 0's step, on the meta device's code paths."""
    from memcalc.config import make_config
    from memcalc.engine.inputs import inputs_of
    from memcalc.tracing import Calling, TraceOptions, register_function, traced
    from memcalc.tracing.optimizers import loop_of

    module = titan()
    calling = Calling(inputs_of(INPUTS, []), loop=loop_of("adamw"),
                      fsdp=sharding(world, module.selective))
    step = module.Llama3Step(flavor, layers)
    config = make_config(impl=register_function(step, "Llama3Step", calling), seq_len=seq,
                         batch=batch, gpu="h100-80gb")
    return traced(step, config, TraceOptions(cuda=False), calling=calling, rank=0).breakdown


@contextmanager
def fsdp_on_meta():
    """FSDP2 on the meta device with no more than it needs to run there: a device handle
    with streams (``torch.meta``) and its refusal of meta parameters skipped; and the
    tracker's 512-B rounding applied to meta storages too (it rounds only CUDA's)."""
    from torch.distributed._tools import mem_tracker
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    from memcalc.tracing.fsdp import MetaStreams
    from memcalc.tracing.tracer import Tracer

    with mock.patch.object(torch, "meta", MetaStreams(Tracer(0)), create=True), \
            mock.patch.object(_fsdp_param_group.FSDPParamGroup, "_validate_no_meta_params",
                              lambda self: None), \
            mock.patch.object(mem_tracker._WeakRefInfo, "_calculate_mem_consumed",
                              lambda info: math.ceil(info.size * info.element_size / 512) * 512):
        yield


def tracked(flavor: str, layers: int, world: int, batch: int, seq: int) -> dict:
    """FSDPMemTracker's peak snapshot of rank 0's measured step, by its categories."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from memcalc.tracing.context_parallel import Ranks, fake_group
    from memcalc.tracing.fsdp import device_mesh

    module = titan()
    with fake_group(Ranks(world, 0)), fsdp_on_meta():
        step = module.Llama3Step(flavor, layers)
        module.selective(step, device_mesh(sharding(world, module.selective), "meta"))
        optimizer = torch.optim.AdamW(step.parameters(), foreach=True)
        tokens, labels = (torch.zeros(batch, seq, dtype=torch.int64, device="meta")
                          for _ in range(2))
        held: list = []

        def one():
            held[:] = [step(tokens, labels)]  # the loop's loss: the previous one dies here
            held[0].backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        one()
        tracker = FSDPMemTracker(step.model, optimizer)
        tracker.track_inputs((tokens, labels, *held))
        with tracker:
            one()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("meta")]
    return {getattr(k, "value", k): v for k, v in peak.items()}


def causes(b) -> dict[str, int]:
    """What memcalc counts at its peak that the tracker does not (module docstring)."""
    live = {"forward": b.forward_live, "backward": b.backward_live,
            "optimizer": b.optimizer_live}[b.peak_phase]
    return {
        "cuBLAS workspaces": sum(c.allocated for c in live if c.role.value == "workspace"),
        "softmax backward's grad * output (CUDA)": sum(
            c.allocated for c in live if c.name.startswith("mul (SafeSoftmaxBackward0")),
        "allocator blocks beyond their requests": sum(
            c.allocated - math.ceil(c.bytes / 512) * 512 for c in live),
        "norm and output's reduce-scatter input": sum(
            c.allocated for c in live if c.name.startswith("reduce-scatter input (root")),
    }


def main(argv: list[str]) -> int:
    flavor, *sizes = argv or ["8B", "32", "8", "2", "8192"]
    layers, world, batch, seq = (int(s) for s in sizes)
    b = memcalc_traced(flavor, layers, world, batch, seq)
    peak = tracked(flavor, layers, world, batch, seq)
    rows = [("memcalc, allocated peak", b.peak_bytes), ("FSDPMemTracker, peak", peak["Total"]),
            ("difference", b.peak_bytes - peak["Total"])]
    found = causes(b)
    rows += [(f"  {name}", value) for name, value in found.items()]
    tracker_rs = peak.get("Reduce Scatter", 0)
    rows += [("  less the tracker's norm reduce-scatter input", -tracker_rs),
             ("unexplained", b.peak_bytes - peak["Total"] - sum(found.values()) + tracker_rs)]
    print(f"{flavor}, {layers} blocks, rank 0 of {world}, batch {batch} of {seq} tokens, "
          f"SelectiveAC, AdamW, meta paths")
    for name, value in rows:
        print(f"{name:<48}{value:>20,}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
