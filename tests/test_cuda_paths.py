"""The CUDA dispatch layer of ``memcalc trace``: each rule against the CUDA behaviour it
cites, and traced fused SDPA equal to ``memcalc breakdown`` for the same call."""

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from memcalc.cli import main  # noqa: E402
from memcalc.config import make_config  # noqa: E402
from memcalc.engine.program import Role  # noqa: E402
from memcalc.analysis.predict import predict  # noqa: E402
from memcalc.tracing import (TraceOptions, installed_release, load_function, trace,  # noqa: E402
                             traced)
from memcalc.impls.sdpa_select import Call, Flags, Release, select  # noqa: E402
from memcalc.validation import figures_of  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
META = TraceOptions(cuda=False)


def causal_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


# --- SDPA: traced fused kernels equal memcalc's models --------------------------------

@pytest.mark.parametrize("dtype, impl", [("bf16", "sdpa-flash"), ("fp16", "sdpa-flash"),
                                         ("fp32", "sdpa-efficient")])
def test_traced_causal_sdpa_equals_breakdown_on_a100(dtype, impl):
    """The issue's call, B=4 H=32 N=8192 d=128 on an A100-40GB: every figure equal.

    The kernel's own allocations are the model's on both sides (the tracer replays
    ``memcalc.impls.sdpa_flash`` / ``sdpa_efficient``'s events for the call:
    ``memcalc/tracing/kernels.py``): this checks the backend choice and what surrounds the
    call, not the kernel; the kernels' hand counts are ``test_impls_sdpa_fused.py``'s
    ``test_flash_by_hand`` and ``test_efficient_by_hand``."""
    config = make_config(impl=impl, seq_len=8192, batch=4, heads=32, head_dim=128, dtype=dtype,
                         causal=True, gpu="a100-40gb")
    result = traced(causal_sdpa, config)
    assert figures_of(result.breakdown) == figures_of(predict(config))
    backend = "flash" if impl == "sdpa-flash" else "efficient"
    rules = f"torch {installed_release().text()}'s rules"  # the installed torch's
    assert f"causal, {rules}: {backend} (priority flash > efficient > math > cudnn" in \
        result.notes[0]


@pytest.mark.parametrize("case", [
    dict(impl="sdpa-flash", dtype="bf16", head_dim=20, heads=4),  # padded head dim
    dict(impl="sdpa-flash", dtype="fp16", head_dim=64, heads=8, kv_heads=2),  # GQA
    dict(impl="sdpa-flash", dtype="fp16", head_dim=20, heads=4, loss="sum"),
    dict(impl="sdpa-flash", dtype="fp16", head_dim=64, heads=4, forward_only=True),
    dict(impl="sdpa-flash", dtype="bf16", head_dim=64, heads=4, batch=1, seq_len=300),  # split-KV
    dict(impl="sdpa-efficient", dtype="fp32", head_dim=64, heads=4, loss="sum"),
    dict(impl="sdpa-efficient", dtype="fp32", head_dim=160, heads=1),
])
def test_traced_sdpa_equals_breakdown_across_layouts(case):
    """Layouts, padding, grouped heads, split keys: the model against itself for the kernel
    (as above), checking the choice and the sizes the call passes it."""
    def attn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              enable_gqa=q.size(1) != k.size(1))

    config = make_config(**{"seq_len": 1000, "batch": 2, **case}, causal=True, gpu="a100-40gb")
    assert figures_of(trace(attn, config)) == figures_of(predict(config))


def test_meta_paths_trace_the_math_backend_instead():
    """What the trace did before: the math backend's N x N float32 scores and softmax
    (4 x 32 x 8192^2 x 4 B = 32 GiB each), equal to memcalc's sdpa-math model."""
    config = make_config(impl="sdpa-flash", seq_len=8192, batch=4, heads=32, head_dim=128,
                         dtype="bf16", causal=True, gpu="a100-40gb")
    traced = trace(causal_sdpa, config, META)
    assert traced.forward_peak_bytes > 2 * 32 * 2**30
    assert figures_of(traced) == figures_of(predict(config.replace(impl="sdpa-math")))


