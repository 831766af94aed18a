"""``sdpa-flash``: ``F.scaled_dot_product_attention`` on PyTorch's FlashAttention-2 backend.

Source-derived (``traced=False``): the CUDA kernels cannot run on the meta device. Read from
PyTorch's sources of the torch 2.13 era (``aten/src/ATen/native/transformers/``):

* ``attention.cpp`` ``scaled_dot_product_attention``: a head dim not a multiple of 8 is
  padded (``pad_last_dim<8, false>``: ``constant_pad_nd``, visible to autograd, so the
  padded q, k, v are what the flash node saves) and the output sliced back
  (``post_process_flash_output``);
* ``cuda/attention.cu`` ``_scaled_dot_product_flash_attention_cuda``: q, k, v are passed
  as ``(B, N, H, d)`` transposed views (no copy) to ``flash_attn/flash_api.cpp``
  ``mha_fwd``, which allocates ``out = empty_like(q)`` (same strides, so the bytes of
  q), ``softmax_lse (B, H, N)`` float32, the split-KV accumulators when
  ``num_splits_heuristic`` picks more than one split, ``rng_state`` ``(2,)`` uint64 and
  ``_unused`` ``()`` uint64, which sdpa returns as ``philox_offset`` (one 512-B block each);
* ``tools/autograd/derivatives.yaml``: ``ScaledDotProductFlashAttentionBackward0`` saves
  query, key, value, output, logsumexp, rng_state and philox_offset (checked on the meta
  device: ``tests/test_impls_sdpa_fused.py``);
* ``cuda/attention_backward.cu`` ``_flash_attention_backward``: ``grad_out.contiguous()``
  and ``out.contiguous()`` of the ``(B, N, H, d)`` views, then ``mha_bwd``: dq, dk, dv
  ``empty_like``, ``softmax_d (B, H, round128(N))`` and ``dq_accum (B, round128(N), H,
  round(d, 32 if d <= 128 else 64))`` float32, and for GQA ``dk_expanded``,
  ``dv_expanded (B, M, H, d)`` summed into dk, dv.

No op calls cuBLAS: the step holds no cuBLAS workspace. ``Dims``: ``B`` batch, ``H``
query heads, ``Hk`` key/value heads, ``N`` query rows, ``M`` key rows, ``D`` head dim.

The split-KV decision needs the device's SM count, which ``Dims`` does not carry yet:
``gpu_of`` reads ``d.sm_count`` / ``d.compute_capability`` when present and assumes an
H100 SXM (132 SMs, 9.0) otherwise.
"""

from __future__ import annotations

from math import ceil


from memcalc.impls.accepted import Accepted
from memcalc.impls.device import Gpu, gpu_of
from memcalc.impls.registry import register
from memcalc.impls.common import with_loss
from memcalc.engine.program import Dims, Program, Role, free, new, release

S, O, G, T = Role.saved, Role.output, Role.gradient, Role.temporary
F32 = "float32"


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def head_dims(d: Dims) -> tuple[int, int]:
    """(padded head dim, kernel-rounded head dim): ``round8(D)`` (``attention.cpp``
    ``pad_last_dim<8>``) and that rounded to 32 (<= 128) or 64 (``flash_api.cpp``)."""
    padded = round_up(d.D, 8)
    return padded, round_up(padded, 32 if padded <= 128 else 64)


def num_splits_heuristic(bnm: int, num_sms: int, num_n_blocks: int, max_splits: int) -> int:
    """``flash_api.cpp`` ``num_splits_heuristic``, in the float32 arithmetic of the C++:
    the fewest splits of the key dimension that reach 85 % of the best wave efficiency."""
    import numpy as np  # here, not at the top: every CLI start-up imports this module

    f32 = np.float32
    if f32(bnm) >= f32(0.8) * f32(num_sms):
        return 1
    max_splits = min(max_splits, num_sms, num_n_blocks)

    def eligible(s: int) -> bool:
        return s == 1 or ceil(num_n_blocks / s) != ceil(num_n_blocks / (s - 1))

    efficiency = []
    for s in range(1, max_splits + 1):
        waves = f32(bnm * s) / f32(num_sms)
        efficiency.append(f32(float(waves) / ceil(float(waves))) if eligible(s) else f32(0))
    best = max(efficiency, default=f32(0))
    for s in range(1, max_splits + 1):
        if eligible(s) and float(efficiency[s - 1]) >= 0.85 * float(best):
            return s
    return 1


def num_splits(d: Dims, gpu: Gpu) -> int:
    """Splits of ``mha_fwd`` (``set_params_splitkv`` with ``num_splits=0``): 128 threads
    per block, so twice the SMs; key block 256 / 128 / 64 by head dim; 64 query rows."""
    padded, _ = head_dims(d)
    block_n = 256 if padded <= 64 else (128 if padded <= 128 else 64)
    bnm = d.B * d.H * ceil(d.N / 64)
    return num_splits_heuristic(bnm, 2 * gpu.sm_count, ceil(d.M / block_n), 128)


