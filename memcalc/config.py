"""Configuration models: what to compute, for which shape, device and protocol.

Every model is frozen, validated and round-trips through JSON. The CLI builds these
same models from its options, so the CLI and the Python API cannot disagree.
"""

from __future__ import annotations

from itertools import islice

import re
from enum import Enum
from typing import Iterable, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from memcalc.engine.allocator import KiB
from memcalc.engine.dims import Dims
from memcalc.gpus import GPU, gpu_preset
from memcalc.impls import canonical, get_impl, registered

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class DType(str, Enum):
    """Element types of q, k, v and everything computed from them."""

    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"

    @classmethod
    def _missing_(cls, value):
        """Aliases: ``float32``, ``float``, ``half``, ``float16``, ``bfloat16``,
        ``torch.bfloat16``, any case (``memcalc.engine.program.DTYPE_ALIASES``)."""
        from memcalc.engine.program import dtype_name

        name = dtype_name(value)
        return cls(name) if name else None

    @property
    def itemsize(self) -> int:
        return 4 if self is DType.fp32 else 2

    @property
    def torch_name(self) -> str:
        return {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[self.value]


SIZE_LIMIT = 2**62
"""Every size is below it (``Shape``; ``memcalc sweep``'s lists say the same)."""


class Shape(BaseModel):
    """The attention problem: ``q`` is ``(batch, heads, seq_len, head_dim)``; ``k`` and
    ``v`` have ``kv_len`` rows (``seq_len`` unless given)."""

    model_config = _FROZEN
    batch: int = Field(8, ge=1, description="batch size B")
    heads: int = Field(1, ge=1, description="attention heads H")
    seq_len: int = Field(16384, ge=1, description="query length N")
    head_dim: int = Field(16, ge=1, description="head dimension d")
    kv_len: int | None = Field(None, ge=1, description="key/value length (default: seq_len)")
    kv_heads: int | None = Field(None, ge=1, description="key/value heads (default: heads; GQA)")

    @field_validator("batch", "heads", "seq_len", "head_dim", "kv_len", "kv_heads")
    @classmethod
    def _below_2_62(cls, value: int | None) -> int | None:
        """Every size below 2^62, as a sweep's lists are: a product of sizes in bytes must
        stay a number numpy's int64 holds where a sweep evaluates it."""
        if value is not None and value >= SIZE_LIMIT:
            raise ValueError(f"must be below 2^62 = {SIZE_LIMIT:,}")
        return value

    @property
    def keys(self) -> int:
        """Key/value rows M."""
        return self.kv_len if self.kv_len is not None else self.seq_len

    @property
    def key_heads(self) -> int:
        """Key/value heads Hk (fewer than ``heads`` for grouped-query attention)."""
        return self.kv_heads if self.kv_heads is not None else self.heads

    @model_validator(mode="after")
    def _check_groups(self) -> "Shape":
        if self.heads % self.key_heads:
            raise ValueError(f"kv_heads: {self.key_heads} must divide heads ({self.heads})")
        return self


_WORKSPACE_RE = re.compile(r"^(:\d+:\d+)+$")
_MASK_RE = re.compile(r"^(none|causal|sliding:[1-9][0-9]*|document:[1-9][0-9]*|padding|full)$")


class Protocol(BaseModel):
    """Options of the measurement protocol (DESIGN.md section 1)."""

    model_config = _FROZEN
    loss: Literal["grad", "sum"] = Field(
        "grad", description="grad: out.backward(grad_out); sum: out.sum().backward()"
    )
    forward_only: bool = Field(False, description="inference under torch.no_grad()")
    deterministic: bool = Field(False, description="the kernels' deterministic backward "
                                "(flash_attn_func(deterministic=True)), where one has it")
    cublas_workspace_config: str | None = Field(
        None, description='CUBLAS_WORKSPACE_CONFIG, e.g. ":4096:8" (SIZE_KiB:COUNT pairs)'
    )
    alloc_conf: str | None = Field(
        None, description="PYTORCH_ALLOC_CONF (formerly PYTORCH_CUDA_ALLOC_CONF), e.g. "
                          "expandable_segments:True")

    @field_validator("cublas_workspace_config")
    @classmethod
    def _check_workspace(cls, value: str | None) -> str | None:
        if value is not None and not _WORKSPACE_RE.match(value):
            raise ValueError('must look like ":4096:8" or ":4096:2:16:8" (SIZE_KiB:COUNT pairs)')
        return value

    @field_validator("alloc_conf")
    @classmethod
    def _check_alloc_conf(cls, value: str | None) -> str | None:
        """Kept as the model follows it (``expandable_segments:True``), None for the
        allocator's defaults; what it cannot follow is refused."""
        from memcalc.engine.allocator import settings_of

        return settings_of(value).text() or None

    @property
    def allocator(self):
        """The caching allocator's settings (``memcalc.engine.allocator.Settings``)."""
        from memcalc.engine.allocator import settings_of

        return settings_of(self.alloc_conf)


class Device(BaseModel):
    """The GPU: a preset by name, or explicit memory and compute capability."""

    model_config = _FROZEN
    gpu: str | None = Field("h100-80gb", description="GPU preset name (memcalc gpus)")
    memory_bytes: int | None = Field(None, ge=1, description="total device memory in bytes")
    compute_capability: tuple[int, int] | None = Field(None, description="e.g. (9, 0)")
    sm_count: int | None = Field(None, ge=1, description="streaming multiprocessors")

    @field_validator("gpu")
    @classmethod
    def _check_gpu(cls, value: str | None) -> str | None:
        if value is not None:
            gpu_preset(value)  # raises a ValueError naming the known presets
        return value

    @model_validator(mode="after")
    def _check(self) -> "Device":
        if self.gpu is None and (self.memory_bytes is None or self.compute_capability is None):
            raise ValueError("give a gpu preset, or both memory_bytes and compute_capability")
        return self

    @property
    def spec(self) -> GPU:
        """The preset (under its own name, whatever the spelling given), with explicit
        fields taking precedence; memory given by hand is of kind ``given``."""
        given = {k: v for k, v in (("memory_bytes", self.memory_bytes),
                                   ("compute_capability", self.compute_capability),
                                   ("sm_count", self.sm_count)) if v is not None}
        if self.gpu is None:
            return GPU(name="custom", label="custom device", source="given by the user", **given)
        if self.memory_bytes is not None:  # not the preset's figure, nor nvidia-smi's
            given.update(memory_kind="given", smi_memory_bytes=None, smi_source="")
        return gpu_preset(self.gpu).model_copy(update=given)


class Config(BaseModel):
    """One question: this implementation, this shape, on this device, under this protocol."""

    model_config = _FROZEN
    impl: str = Field("naive", description="implementation name (memcalc impls)")
    shape: Shape = Shape()
    dtype: DType = DType.fp32
    causal: bool = False
    chunk: int = Field(64, ge=1, description="chunk length of chunked implementations")
    mask: str = Field("none", description="the mask: flex's BlockMask (causal, sliding:W, "
                                          "document:L) or an attn_mask (padding, full)")
    block_mask: Literal["given", "dense"] = Field(
        "given", description="flex: the BlockMask built before the step (given), or by "
                             "create_block_mask run eagerly inside it (dense)")
    cp: int = Field(1, ge=1, description="context-parallel ranks the sequence is split over "
                                         "(PyTorch's ring attention or DeepSpeed-Ulysses; "
                                         "the busiest rank's step)")
    cp_method: Literal["allgather", "alltoall", "ulysses"] = Field(
        "allgather", description="how context-parallel ranks exchange K/V: allgather "
                                 "(PyTorch's default) or alltoall; ulysses: "
                                 "DeepSpeed-Ulysses' all-to-alls of heads for rows")
    tp: int = Field(1, ge=1, description="tensor-parallel ranks the heads are split over")
    device: Device = Device()
    protocol: Protocol = Protocol()

    @field_validator("impl", mode="before")
    @classmethod
    def _check_impl(cls, value):
        value = canonical(value)
        if isinstance(value, str):
            get_impl(value)  # raises a ValueError naming the known implementations
        return value

    @field_validator("mask")
    @classmethod
    def _check_mask(cls, value: str) -> str:
        if not _MASK_RE.match(value):
            raise ValueError("not a mask: none, causal, sliding:W, document:L (W, L whole "
                             "numbers of rows), padding or full")
        return value

    @model_validator(mode="after")
    def _check_mask_read(self) -> "Config":
        kind = self.mask.split(":")[0]
        if self.mask != "none" and kind not in get_impl(self.impl).masks:
            readers = "; ".join(f"{n}: {', '.join(i.masks)}" for n, i in registered().items()
                                if i.masks)
            raise ValueError(f"mask: {self.impl} takes no {kind} mask; the masks each reads: "
                             f"{readers} (--causal masks the others)")
        return self

    @model_validator(mode="after")
    def _check_block_mask(self) -> "Config":
        if self.block_mask == "dense" and (self.impl != "flex" or (
                self.mask == "none" and not self.causal)):
            raise ValueError("block_mask: dense is create_block_mask run in the step, for "
                             "flex with a mask (--mask causal, sliding:W, document:L, or "
                             f"--causal); got {self.impl} with mask {self.mask}")
        return self

    @model_validator(mode="after")
    def _check_tp(self) -> "Config":
        s = self.shape
        if s.heads % self.tp or s.key_heads % self.tp:
            raise ValueError(f"tp: {self.tp} ranks must divide the heads ({s.heads}) and the "
                             f"key/value heads ({s.key_heads}): each rank holds a share of both")
        return self

    @model_validator(mode="after")
    def _check_cp(self) -> "Config":
        if self.cp == 1:
            return self
        from memcalc.impls.ring import refusal  # the SDPA kernels' modules: not at start-up

        refused = refusal(self.impl, get_impl(self.impl).user_code, self.cp, self.cp_method,
                          self.causal, self.shape, self.tp)
        if refused:
            raise ValueError(refused)
        return self

    @model_validator(mode="after")
    def _check_gqa(self) -> "Config":
        if self.shape.key_heads != self.shape.heads and not get_impl(self.impl).gqa:
            raise ValueError(f"kv_heads: implementation {self.impl} needs kv_heads == heads "
                             f"({self.shape.key_heads} != {self.shape.heads})")
        return self

    @property
    def dims(self) -> Dims:
        """The sizes programs are built from (the one place they are read)."""
        return Dims.of(self)

    def label(self, leave_out: str | Iterable[str] = ()) -> str:
        """The sizes and options as every title shows them: ``B=8 H=1 N=16384 d=16 fp32``,
        then what differs from the defaults (key/value heads and length, causal,
        forward-only, the loss, the chunk, the cuBLAS workspace setting); ``leave_out``:
        the size a search solves for, or what a sweep varies (sizes, ``dtype``)."""
        left = {leave_out} if isinstance(leave_out, str) else set(leave_out)
        impl = get_impl(self.impl)
        reads = impl.reads
        left |= set(Shape.model_fields) - reads if reads is not None else set()
        dtype = impl.title(self.dtype.value) if impl.title else self.dtype.value
        s, p = self.shape, self.protocol
        sizes = {"batch": f"B={s.batch}", "heads": f"H={s.heads}",
                 "kv_heads": f"Hk={s.kv_heads}" if s.kv_heads else "",
                 "seq_len": f"N={s.seq_len}", "kv_len": f"M={s.kv_len}" if s.kv_len else "",
                 "head_dim": f"d={s.head_dim}"}
        options = ["" if "dtype" in left else dtype, "causal" if self.causal else "",
                   f"mask={self.mask}" if self.mask != "none" else "",
                   "block-mask=dense" if self.block_mask == "dense" else "",
                   "forward-only" if p.forward_only else "",
                   f"loss={p.loss}" if p.loss != "grad" else "",
                   "deterministic" if p.deterministic else "",
                   f"tp={self.tp}" if self.tp > 1 else "",
                   f"cp={self.cp} {self.cp_method}" if self.cp > 1 else "",
                   f"chunk={self.chunk}" if self.chunk != Config.model_fields["chunk"].default
                   else "",
                   f"CUBLAS_WORKSPACE_CONFIG={p.cublas_workspace_config}"
                   if p.cublas_workspace_config else "",
                   f"PYTORCH_ALLOC_CONF={p.alloc_conf}" if p.alloc_conf else ""]
        shown = [v for k, v in sizes.items() if k not in left] + options
        return " ".join(part for part in shown if part)

    def replace(self, **changes) -> "Config":
        """This configuration with some fields changed, validated as a new one: the one way
        to vary a configuration. Shape fields (``seq_len``, ``batch``, ...) are given
        directly; ``kv_len`` keeps following ``seq_len`` unless it was set."""
        data = self.model_dump()
        for field, value in changes.items():
            if field in Shape.model_fields:
                data["shape"][field] = value
            elif field in Config.model_fields:
                data[field] = value
            else:
                known = ", ".join([*Config.model_fields, *Shape.model_fields])
                raise ValueError(f"{field}: not a configuration field; known: {known}")
        return Config.model_validate(data)

    @property
    def workspace_bytes(self) -> int:
        """One cuBLAS workspace: ``aten/src/ATen/cuda/CublasHandlePool.cpp``,
        ``getChosenWorkspaceSize``: the sum of SIZE_KiB * 1024 * COUNT of
        ``CUBLAS_WORKSPACE_CONFIG`` or, by default, 32 MiB on compute capability 9.0
        and newer, else ``:4096:2:16:8`` (8,519,680 B)."""
        config = self.protocol.cublas_workspace_config
        if config is None:
            major = self.device.spec.compute_capability[0]
            config = ":32768:1" if major >= 9 else ":4096:2:16:8"
        numbers = [int(n) for n in config.strip(":").split(":")]
        return sum(size * KiB * count for size, count in zip(numbers[::2], numbers[1::2]))



def make_config(*, impl: str = "naive", seq_len: int = 16384, batch: int = 8, heads: int = 1,
                head_dim: int = 16, kv_len: int | None = None, kv_heads: int | None = None,
                dtype: str = "fp32", causal: bool = False, chunk: int = 64, mask: str = "none",
                block_mask: str = "given", gpu: str | None = "h100-80gb", loss: str = "grad",
                forward_only: bool = False, cublas_workspace_config: str | None = None,
                deterministic: bool = False, cp: int = 1, cp_method: str = "allgather",
                tp: int = 1, alloc_conf: str | None = None) -> Config:
    """A ``Config`` from the flat options the CLI and the Python API share (the CLI's
    ``--seq`` is ``seq_len``); a bad value is a one-line ValueError that starts with the
    field (``kv_heads: 3 must divide heads (4)``), which the CLI names by its option."""
    from pydantic import ValidationError

    from memcalc.errors import one_line

    if gpu is None:
        from memcalc.gpus import gpu_presets

        raise ValueError(f"gpu: a GPU preset (memcalc.gpus.gpu_presets()); known: "
                         f"{', '.join(gpu_presets())} (got None)")
    try:
        return Config(
            impl=impl, dtype=dtype, causal=causal, chunk=chunk, mask=mask,
            block_mask=block_mask, cp=cp, cp_method=cp_method, tp=tp,
            shape=Shape(batch=batch, heads=heads, seq_len=seq_len, head_dim=head_dim,
                        kv_len=kv_len, kv_heads=kv_heads),
            device=Device(gpu=gpu),
            protocol=Protocol(loss=loss, forward_only=forward_only,
                              cublas_workspace_config=cublas_workspace_config,
                              deterministic=deterministic, alloc_conf=alloc_conf),
        )
    except ValidationError as error:
        raise ValueError(one_line(error)) from None


def first_accepted(impls, **options) -> Config:
    """``make_config(**options)`` with the first of ``impls`` (None: every implementation)
    that takes the options: the base of a command over several, whose others still run
    and refuse for themselves (``--kv-heads`` with naive first: naive is listed as refused,
    sdpa-math solved); an implementation given in ``options`` comes first. The first one's
    refusal when none takes them."""
    from memcalc.impls import impl_names

    names = [options.pop("impl")] if "impl" in options else []
    names += list(impls) if impls is not None else ["naive", *impl_names()]
    return first_taken(dict.fromkeys(names), lambda impl: make_config(impl=impl, **options))


def first_taken(candidates, make, refused: type[Exception] = ValueError):
    """``make(c)`` for the first of ``candidates`` (at most 64 tried) that it does not
    refuse (raise ``refused``); the first refusal when it refuses them all."""
    first = None
    for candidate in islice(candidates, 64):
        try:
            return make(candidate)
        except refused as error:
            first = first or error
    raise first


MESH_AXES = ("dp_replicate", "dp_shard", "cp", "tp")  # torchtitan's ParallelDims, its order


class Mesh(BaseModel):
    """The ranks a traced training step runs on, named as torchtitan's ``ParallelDims``
    names them: ``dp_replicate`` (HSDP's replicas), ``dp_shard`` (FSDP's shards), ``cp``
    (context parallelism: each rank holds a slice of the sequence) and ``tp`` (tensor
    parallelism: the model's own plan). An axis not given is 1; the ranks are their
    product, laid out in that order (the last axis varies fastest). FSDP shards the
    parameters over ``dp_shard`` x ``cp`` ranks (torchtitan's ``dp_shard_cp``) and
    replicates them over ``dp_replicate``; context parallelism's ring runs over ``cp``.

        >>> memcalc.Mesh(dp_shard=4, cp=2).ranks
        8
    """

    model_config = _FROZEN
    dp_replicate: int = Field(1, ge=1, description="HSDP's replicas")
    dp_shard: int = Field(1, ge=1, description="FSDP's shards")
    cp: int = Field(1, ge=1, description="context-parallel ranks (the sequence split)")
    tp: int = Field(1, ge=1, description="tensor-parallel ranks (the model's own plan)")

    @classmethod
    def parse(cls, text: str, field: str = "--mesh") -> "Mesh":
        """``dp_shard=4,cp=2`` as a ``Mesh``; a ValueError naming ``field`` otherwise."""
        from memcalc.errors import did_you_mean

        sizes = {}
        for part in str(text).split(","):
            name, sep, value = (s.strip() for s in part.partition("="))
            if name not in MESH_AXES:
                raise ValueError(f"{field}: unknown axis {name!r}{did_you_mean(name, MESH_AXES)}"
                                 f"; give AXIS=SIZE pairs of {', '.join(MESH_AXES)}, e.g. "
                                 f"dp_shard=4,cp=2")
            if name in sizes:
                raise ValueError(f"{field}: {name} given twice (got {text!r})")
            if not sep or not value.isdigit() or int(value) < 1:
                raise ValueError(f"{field}: {name} takes a whole number of ranks, at least 1, "
                                 f"as {name}=4 (got {part.strip()!r})")
            sizes[name] = int(value)
        return cls(**sizes)

    @property
    def ranks(self) -> int:
        """Every rank of the mesh."""
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def shards(self) -> int:
        """The ranks FSDP shards each parameter over: ``dp_shard`` x ``cp``."""
        return self.dp_shard * self.cp

    def axes(self) -> tuple[tuple[str, int], ...]:
        """``(name, size)`` of the axes given and of ``dp_shard`` (what FSDP shards over),
        in torchtitan's order: the device mesh's dimensions (the others are 1 and left
        out)."""
        given = self.model_fields_set | {"dp_shard"}
        return tuple((n, getattr(self, n)) for n in MESH_AXES if n in given)

    def coordinates(self, rank: int) -> dict[str, int]:
        """Rank ``rank``'s index along each axis (row-major over ``MESH_AXES``)."""
        out = {}
        for name in reversed(MESH_AXES):
            size = getattr(self, name)
            out[name], rank = rank % size, rank // size
        return out

    def shard_index(self, rank: int) -> int:
        """Rank ``rank``'s place among the ``shards`` ranks FSDP shards over."""
        c = self.coordinates(rank)
        return c["dp_shard"] * self.cp + c["cp"]

    def text(self) -> str:
        """``dp_shard=4,cp=2``: the axes, as ``--mesh`` takes them."""
        return ",".join(f"{n}={s}" for n, s in self.axes())


class Step(BaseModel):
    """What a traced training step runs around the model, as a training loop does: the
    optimizer (``adamw``, ``adam`` or ``sgd``, ``:fused`` or ``:forloop``; None: none),
    the forward and backward passes per optimizer step (``grad_accum``), the total norm
    the grads are clipped to first (``clip_grad_norm``; None: not clipped), how the
    code's ``torch.compile`` calls run (None: compiled as inductor compiles them for the
    GPU; ``"default"``: the whole model compiled too; ``"eager"``: uncompiled), and the
    activation memory budget they are compiled at (``activation_budget``, 0 to 1; None:
    torch's setting, 1 unless changed).

        >>> memcalc.Step(optimizer="adamw", clip_grad_norm=1.0).grad_accum
        1
    """

    model_config = _FROZEN
    optimizer: str | None = Field(None, description="adamw, adam or sgd; :fused, :forloop")
    grad_accum: int = Field(1, ge=1, description="forward and backward passes a step")
    clip_grad_norm: float | None = Field(None, gt=0, description="clip_grad_norm_'s max_norm")
    compile: Literal["eager", "default"] | None = Field(
        None, description="default: the model compiled as torch.compile(model) does; eager: "
                          "the code's torch.compile calls left uncompiled (without it they "
                          "are compiled as inductor compiles them for the GPU)")
    activation_budget: float | None = Field(
        None, ge=0, le=1, description="torch._functorch.config.activation_memory_budget for "
                                      "the compiled code: the share of saved activations "
                                      "the partitioner keeps")
