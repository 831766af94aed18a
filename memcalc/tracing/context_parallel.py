"""Context parallelism in a trace: one rank's ``scaled_dot_product_attention`` run as
PyTorch's own ring attention (``torch/distributed/tensor/experimental/_context_parallel/
_attention.py``, ``_templated_ring_attention`` and its backward), for rank ``rank`` of
``world`` on a fake process group (``torch.testing._internal.distributed.fake_pg``), as
``context_parallel`` runs it under DTensor.

Torch's code runs as written: the K/V exchange (``_AllGatherRotater`` or
``_AllToAllRotater``, ``torch.cat`` of k and v, the functional collectives, whose CUDA
behaviour is ``collectives.py``'s), the load-balanced causal steps (the rank's two chunks,
``chunk(2)`` of q or of k/v), the float32 merge of each step's output and logsumexp
(``_SDPAMerger``), the backward's float32 gradient accumulators and rotating dK/dV. Each
step's kernel call (``aten._scaled_dot_product_flash_attention`` and the others) is memcalc's
model of that kernel (``kernels.Kernel``), as in a one-GPU trace.

Autograd sees one node, the kernel's (``ScaledDotProductFlashAttentionBackward0``): it saves
the rank's q, k, v, the merged output and logsumexp, and one step's philox tensors, the
last step's (the first step's from torch 2.14: ``memcalc.impls.ring.FIRST_STEP_REST``)
(``tools/autograd/derivatives.yaml``).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.util import find_spec

import torch
import torch.distributed as dist

from memcalc.tracing.errors import NotModelled
from memcalc.tracing.kernels import CUDNN, EFFICIENT, FLASH, Kernel, dims_of, meta_copies
from memcalc.impls.sdpa_select import Call

METHODS = {"allgather": "ALL_GATHER", "alltoall": "ALL_TO_ALL"}


@dataclass(frozen=True)
class Ranks:
    """This trace is rank ``rank`` of ``world`` context-parallel ranks, exchanging K/V by
    ``method`` (``allgather``: torch's default, or ``alltoall``), over a ``group`` of
    ``nccl`` (the collectives as NCCL runs them: ``collectives.py``) or ``fake`` (a fake
    process group, which keeps nothing of a collective's: what ``validation/cp_one_gpu.py``
    measures, every rank in turn on one GPU). With a ``mesh`` (``memcalc.config.Mesh``,
    ``--mesh``), ``world`` and ``rank`` are the whole mesh's, and the ring runs over the
    ranks of this one's "cp" axis (``ring_group``)."""

    world: int
    rank: int
    method: str = "allgather"
    group: str = "nccl"
    mesh: object = None

    @property
    def cp(self) -> tuple[int, int]:
        """``(rank, ranks)`` in the ring."""
        if self.mesh is None:
            return self.rank, self.world
        return self.mesh.coordinates(self.rank)["cp"], self.mesh.cp


_RING_GROUPS: dict = {}  # the "cp" process group of each mesh, while its fake group is up


def ring_group(ranks: Ranks):
    """The process group the ring runs over: every rank (``dist.group.WORLD``), or, on a
    mesh with other axes, the ranks of this one's "cp" axis (torchtitan's
    ``parallel_dims.get_mesh("cp")``), made once per fake process group."""
    if ranks.mesh is None or ranks.mesh.cp == ranks.world:
        return dist.group.WORLD
    if ranks.mesh not in _RING_GROUPS:
        from torch.distributed.device_mesh import init_device_mesh

        names, sizes = zip(*((n, getattr(ranks.mesh, n)) for n in
                             ("dp_replicate", "dp_shard", "cp", "tp")))
        _RING_GROUPS[ranks.mesh] = init_device_mesh("meta", sizes, mesh_dim_names=names
                                                    )["cp"].get_group()
    return _RING_GROUPS[ranks.mesh]


def _attention():
    """Torch's ring attention module: ``_context_parallel/_attention.py`` (torch 2.13 on; a
    module of its own, ``experimental/_attention.py``, in earlier releases)."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention
    except ImportError:
        from torch.distributed.tensor.experimental import _attention
    return _attention


_SET_UP: list[tuple[int, int]] = []  # (world, rank) of the fake groups set up here


@contextmanager
def fake_group(ranks: Ranks):
    """A fake process group in which this process is ``ranks.rank`` of ``ranks.world``, and
    torch's rotate method set to ``ranks.method``, for the whole step; as they were after.
    Inside one set up here for the same rank (FSDP's, with context parallelism over the
    same ranks), that one."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    nested = dist.is_initialized() and _SET_UP[-1:] == [(ranks.world, ranks.rank)]
    if dist.is_initialized() and not nested:
        raise NotModelled("--cp: a process group is already set up in this process")
    cp = _attention()
    method = cp._cp_options.rotate_method
    hook = sys.excepthook  # init_process_group wraps it for good ("[rank0]: " on each line)
    if not nested:
        dist.init_process_group("fake", store=FakeStore(), rank=ranks.rank,
                                world_size=ranks.world)
        _SET_UP.append((ranks.world, ranks.rank))
    if ranks.method in METHODS:  # torch's ring; Ulysses' all-to-alls are the caller's code
        cp._cp_options.rotate_method = getattr(cp._RotateMethod, METHODS[ranks.method])
    elif deepspeed_installed():
        deepspeed_layer()
    try:
        yield
    finally:
        cp._cp_options.rotate_method = method
        if not nested:
            _RING_GROUPS.clear()
            _SET_UP.pop()
            dist.destroy_process_group()
            sys.excepthook = hook


def deepspeed_installed() -> bool:
    """Whether DeepSpeed is importable (the ``deepspeed`` extra), whose own code
    DeepSpeed-Ulysses' traces run."""
    return find_spec("deepspeed") is not None


def quiet_deepspeed() -> None:
    """Import DeepSpeed with its logs kept off stdout, before a traced file imports it: its
    logger writes there (``deepspeed/utils/logging.py``, a handler made at import), and it
    warns on a machine without a GPU that its accelerator is the CPU."""
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        import deepspeed.comm.torch  # noqa: F401
        import deepspeed.sequence.layer  # noqa: F401


def deepspeed_layer():
    """``deepspeed.sequence.layer`` (DeepSpeed-Ulysses' ``DistributedAttention``) with
    ``deepspeed.comm``'s backend over the process group already set up: its
    ``TorchBackend`` (``deepspeed/comm/torch.py``), whose ``all_to_all_single`` is
    ``torch.distributed.all_to_all_single``, built without the shared-memory op DeepSpeed
    compiles for CPU collectives (no all-to-all calls it)."""
    from datetime import timedelta
    from unittest import mock

    quiet_deepspeed()
    import deepspeed.comm.comm as comm
    from deepspeed.comm.torch import TorchBackend
    from deepspeed.sequence import layer

    if comm.cdb is None:
        with mock.patch("deepspeed.comm.torch.build_shm_op", return_value=None):
            comm.cdb = TorchBackend("fake", timedelta(minutes=1), None)
    return layer


def _kernel(paths, backend: str, q, k, v, is_causal) -> Kernel:
    """The model of ``backend`` for one step's q, k, v (views of the rank's tensors)."""
    call = Call(tuple(q.shape), tuple(k.shape), tuple(v.shape),
                str(q.dtype).removeprefix("torch."), is_causal=bool(is_causal),
                requires_grad=True, itemsize=q.element_size())
    return Kernel(backend, dims_of(call, paths.gpu), call, paths,
                  *meta_copies(paths.tracer, (q, k, v)))


# the philox seed and offset each kernel's model makes on the device (the efficient
# kernel's are CPU scalars without dropout: none), which the node saves
REST = {FLASH: ("rng_state", "philox_offset"), CUDNN: ("seed", "offset"), EFFICIENT: ()}


def _cpu_scalar() -> torch.Tensor:
    """A philox seed or offset the efficient kernel makes on the CPU (not traced)."""
    return torch.empty((), dtype=torch.int64)


def kernel_step(paths, backend: str):
    """The kernel's op as the ring calls it at each step: its model's forward, returning
    the output, the logsumexp and the op's other outputs (``native_functions.yaml``: flash
    and cuDNN add cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset,
    debug_attn_mask; the efficient kernel philox_seed and philox_offset)."""
    def step(q, k, v, is_causal=False, **_):
        kernel = _kernel(paths, backend, q, k, v, is_causal)
        out, kept = kernel.forward(), kernel.kept
        if backend == EFFICIENT:
            return out, kept.pop("lse"), _cpu_scalar(), _cpu_scalar()
        seed, offset = (kept.pop(name) for name in REST[backend])
        return out, kept.pop("lse"), None, None, q.shape[2], k.shape[2], seed, offset, None
    return step


def kernel_step_backward(paths, backend: str):
    """The kernel's backward op on one step's q, k, v, given the merged output and
    logsumexp and the step's grad (``grad_out``): their layouts decide its copies."""
    def step(query, key, value, out, logsumexp, is_causal=False, **kwargs):
        kernel = _kernel(paths, backend, query, key, value, is_causal)
        kernel.out_copy = not out.transpose(1, 2).is_contiguous()
        return kernel.backward(kwargs[GRAD_OUT[backend]])
    return step


# the name the ring passes each kernel's backward its grad under (``grad_out_name``)
GRAD_OUT = {FLASH: "grad_out", CUDNN: "grad_out", EFFICIENT: "grad_out_"}


def ring_forward(paths, backend: str, causal: bool, q, k, v) -> tuple:
    """``_templated_ring_attention`` with the kernel's model at each step: the merged
    output, logsumexp, and the last step's other outputs."""
    return _attention()._templated_ring_attention(ring_group(paths.cp), 2,
                                                  kernel_step(paths, backend), q, k, v,
                                                  is_causal=causal)


class Ring(torch.autograd.Function):
    """The kernel's node under context parallelism: the ring forward, then the ring
    backward; saves what the kernel's node saves (q, k, v, the output, the logsumexp, the
    philox tensors: ``tools/autograd/derivatives.yaml``)."""

    @staticmethod
    def forward(ctx, paths, backend, causal, q, k, v):
        out, lse, *rest = ring_forward(paths, backend, causal, q, k, v)
        ctx.paths, ctx.backend, ctx.causal = paths, backend, causal
        ctx.save_for_backward(q, k, v, out, lse, *rest[-2:] if backend == EFFICIENT
                              else rest[4:6])  # philox_seed, philox_offset
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, seed, offset = ctx.saved_tensors
        dq, dk, dv, *_ = _attention()._templated_ring_attention_backward(
            ring_group(ctx.paths.cp), 2, kernel_step_backward(ctx.paths, ctx.backend), grad_out,
            GRAD_OUT[ctx.backend], q, k, v, out, lse, ctx.causal, philox_seed=seed,
            philox_offset=offset)
        return None, None, None, dq, dk, dv


def run(paths, backend: str, q, k, v, call: Call) -> torch.Tensor:
    """``scaled_dot_product_attention`` on this rank's q, k, v under context parallelism."""
    if backend not in REST:
        raise NotModelled(f"--cp: context parallelism with the {backend} backend is not "
                          f"modelled (PyTorch's ring attention calls flash, cuDNN and the "
                          f"memory-efficient kernel)")
    if call.mask is not None or call.dropout > 0:
        raise NotModelled("--cp: torch's context parallelism takes no attn_mask, and "
                          "dropout is not modelled")
    rank, ranks = paths.cp.cp
    paths.note(f"context parallelism: torch's ring attention ({paths.cp.method}), rank "
               f"{rank} of {ranks} on a fake process group, the "
               f"{backend} kernel's model at each step")
    if not call.requires_grad:
        with torch.no_grad():
            return ring_forward(paths, backend, call.is_causal, q, k, v)[0]
    return Ring.apply(paths, backend, call.is_causal, q, k, v)