MAX_HEAD_DIM = 256  # sdp_utils.cpp check_head_dim_size_flash (also memcalc.impls.sdpa_select)


def accepted(d: Dims) -> tuple[Accepted, ...]:
    """The head dims FlashAttention takes: up to 256 (others are padded to a multiple of 8,
    ``pads``); ``check`` refuses the rest, a search probes only these."""
    return (Accepted("head_dim", most=MAX_HEAD_DIM, kernel="FlashAttention",
                     most_source="sdp_utils.cpp check_head_dim_size_flash"),)


def check(d: Dims, gpu: Gpu) -> None:
    """What ``sdp_utils.cpp`` / ``mha_fwd`` accept; torch picks another backend otherwise."""
    if gpu.compute_capability < (8, 0):
        raise ValueError(f"--gpu: sdpa-flash: FlashAttention needs compute capability 8.0 or "
                         f"newer, not {cc_text(gpu)} (flash_api.cpp mha_fwd is_sm80_or_newer)")
    if d.dtype == F32:
        raise ValueError("--dtype: sdpa-flash: FlashAttention supports fp16 and bf16 only "
                         "(flash_api.cpp mha_fwd); torch would pick another backend for fp32")
    for rule in accepted(d):
        rule.refuse("sdpa-flash", d.D)
    if d.causal and d.N != d.M:
        raise ValueError("--kv-len: sdpa-flash: causal attention with kv_len != seq_len is not "
                         "dispatched to flash (sdp_utils.cpp check_flash_causal_non_square_seqlens)")


def cc_text(gpu: Gpu) -> str:
    """The device's compute capability as written: ``7.5``."""
    return ".".join(map(str, gpu.compute_capability))


def pads(d: Dims, shape=None) -> list:
    """``pad_last_dim<8>`` of q, k, v: new tensors only when D % 8 != 0, saved by the node;
    ``shape(rows, heads, width)``: their layout, (B, H, N, dp) unless given (the flash-attn
    packages' ``F.pad`` keeps theirs: ``flash_attn.seq_first``)."""
    padded, _ = head_dims(d)
    if padded == d.D:
        return []
    shape = shape or (lambda rows, heads, width: (d.B, heads, rows, width))  # (B, H, N, dp)
    return [new("q_pad", shape(d.N, d.H, padded), d.dtype, S, "constant_pad_nd"),
            new("k_pad", shape(d.M, d.Hk, padded), d.dtype, S, "constant_pad_nd"),
            new("v_pad", shape(d.M, d.Hk, padded), d.dtype, S, "constant_pad_nd")]


def split_accumulators(d: Dims, gpu: Gpu) -> list:
    """``set_params_splitkv``: float32 partial results of each key split, kept alive until
    ``mha_fwd`` returns (allocated before the rng state)."""
    splits = num_splits(d, gpu)
    if splits <= 1:
        return []
    _, rounded = head_dims(d)
    return [
        new("lse_accum", (splits, d.B, d.H, d.N), F32, T, "empty"),  # (S, B, H, N)
        new("out_accum", (splits, d.B, d.H, d.N, rounded), F32, T, "empty"),  # (S, B, H, N, dr)
    ]


def forward(d: Dims, gpu: Gpu, on: str) -> list:
    """The forward; ``on="meta"`` gives what the meta registrations allocate (no kernel
    internals), for checking the autograd skeleton on the meta device."""
    padded, _ = head_dims(d)
    accum = split_accumulators(d, gpu) if on == "cuda" else []
    saved = [t.name for t in pads(d)] + ["lse", "rng_state", "philox_offset"]
    return pads(d) + [
        new("out", (d.B, d.N, d.H, padded), d.dtype, O, "empty_like"),  # (B, N, H, dp), q's layout
        new("lse", (d.B, d.H, d.N), F32, S, "empty"),  # (B, H, N) softmax_lse
        *accum,
        new("rng_state", (2,), "uint64", S, "empty"),  # (2,) philox seed, offset: 512-B block
        new("philox_offset", (), "uint64", S, "empty"),  # () mha_fwd's _unused: 512-B block
        *([free(*(t.name for t in accum))] if accum else []),
        free(*saved),  # autograd holds them (output, lse, rng_state, philox_offset, padded qkv)
    ]


