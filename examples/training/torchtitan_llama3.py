"""torchtitan's Llama 3.1 8B training step, built and sharded by torchtitan's own code
(``pip install --no-deps torchtitan==0.3.0`` and ``pip install ".[torchtitan]"``: see the
training guide). Nothing is downloaded: the model is built on the meta device.

    memcalc trace examples/training/torchtitan_llama3.py:Llama3Step --input tokens=B,N:int64 --input labels=B,N:int64 --seq 8192 --batch 2 --optimizer adamw --fsdp 8 --fsdp-apply examples/training/torchtitan_llama3.py:selective --gpu-gb 96

What is torchtitan's, as written:

* the model: ``model_registry("8B")`` (32 blocks of 4,096, 32 query heads of 128 over 8
  key/value heads, a fused QKV projection, an MLP of 14,336, a vocabulary of 128,256),
  with the inner attention its Llama 3 ran through 2025 and its published tables used,
  ``ScaledDotProductAttention`` (``F.scaled_dot_product_attention`` under
  ``sdpa_kernel([CUDNN_ATTENTION, FLASH_ATTENTION, MATH], set_priority=True)``); 0.3.0's
  default is compiled FlexAttention;
* the loss: ``cross_entropy_loss`` (the logits in float32, summed), as the published
  tables' trainer computed it (``Llama3Step``); or 0.3.0's trainer default,
  ``ChunkedLossWrapper`` (``ChunkedLlama3Step``): the head and the loss over 8 chunks of
  the sequence, each chunk's backward run inside the loss, then the decoder's backward;
* the sharding (``selective``, ``full``, ``no_ac``; ``compiled``, ``compiled_no_ac``: with
  torchtitan's ``apply_compile``): what ``parallelize_llama`` does for this
  configuration, activation checkpointing first (``SelectiveAC``: every op of its save list
  kept, every second matmul recomputed; or ``FullAC``), then ``apply_fsdp_to_decoder``
  (bfloat16 parameters, float32 reductions, each block resharded after its forward).

The sharding functions take the mesh memcalc gives them (``--fsdp P``, or ``--mesh`` with
torchtitan's axes: dp_replicate, dp_shard, cp, tp). ``parallelize_llama`` itself is not
called: 0.3.0 builds its own CUDA device mesh
(``ParallelDims``) and shards through its ``spmd_types`` backend. ``LAYERS`` in the
environment sets the depth (default 32), ``FLAVOR`` the model (default ``8B``;
``debugmodel`` is torchtitan's small one).
"""

import os

import torch
from torchtitan.components.loss import ChunkedLossWrapper, cross_entropy_loss
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import model_registry

FLAVOR = os.environ.get("FLAVOR", "8B")
LAYERS = int(os.environ.get("LAYERS", 32))


def build(flavor: str = FLAVOR, layers: int = LAYERS) -> torch.nn.Module:
    """torchtitan's Llama 3 of ``flavor``, its first ``layers`` blocks, SDPA inside, on
    the meta device."""
    config = model_registry(flavor).model
    config.layers = config.layers[:layers]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    with torch.device("meta"):
        return config.build()


class Llama3Step(torch.nn.Module):
    """The model and its loss: ``loss = cross_entropy_loss(model(tokens), labels)``, as
    torchtitan's trainer computes it."""

    def __init__(self, flavor: str = FLAVOR, layers: int = LAYERS):
        super().__init__()
        self.model = build(flavor, layers)

    def forward(self, tokens, labels):
        return cross_entropy_loss(self.model(tokens), labels)


class ChunkedLlama3Step(Llama3Step):
    """The model and torchtitan 0.3.0's default loss, ``ChunkedLossWrapper``, set up as its
    trainer sets it up: the loss holds the head (``set_lm_head``), the model skips it."""

    def __init__(self, flavor: str = FLAVOR, layers: int = LAYERS):
        super().__init__(flavor, layers)
        self.loss = ChunkedLossWrapper(ChunkedLossWrapper.Config())

    def forward(self, tokens, labels):
        self.loss.set_lm_head(self.model.lm_head)
        self.model._skip_lm_head = True
        loss, _ = self.loss(self.model(tokens), labels)
        return loss


def dp_mesh(mesh):
    """The mesh FSDP shards over, as ``parallelize_llama`` takes it from ``ParallelDims``:
    the dp_shard x cp ranks flattened (``dp_shard_cp``; torchtitan calls it ``fsdp``), after
    dp_replicate for HSDP."""
    names = mesh.mesh_dim_names
    shard = "dp_shard_cp" if "cp" in names else "dp_shard"
    return mesh["dp_replicate", shard] if "dp_replicate" in names else mesh[shard]


def _sharded(step: Llama3Step, mesh, checkpointing) -> None:
    """``parallelize_llama``'s order: activation checkpointing, then FSDP."""
    if checkpointing is not None:
        checkpointing.apply(step.model)
    apply_fsdp_to_decoder(step.model, dp_mesh(mesh), param_dtype=torch.bfloat16,
                          reduce_dtype=torch.float32, pp_enabled=False)


def selective(step: Llama3Step, mesh) -> None:
    """torchtitan's default: selective activation checkpointing, then FSDP."""
    _sharded(step, mesh, SelectiveAC(SelectiveAC.Config()))


def full(step: Llama3Step, mesh) -> None:
    """Every block recomputed in the backward, then FSDP."""
    _sharded(step, mesh, FullAC(FullAC.Config()))


def no_ac(step: Llama3Step, mesh) -> None:
    """FSDP alone."""
    _sharded(step, mesh, None)


def _compiled(step: Llama3Step, mesh, checkpointing) -> None:
    """``parallelize_llama``'s order with torchtitan's ``--compile``: activation
    checkpointing, ``apply_compile`` (each block compiled in place, with inductor and
    ``fullgraph=True``), then FSDP. ``apply_compile`` reads only the tensor-parallel flag of
    its ``ParallelDims``."""
    from types import SimpleNamespace

    from torchtitan.config.configs import CompileConfig
    from torchtitan.distributed.compile import apply_compile

    if checkpointing is not None:
        checkpointing.apply(step.model)
    apply_compile(step.model, compile_config=CompileConfig(enable=True),
                  parallel_dims=SimpleNamespace(tp_enabled=False))
    _sharded(step, mesh, None)


def compiled(step: Llama3Step, mesh) -> None:
    """torchtitan's default with ``--compile``: selective checkpointing, compiled blocks,
    FSDP."""
    _compiled(step, mesh, SelectiveAC(SelectiveAC.Config()))


def compiled_no_ac(step: Llama3Step, mesh) -> None:
    """Compiled blocks and FSDP, no checkpointing."""
    _compiled(step, mesh, None)
