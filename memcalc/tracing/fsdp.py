"""FSDP2 in a trace: the user's model sharded by PyTorch's own ``fully_shard``
(``torch/distributed/fsdp/_fully_shard``), run as rank ``rank`` of ``world`` on a fake
process group (as the ring of ``context_parallel.py`` is), on the meta device.

What a rank holds is what torch's code makes: the dim-0 shard of every parameter, padded
to ``ceil(dim 0 / world)`` rows (``FSDPParam._init_sharded_param``), the all-gather buffer
of each group and the unsharded parameters copied out of it, the reduce-scatter input and
output, the sharded grads, and the optimizer's state of the shards (a DTensor's local
tensor). Three things differ on the meta device, each mended here for the trace only and
put back after it:

* ``_get_device_handle("meta")`` is ``getattr(torch, "meta")``, which does not exist:
  ``fully_shard`` cannot find the device nor make its streams. ``torch.meta`` is set to
  ``MetaStreams``, whose streams are numbered and whose ``stream(s)`` context makes the
  tracer allocate on ``s`` (the caching allocator keeps a pool per stream:
  ``memcalc.engine.allocator``);
* ``FSDPParamGroup.lazy_init`` refuses parameters on the meta device ("FSDP parameters
  should be materialized from meta device before training"): the one check,
  ``_validate_no_meta_params``, is skipped (the least invasive way found: no other FSDP
  code is replaced, and a meta tensor holds no values to materialize);
* FSDP frees and re-allocates the unsharded parameters by resizing their storages
  (``_fsdp_param.free_storage``/``alloc_storage``), which no dispatch mode sees: the two
  functions are wrapped to tell the tracer (``Tracer.resized``).

c10d's collectives on the fake group do nothing; FSDP2 calls them synchronously (its
default ``unshard_async_op=False``), and a synchronous NCCL collective keeps nothing past
its last reference (measured on an H100, torch 2.11: ``validation/nccl_stash.py``), so the
fake group's behaviour is the GPU's here.

The wrapping is torchtitan's (``torchtitan/models/llama3/infra/parallelize.py``,
``apply_fsdp``): each block of the model's repeated layers, then the root;
``reshard_after_forward`` by its policy ``default`` (every block but the last: backward
starts with it), ``always`` or ``never``; ``MixedPrecisionPolicy(param_dtype,
reduce_dtype)``; or the user's own function ``apply(model, mesh)`` that calls
``fully_shard`` (``--fsdp-apply``: torchtitan's ``apply_fsdp`` written by the user), called
on each rank's copy, traced as written. A model already sharded is refused: its
construction needed a process group, which a trace sets up per rank after loading it.
"""

from __future__ import annotations

import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Iterator

import torch

POLICIES = ("default", "always", "never")


@dataclass(frozen=True)
class Sharding:
    """FSDP2 over ``world`` ranks: ``reshard_after_forward`` as torchtitan's policy names it,
    the mixed-precision policy's ``param_dtype`` and ``reduce_dtype`` (None: the
    parameters' own)."""

    world: int
    reshard_after_forward: str = "default"
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    # the user's own ``apply(model, mesh)`` calling ``fully_shard`` (``--fsdp-apply``), and
    # its name; None: torchtitan's policy above
    apply: object = field(default=None, compare=False)
    apply_name: str = ""
    # tensor-parallel ranks within each FSDP group (``--fsdp-tp``): a 2-D mesh
    # ("dp_shard", "tp") of world x tp ranks, the user's ``apply`` parallelizing over "tp"
    tp: int = 1
    # the layout over named axes (``--mesh``: a ``memcalc.config.Mesh``), whose dp_shard x
    # cp ranks are ``world``; None: the 1-D or ("dp_shard", "tp") mesh of the flags above
    mesh: object = None

    @property
    def ranks(self) -> int:
        """Every rank of the mesh: FSDP's times tensor parallelism's (and HSDP's replicas')."""
        return self.mesh.ranks if self.mesh is not None else self.world * self.tp

    def text(self) -> str:
        """``fsdp=8`` and what differs from the defaults, for titles."""
        if self.mesh is not None:
            by = f" by {self.apply_name}" if self.apply is not None else ""
            return f"mesh {self.mesh.text()}{by}"
        if self.apply is not None:
            tp = f" tp={self.tp}" if self.tp > 1 else ""
            return f"fsdp={self.world}{tp} by {self.apply_name}"
        parts = [f"fsdp={self.world}"]
        if self.param_dtype or self.reduce_dtype:
            parts.append(f"mp {_short(self.param_dtype)}/{_short(self.reduce_dtype)}")
        if self.reshard_after_forward != "default":
            parts.append(f"reshard {self.reshard_after_forward}")
        return " ".join(parts)


