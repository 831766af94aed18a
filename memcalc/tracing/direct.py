"""A direct trace: one step of the user's function or model at one configuration, on the
meta device along the GPU's code paths (``trace``, ``traced``), each rank's under ``--cp``,
with what the trace took or could not see (``report.Traced``)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

from memcalc.analysis.breakdown import Breakdown
from memcalc.config import Config
from memcalc.engine.inputs import QKV, Input
from memcalc.impls.device import gpu_of
from memcalc.impls.sdpa_cudnn import Workspace
from memcalc.tracing import compiled
from memcalc.tracing.errors import TraceError
from memcalc.tracing.explain import called_with, guarded
from memcalc.impls.sdpa_select import Release as TorchRelease
from memcalc.tracing.target import Bound, Calling, bound


def installed_release() -> TorchRelease:
    """The SDPA rules of the installed torch's release (with its PyPI wheel's cuDNN and
    CUDA), else the newest known."""
    import torch

    try:
        return TorchRelease.of(torch.__version__)
    except ValueError:
        return TorchRelease()


@dataclass(frozen=True)
class TraceOptions:
    """How a trace emulates the GPU: ``cuda=False`` follows the meta device's code paths
    (what validation checks); ``release``: the torch release whose SDPA rules apply, with
    its build's cuDNN/CUDA versions (default: the installed torch's); ``workspace``: cuDNN's
    workspace sizes; ``group``: under ``--cp``, the process group's collectives as ``nccl``
    runs them (default) or as a ``fake`` group does (``context_parallel.Ranks``)."""

    cuda: bool = True
    release: TorchRelease = field(default_factory=installed_release)
    workspace: Workspace = Workspace()
    group: str = "nccl"


def trace(fn: Callable, config: Config, options: TraceOptions = TraceOptions(),
          calling: Calling = Calling()) -> Breakdown:
    """The breakdown of ``fn``'s step under ``config``, traced on the meta device as it
    would run on ``config``'s GPU; ``fn`` is called as ``calling`` says (with ``q, k, v``
    unless it gives other inputs: ``memcalc.engine.inputs``)."""
    return traced(fn, config, options, calling=calling).breakdown


def traced(fn: Callable, config: Config, options: TraceOptions = TraceOptions(),
           budget=None, history: list | None = None, calling: Calling = Calling(),
           rank: int | None = None):
    """``trace`` with its notes (SDPA backends and why, what is not modelled, which of
    several returned values was the output) and, given a ``memcalc.analysis.budget.Budget``, whether
    the step fits in it (a capped direct trace). ``history``: a list to extend with the
    allocator ledger's history (for plots). Under ``--cp``, every rank is traced and the
    busiest shown, or only ``rank`` when given."""
    from memcalc.analysis.budget import fit
    from memcalc.tracing.report import Traced

    if calling.autocast and not options.cuda:
        raise TraceError("--autocast: autocast is CUDA's; --meta-paths follows the meta "
                         "device, where torch turns CUDA autocast off")
    if config.cp > 1 and not options.cuda:
        raise TraceError("--cp: context parallelism runs NCCL's collectives, on the GPU's "
                         "code paths; not with --meta-paths")
    call = bound(fn, config, calling)
    inputs = calling.inputs
    rank = calling.rank if rank is None else rank
    if rank is not None:
        result, paths, tracer = _rank_traced(call, config, options, inputs, rank)
        ranks = (rank,)
    else:
        result, paths, tracer, rank, ranks = _busiest_traced(call, config, options, inputs)
    if history is not None:
        history.extend(tracer.ledger.history)
    checked = {}
    if budget is not None:
        replay = lambda capacity: _capped(call, config, options, inputs, capacity,  # noqa: E731
                                          (rank, *(r for r in ranks if r != rank)))
        checked = dict(budget=budget, fit=fit(config, budget.budget_bytes, result, replay))
    notes = (*(paths.notes if paths else ()), *_returned(call), *compiled.notes())
    return Traced(breakdown=result, gpu=config.device.spec.label, cuda_paths=options.cuda,
                  notes=notes, kernels=tuple(paths.kernels) if paths else (),
                  inputs=tuple(i.text() for i in inputs if inputs is not QKV),
                  autocast=calling.autocast, param_dtype=calling.param_dtype,
                  optimizer=calling.loop.optimizer.text() if calling.loop.optimizer else None,
                  grad_accum=calling.loop.accumulate, clip=calling.loop.clip, **checked)


def _returned(call: Bound) -> tuple[str, ...]:
    """The note that says which returned value the backward started from, if there were
    several."""
    if not call.returned:
        return ()
    return (f"the function returned {call.returned} is the output the backward starts from "
            "(the rest is dropped before it)",)


def _busiest_traced(call: Bound, config: Config, options: TraceOptions,
                    inputs: tuple[Input, ...]) -> tuple:
    """Every rank's step, the busiest one's shown as ``memcalc.analysis.predict`` shows
    it: ``(breakdown, paths, tracer, rank, distinct)``, ``distinct`` the first rank of
    each set whose steps are alike."""
    from memcalc.analysis.predict import busiest, ranked

    world = world_of(call, config)
    made: dict = {}  # each distinct rank's trace, by what its step depends on
    alike = _chunked_as_predicted(call, config, options)
    keys = {r: _signature(call, config, r, alike) for r in range(world)}
    ranks = [made.get(key) or made.setdefault(key, _rank_traced(call, config, options, inputs, r))
             for r, key in keys.items()]
    breakdowns = [b for b, _, _ in ranks]
    rank = busiest(breakdowns)
    result, paths, tracer = ranks[rank]
    if world > 1:
        result = ranked(result, rank, breakdowns)
    firsts: dict = {}
    for r, key in keys.items():
        firsts.setdefault(key, r)
    return result, paths, tracer, rank, tuple(firsts.values())


def _capped(call: Bound, config: Config, options: TraceOptions, inputs: tuple[Input, ...],
            capacity: int, ranks: tuple[int, ...]) -> Breakdown:
    """The step capped at ``capacity`` on each of ``ranks``, in order (each its own GPU):
    an ``OutOfMemory`` naming the rank where one runs out, as the step fails there, else
    the busiest capped step. (Only the busiest rank unbounded was once replayed: Llama-3-8B
    over FSDP 8 x CP 8 at 65,808 tokens "fit" on rank 0, and ranks 1, 5 and 6 ran out.)"""
    from memcalc.analysis.predict import busiest, on_rank

    if world_of(call, config) == 1:
        return _measure(call, config, options, inputs, capacity, rank=ranks[0])
    capped = [on_rank(r, lambda r=r: _measure(call, config, options, inputs, capacity, rank=r))
              for r in ranks]
    return capped[busiest(capped)]


def _signature(call: Bound, config: Config, rank: int, alike: bool = True):
    """What rank ``rank``'s step depends on: under FSDP, the rows of each parameter it holds
    (``fsdp.rank_signature``: ranks that hold alike run the same ops on the same sizes,
    collectives included), when the sharding chunks dim 0 of every parameter (``alike``),
    and on a ``--mesh`` its place in the context-parallel ring (HSDP's replicas of a rank
    run its step); else the rank."""
    mesh = mesh_of(call)
    if call.sharding is None or call.sharding.tp > 1 or not alike or (
            config.cp > 1 and mesh is None):
        return rank
    from memcalc.tracing.fsdp import rank_signature

    if mesh is None:
        return ("fsdp", rank_signature(call.fn, call.sharding.world, rank))
    return ("mesh", rank_signature(call.fn, mesh.shards, mesh.shard_index(rank)),
            mesh.coordinates(rank)["cp"])


def _chunked_as_predicted(call: Bound, config: Config, options: TraceOptions) -> bool:
    """Whether the sharding holds on each rank the dim-0 chunk of every parameter that
    ``fsdp.rank_signature`` predicts: FSDP's own wrapping does; the user's ``apply``
    (``--fsdp-apply``) is checked on its first and last ranks' copies (torchtitan's
    ``apply_fsdp_to_decoder`` does: its ranks are then traced once per kind, not each);
    one that shards otherwise (a ``shard_placement_fn``) has every rank traced."""
    mesh = mesh_of(call)
    if call.sharding is None or call.sharding.apply is None or (config.cp > 1 and mesh is None):
        return True
    from memcalc.tracing.fsdp import held_rows, rank_signature, sharded
    from memcalc.tracing.state import kept, on_meta
    from memcalc.tracing.tracer import Tracer

    scratch = Tracer(config.workspace_bytes, None, paths_for(config, options, 0, mesh_of(call)),
                     gpu_of(config.dims), config.protocol.allocator)
    with kept(call.fn), on_meta(call.fn, call.param_dtype):
        for rank in sorted({0, call.sharding.ranks - 1}):
            shards, index = ((mesh.shards, mesh.shard_index(rank)) if mesh is not None
                             else (call.sharding.world, rank))
            with sharded(call, rank, scratch) as (on_rank, _):
                if held_rows(on_rank.fn) != rank_signature(call.fn, shards, index):
                    return False
    return True


def world_of(call: Bound, config: Config) -> int:
    """How many ranks the step runs on: context parallelism's, FSDP's (the same ranks when
    both), else 1."""
    return max(config.cp, call.sharding.ranks if call.sharding is not None else 1)


def _rank_traced(call: Bound, config: Config, options: TraceOptions,
                 inputs: tuple[Input, ...], rank: int) -> tuple:
    """``(breakdown, paths, tracer)`` of one rank's step (the only one's without ``--cp``)."""
    from memcalc.tracing.tracer import Tracer

    paths = paths_for(config, options, rank, mesh_of(call))
    tracer = Tracer(config.workspace_bytes, None, paths, gpu_of(config.dims),
                    config.protocol.allocator)
    result = _measure(call, config, options, inputs, paths=paths, tracer=tracer, rank=rank)
    if config.cp > 1 and config.cp_method == "ulysses" and not paths.collectives:
        raise TraceError("--cp-method ulysses: the step made no all-to-all; DeepSpeed-Ulysses "
                         "is the caller's code (DistributedAttention around the attention): "
                         "trace the function that calls it, on its rank's (B, N, H, D) rows")
    return result, paths, tracer


def paths_for(config: Config, options: TraceOptions, rank: int = 0, mesh=None):
    """The CUDA dispatch layer for ``config``'s GPU, or None with ``cuda=False``; under
    ``--cp``, as rank ``rank`` (``context_parallel.py``) of the cp ranks, or of ``mesh``'s
    (``--mesh``: the ring over its "cp" axis)."""
    if not options.cuda:
        return None
    from memcalc.tracing.cuda_paths import CudaPaths

    paths = CudaPaths(config.device.spec, options.release, options.workspace)
    if config.cp > 1:
        from memcalc.tracing.context_parallel import Ranks

        world = mesh.ranks if mesh is not None else config.cp
        paths.cp = Ranks(world, rank, config.cp_method, options.group, mesh)
    return paths


def mesh_of(call: Bound):
    """The call's ``--mesh`` (a ``memcalc.config.Mesh``), or None."""
    return call.sharding.mesh if call.sharding is not None else None


