"""memcalc's trace beside PyTorch's own memory trackers, which know nothing of memcalc:
``MemTracker`` (one GPU) and ``FSDPMemTracker`` (FSDP2), the estimator torchtitan used,
``torch/distributed/_tools/``. They run the same step on the meta device, counting every
live storage; memcalc's allocated peak is theirs plus what only a GPU allocates, listed by
cause:

* the cuBLAS workspace of each thread that calls cuBLAS (the main thread's and the autograd
  engine's: 2 x 32 MiB on an H100, ``CublasHandlePool.cpp``);
* CUDA-only temporaries (a split reduction's buffers, a fused kernel's scratch, FSDP's
  packed copy metadata), made and freed inside an op: none is alive at these models'
  peaks, which ``test_no_cuda_only_temporary_is_alive_at_the_peak`` checks.

The trackers count a storage's bytes rounded to 512 on CUDA (``_WeakRefInfo``,
``_PYTORCH_MIN_ALLOCATE``); on the meta device they do not round, so the rule is applied to
meta storages too. Every tensor here is under 1 MiB, so each block is its rounded request
(the small pool splits down to 512 B), as in the trackers' count."""

import math
from contextlib import contextmanager

import pytest

torch = pytest.importorskip("torch")

import memcalc  # noqa: E402
from memcalc.engine.program import Role  # noqa: E402
from memcalc.tracing.fsdp import Sharding  # noqa: E402

from test_tracing_fsdp import INPUTS, Stack  # noqa: E402

WORKSPACES = 2 * 33_554_432  # the main and the autograd threads' cuBLAS workspaces, H100


@pytest.fixture
def rounded_on_meta(monkeypatch):
    """The trackers' CUDA rounding, for meta storages."""
    from torch.distributed._tools import mem_tracker

    monkeypatch.setattr(mem_tracker._WeakRefInfo, "_calculate_mem_consumed",
                        lambda info: math.ceil(info.size * info.element_size / 512) * 512)