def test_h100_prefers_cudnn_unless_deprioritized():
    """check_prefer_cudnn_attention: cc 9.0 with cuDNN > 9.15 puts cuDNN first."""
    call = Call((4, 32, 8192, 128), (4, 32, 8192, 128), (4, 32, 8192, 128), "bfloat16",
                is_causal=True)
    assert select(call, (9, 0), env={}).backend == "cudnn"
    assert select(call, (9, 0), env={"TORCH_CUDNN_SDPA_DEPRIORITIZED": "1"}).backend == "flash"
    assert select(call, (9, 0), release=Release(cudnn_version=91002), env={}).backend == "flash"
    assert select(call, (8, 0), env={}).backend == "flash"  # A100: default order
    config = make_config(impl="sdpa-flash", seq_len=1024, batch=1, heads=4, head_dim=64,
                         dtype="bf16", causal=True, gpu="h100-80gb")
    assert ": cudnn (priority cudnn > flash" in traced(causal_sdpa, config).notes[0]


@pytest.mark.parametrize("change, backend, why", [
    (dict(dtype="float32"), "efficient", "dtype float32"),
    (dict(mask=(1024, 1024)), "efficient", "attn_mask"),
    (dict(k=(2, 8, 512, 64), v=(2, 8, 512, 64)), "efficient", "kv_len != seq_len"),
    (dict(q=(2, 8, 1024, 72), k=(2, 8, 1024, 72), v=(2, 8, 1024, 72)), "flash", None),
    (dict(q=(2, 8, 1024, 288), k=(2, 8, 1024, 288), v=(2, 8, 1024, 288)), "efficient", "256"),
    (dict(k=(2, 2, 1024, 64), v=(2, 2, 1024, 64)), "math", "enable_gqa"),
    (dict(k=(2, 2, 1024, 64), v=(2, 2, 1024, 64), enable_gqa=True), "flash", None),
    (dict(last_strides=(1, 2, 1)), "math", "last dimension"),
])
def test_selection_filters_of_sdp_utils(change, backend, why):
    """select_sdp_backend on an A100 (sm80: priority flash, efficient, math)."""
    base = dict(q=(2, 8, 1024, 64), k=(2, 8, 1024, 64), v=(2, 8, 1024, 64), dtype="float16",
                is_causal=True)
    choice = select(Call(**{**base, **change}), (8, 0), env={})
    assert choice.backend == backend
    assert why is None or why in choice.reason()


def test_sm86_training_head_dim_200_is_not_flash():
    call = Call((1, 4, 512, 200), (1, 4, 512, 200), (1, 4, 512, 200), "float16")
    assert select(call, (8, 6), env={}).backend == "efficient"
    assert select(call, (8, 0), env={}).backend == "flash"