def _measure(call: Bound, config: Config, options: TraceOptions, inputs: tuple[Input, ...],
             capacity: int | None = None, paths=None, tracer=None, rank: int = 0) -> Breakdown:
    """One direct trace of the bound call's step (see ``trace``)."""
    from memcalc.tracing.tracer import Tracer, measure

    paths = paths or paths_for(config, options, rank, mesh_of(call))
    tracer = tracer or Tracer(config.workspace_bytes, capacity, paths, gpu_of(config.dims),
                              config.protocol.allocator)

    def run():
        with rank_state(call, config, options, inputs, tracer, rank) as (on_rank, state, like):
            return measure(config, on_rank, capacity, paths, state, like, tracer, inputs,
                           call.loop)

    return guarded(run, call.fn, called_with(config, inputs))


@contextmanager
def rank_state(call: Bound, config: Config, options: TraceOptions, inputs: tuple[Input, ...],
               tracer, rank: int = 0) -> Iterator[tuple]:
    """``(call, state, out_like)`` of rank ``rank``'s step: the call (under ``--fsdp``, on
    the rank's sharded copy of the module: ``memcalc.tracing.fsdp``), the state it keeps
    resident on the meta device, and ``grad_out``'s ``(shape, dtype)`` (``output_like``);
    the user's objects as they were after."""
    from memcalc.tracing.state import kept, on_meta

    with kept(call.fn), on_meta(call.fn, call.param_dtype) as state:
        out_like = output_like(call, config, options, inputs,
                               tracer.paths.kernels if tracer.paths is not None else None)
        if call.sharding is None:
            yield call, state, out_like
            return
        from memcalc.tracing.fsdp import sharded

        with sharded(call, rank, tracer) as (on_rank, rank_resident):
            yield on_rank, rank_resident, out_like