def copies(d: Dims, grad_copy: bool | None = None, out_copy: bool | None = None) -> list:
    """``_flash_attention_backward``: ``.contiguous()`` of the ``(B, N, H, dp)`` views of
    grad and out. A (B, H, N, dp)-contiguous tensor transposed is contiguous only when
    H == 1 or N == 1; out.sum()'s grad (unpadded) is a stride-0 expand: always a copy.
    ``grad_copy`` / ``out_copy``: the decision read off real tensors' strides (the tracer
    passes them for layouts other than the protocol's); None: the protocol's layout."""
    padded, _ = head_dims(d)
    transposed = d.H > 1 and d.N > 1
    if grad_copy is None:
        grad_copy = transposed or (d.loss == "sum" and padded == d.D)
    if out_copy is None:
        out_copy = transposed
    shape = (d.B, d.N, d.H, padded)
    return ([new("dout_t", shape, d.dtype, T, "contiguous")] if grad_copy else []) + (
        [new("out_t", shape, d.dtype, T, "contiguous")] if out_copy else [])


def mha_bwd_buffers(d: Dims) -> list:
    """``mha_bwd``'s float32 buffers (non-deterministic path) and the GQA expansions."""
    padded, rounded = head_dims(d)
    rows = round_up(d.N, 128)
    events = [
        new("softmax_d", (d.B, d.H, rows), F32, T, "empty"),  # (B, H, round128(N))
        new("dq_accum", (d.B, rows, d.H, rounded), F32, T, "empty"),  # (B, round128(N), H, dr)
    ]
    if d.Hk != d.H:
        events += [
            new("dk_expanded", (d.B, d.M, d.H, padded), d.dtype, T, "empty"),  # (B, M, H, dp)
            new("dv_expanded", (d.B, d.M, d.H, padded), d.dtype, T, "empty"),  # (B, M, H, dp)
        ]
    return events


def grads(d: Dims, role: Role) -> list:
    """dq, dk, dv: ``empty_like`` of the transposed views, so q's and k's own layout."""
    padded, _ = head_dims(d)
    return [
        new("dq", (d.B, d.N, d.H, padded), d.dtype, role, "empty_like"),  # (B, N, H, dp)
        new("dk", (d.B, d.M, d.Hk, padded), d.dtype, role, "empty_like"),  # (B, M, Hk, dp)
        new("dv", (d.B, d.M, d.Hk, padded), d.dtype, role, "empty_like"),  # (B, M, Hk, dp)
    ]


def unpad_grads(d: Dims) -> list:
    """``ConstantPadNdBackward0`` (negative pad: a contiguous clone), latest node first:
    v, k, then q; each clone becomes the leaf's grad as is."""
    events = []
    for name, heads, rows in (("v", d.Hk, d.M), ("k", d.Hk, d.M), ("q", d.H, d.N)):
        events += [new(f"{name}.grad", (d.B, heads, rows, d.D), d.dtype, G, "constant_pad_nd"),
                   free(f"d{name}")]  # (B, heads, rows, D)
    return events


def backward(d: Dims, on: str, grad_copy: bool | None = None,
             out_copy: bool | None = None) -> list:
    """SliceBackward0 when padded, the flash backward node, the pads' backward
    (``grad_copy``, ``out_copy``: see ``copies``)."""
    padded, _ = head_dims(d)
    pad = padded != d.D
    layout = copies(d, grad_copy, out_copy) if on == "cuda" else []
    buffers = mha_bwd_buffers(d) if on == "cuda" else []
    events = [new("dout_pad", (d.B, d.H, d.N, padded), d.dtype, T, "slice_backward")] if pad else []
    events += layout + grads(d, T if pad else G) + buffers  # (B, H, N, dp) zeros + grad
    if layout or buffers:  # mha_bwd, then _flash_attention_backward return
        events.append(free(*(t.name for t in buffers + layout)))
    events.append(release(*[t.name for t in pads(d)], "lse", "rng_state", "philox_offset"))
    return events + ([free("dout_pad")] + unpad_grads(d) if pad else [])


def program(d: Dims, gpu: Gpu | None = None, on: str = "cuda") -> Program:
    """The step on ``gpu`` (default: ``gpu_of(d)``); ``on="meta"`` drops what only the CUDA
    kernels allocate, leaving what the meta registrations and autograd do."""
    gpu = gpu or gpu_of(d)
    check(d, gpu)
    return Program(tuple(forward(d, gpu, on)), tuple(with_loss(d, backward(d, on))))


@register("sdpa-flash", "SDPA FlashAttention-2 backend: saves the (B, H, N) logsumexp",
          gqa=True, traced=False, accepted=accepted)
def sdpa_flash(d: Dims) -> Program:
    """Saved: logsumexp, rng_state, philox_offset (and padded q, k, v when D % 8 != 0); backward:
    layout copies of grad and out, dq, dk, dv, float32 softmax_d and dq_accum."""
    return program(d)
