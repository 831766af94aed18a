"""``sdpa-efficient``: ``F.scaled_dot_product_attention`` on the memory-efficient (CUTLASS,
xFormers-derived) backend.

Source-derived (``traced=False``). Read from PyTorch's sources of the torch 2.13 era
(``aten/src/ATen/native/transformers/cuda/``):

* ``attention.cu`` ``_scaled_dot_product_efficient_attention_cuda`` passes ``(B, N, H, d)``
  transposed views to ``_efficient_attention_forward``: ``res = empty({B, N, H, d})``
  (the user's output is its ``(B, H, N, d)`` transpose), ``logsumexp (B, H,
  ceil(N/32)*32)`` float32 (``kAlignLSE = 32`` in ``mem_eff_attention/kernel_forward.h``;
  ``(B, H, 0)`` when no grad is needed: ``should_compute_logsumexp``), and an
  ``output_accum (B, N, H, d)`` float32 temporary when the kernel cannot keep the output
  in registers (fp16/bf16 and d > 128: ``kNeedsOutputAccumulatorBuffer``, kernel
  ``32x128_gmem`` in ``kernels/cutlassF.h``). The philox seed and offset are CPU tensors
  outside CUDA-graph capture (``device = in_capture_stream ? kCUDA : kCPU``): no device
  memory (the meta registration puts them on the tensor's device).
* ``derivatives.yaml``: the backward node saves query, key, value, output, log_sumexp,
  philox_seed, philox_offset (checked on the meta device in the tests).
* ``attention_backward.cu`` ``_efficient_attention_backward``: ``grad_out.contiguous()``
  of the ``(B, N, H, d)`` view; grad_q, grad_k, grad_v ``empty`` in ``(B, N, H, d)``
  (returned transposed, so ``AccumulateGrad`` copies each into the leaf's layout when
  H > 1 and the length > 1); ``delta``: ``empty({B, H, N})`` float32 when the kernel
  computes it (``kKernelComputesDelta``: fp16/bf16), else ``(grad_out * out).sum(-1)
  .transpose(-2, -1).contiguous()`` in float32 (fp32); the workspace of
  ``kernel_backward.h`` ``Params::workspace_size``.

No op calls cuBLAS. No grouped-query attention: ``sdp_utils.cpp`` checks
``check_batch_size_and_num_heads_dense<false>`` for this backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil

from memcalc.impls.accepted import Accepted
from memcalc.impls.registry import register
from memcalc.impls.common import with_loss
from memcalc.impls.device import Gpu, gpu_of
from memcalc.impls.sdpa_flash import cc_text, round_up
from memcalc.engine.inputs import QKV, Input, input_tensors
from memcalc.engine.program import Dims, Program, Role, Tensor, free, new, release

S, O, G, T = Role.saved, Role.output, Role.gradient, Role.temporary
F32 = "float32"


@dataclass(frozen=True)
class Kernel:
    """An ``AttentionBackwardKernel`` instance: query and key tile, largest head dim."""

    block_i: int
    block_j: int
    max_k: int
    half: bool

    @property
    def output_in_rf(self) -> bool:
        """``kOutputInRF = kIsHalf && kMaxK <= kBlockSizeI``: dk, dv stay in registers."""
        return self.half and self.max_k <= self.block_i


# kernels/cutlassB.h dispatch_cutlassB_{f16,bf16,f32}_sm80, in order, without dropout
# (the "seqaligned" variants have the same tiles); the first with kMaxK >= d is taken.
_HALF = ((64, 64, 32), (64, 64, 64), (128, 128, 128), (64, 64, 128), (128, 64, 65536))
_FLOAT = ((64, 64, 32), (64, 64, 64), (128, 64, 128), (64, 64, 128), (128, 64, 65536))


def minimum_gemm_alignment(half: bool, cc: tuple[int, int]) -> int:
    """Elements a head dim must be a multiple of (``sdp_utils.cpp``
    ``minimum_gemm_alignment``; also ``memcalc.impls.sdpa_select``): sm80+ 4 in fp32, 8
    in fp16 and bf16."""
    align = 4 if cc[0] >= 8 else 1
    use_tc = cc[0] >= 8 or (cc[0] >= 7 and half)
    return max(align, 128 // (16 if half else 32)) if use_tc else align


def accepted(d: Dims) -> tuple[Accepted, ...]:
    """The head dims the kernels take: multiples of ``minimum_gemm_alignment``, up to the
    largest ``kMaxK`` (``_HALF``, ``_FLOAT``); ``check`` refuses the rest, a search probes
    only these."""
    kernels = _FLOAT if d.dtype == F32 else _HALF
    step = minimum_gemm_alignment(d.dtype != F32, gpu_of(d).compute_capability)
    return (Accepted("head_dim", step=step,
                     most=max(k for _, _, k in kernels),
                     kernel="the memory-efficient kernel",
                     step_source="sdp_utils.cpp check_head_dim_size_mem_efficient",
                     most_source="kernels/cutlassB.h kMaxK"),)


def check(d: Dims, gpu: Gpu) -> None:
    """Inputs and devices this model covers; torch uses another backend or kernel otherwise."""
    for rule in accepted(d):
        rule.refuse("sdpa-efficient", d.D)
    if gpu.compute_capability not in ((8, 0), (9, 0)):
        raise ValueError(f"--gpu: sdpa-efficient is modelled for compute capability 8.0 and "
                         f"9.0, not {cc_text(gpu)}: 8.6/8.9 pick other kernels (shared memory), "
                         f">= 10.0 has none in cutlassB.h")


def backward_kernel(d: Dims) -> Kernel:
    """The kernel ``dispatch_cutlassB`` launches on sm80 / sm90 (all fit in their shared
    memory: the 128x128 tile was written for the A100's 164 KiB)."""
    half = d.dtype != F32
    for i, j, k in _HALF if half else _FLOAT:
        if k >= d.D:
            return Kernel(i, j, k, half)
    raise AssertionError("kMaxK 65536 covers every head dim")


def key_splits(d: Dims, kernel: Kernel) -> int:
    """``num_splits_key`` heuristic of ``_efficient_attention_backward``."""
    splits = ceil(d.M / kernel.block_j)
    if d.B * d.H >= 256 and d.M <= 2 * kernel.block_j:
        splits = 1
    if not kernel.output_in_rf and kernel.half:  # kNeedsAccumGradK / V
        splits = min(splits, 200 // (d.B * d.H))
    return max(splits, 1)


def workspace_bytes(d: Dims) -> int:
    """``Params::workspace_size``: per (batch, head), float32 dK/dV accumulators (when the
    kernel cannot keep them in registers) and the dQ tiles of the split-key reduction
    (``GradQTempStorage``: 16 B of lock and counter, then block_i x block_j floats)."""
    k = backward_kernel(d)
    gq = ceil(d.N / k.block_i) * ceil(d.D / k.block_j) * (4 + k.block_i * k.block_j)
    gkv = 0
    if k.half and not k.output_in_rf:
        gkv = 2 * key_splits(d, k) * round_up(d.M, k.block_j) * round_up(d.D, k.block_i)
    return d.B * d.H * round_up(gkv + gq, 4) * 4


def forward(d: Dims, on: str, grad: bool) -> list:
    """res, logsumexp (when a grad is needed), the output accumulator; ``on="meta"``: what
    the meta registration allocates instead (seed and offset on the device, no buffer)."""
    lse_len = round_up(d.N, 32) if grad else 0
    buffer = d.dtype != F32 and d.D > 128 and on == "cuda"
    rng = ["seed", "offset"] if on == "meta" else []
    return [
        new("out", (d.B, d.N, d.H, d.D), d.dtype, O, "empty"),  # (B, N, H, D); seen transposed
        *([new("lse", (d.B, d.H, lse_len), F32, S, "empty")] if grad else []),  # (B, H, ceil32(N))
        *([new("out_accum", (d.B, d.N, d.H, d.D), F32, T, "empty"), free("out_accum")]
          if buffer else []),  # (B, N, H, D) float32
        *(new(name, (), "int64", S, "empty") for name in rng),  # () meta-only scalars
        *([free(*(["lse"] if grad else []), *rng)] if grad or rng else []),
    ]


def delta(d: Dims) -> tuple[list, list]:
    """The (B, H, N) float32 ``delta = rowsum(dO * O)`` and what frees it."""
    if d.dtype != F32:
        return [new("delta", (d.B, d.H, d.N), F32, T, "empty")], ["delta"]  # (B, H, N)
    events = [
        new("do*o", (d.B, d.N, d.H, d.D), F32, T, "mul"),  # (B, N, H, D)
        new("rowsum", (d.B, d.N, d.H), F32, T, "sum"),  # (B, N, H)
    ]
    if d.H > 1 and d.N > 1:  # the (B, H, N) transpose is not contiguous: a copy
        events += [new("delta", (d.B, d.H, d.N), F32, T, "contiguous"), free("do*o", "rowsum")]
        return events, ["delta"]
    return events + [free("do*o")], ["rowsum"]


def kernel_internals(d: Dims, grad_copy: bool | None = None) -> tuple[list, list]:
    """What ``_efficient_attention_backward`` allocates besides the grads (CUDA only): the
    grad copy before them; delta and the workspace after them, with their frees (delta
    dies with the launch lambda, the workspace and the copy when the function returns).
    ``grad_copy``: the decision read off the real grad's strides (the tracer's); None: the
    protocol's layout."""
    if grad_copy is None:
        grad_copy = (d.H > 1 and d.N > 1) or d.loss == "sum"  # stride-0 expand under sum
    copy = [new("dout_t", (d.B, d.N, d.H, d.D), d.dtype, T, "contiguous")] if grad_copy else []
    delta_events, delta_names = delta(d)
    size = workspace_bytes(d)
    work = [new("workspace", (size,), "uint8", T, "empty")] if size else []  # (bytes,)
    ends = [t.name for t in work + copy]
    return copy, delta_events + work + [free(*delta_names)] + ([free(*ends)] if ends else [])


def accumulate(d: Dims) -> list:
    """``AccumulateGrad`` of q, k, v (in that order): a copy into the leaf's (B, H, N, D)
    layout unless the transposed layouts coincide (H == 1 or one row)."""
    events = []
    for name, rows in (("q", d.N), ("k", d.M), ("v", d.M)):
        if d.H > 1 and rows > 1:
            shape = (d.B, d.H, rows, d.D)  # (B, H, rows, D), the leaf's layout
            events += [new(f"{name}.grad", shape, d.dtype, G, "clone"), free(f"d{name}")]
    return events


def backward(d: Dims, on: str, grad_copy: bool | None = None, leaves: bool = True,
             bias: tuple[str, ...] = (), bias_grad: bool = False) -> list:
    """The efficient backward node, then AccumulateGrad into the protocol's leaves
    (``leaves=False``: the node alone, for the tracer, whose autograd runs what follows);
    ``bias``: the saved attn_mask, released with the logsumexp; ``bias_grad``: the mask
    requires grad (the tracer's calls only)."""
    before, after = kernel_internals(d, grad_copy) if on == "cuda" else ([], [])
    role = T if d.H > 1 else G
    rng = ["seed", "offset"] if on == "meta" else []
    return before + [
        new("dq", (d.B, d.N, d.H, d.D), d.dtype, role if d.N > 1 else G, "empty"),  # (B, N, H, D)
        new("dk", (d.B, d.M, d.H, d.D), d.dtype, role if d.M > 1 else G, "empty"),  # (B, M, H, D)
        new("dv", (d.B, d.M, d.H, d.D), d.dtype, role if d.M > 1 else G, "empty"),  # (B, M, H, D)
        *([bias_gradient(d)] if bias_grad else []),
        *after,
        release("lse", *rng, *bias),
        *(accumulate(d) if leaves else []),
    ]


def bias_gradient(d: Dims) -> Tensor:
    """``grad_bias`` of ``_efficient_attention_backward`` (attention_backward.cu), made after
    dq, dk, dv when the attn_mask requires grad: the shape of the bias the kernel read, the
    mask expanded to (B, H, N, M), its last dim padded to a multiple of 16 ("force alignment
    for the last dim"), sliced back to M for the caller: a dense N x M tensor per head."""
    return new("grad_bias", (d.B, d.H, d.N, round_up(d.M, 16)), d.dtype, T, "empty")


# --mask: a bool attn_mask, as Hugging Face passes a padding mask to sdpa
MASK_DIMS = {"padding": ("B", "1", "1", "M"), "full": ("B", "1", "N", "M")}
MEM_EFF_ALIGNMENT = 8  # attention.cpp preprocess_mask: mem_eff_alignment


def mask_events(d: Dims) -> tuple[list, str]:
    """What ``attention.cpp`` (2.13) makes of a bool attn_mask before the kernel, and the
    name of what the kernel gets: ``convert_boolean_attn_mask``, ``where(mask, 0, -inf)``
    of the mask's shape in q's dtype (a 0-d -inf, and inside ``where`` a 0-d 0); then, the
    keys not a multiple of 8, ``pad_bias<8>``: padded to the next multiple and sliced back,
    before the broadcast to (B, H, N, M), a view. The node saves it (``attn_bias``)."""
    shape = Input("mask", MASK_DIMS[d.mask]).shape(d)  # (B, 1, 1, M) or (B, 1, N, M)
    pad = d.M % MEM_EFF_ALIGNMENT != 0
    events = [
        new("mask -inf", (), d.dtype, T, "scalar_tensor"),  # () the fill of masked keys
        new("mask 0", (), d.dtype, T, "scalar_tensor"),  # () inside where
        new("mask_float", shape, d.dtype, T if pad else S, "where"),  # the mask's shape
        free("mask 0"), free("mask -inf"),
    ]
    if not pad:
        return events, "mask_float"
    padded = (*shape[:-1], round_up(d.M, MEM_EFF_ALIGNMENT))  # (..., round8(M))
    return events + [new("mask_pad", padded, d.dtype, S, "constant_pad_nd"),
                     free("mask_float")], "mask_pad"


def program(d: Dims, gpu: Gpu | None = None, on: str = "cuda", grad: bool = True) -> Program:
    """The step on ``gpu`` (default ``gpu_of(d)``); ``on="meta"``: the meta registrations'
    allocations; ``grad=False`` for ``forward_only`` (no logsumexp is computed); with
    ``--mask padding|full`` the bool mask is an input, and what the kernel gets of it is
    kept for the backward."""
    check(d, gpu or gpu_of(d))
    if d.mask == "none":
        return Program(tuple(forward(d, on, grad)), tuple(with_loss(d, backward(d, on))))
    prepare, name = mask_events(d)
    inputs = input_tensors(d, (*QKV, Input("mask", MASK_DIMS[d.mask], "bool")))
    return Program((*prepare, *forward(d, on, grad), free(name)),
                   tuple(with_loss(d, backward(d, on, bias=(name,)))), tuple(inputs))


@register("sdpa-efficient", "SDPA memory-efficient backend: saves the (B, H, ceil32(N)) "
          "logsumexp", traced=False, accepted=accepted, masks=("padding", "full"))
def sdpa_efficient(d: Dims) -> Program:
    """Saved: the logsumexp; backward: the grad copy, (B, N, H, D) grads copied into the
    leaves' layout, float32 delta and the kernel's workspace."""
    return program(d, grad=not d.forward_only)