def test_sdpa_kernel_in_user_code_is_respected():
    """torch.nn.attention.sdpa_kernel sets torch.backends.cuda flags, readable on meta."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def attn(q, k, v):
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    config = make_config(impl="sdpa-efficient", seq_len=1000, batch=2, heads=4, head_dim=64,
                         dtype="fp16", causal=True, gpu="a100-40gb")
    result = traced(attn, config)
    assert "efficient" in result.notes[0] and "flash: disabled" in result.notes[0]
    assert figures_of(result.breakdown) == figures_of(predict(config))
    assert select(Call((1, 1, 8, 8), (1, 1, 8, 8), (1, 1, 8, 8), "float16"), (8, 0),
                  Flags(flash=False, efficient=False, math=True, cudnn=True), env={}
                  ).backend == "math"


def test_cudnn_model_and_its_workspace_parameter():
    """cuDNN on an H100: o, (B, H, N, 1) float32 stats; backward dq, dk, dv and the
    workspace, by default (B*H*N*d + B*H*N) x 4 B + 256 B (what an H200 measured)."""
    B, H, N, d = 2, 4, 1024, 64
    config = make_config(impl="sdpa-flash", seq_len=N, batch=B, heads=H, head_dim=d,
                         dtype="bf16", causal=True, gpu="h100-80gb")
    b = trace(causal_sdpa, config)
    saved = {c.name.split(" (")[0]: c for c in b.saved}
    assert saved["cudnn lse"].shape == (B, H, N, 1) and saved["cudnn lse"].dtype == "float32"
    work = [c for c in b.backward_live if c.name.startswith("cudnn cudnn_workspace")]
    assert work[0].bytes == (B * H * N * d + B * H * N) * 4 + 256  # 2,130,176 B, measured
    given = trace(causal_sdpa, config, TraceOptions(workspace=__import__(
        "memcalc.impls.sdpa_cudnn", fromlist=["Workspace"]).Workspace(0, 1 << 20)))
    work = [c for c in given.backward_live if c.name.startswith("cudnn cudnn_workspace")]
    assert work[0].bytes == 1 << 20


# --- softmax, dropout, mask add ----------------------------------------------------------

def _history(fn, config, options=TraceOptions(), entries=False):
    history = []
    result = traced(fn, config, options, history=history)
    allocs = [e for e in history if e.kind == "alloc"]
    return result, allocs if entries else [e.component for e in allocs]


def test_half_to_float_softmax_keeps_no_float32_copy():
    """SoftMax.cpp: fp16 input with dtype=float32 runs _softmax(half_to_float=True)."""
    def attn(q, k, v):
        return F.softmax(q @ k.transpose(-2, -1), dim=-1, dtype=torch.float32).to(q.dtype) @ v

    B, H, N = 1, 2, 512
    config = make_config(impl="naive", seq_len=N, batch=B, heads=H, head_dim=64, dtype="fp16")
    gpu, allocs = _history(attn, config, entries=True)
    meta, meta_allocs = _history(attn, config, META, entries=True)

    def at_softmax(entries):  # allocated bytes right after the measured step's _softmax
        return [e.allocated for e in entries if e.component.op == "_softmax"][-1]

    # the meta path holds the float32 copy beside the scores and the result: B*H*N*N*4 more
    assert at_softmax(meta_allocs) - at_softmax(allocs) == B * H * N * N * 4  # 2 MiB
    allocs, meta_allocs = [e.component for e in allocs], [e.component for e in meta_allocs]

    def f32_copies(cs):  # forward only: the backward's ToCopyBackward0 is legitimate
        return [c for c in cs if c.op == "_to_copy" and c.dtype == "float32"
                and c.role is Role.activation]

    assert not f32_copies(allocs) and f32_copies(meta_allocs)
    assert "half_to_float=True" in " ".join(gpu.notes)


def test_bf16_softmax_with_float32_dtype_is_converted_as_on_cuda():
    def attn(q, k, v):
        return F.softmax(q @ k.transpose(-2, -1), dim=-1, dtype=torch.float32).to(q.dtype) @ v

    config = make_config(impl="naive", seq_len=256, batch=1, heads=2, head_dim=64, dtype="bf16")
    assert figures_of(trace(attn, config)) == figures_of(trace(attn, config, META))


def test_training_dropout_saves_a_bool_mask():
    """Dropout.cpp/Dropout.cu: native_dropout, whose mask (bool) autograd saves."""
    def attn(q, k, v):
        return F.dropout(torch.softmax(q @ k.transpose(-2, -1), -1), 0.1, training=True) @ v

    B, H, N = 1, 2, 512
    config = make_config(impl="naive", seq_len=N, batch=B, heads=H, head_dim=64, dtype="fp16")
    saved = trace(attn, config).saved
    masks = [c for c in saved if c.op == "native_dropout" and c.dtype == "bool"]
    assert [c.bytes for c in masks] == [B * H * N * N]  # one byte per element
    meta_saved = trace(attn, config, META).saved
    assert not [c for c in meta_saved if c.dtype == "bool"]
    assert [c for c in meta_saved if c.op in ("bernoulli", "empty_like", "div")
            and c.dtype == "float16" and c.shape == (B, H, N, N)]


def test_fused_dropout_allocates_its_mask_before_its_output():
    """Dropout.cu, dropout_cuda: ``mask = at::empty_like(self, bool)`` then ``ret =
    at::empty_like(self)``; the meta kernel returns them the other way round, and the order
    decides which cached block each takes (an independent reference's backward peak for
    nanoGPT's manual attention, B=3 H=5 N=777 d=80 fp16, matched the meta order)."""
    def attn(q, k, v):
        return F.dropout(torch.softmax(q @ k.transpose(-2, -1), -1), 0.1, training=True) @ v

    config = make_config(impl="naive", seq_len=64, batch=1, heads=2, head_dim=16, dtype="fp16")
    _, allocs = _history(attn, config)
    dropout = [c.dtype for c in allocs if c.op == "native_dropout"]
    assert dropout[:2] == ["bool", "float16"]  # the warm-up's: mask, then output


def test_math_backend_mask_add_is_in_place(monkeypatch):
    """attention.cpp: attn.add_(*attn_mask), in place on a GPU and on both trace paths;
    out of place under a dispatch mode when the tracer does not make it so."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from memcalc.tracing import tracer as emulated

    def attn(q, k, v):
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    B, H, N = 1, 2, 256
    config = make_config(impl="sdpa-math", seq_len=N, batch=B, heads=H, head_dim=64, causal=True)
    adds = lambda cs: [c for c in cs if c.op == "add" and c.shape == (B, H, N, N)]  # noqa: E731
    assert not adds(_history(attn, config)[1]) and not adds(_history(attn, config, META)[1])
    monkeypatch.setattr(emulated, "is_mask_add", lambda func, args: False)
    assert len(adds(_history(attn, config, META)[1])) == 2  # warm-up and measured step


# --- grad_out, module state, unmodelled -------------------------------------------------

def test_hf_layout_output_traces_with_grad_out_of_its_shape():
    fn = load_function(f"{ROOT}/examples/attention/hf_llama.py:attn")
    B, H, N, d = 1, 4, 256, 64
    config = make_config(impl="naive", seq_len=N, batch=B, heads=H, head_dim=d, dtype="fp16",
                         causal=True)
    b = trace(fn, config)
    grad_out = [c for c in b.forward_live if c.name == "grad_out"]
    assert grad_out[0].shape == (B, N, H, d)


def test_module_parameters_and_buffers_are_resident():
    """nanoGPT's causal bias (1, 1, 16384, 16384) float32 buffer and c_proj's weight."""
    from memcalc.engine.inputs import inputs_of
    from memcalc.tracing import Calling

    fn = load_function(f"{ROOT}/examples/attention/nanogpt.py:SlowCausalSelfAttention")
    config = make_config(impl="naive", seq_len=128, batch=1)
    b = trace(fn, config, calling=Calling(inputs_of(["x=B,N,768"])))
    state = {c.name: c for c in b.forward_live if c.role in (Role.parameter, Role.buffer)}
    assert state["bias"].role is Role.buffer and state["bias"].bytes == 16384 * 16384 * 4
    assert state["c_proj.weight"].role is Role.parameter
    assert state["c_proj.weight"].bytes == 768 * 768 * 4  # float32, as nn.Linear makes it


def test_a_functions_module_level_meta_tensors_are_resident(tmp_path):
    (tmp_path / "glob.py").write_text(
        "import torch\n"
        "TABLE = torch.empty(1000, 1000, device='meta')\n"
        "UNUSED = torch.empty(10, device='meta')\n"
        "def attn(q, k, v):\n"
        "    assert TABLE.shape[0] == 1000  # refers to it: part of its state\n"
        "    return q + v\n")
    fn = load_function(f"{tmp_path}/glob.py:attn")
    b = trace(fn, make_config(impl="naive", seq_len=64, batch=1))
    assert [(c.name, c.role, c.bytes) for c in b.forward_live if c.role is Role.buffer] == [
        ("TABLE", Role.buffer, 1000 * 1000 * 4)]  # not UNUSED, which it never names


def test_reductions_not_modelled_are_named_and_sum_is_not():
    """sum's and mean's split-reduction buffers are modelled (memcalc.impls.reductions);
    amax's, whose accumulator memcalc does not size yet, are named unmodelled."""
    def attn(q, k, v):
        s = q @ k.transpose(-2, -1)
        s = s - s.amax(-1, keepdim=True)
        return (s / s.sum(-1, keepdim=True)) @ v

    result = traced(attn, make_config(impl="naive", seq_len=64, batch=1))
    assert any("aten::amax" in n and "not modelled" in n for n in result.notes)
    assert not any("aten::sum" in n for n in result.notes)


# --- the command --------------------------------------------------------------------------

def test_trace_command_checks_the_budget(capsys):
    target = f"{ROOT}/examples/attention/hf_llama.py:attn"
    args = ["trace", target, "--seq", "8192", "--batch", "1", "--heads", "8", "--head-dim", "64",
            "--dtype", "fp16", "--json"]
    assert main(args + ["--gpu-gb", "1", "--reserve", "0"]) == 0
    data = json.loads(capsys.readouterr().out)
    # the float32 scores alone, 8 x 8192 x 8192 x 4 B = 2 GiB, exceed a 1 GiB budget
    assert data["fits"] is False and data["budget_bytes"] == 2**30
    assert any("half_to_float" in n for n in data["notes"])
    assert main(args + ["--gpu", "a100-40gb"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"] is True


def test_trace_command_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    target = f"{ROOT}/examples/attention/xtransformers.py:Attend"
    path = tmp_path / "step.png"
    assert main(["trace", target, "--seq", "256", "--batch", "1", "--heads", "2",
                 "--dtype", "fp16", "--causal", "--plot", str(path)]) == 0
    assert path.stat().st_size > 0


def test_the_efficient_kernel_gets_the_mask_padded_to_8_before_the_expand():
    """attention.cpp (2.13) preprocess_mask: a bool (B, 1, 1, M) mask, M = 100, is made
    where(mask, 0, -inf) of its own shape, then padded to (B, 1, 1, 104) and sliced, then
    expanded to (B, H, N, M) as a view: nothing widened to the heads or rows."""
    from memcalc.tracing.cuda_paths import fused_mask

    q = torch.empty(2, 4, 100, 16, dtype=torch.float16, device="meta")
    mask = torch.ones(2, 1, 1, 100, dtype=torch.bool, device="meta")
    made = fused_mask(mask, q, q, "efficient")
    assert made.shape == (2, 4, 100, 100) and made.stride() == (104, 0, 0, 1)
    assert made.untyped_storage().nbytes() == 2 * 104 * 2  # (2, 1, 1, 104) fp16
    q104 = torch.empty(2, 4, 104, 16, dtype=torch.float16, device="meta")
    aligned = torch.zeros(2, 1, 1, 104, dtype=torch.float16, device="meta")
    assert fused_mask(aligned, q104, q104, "efficient")._base is aligned  # no copy: a view
    assert fused_mask(mask, q, q, "cudnn").shape == (2, 1, 1, 100)  # cuDNN expands inside


def test_a_mask_the_kernels_cannot_take_is_one_line():
    from memcalc.tracing.cuda_paths import fused_mask
    from memcalc.tracing.errors import RefusedOnGpu

    q = torch.empty(2, 4, 100, 16, dtype=torch.float16, device="meta")
    with pytest.raises(RefusedOnGpu, match="invalid dtype for bias"):
        fused_mask(torch.zeros(100, 100, device="meta"), q, q, "efficient")  # fp32 mask, fp16 q


LEARNED_BIAS = """import torch.nn.functional as F


def attn(q, k, v, bias):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
"""


def _learned_bias(tmp_path, capsys, *options):
    (tmp_path / "bias.py").write_text(LEARNED_BIAS)
    code = main(["trace", f"{tmp_path}/bias.py:attn", "--seq", "1000", "--heads", "4",
                 "--head-dim", "64", "--dtype", "fp16", "--batch", "2", "--input", "q=B,H,N,D",
                 "--input", "k=B,H,N,D", "--input", "v=B,H,N,D", "--input", "bias=1,H,N,N",
                 *options, "--json"])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else err)


def test_a_learned_bias_gets_the_efficient_kernels_grad_bias(tmp_path, capsys):
    """A (1, H, N, N) bias that requires grad: cuDNN refuses it (sdp_utils), the efficient
    kernel takes it and makes ``grad_bias`` after dq, dk, dv (attention_backward.cu): the
    bias as the kernel read it, expanded to (B, H, N, M), its last dim padded to 16:
    2 x 4 x 1000 x 1008 x 2 B = 16,128,000 B (a 16 MiB segment, unsplit). Autograd sums it
    back to the bias's shape (ExpandBackward0): 1 x 4 x 1000 x 1000 x 2 B = 8,000,000 B.
    At the backward peak: q, k, v, grad_out (4 x 1,024,000), the bias (8,000,000), the
    output (1,024,000), the three accumulated grads (3 x 1,024,000), grad_bias's block
    (16,777,216) and the sum (8,000,000) = 40,969,216 B."""
    code, data = _learned_bias(tmp_path, capsys)
    assert code == 0, data
    alive = {c["name"].split(" (")[0]: c["bytes"] for c in data["components"]}
    assert alive["efficient grad_bias"] == 2 * 4 * 1000 * 1008 * 2 == 16_128_000
    assert alive["bias.grad"] == 4 * 1000 * 1000 * 2 == 8_000_000  # the sum, its grad
    assert data["backward_peak_bytes"] == (4 * 1_024_000 + 8_000_000 + 1_024_000
                                           + 3 * 1_024_000 + 16_777_216 + 8_000_000)
    assert any("cudnn: attn_mask requires grad" in note for note in data["notes"])


def test_a_learned_bias_with_q_k_v_that_need_no_grad_is_one_line(tmp_path, capsys):
    code, err = _learned_bias(tmp_path, capsys, "--no-grad", "q", "--no-grad", "k",
                              "--no-grad", "v")
    assert code == 2 and err.count("\n") == 1
    assert "an attn_mask that requires grad when q, k and v do not" in err


def test_the_mask_conversion_is_the_installed_torchs_own():
    """The bool -> q's dtype conversion fused_mask runs is what the installed torch's
    scaled_dot_product_attention runs first (convert_boolean_attn_mask, before any backend):
    two 0-d scalars, then ``where`` of the mask's own shape. (The efficient kernel's pad
    cannot be seen here: a CPU build takes the math path.)"""
    from torch.utils._python_dispatch import TorchDispatchMode

    from memcalc.tracing.cuda_paths import fused_mask

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.ops.append((func.__name__, tuple(out.shape), out.dtype))
            return out

    q = torch.empty(2, 4, 100, 16, dtype=torch.float16, device="meta")
    mask = torch.ones(2, 1, 1, 100, dtype=torch.bool, device="meta")
    with Log() as torch_own:
        F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    with Log() as ours:
        fused_mask(mask, q, q, "cudnn")
    assert torch_own.ops[:3] == ours.ops == [
        ("scalar_tensor.default", (), torch.float16), ("scalar_tensor.default", (), torch.float16),
        ("where.self", (2, 1, 1, 100), torch.float16)]
