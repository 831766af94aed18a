"""``memcalc.tracing.kernels``: fused SDPA kernels replayed from memcalc's models."""

import pytest

torch = pytest.importorskip("torch")

from memcalc.engine.dims import Dims  # noqa: E402
from memcalc.gpus import gpu_preset  # noqa: E402
from memcalc.tracing.cuda_paths import CudaPaths  # noqa: E402
from memcalc.impls.sdpa_cudnn import DEFAULT_NOTE, Workspace  # noqa: E402
from memcalc.tracing.kernels import Kernel, dims_of, run  # noqa: E402
from memcalc.impls.sdpa_select import CUDNN, EFFICIENT, FLASH, Call  # noqa: E402
from memcalc.tracing.tracer import Tracer  # noqa: E402

B, H, N = 1, 2, 8  # every call here: (1, 2, 8, d), meta tensors only
GPU_OF = {FLASH: "a100-40gb", EFFICIENT: "a100-40gb", CUDNN: "h100-80gb"}
DTYPE_OF = {FLASH: "float16", EFFICIENT: "float32", CUDNN: "bfloat16"}


def paths_on(gpu: str, workspace: Workspace = Workspace()) -> CudaPaths:
    paths = CudaPaths(gpu_preset(gpu), workspace=workspace)
    paths.tracer = Tracer(0, None, paths)
    return paths


def qkv(d: int, dtype: str, grad: bool = True, heads_kv: int = H):
    """Contiguous (B, H, N, d) q and (B, Hk, N, d) k, v on the meta device."""
    def make(heads):
        return torch.empty(B, heads, N, d, dtype=getattr(torch, dtype), device="meta",
                           requires_grad=grad)

    return make(H), make(heads_kv), make(heads_kv)


def call_of(q, k, v, **change) -> Call:
    return Call(tuple(q.shape), tuple(k.shape), tuple(v.shape),
                str(q.dtype).removeprefix("torch."), requires_grad=q.requires_grad, **change)


def log(tracer: Tracer, start: int = 0) -> list[str]:
    """The tracer's events from ``start``: ``+name bytes`` per allocation (the model's name,
    without the source location), ``-name`` per free."""
    names, lines = {}, []
    for i, event in enumerate(tracer.events):
        if event[0] == "alloc":
            names[event[1]] = event[2].name.split(" (")[0]
            lines.append((i, f"+{names[event[1]]} {event[2].bytes}"))
        elif event[0] == "free":
            lines.append((i, f"-{names[event[1]]}"))
    return [line for i, line in lines if i >= start]


def test_dims_of_reads_query_sizes_from_q_key_sizes_from_k_and_the_device_from_the_gpu():
    call = Call((2, 8, 16, 64), (2, 2, 24, 64), (2, 2, 24, 64), "bfloat16", is_causal=True,
                requires_grad=False)
    h100 = gpu_preset("h100-80gb")
    assert dims_of(call, h100) == Dims(B=2, H=8, N=16, M=24, D=64, dtype="bfloat16",
                                       causal=True, loss="grad", Hk=2, chunk=64,
                                       forward_only=True, sm_count=132,
                                       compute_capability=(9, 0))


@pytest.mark.parametrize("backend, stride", [
    # (B, H, N, d) = (1, 2, 8, 16); q contiguous: (H*N*d, N*d, d, 1) = (256, 128, 16, 1)
    (FLASH, (256, 128, 16, 1)),  # empty_like(q): q's layout
    (EFFICIENT, (256, 16, 32, 1)),  # always (B, N, H, d)-contiguous: (N*H*d, d, H*d, 1)
    (CUDNN, (256, 128, 16, 1)),  # alloc_with_matching_layout: q's
])
def test_output_and_grads_have_the_layout_the_cuda_kernel_gives_them(backend, stride):
    """The output and dq, dk, dv are real tensors with the kernel's strides, so autograd's
    next step (an AccumulateGrad copy or none) is what a GPU does."""
    paths = paths_on(GPU_OF[backend])
    q, k, v = qkv(16, DTYPE_OF[backend])
    kernel = Kernel(backend, dims_of(call_of(q, k, v), paths.gpu), call_of(q, k, v), paths,
                    q.detach(), k.detach(), v.detach())
    with paths.tracer:
        out = kernel.forward()
        assert (tuple(out.shape), out.stride()) == ((1, 2, 8, 16), stride)
        grads = kernel.backward(torch.empty_like(out))
    assert [g.stride() for g in grads] == [stride] * 3


