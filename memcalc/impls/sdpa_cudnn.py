"""What PyTorch allocates around a cuDNN attention call (``SDPBackend.CUDNN_ATTENTION``).

The tensors PyTorch makes itself are modelled from ``aten/src/ATen/native/transformers/
cuda/attention.cu`` / ``attention_backward.cu`` and ``aten/src/ATen/native/cudnn/MHA.cpp``
(shapes agree with the meta registration, ``torch/_meta_registrations.py``):

* forward: the philox seed and offset (one int64 each, on the device, with or without
  dropout: measured on an H200 with torch 2.11, and what the meta registration of 2.12 and
  2.13 allocates), then ``o`` with q's layout (``alloc_with_matching_layout``) and the
  softmax statistics ``(B, H, N, 1)`` float32 when a grad is needed; all but ``o`` saved;
* backward: ``dq, dk, dv`` with q's, k's, v's layouts, and ``grad_out`` permuted to o's
  layout when its strides differ (a copy).

cuDNN sizes its own workspace at run time (``mha_graph->get_workspace_size()``, allocated
through the caching allocator, so it counts). It cannot be read from a source file: it is a
parameter, ``Workspace``, whose default is what an H200 measured (torch 2.11 and its cuDNN,
bf16 and fp16, B=2, H=4, d=64, N=1,024 and 4,096, causal or not;
``validation/results/``): 256 B in the forward, and in the backward a float32 dQ
accumulator (B, H, N, d) plus float32 row statistics (B, H, N) plus 256 B, what cuDNN's
non-deterministic SDPA backward keeps in its workspace; with grouped key/value heads, dK and
dV at every query head too (``full_head_grads``, as an H100 measured with Llama's GQA).
Other shapes, head dims and cuDNN releases are that formula's extrapolation, not
measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

from memcalc.engine.program import ITEMSIZE, Dims, Program, Role, free, new, release
from memcalc.impls.accepted import Accepted
from memcalc.impls.common import with_loss
from memcalc.impls.registry import register

S, O, T, G = Role.saved, Role.output, Role.temporary, Role.gradient
F32 = "float32"


@dataclass(frozen=True)
class Workspace:
    """cuDNN workspace sizes in bytes; None: the default, as an H200 measured."""

    forward: int | None = None
    backward: int | None = None

    def forward_bytes(self, d: Dims) -> int:
        return MEASURED_EXTRA if self.forward is None else self.forward

    def backward_bytes(self, d: Dims) -> int:
        if self.backward is not None:
            return self.backward
        # dQ accumulator + row statistics, float32, and 256 B (H200, torch 2.11)
        return (d.B * d.H * d.N * d.D * 4 + d.B * d.H * d.N * 4 + full_head_grads(d)
                + MEASURED_EXTRA)


def full_head_grads(d: Dims) -> int:
    """Grouped key/value heads: cuDNN's backward computes dK and dV at every query head,
    in q's dtype, and sums each group into dk, dv (``dK_fullhead``, ``dV_fullhead``,
    (B, H, M, d) each: cudnn-frontend's ``CompositeSDPABackwardNode``,
    include/cudnn_frontend/node/scaled_dot_product_flash_attention.h); the workspace holds
    them. Measured on an H100 (torch 2.11): Llama's 4 query heads over 2 key/value heads,
    d = 64, bf16, exactly this much more than the formula without them."""
    return 0 if d.Hk == d.H else 2 * d.B * d.H * d.M * d.D * ITEMSIZE[d.dtype]


MEASURED_EXTRA = 256  # what cuDNN asked for beyond the formula in every shape measured
DEFAULT_NOTE = ("cuDNN workspace: cuDNN sizes it at run time; taken as measured on an H200 "
                "(torch 2.11): 256 B forward, (B*H*N*d + B*H*N) x 4 B + 256 B backward "
                "(+ 2 x B*H*M*d x dtype size with grouped key/value heads), "
                "extrapolated to other shapes (--cudnn-workspace sets it)")


def forward(d: Dims, grad: bool, ws: Workspace) -> list:
    """Seed and offset (with or without dropout), o, the softmax statistics, the forward
    workspace."""
    rng = ["seed", "offset"]
    work = ws.forward_bytes(d)
    saved = (["lse"] if grad else []) + rng
    return [
        *(new(name, (), "int64", S, "empty") for name in rng),  # () philox seed, offset
        new("out", (d.B, d.H, d.N, d.D), d.dtype, O, "empty"),  # (B, H, N, d), q's layout
        *([new("lse", (d.B, d.H, d.N, 1), F32, S, "empty")] if grad else []),  # (B, H, N, 1)
        *([new("cudnn_workspace", (work,), "uint8", T, "allocate"), free("cudnn_workspace")]
          if work else []),
        *([free(*saved)] if saved else []),
    ]


def grad_copied(grad_strides: tuple) -> bool:
    """Whether ``run_cudnn_SDP_bprop`` copies the output's grad to the output's layout
    (``permute_to_matching_layout``, ``aten/src/ATen/native/cudnn/MHA.cpp``): with cuDNN
    9.5.1 and later only when its innermost stride is not 1, as the stride-0 expand of
    ``out.sum()``'s grad; a grad of other strides is read as it is (measured on an H100,
    torch 2.11+cu130: a (B, N, H, d)-strided grad against a (B, H, N, d) output, no copy).
    Built against an older cuDNN (``CUDNN_VERSION < 90501``) torch copies on any stride
    difference of the dims longer than 1 (not modelled)."""
    return grad_strides[-1] != 1


def backward(d: Dims, grad_copy: bool, ws: Workspace, grads: Role = T) -> list:
    """``_cudnn_attention_backward``: the grad permuted to o's layout, dq, dk, dv (``grads``:
    their role; a trace tells the leaves' grads itself), the workspace; then autograd
    releases the statistics (and seed, offset)."""
    work = ws.backward_bytes(d)
    copy = [new("dout_t", (d.B, d.H, d.N, d.D), d.dtype, T, "permute")] if grad_copy else []
    ends = ([t.name for t in copy] + (["cudnn_workspace"] if work else []))
    return copy + [
        new("dq", (d.B, d.H, d.N, d.D), d.dtype, grads, "empty_like"),  # (B, H, N, d)
        new("dk", (d.B, d.Hk, d.M, d.D), d.dtype, grads, "empty_like"),  # (B, Hk, M, d)
        new("dv", (d.B, d.Hk, d.M, d.D), d.dtype, grads, "empty_like"),  # (B, Hk, M, d)
        *([new("cudnn_workspace", (work,), "uint8", T, "allocate")] if work else []),
        *([free(*ends)] if ends else []),
        release("lse", "seed", "offset"),
    ]


# --- sdpa-cudnn: the protocol's step on the cuDNN backend --------------------------------------

def head_dim_limit(d_qk: int, d_v: int, cc, torch: tuple = (2, 13), cudnn_version: int = 92000,
                   frontend_d256: bool = False) -> int:
    """The largest head dim ``check_cudnn_tensor_shapes`` takes: 128 to 2.7; 256 on sm90
    with cuDNN > 9.5 (2.8) or >= 9.10 (2.9 to 2.13); the (192, 128) pair with cuDNN >= 9.11
    (2.11); from 2.14, 256 on sm90/10x with cuDNN > 9.22 and a frontend that has it. The
    default: torch 2.13 with its wheel's cuDNN 9.20 (``memcalc.impls.sdpa_select``
    passes each release's)."""
    sm90 = (cc[0] == 9 and cc[1] == 0) or cc[0] == 10
    torch = tuple(torch)[:2]
    if torch >= (2, 14):
        sm107_old = tuple(cc) == (10, 7) and cudnn_version <= 92500
        if sm90 and not sm107_old and cudnn_version > 92200 and frontend_d256:
            return 256
    elif torch >= (2, 9) and tuple(cc) == (9, 0) and cudnn_version >= 91000:
        return 256
    elif torch == (2, 8) and cc[0] == 9 and cudnn_version > 90500:
        return 256
    if torch >= (2, 11) and sm90 and cudnn_version >= 91100 and (d_qk, d_v) == (192, 128):
        return 192
    return 128