def _short(dtype: str | None) -> str:
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", None: "-"}.get(dtype, dtype)


def sharding_of(world: int | None, reshard: str = "default", param_dtype: str | None = None,
                reduce_dtype: str | None = None, field: str = "--fsdp", apply=None,
                apply_name: str = "", tp: int = 1, mesh=None) -> Sharding | None:
    """The ``Sharding`` of ``--fsdp P`` and its options (``apply``: the user's own
    ``apply(model, mesh)``, named ``apply_name``, which then decides resharding and mixed
    precision), or of ``--mesh`` (``mesh``, a ``memcalc.config.Mesh``: FSDP over its
    dp_shard x cp ranks, in place of ``world`` and ``tp``); None without either; a
    ValueError naming the field for a bad value."""
    if mesh is not None:
        if world is not None or tp != 1:
            raise ValueError("--mesh: it gives the ranks; drop --fsdp, --fsdp-tp and --cp")
        if mesh.tp > 1 and apply is None:
            raise ValueError(f"--mesh tp={mesh.tp}: a tensor-parallel plan is the model's own; "
                             f"give --fsdp-apply FILE.py:FUNCTION, an apply(model, mesh) that "
                             f"parallelizes over mesh['tp'] and shards the rest")
        return replace(sharding_of(mesh.shards, reshard, param_dtype, reduce_dtype, "--mesh",
                                   apply, apply_name), mesh=mesh, tp=mesh.tp)
    if world is None:
        if apply is not None:
            raise ValueError(f"fsdp_apply {apply_name}: an FSDP option; give the number of "
                             f"ranks, fsdp=P")
        return None
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"{field}: FSDP ranks, a whole number of at least 1 (got {world!r})")
    if reshard not in POLICIES:
        from memcalc.names import did_you_mean

        raise ValueError(f"--reshard-after-forward: one of {', '.join(POLICIES)} (got "
                         f"{reshard!r}){did_you_mean(reshard, list(POLICIES))}")
    if apply is not None and (reshard != "default" or param_dtype or reduce_dtype):
        raise ValueError(f"--fsdp-apply {apply_name}: its own fully_shard calls decide "
                         f"resharding and mixed precision; drop --reshard-after-forward, "
                         f"--fsdp-param-dtype and --fsdp-reduce-dtype")
    if apply is not None and not callable(apply):
        raise ValueError(f"--fsdp-apply: a function apply(model, mesh), not "
                         f"{type(apply).__name__}")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"--fsdp-tp: tensor-parallel ranks, a whole number of at least 1 "
                         f"(got {tp!r})")
    if tp > 1 and apply is None:
        raise ValueError(f"--fsdp-tp {tp}: a tensor-parallel plan is the model's own; give "
                         f"--fsdp-apply FILE.py:FUNCTION, an apply(model, mesh) that "
                         f"parallelizes over mesh['tp'] and shards over mesh['dp_shard']")
    return Sharding(world, reshard, param_dtype, reduce_dtype, apply, apply_name, tp)