def test_forward_only_call_allocates_no_statistics_and_keeps_nothing_but_the_output():
    """No grad: cuDNN computes no softmax statistics; the dropout seed and offset die
    inside the call (nothing is saved)."""
    paths = paths_on("h100-80gb")
    q, k, v = qkv(16, "bfloat16", grad=False)
    with paths.tracer:
        out = run(CUDNN, q, k, v, call_of(q, k, v, dropout=0.125))
    # seed, offset: one int64 each, first; out: 1 x 2 x 8 x 16 x 2 B = 512 B; the forward
    # workspace, 256 B (as an H200 measured), freed in the call
    assert log(paths.tracer) == ["+cudnn seed 8", "+cudnn offset 8", "+cudnn out 512",
                                 "+cudnn cudnn_workspace 256", "-cudnn cudnn_workspace",
                                 "-cudnn seed", "-cudnn offset"]
    assert out.grad_fn is None


def test_saved_tensors_live_until_the_backward_and_the_workspace_only_inside_it():
    """cuDNN with dropout in training: the statistics, seed and offset outlive the forward
    (autograd holds them); the backward's dq, dk, dv become the leaves' grads as they are
    (q's layout: no AccumulateGrad copy) and the workspace dies with the call."""
    paths = paths_on("h100-80gb")
    q, k, v = qkv(16, "bfloat16")
    with paths.tracer:
        out = run(CUDNN, q, k, v, call_of(q, k, v, dropout=0.125))
        live = sorted(c.component.name.split(" (")[0] for c in paths.tracer.ledger.live.values())
        assert live == ["cudnn lse", "cudnn offset", "cudnn out", "cudnn seed"]
        start = len(paths.tracer.events)
        out.backward(out.detach())  # a grad of o's own strides: no permute copy
    # dq, dk, dv: 1 x 2 x 8 x 16 x 2 B = 512 B each; workspace (B*H*N*d + B*H*N) x 4 B
    # + 256 B = (256 + 16) x 4 + 256 B = 1344 B; lse (1, 2, 8, 1) float32 released with seed
    # and offset
    assert log(paths.tracer, start) == [
        "+cudnn dq 512", "+cudnn dk 512", "+cudnn dv 512", "+cudnn cudnn_workspace 1344",
        "-cudnn cudnn_workspace", "-cudnn seed", "-cudnn offset", "-cudnn lse"]  # as made
    assert [t.grad.untyped_storage().nbytes() for t in (q, k, v)] == [512] * 3


def test_cudnn_copies_grad_out_only_when_its_innermost_stride_is_not_one():
    """run_cudnn_SDP_bprop (cuDNN 9.5.1 on) permutes grad_out to o's layout only when its
    innermost stride is not 1: a grad of o's strides and a (B, N, H, d)-strided one against
    the (B, H, N, d) output are read as they are (the latter measured on an H100 under
    DeepSpeed's Ulysses for Hugging Face models); out.sum()'s stride-0 expand is copied
    (1 x 2 x 8 x 16 x 2 B = 512 B)."""
    paths = paths_on("h100-80gb")
    q, k, v = qkv(16, "bfloat16")
    copies = []
    expanded = torch.empty((), dtype=torch.bfloat16, device="meta").expand(1, 2, 8, 16)
    for grad_out in (torch.empty(1, 2, 8, 16, dtype=torch.bfloat16, device="meta"),
                     torch.empty(1, 8, 2, 16, dtype=torch.bfloat16, device="meta").transpose(1, 2),
                     expanded):
        kernel = Kernel(CUDNN, dims_of(call_of(q, k, v), paths.gpu), call_of(q, k, v), paths,
                        q.detach(), k.detach(), v.detach())
        with paths.tracer:
            kernel.forward()
            start = len(paths.tracer.events)
            kernel.backward(grad_out)
        copies.append([line for line in log(paths.tracer, start) if "dout_t" in line])
    assert copies == [[], [], ["+cudnn dout_t 512", "-cudnn dout_t"]]