def accepted(d: Dims) -> tuple[Accepted, ...]:
    most = head_dim_limit(d.D, d.D, d.compute_capability)
    return (Accepted("head_dim", step=8, most=most, kernel="cuDNN attention",
                     step_source="sdp_utils.cpp check_cudnn_tensor_shapes",
                     most_source="sdp_utils.cpp check_cudnn_tensor_shapes, torch 2.13"),)


def check(d: Dims) -> None:
    """What ``can_use_cudnn_attention`` (torch 2.13) refuses."""
    cc = tuple(d.compute_capability)
    if not (8, 0) <= cc <= (12, 1):
        raise ValueError(f"--gpu: sdpa-cudnn: cuDNN attention needs compute capability 8.0 to "
                         f"12.1, not {cc[0]}.{cc[1]} (sdp_utils.cpp check_cudnn_hardware_support)")
    if d.dtype == F32:
        raise ValueError("--dtype: sdpa-cudnn: cuDNN attention takes fp16 and bf16 only "
                         "(sdp_utils.cpp check_dtypes_low_precision)")
    if d.deterministic and not d.forward_only:
        raise ValueError("--deterministic: sdpa-cudnn: torch (2.5 on) does not run cuDNN "
                         "attention under deterministic algorithms (check_cudnn_deterministic)")
    for rule in accepted(d):
        rule.refuse("sdpa-cudnn", d.D)


@register("sdpa-cudnn", "SDPA cuDNN backend: saves the (B, H, N, 1) statistics; cuDNN's "
          "own workspace as measured", gqa=True, traced=False, accepted=accepted,
          source="PyTorch's CUDA kernel sources, cuDNN's workspace as an H200 measured "
                 "(torch 2.11, d=64) and extrapolated")
def sdpa_cudnn(d: Dims) -> Program:
    """Saved: the float32 statistics; backward: dq, dk, dv, the grad in o's layout when its
    strides differ (``out.sum()``'s expand), and cuDNN's workspace as ``Workspace``
    gives it (measured on an H200; cuDNN sizes it at run time)."""
    check(d)
    grad = not d.forward_only
    ws = Workspace()
    return Program(tuple(forward(d, grad, ws)),
                   tuple(with_loss(d, backward(d, d.loss == "sum", ws, G))))