class MetaStream:
    """A CUDA stream as FSDP uses one, numbered for the tracer; events are no-ops (the
    allocator is told nothing by them: FSDP2 frees a buffer once its event is waited on,
    which its code does by dropping the reference). ``stream_id``, ``device_index`` and
    ``device_type`` are what torch 2.15's ``record_grad_output_stream`` passes to its op, a
    no-op on CUDA (``_fully_shard/_fsdp_collectives.py``)."""

    device_index = 0
    device_type = 1  # c10::DeviceType::CUDA

    def __init__(self, number: int):
        self.number = number
        self.stream_id = number

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event or MetaEvent()


def _uncast(scope: dict, dtype) -> bool:
    """Whether ``foreach_reduce`` (its local ``scope``) keeps its ``dtype`` output as the
    sharded grads: ``orig_dtype`` None or that dtype up to torch 2.14; from 2.15 each
    parameter's ``sharded_grad_dtype`` (``_cast_and_view_sharded_grads``,
    ``_fully_shard/_fsdp_collectives.py``)."""
    if "orig_dtype" in scope:
        return scope["orig_dtype"] in (None, dtype)
    return all(getattr(p, "sharded_grad_dtype", None) in (None, dtype)
               for p in scope.get("fsdp_params", ()))


class MetaEvent:
    def record(self, stream=None):
        return self

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class MetaStreams:
    """``torch.meta`` for the trace: the device handle FSDP asks ``_get_device_handle``
    for (``current_device``, ``Stream``, ``Event``, ``current_stream``, ``stream``)."""

    Event = MetaEvent

    def __init__(self, tracer):
        self.tracer = tracer
        self.default = MetaStream(0)
        self.current = self.default
        self.made = 0

    def Stream(self, priority: int = 0) -> MetaStream:  # noqa: N802 - torch.cuda.Stream
        self.made += 1
        return MetaStream(self.made)

    def current_device(self) -> int:
        return 0

    def current_stream(self, device=None) -> MetaStream:
        return self.current

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    @contextmanager
    def stream(self, stream: MetaStream | None):
        """Allocations in the block are made on ``stream``, as under ``torch.cuda.stream``."""
        before = self.current
        self.current = stream or before
        self.tracer.set_stream(self.current.number)
        try:
            yield
        finally:
            self.current = before
            self.tracer.set_stream(before.number)