def test_padded_flash_saves_the_padded_copies_and_releases_them_before_unpadding():
    """attention.cpp pad_last_dim<8>: d=20 runs as 24, padded by visible constant_pad_nd
    ops before the flash op (which saves the padded q, k, v and output, not the user's),
    the output sliced back; SliceBackward0 hands the node a (B, H, N, 24)-contiguous grad,
    so the kernel copies it whatever the layout of the grad given (here (B, N, H, d)); the
    flash node's saved tensors are released before ConstantPadNdBackward0 makes the leaves'
    grads."""
    paths = paths_on("a100-40gb")
    q, k, v = qkv(20, "float16")
    with paths.tracer:
        out = run(FLASH, q, k, v, call_of(q, k, v))
        # a slice of the (1, 2, 8, 24)-contiguous output: (2*8*24, 8*24, 24, 1)
        assert (tuple(out.shape), out.stride()) == ((1, 2, 8, 20), (384, 192, 24, 1))
        assert out.untyped_storage().nbytes() == 768  # 1 x 2 x 8 x 24 x 2 B
        flash = out.grad_fn.next_functions[0][0]
        assert (out.grad_fn.name(), flash.name()) == (
            "SliceBackward0", "ScaledDotProductFlashAttentionBackward0")
        saved = {name: tuple(flash.__getattribute__(f"_saved_{name}").shape)
                 for name in ("query", "key", "value", "output")}
        assert saved == dict.fromkeys(saved, (1, 2, 8, 24))
        grad_out = torch.empty(1, 8, 2, 20, dtype=torch.float16, device="meta").transpose(1, 2)
        start = len(paths.tracer.events)
        out.backward(grad_out)
    padded = 768  # (1, 2, 8, 24) x 2 B: dout_pad, dout_t, out_t, dq, dk, dv alike
    assert log(paths.tracer, start) == [
        f"+slice_backward {padded}", f"+flash dout_t {padded}", f"+flash out_t {padded}",
        f"+flash dq {padded}", f"+flash dk {padded}", f"+flash dv {padded}",
        "+flash softmax_d 1024",  # (1, 2, round128(8) = 128) x 4 B
        "+flash dq_accum 32768",  # (1, 128, 2, round32(24) = 32) x 4 B
        # mha_bwd returns (frees are taken in allocation order), then the release of the
        # padded q, k, v, logsumexp and philox tensors, then of the node's input grad
        "-flash dout_t", "-flash out_t", "-flash softmax_d", "-flash dq_accum",
        "-constant_pad_nd", "-constant_pad_nd", "-constant_pad_nd", "-flash lse",
        "-flash rng_state", "-flash philox_offset", "-slice_backward",
        # ConstantPadNdBackward0, latest first: (1, 2, 8, 20) x 2 B = 640 B each
        "+constant_pad_nd 640", "-flash dv", "+constant_pad_nd 640", "-flash dk",
        "+constant_pad_nd 640", "-flash dq"]


def test_run_notes_the_cudnn_workspace_it_assumes_or_was_given():
    notes = []
    for workspace in (Workspace(), Workspace(None, 4096), Workspace(1024, 4096)):
        paths = paths_on("h100-80gb", workspace)
        q, k, v = qkv(16, "bfloat16", grad=False)
        with paths.tracer:
            run(CUDNN, q, k, v, call_of(q, k, v))
        notes += list(paths.notes)
    assert notes == [DEFAULT_NOTE, "cuDNN workspace: 0 B forward, 4096 B backward (as given)",
                     "cuDNN workspace: 1024 B forward, 4096 B backward (as given)"]


def test_efficient_refuses_grouped_heads_and_notes_its_dropout_workspace():
    paths = paths_on("a100-40gb")
    q, k, v = qkv(16, "float32", heads_kv=1)
    with paths.tracer, pytest.raises(ValueError) as error:
        run(EFFICIENT, q, k, v, call_of(q, k, v, enable_gqa=True))
    assert str(error.value) == (
        "scaled_dot_product_attention: the efficient backend with grouped key/value heads "
        "is not modelled (memcalc's sdpa-efficient)")
    q, k, v = qkv(16, "float32", grad=False)
    with paths.tracer:
        run(EFFICIENT, q, k, v, call_of(q, k, v, dropout=0.5))
    assert list(paths.notes) == [
        "efficient backend with dropout: its backward kernel's workspace is modelled for the "
        "no-dropout kernels (kernels/cutlassB.h)"]