class Mlp(torch.nn.Module):
    """``Linear(30, 64)``, ReLU, ``Linear(64, 30)``."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(30, 64), torch.nn.Linear(64, 30)

    def forward(self, x):
        return self.b(self.a(x).relu())


def tracked_peak(model, optimizer, tracker, out_dtype=torch.float32) -> int:
    """The protocol's training loop (``memcalc/tracing/protocol.py``) on x (2, 8, 30), which
    needs grad: a warm-up step, then the measured one under ``tracker``: the forward (the
    previous output dies when it returns), its backward from a grad of the output's shape
    and dtype (``out_dtype``: FSDP's mixed precision returns bf16), the optimizer's step,
    its zero_grad and the input's grad reset. The tracker's peak."""
    x = torch.empty(2, 8, 30, device="meta", requires_grad=True)
    grad_out = torch.empty(2, 8, 30, device="meta", dtype=out_dtype)

    def step(held):
        out = model(x)
        held.clear()
        out.backward(grad_out)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        x.grad = None
        return [out]

    held = step([])
    if hasattr(tracker, "track_inputs"):
        tracker.track_inputs((x, grad_out, *held))
    else:
        tracker.track_external(model, optimizer, x, grad_out, *held)
    with tracker:
        step(held)
    return tracker.get_tracker_snapshot("peak")[torch.device("meta")]["Total"]


def test_one_gpus_peak_is_memtrackers_and_the_cublas_workspaces(rounded_on_meta):
    from torch.distributed._tools.mem_tracker import MemTracker

    with torch.device("meta"):
        model = Mlp()
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    traced = memcalc.trace(Mlp, inputs=INPUTS, seq_len=8, batch=2, optimizer="adamw")
    assert traced.peak_bytes == tracked_peak(model, optimizer, MemTracker()) + WORKSPACES


@pytest.mark.parametrize("world, rank, param_dtype, reduce_dtype", [
    (2, 0, None, None),
    (4, 3, None, None),  # uneven: rank 3 holds 1 row of each (10, 30) weight, 6 of (30, 10)
    (2, 1, "bfloat16", "float32"),  # mixed precision: bf16 compute, float32 reduction
])
def test_an_fsdp_ranks_peak_is_fsdpmemtrackers_and_the_cublas_workspaces(
        rounded_on_meta, world, rank, param_dtype, reduce_dtype):
    """Rank ``rank`` of ``world``: torch's fully_shard as memcalc applies it (each block,
    then the root) on a fake process group; FSDPMemTracker counts the sharded parameters,
    the all-gather buffers and unsharded parameters, the reduce-scatter buffers, the grads
    and AdamW's state of the shards."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from memcalc.tracing.context_parallel import Ranks, fake_group
    from memcalc.tracing.fsdp import shard

    sharding = Sharding(world, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    traced = _rank_traced(sharding, rank)
    with fake_group(Ranks(world, rank)), fsdp_on_meta():
        with torch.device("meta"):
            model = Stack()
        shard(model, sharding)
        optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
        peak = tracked_peak(model, optimizer, FSDPMemTracker(model, optimizer),
                            getattr(torch, param_dtype or "float32"))
    assert traced.peak_bytes == peak + WORKSPACES


@contextmanager
def fsdp_on_meta():
    """FSDP2 on the meta device with no more than it needs to run there, none of memcalc's
    naming of its buffers: a device handle with streams (``torch.meta``) and its refusal of
    meta parameters skipped (``memcalc.tracing.fsdp``'s first two mends)."""
    from unittest import mock

    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    from memcalc.tracing.fsdp import MetaStreams
    from memcalc.tracing.tracer import Tracer

    with mock.patch.object(torch, "meta", MetaStreams(Tracer(0)), create=True), \
            mock.patch.object(_fsdp_param_group.FSDPParamGroup, "_validate_no_meta_params",
                              lambda self: None):
        yield


def _rank_traced(sharding: Sharding, rank: int):
    from memcalc.engine.inputs import inputs_of
    from memcalc.tracing import Calling, TraceOptions, register_function, traced
    from memcalc.tracing.optimizers import loop_of

    calling = Calling(inputs_of(["x=B,N,30"], []), loop=loop_of("adamw"), fsdp=sharding)
    config = memcalc.make_config(impl=register_function(Stack(), "Stack", calling),
                                 seq_len=8, batch=2)
    return traced(Stack(), config, TraceOptions(), calling=calling, rank=rank).breakdown


def test_no_cuda_only_temporary_is_alive_at_the_peak():
    """What the trackers cannot see is made and freed inside an op: at these peaks only the
    workspaces are memcalc's own."""
    for b in (memcalc.trace(Mlp, inputs=INPUTS, seq_len=8, batch=2, optimizer="adamw"),
              _rank_traced(Sharding(2), 0)):
        live = b.optimizer_live if b.peak_phase == "optimizer" else \
            b.backward_live if b.peak_phase == "backward" else b.forward_live
        own = [c.name for c in live if c.role is Role.workspace or "packed" in c.name
               or "split-reduction" in c.name]
        assert sorted(own) == ["cuBLAS workspace, autograd thread",
                               "cuBLAS workspace, main thread"]


# --- torchtitan's Llama 3 step (validation/memtracker.py) -----------------------------------

def memtracker_script():
    """``validation/memtracker.py``, which runs both sides (skipped without torchtitan)."""
    import importlib.util
    from pathlib import Path

    pytest.importorskip("torchtitan")
    path = Path(__file__).resolve().parents[1] / "validation" / "memtracker.py"
    spec = importlib.util.spec_from_file_location("memtracker", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_torchtitans_step_is_fsdpmemtrackers_and_the_causes_listed():
    """torchtitan's debugmodel (256 wide, 16 heads of 16, a vocabulary of 2,048), 2 blocks,
    SelectiveAC, FSDP over 2 ranks (bf16 parameters, float32 reductions), AdamW, batch 2 of
    256 tokens, on the meta paths (SDPA's math backend on both sides). memcalc's allocated
    peak, in the second block's backward, is the tracker's plus:

    * the cuBLAS workspaces: 2 x 33,554,432 B;
    * softmax_backward_cuda's ``grad * output``: B x H x N x N float32 = 2 x 16 x 256 x 256
      x 4 B = 8,388,608 B;
    * the norm and lm_head's float32 reduce-scatter input, which torch holds through the
      next block's backward, less the tracker's: under its hooks the group reduce-scatters
      lm_head alone and then the norm, and holds the norm's only: (256 + 2,048 x 256) x 4 B
      - 256 x 4 B = 2,097,152 B."""
    script = memtracker_script()
    b = script.memcalc_traced("debugmodel", 2, 2, 2, 256)
    peak = script.tracked("debugmodel", 2, 2, 2, 256)
    assert b.peak_bytes == peak["Total"] + 2 * 33_554_432 + 8_388_608 + 2_097_152
    assert peak["Reduce Scatter"] == 256 * 4  # the norm's, 512-B rounded: 1,024 B