@contextmanager
def on_meta(tracer) -> Iterator[None]:
    """FSDP2 runnable on the meta device under ``tracer`` (the module docstring's three
    mends), its buffers named (``Names``), all undone after."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    group = _fsdp_param_group.FSDPParamGroup
    names = Names(tracer)
    saved = (getattr(torch, "meta", None), group._validate_no_meta_params)
    torch.meta = MetaStreams(tracer)
    group._validate_no_meta_params = lambda self: None
    try:
        with names.patched():
            yield
    finally:
        if saved[0] is None:
            del torch.meta
        else:
            torch.meta = saved[0]
        group._validate_no_meta_params = saved[1]
        tracer.set_stream(0)


class Names:
    """FSDP's buffers named in the trace (its code is all torch's, so the tracer's own
    names, the op and the user's line, would read ``empty (?)``): each parameter's
    unsharded tensor after it (``h.0.attn.c_attn.weight (unsharded)``), a group's all-gather
    buffer and reduce-scatter input and output after the group's module. Also tells the
    tracer of the storages FSDP resizes (the module docstring)."""

    def __init__(self, tracer):
        self.tracer = tracer

    @contextmanager
    def patched(self) -> Iterator[None]:
        from torch.distributed.fsdp._fully_shard import (_fsdp_collectives, _fsdp_param,
                                                         _fsdp_param_group)

        param, mixin = _fsdp_param.FSDPParam, _fsdp_collectives.DefaultAllocMixin
        saved = [(_fsdp_param, "alloc_storage"), (_fsdp_param, "free_storage"),
                 (_fsdp_param_group, "alloc_storage"), (param, "init_all_gather_outputs"),
                 (mixin, "allocate")]
        saved = [(owner, name, getattr(owner, name)) for owner, name in saved]
        alloc, free, init, allocate = saved[0][2], saved[1][2], saved[3][2], saved[4][2]
        _fsdp_param.alloc_storage = _fsdp_param_group.alloc_storage = \
            lambda tensor: self.alloc_storage(alloc, tensor)
        _fsdp_param.free_storage = lambda tensor: self.free_storage(free, tensor)
        param.init_all_gather_outputs = lambda p, *args: self.init_outputs(init, p, *args)
        mixin.allocate = lambda comm, *args, **kwargs: self.allocate(allocate, comm, *args,
                                                                     **kwargs)
        try:
            yield
        finally:
            for owner, name, value in saved:
                setattr(owner, name, value)

    def alloc_storage(self, alloc, tensor) -> None:
        """``alloc_storage``: the unsharded tensor's block again, named after its parameter
        (the caller's ``fsdp_param``, or the ``FSDPParam`` itself)."""
        from memcalc.engine.program import Role
        from memcalc.tracing.tracer import component

        alloc(tensor)
        caller = sys._getframe(2).f_locals
        fsdp_param = caller.get("fsdp_param", caller.get("self"))
        name = f"{getattr(fsdp_param, '_param_fqn', 'parameter')} (unsharded)"
        self.tracer.resized(tensor, component(name, Role.unsharded, "all-gather copy-out",
                                              tuple(tensor.shape),
                                              str(tensor.dtype).removeprefix("torch."), 0))

    def free_storage(self, free, tensor) -> None:
        free(tensor)
        self.tracer.resized(tensor)

    def init_outputs(self, init, fsdp_param, *args) -> None:
        """``init_all_gather_outputs``: the unsharded tensors made (the first all-gather),
        named after the parameter."""
        from memcalc.engine.program import Role

        with self.tracer.naming(f"{fsdp_param._param_fqn} (unsharded)", Role.unsharded,
                                "all-gather copy-out"):
            init(fsdp_param, *args)

    def allocate(self, allocate, comm, *args, **kwargs):
        """A collective's buffer (``DefaultAllocMixin.allocate``), named by what asks for it:
        ``foreach_all_gather``'s output, ``foreach_reduce``'s input (on the compute stream)
        and output (on the reduce-scatter stream), after the group's module. The output is
        the group's sharded grads (role gradient) unless it is cast to the parameters'
        dtype after (``reduce_dtype`` not theirs)."""
        from memcalc.engine.program import Role

        frame = sys._getframe(2)
        group = _group(frame.f_locals.get("fsdp_params", ()))
        what = {"foreach_all_gather": "all-gather buffer"}.get(frame.f_code.co_name) or (
            "reduce-scatter input" if self.tracer.stream == 0 else "reduce-scatter output")
        grads = what == "reduce-scatter output" and _uncast(frame.f_locals, kwargs.get("dtype"))
        with self.tracer.naming(f"{what} ({group}){': sharded grads' * grads}",
                                Role.gradient if grads else Role.collective, what):
            return allocate(comm, *args, **kwargs)


def _group(fsdp_params) -> str:
    """The module a parameter group belongs to: its parameters' modules' common prefix
    (``transformer.h.0``), ``root`` when they share none."""
    modules = [p._param_fqn.split(".")[:-1] for p in fsdp_params]
    prefix = []
    for parts in zip(*modules):
        if len(set(parts)) > 1:
            break
        prefix.append(parts[0])
    return ".".join(prefix) or "root"


def sharded_by_user(module: torch.nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to the model already (refused: ``shard``)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated layers, torchtitan's unit of sharding: the children of its
    largest ``ModuleList`` (or ``ModuleDict``) whose children are all of one class
    (``model.layers`` of Llama, ``transformer.h`` of GPT-2, ``blocks`` of timm); none
    when it has no such list."""
    found: list[torch.nn.Module] = []
    for m in module.modules():
        if isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            children = list(m.children())
            if children and len({type(c) for c in children}) == 1 and len(children) > len(found):
                found = children
    return found


def shard(module: torch.nn.Module, sharding: Sharding, device: str = "meta") -> torch.nn.Module:
    """``module`` sharded as torchtitan's ``apply_fsdp`` does, over the process group set
    up for this rank (a mesh of ``sharding.world`` on ``device``: the meta device in a
    trace, ``cuda`` in a live run); a model already sharded is refused."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if sharded_by_user(module):
        from memcalc.tracing.errors import TraceError

        raise TraceError("--fsdp: the model is already sharded (fully_shard was applied to "
                         "it): give the unsharded model, which --fsdp shards per rank")
    mesh = device_mesh(sharding, device, for_apply=sharding.apply is not None)
    if sharding.apply is not None:  # the user's own fully_shard calls, as written
        with warnings.catch_warnings():  # torch 2.15 warns of slicing "dp_shard_cp", which
            # memcalc flattened onto the mesh it hands over (torchtitan keeps its own)
            warnings.filterwarnings("ignore", "Slicing a flattened dim from root mesh")
            sharding.apply(module, mesh)
        if not sharded_by_user(module):
            from memcalc.tracing.errors import TraceError

            raise TraceError(f"--fsdp-apply {sharding.apply_name}: it called fully_shard on "
                             f"nothing of the model (apply(model, mesh) shards the model "
                             f"it is given)")
        return module
    dtype = lambda name: getattr(torch, name) if name else None  # noqa: E731
    mp = MixedPrecisionPolicy(param_dtype=dtype(sharding.param_dtype),
                              reduce_dtype=dtype(sharding.reduce_dtype))
    layers = blocks(module)
    for i, block in enumerate(layers):
        fully_shard(block, mesh=mesh, mp_policy=mp,
                    reshard_after_forward=_reshard(sharding.reshard_after_forward, i, len(layers)))
    fully_shard(module, mesh=mesh, mp_policy=mp,
                reshard_after_forward=sharding.reshard_after_forward != "never")
    return module


def device_mesh(sharding: Sharding, device: str, for_apply: bool = True):
    """The device mesh of ``sharding`` on ``device``: for the user's ``apply``, the flags'
    1-D ("dp_shard",) or 2-D ("dp_shard", "tp") mesh, or ``--mesh``'s named axes with
    dp_shard and cp flattened into "dp_shard_cp" when both are there (torchtitan's
    ``ParallelDims``); for memcalc's own sharding, FSDP's: the "dp_shard_cp" ranks, and
    HSDP's ("dp_replicate", "dp_shard_cp") when there are replicas. Ranks are laid out
    as the mesh's axes, the last varying fastest (``memcalc.config.Mesh.coordinates``)."""
    from torch.distributed.device_mesh import init_device_mesh

    layout = sharding.mesh
    if layout is None:
        names = ("dp_shard",) if sharding.tp == 1 else ("dp_shard", "tp")
        return init_device_mesh(device, (sharding.world, sharding.tp)[:len(names)],
                                mesh_dim_names=names)
    if not for_apply:
        axes = ((("dp_replicate", layout.dp_replicate),) if layout.dp_replicate > 1 else ()) \
            + (("dp_shard_cp", layout.shards),)
        return init_device_mesh(device, tuple(s for _, s in axes),
                                mesh_dim_names=tuple(n for n, _ in axes))
    axes = layout.axes()
    mesh = init_device_mesh(device, tuple(s for _, s in axes),
                            mesh_dim_names=tuple(n for n, _ in axes))
    if {"dp_shard", "cp"} <= {n for n, _ in axes}:
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return mesh


def _reshard(policy: str, i: int, count: int) -> bool:
    """torchtitan's ``reshard_after_forward`` of block ``i`` of ``count``: by ``default``
    every block but the last (the backward starts with it at once)."""
    return policy == "always" or (policy == "default" and i < count - 1)


def resident(module: torch.nn.Module) -> tuple:
    """``(name, tensor, role)`` of what a sharded model holds from the start: each
    parameter (a DTensor, whose local tensor views the padded shard), each buffer."""
    from memcalc.engine.program import Role

    return (tuple((n, p, Role.parameter) for n, p in module.named_parameters())
            + tuple((n, b, Role.buffer) for n, b in module.named_buffers()))


@contextmanager
def sharded(call, rank: int, tracer) -> Iterator[tuple]:
    """``(call, state)``: the bound ``call`` on rank ``rank``'s sharded copy of its module
    (the user's module left as it was), and that copy's resident state; in the rank's fake
    process group, with FSDP runnable on meta under ``tracer``."""
    import copy

    from memcalc.tracing.context_parallel import Ranks, fake_group

    with fake_group(Ranks(call.sharding.ranks, rank)), on_meta(tracer):
        module = copy.deepcopy(call.fn)
        how = described(module, call.sharding)
        if tracer.paths is not None:
            tracer.paths.note(f"{how}; rank {rank} of {call.sharding.ranks} on a fake process "
                              f"group, its collectives' buffers on streams of their own")
        on_rank = copy.copy(call)
        on_rank.fn = shard(module, call.sharding)
        yield on_rank, resident(on_rank.fn)


def described(module: torch.nn.Module, sharding: Sharding) -> str:
    """How FSDP2 is applied to ``module``, for the trace's notes."""
    if sharding.apply is not None:
        mesh = (f"a mesh of {' x '.join(str(s) for _, s in sharding.mesh.axes())} ranks "
                f"{tuple(n for n, _ in sharding.mesh.axes())}"
                if sharding.mesh is not None else
                f"a mesh of {sharding.world} x {sharding.tp} ranks ('dp_shard', 'tp')"
                if sharding.tp > 1 else f"a mesh of {sharding.world} ranks ('dp_shard',)")
        return (f"FSDP2 as {sharding.apply_name} applies it (its own fully_shard calls) on "
                f"{mesh}")
    layers = blocks(module)
    where = (f"each of the {len(layers)} {type(layers[0]).__name__} blocks, then the root"
             if layers else "the root (no repeated layers found)")
    policy = {"default": "every block but the last", "always": "every block and the root",
              "never": "none"}[sharding.reshard_after_forward]
    mp = (f"; MixedPrecisionPolicy(param_dtype={sharding.param_dtype}, "
          f"reduce_dtype={sharding.reduce_dtype})"
          if sharding.param_dtype or sharding.reduce_dtype else "")
    over = "" if sharding.mesh is None else (
        f" over the {sharding.mesh.shards} dp_shard x cp ranks"
        + (f", replicated over {sharding.mesh.dp_replicate} (HSDP)"
           if sharding.mesh.dp_replicate > 1 else ""))
    return (f"FSDP2 as torchtitan applies it: fully_shard on {where}{over}; reshard after "
            f"forward: {policy} (--reshard-after-forward {sharding.reshard_after_forward}){mp}")


def rank_signature(module: torch.nn.Module, world: int, rank: int) -> tuple:
    """What rank ``rank``'s step depends on besides the code: the rows of each parameter it
    holds (dim 0 chunked ``ceil(rows / world)`` a rank). Ranks of one signature run the
    same step: traced once."""
    def rows(p) -> int:
        n = p.shape[0] if p.dim() else 1
        chunk = -(-n // world)
        return max(0, min(chunk, n - rank * chunk))

    return tuple(rows(p) for p in module.parameters())


def held_rows(module: torch.nn.Module) -> tuple:
    """The rows of each parameter's local shard on this rank's sharded ``module``, as
    ``rank_signature`` predicts them (a 0-d parameter: its one row on rank 0)."""
    from memcalc.tracing.tracer import local

    return tuple(local(p).shape[0] if p.dim() else int(local(p).numel())
                 for p in module.parameters())