def test_a_value_head_dim_unlike_the_querys_is_refused_in_one_line():
    """Efficient (and cuDNN at 192/128) accept it; the output is then v's width, which the
    programs, with one head dim, cannot give: refused, not traced with the wrong shape."""
    paths = paths_on("a100-40gb")
    q, k, _ = qkv(16, "float32")
    v = torch.empty(B, H, N, 8, dtype=torch.float32, device="meta", requires_grad=True)
    with paths.tracer, pytest.raises(ValueError) as error:
        run(EFFICIENT, q, k, v, call_of(q, k, v))
    assert str(error.value) == (
        "scaled_dot_product_attention: a value head dim (8) unlike the query's (16) is not "
        "modelled for the efficient backend")


# --- what checkpointing sees --------------------------------------------------------------
# (B, H, N, d) = (1, 2, 1024, 64) in half precision; the op's outputs, each its own block:
OUT = 1 * 2 * 1024 * 64 * 2  # 262,144 B, out (and the relu after it: the step's output)
LSE = 1 * 2 * 1024 * 4  # 8,192 B: (B, H, N) float32 logsumexp ((B, H, N, 1) for cuDNN; the
#   efficient kernel's (B, H, ceil32(N)) is as long at N = 1024)
PHILOX = 2 * 512  # flash's rng_state (2,) uint64 and unused (), cuDNN's seed and offset ():
#   one 512-B block each; the efficient kernel makes its philox scalars on the CPU
SAVED_BY_THE_OP = {CUDNN: OUT + LSE + PHILOX, FLASH: OUT + LSE + PHILOX, EFFICIENT: OUT + LSE}
OP_OF = {CUDNN: torch.ops.aten._scaled_dot_product_cudnn_attention.default,
         FLASH: torch.ops.aten._scaled_dot_product_flash_attention.default,
         EFFICIENT: torch.ops.aten._scaled_dot_product_efficient_attention.default}
SDP_BACKEND = {CUDNN: "CUDNN_ATTENTION", FLASH: "FLASH_ATTENTION",
               EFFICIENT: "EFFICIENT_ATTENTION"}


def checkpointed(backend: str, policy=None):
    """``sdpa(q, k, v).relu()`` on ``backend`` under non-reentrant checkpointing: selective
    with ``policy`` (torch.utils.checkpoint's ``create_selective_checkpoint_contexts``), or
    full without one."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    def attn(q, k, v):
        with sdpa_kernel([getattr(SDPBackend, SDP_BACKEND[backend])]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).relu()

    def step(q, k, v):
        if policy is None:
            return checkpoint(attn, q, k, v, use_reentrant=False)
        return checkpoint(attn, q, k, v, use_reentrant=False,
                          context_fn=lambda: create_selective_checkpoint_contexts(policy))
    return step


def traced_saved(fn, backend: str) -> int:
    import memcalc

    return memcalc.trace(fn, seq_len=1024, batch=1, heads=2, head_dim=64,
                         dtype="fp16" if backend != CUDNN else "bf16",
                         gpu=GPU_OF[backend] if backend != CUDNN else "h100-80gb").saved_bytes


@pytest.mark.parametrize("backend", [CUDNN, FLASH, EFFICIENT])
def test_a_selective_checkpoint_policy_is_asked_about_the_op_and_saves_its_outputs(backend):
    """The policy is asked about the fused op itself (as torchtitan's SelectiveAC names
    aten._scaled_dot_product_cudnn_attention); not saved, nothing of it outlives the
    forward; saved, its outputs are what the forward leaves behind."""
    asked = []

    def policy(ctx, func, *args, **kwargs):
        from torch.utils.checkpoint import CheckpointPolicy

        asked.append(func)
        return CheckpointPolicy.PREFER_RECOMPUTE

    assert traced_saved(checkpointed(backend, policy), backend) == 0
    assert OP_OF[backend] in asked
    saving = checkpointed(backend, [OP_OF[backend]])
    assert traced_saved(saving, backend) == SAVED_BY_THE_OP[backend]


@pytest.mark.parametrize("backend", [CUDNN, FLASH, EFFICIENT])
def test_full_checkpointing_keeps_nothing_of_the_op(backend):
    """Non-reentrant checkpointing frees every output of the op, its logsumexp and philox
    tensors included (autograd saves them, and checkpointing's hooks drop them)."""
    assert traced_saved(checkpointed(backend), backend) == 0