@contextmanager
def _sharded_or_not(call: Bound, tracer) -> Iterator[Bound]:
    """The call as rank 0 runs it under ``--fsdp`` (its mixed precision decides the
    output's dtype), else as it is."""
    if call.sharding is None:
        yield call
        return
    from memcalc.tracing.fsdp import sharded

    with sharded(call, 0, tracer) as (on_rank, _):
        yield on_rank


def output_like(call: Bound, config: Config, options: TraceOptions,
                inputs: tuple[Input, ...], kernels: dict | None = None) -> tuple | None:
    """``(shape, dtype)`` of the call's output when it is not q's, from a forward under
    ``no_grad`` along the same code paths (a scratch trace): what ``grad_out`` must look
    like. None when there is no ``grad_out`` to make. What the scratch forward leaves on the
    function's modules and module-level names (state built on the first call, such as a
    causal mask buffer registered lazily) is undone after it (``state.kept``): on a GPU the
    protocol's warm-up is the first call, and builds it there. ``kernels``: the trace's
    record of the fused SDPA backends run, which the scratch forward adds to (it is the
    first to run them, and to fail at a length the ring does not take)."""
    from memcalc.tracing.state import kept
    from memcalc.tracing.tracer import Tracer, output_of

    if config.protocol.forward_only or config.protocol.loss != "grad":
        return None
    paths = paths_for(config, options, 0, mesh_of(call))
    if paths is not None and kernels is not None:
        paths.kernels = kernels
    scratch = Tracer(config.workspace_bytes, None, paths, gpu_of(config.dims),
                     config.protocol.allocator)
    with kept(call.fn), _sharded_or_not(call, scratch) as on_rank:
        shape, dtype = output_of(config, on_rank, scratch, inputs)
    d = config.dims
    if inputs is QKV and shape == (d.B, d.H, d.N, d.D) and dtype == d.dtype:
        return None
    if not dtype.startswith(("float", "bfloat")):
        raise TraceError(f"the output is {dtype}: the backward needs a floating tensor")
    return shape, dtype
