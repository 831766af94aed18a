"""``sdpa-flash`` and ``sdpa-efficient``: source-derived models of the fused SDPA backends.

The CUDA kernels cannot run here, so the tests check three things: figures derived by hand
from the kernel sources; the autograd skeleton (what the aten ops return, what their
backward nodes save, the layout copies of ``AccumulateGrad``, the head-dim padding) against
the meta device, through the same emulated tracer as the traced models; and the output
shapes of the meta registrations on fake CUDA tensors (which this CPU-only build can make:
``FakeTensorMode`` with ``device="cuda"``; only autograd on them aborts the process, in
``AccumulateGrad``'s device guard, so the backward ops are called directly).
"""

import dataclasses
import itertools

import pytest

from memcalc.impls import registry

from memcalc.config import Config, Protocol
from memcalc.impls import IMPLS, get_impl, sdpa_efficient, sdpa_flash
from memcalc.impls.device import A100, H100_SXM
from memcalc.engine.program import Dims, Tensor
from memcalc.analysis.predict import predict
from memcalc.config import make_config
from memcalc.validation.compare import figures_of

MiB = 1024 * 1024


def dims(B=2, H=4, N=100, D=64, dtype="float16", M=None, Hk=None, causal=False, loss="grad"):
    return Dims(B=B, H=H, N=N, M=M or N, D=D, dtype=dtype, causal=causal, loss=loss,
                Hk=Hk or H, chunk=64)


def tensors(program) -> dict[str, Tensor]:
    return {e.name: e for e in program.forward + program.backward if isinstance(e, Tensor)}


def test_registered_as_source_derived():
    assert not get_impl("sdpa-flash").traced and get_impl("sdpa-flash").gqa
    assert not get_impl("sdpa-efficient").traced and not get_impl("sdpa-efficient").gqa


# ---- sdpa-flash, by hand -----------------------------------------------------------------
# B=8, H=16, N=4096, D=128, bf16, H100 SXM, loss="grad". Every tensor is a multiple of 2 MiB,
# so each block is its request:
#   ND   = 8 x 16 x 4096 x 128 x 2 B = 134,217,728 (128 MiB): q, k, v, grad_out, out, dq, ...
#   LSE  = 8 x 16 x 4096 x 4 B       =   2,097,152 (2 MiB): logsumexp; softmax_d (4096 is
#          already a multiple of 128)
#   ACC  = 8 x 4096 x 16 x 128 x 4 B = 268,435,456 (256 MiB): dq_accum (128 is a multiple of 32)
#   RNG  = 512 + 512: rng_state (2 x 8 B) and philox_offset (8 B), one small block each
# No split-KV: B x H x ceil(N / 64) = 8 x 16 x 64 = 8192 >= 0.8 x 2 x 132.
# saved    = LSE + RNG                                   =     2,098,176
# fwd peak = 4 ND (inputs) + ND (out) + LSE + RNG        =   673,186,816
# bwd peak = 5 ND + LSE + RNG, + grad and out copies in (B, N, H, d) (2 ND, H > 1 and N > 1),
#            dq, dk, dv (3 ND), softmax_d (LSE), dq_accum (ACC)
#          = 10 ND + 2 LSE + ACC + RNG = 1540 MiB + 1024  = 1,614,808,064
ND, LSE, ACC, RNG = 134_217_728, 2_097_152, 268_435_456, 1024
BIG = {"batch": 8, "heads": 16, "seq_len": 4096, "head_dim": 128}


def test_flash_by_hand():
    b = predict(Config(impl="sdpa-flash", dtype="bf16", shape=BIG))
    assert b.saved_bytes == LSE + RNG  # 2,098,176
    assert sorted(c.name for c in b.saved) == ["lse", "philox_offset", "rng_state"]
    assert b.forward_peak_bytes == 5 * ND + LSE + RNG  # 673,186,816
    assert b.backward_peak_bytes == 10 * ND + 2 * LSE + ACC + RNG  # 1,614,808,064
    assert b.workspace_bytes == 0  # no cuBLAS call on either thread


def test_flash_rejects_fp32_and_wide_heads():
    with pytest.raises(ValueError, match="fp16 and bf16"):
        predict(Config(impl="sdpa-flash", dtype="fp32", shape=BIG))
    with pytest.raises(ValueError, match="256"):
        sdpa_flash.program(dims(D=320))
    with pytest.raises(ValueError, match="8.0 or newer"):
        sdpa_flash.program(dims(), gpu=sdpa_flash.Gpu(40, (7, 5)))  # a T4


def test_split_heuristic_example_of_the_source():
    """flash_api.cpp's comment: 48 (batch x heads x blocks) on 108 SMs, 2 splits (0.89)."""
    assert sdpa_flash.num_splits_heuristic(48, 108, 64, 128) == 2
    assert sdpa_flash.num_splits_heuristic(212, 264, 64, 128) == 1  # >= 0.8 x 264 = 211.2


def test_split_kv_depends_on_the_sm_count():
    # B x H x ceil(4096 / 64) = 3 x 64 = 192: under 0.8 x 264 (H100) but not 0.8 x 216 (A100).
    # H100: 16 key blocks of 256; efficiencies 0.727 (1, 2, 3 splits), 0.970 (4): 4 splits
    d = dims(B=1, H=3, N=4096, D=64)
    assert sdpa_flash.num_splits(d, H100_SXM) == 4
    assert sdpa_flash.num_splits(d, A100) == 1


def test_split_kv_accumulators_in_the_forward_peak():
    # B=1, H=2, N=1024, D=64 fp16: 1 x 2 x 16 = 32 query blocks; 4 key blocks of 256:
    # 4 splits (efficiency 0.485, vs 0.242 for 2; 3 is not eligible).
    # ND = 1 x 2 x 1024 x 64 x 2 B = 262,144; LSE = 1 x 2 x 1024 x 4 B = 8,192
    # lse_accum = 4 x 1 x 2 x 1024 x 4 B = 32,768; out_accum = 4 x 1 x 2 x 1024 x 64 x 4 B
    # = 2,097,152 (2 MiB: a 20 MiB segment, split)
    b = predict(Config(impl="sdpa-flash", dtype="fp16",
                       shape={"batch": 1, "heads": 2, "seq_len": 1024, "head_dim": 64}))
    # q, k, v, grad_out, out; lse, accumulators, rng_state, philox_offset = 3,449,856
    assert b.forward_peak_bytes == 5 * 262_144 + 8_192 + 32_768 + 2_097_152 + 1024
    assert b.saved_bytes == 8_192 + 1024  # the accumulators die with mha_fwd


def test_flash_pads_head_dims_and_expands_gqa():
    p = sdpa_flash.program(dims(B=2, H=4, Hk=2, N=1000, D=20))
    t = tensors(p)
    assert t["q_pad"].shape == (2, 4, 1000, 24)  # pad_last_dim<8>: 20 -> 24
    assert t["k_pad"].shape == (2, 2, 1000, 24)  # k, v keep their 2 heads
    assert t["dq_accum"].shape == (2, 1024, 4, 32)  # round128(1000), round32(24)
    assert t["softmax_d"].shape == (2, 4, 1024)
    assert t["dk_expanded"].shape == (2, 1000, 4, 24)  # GQA: per query head, then summed
    assert t["q.grad"].shape == (2, 4, 1000, 20)  # ConstantPadNdBackward0 clones


def test_flash_copies_follow_the_layout():
    assert "dout_t" not in tensors(sdpa_flash.program(dims(H=1)))  # (B, N, 1, d) is contiguous
    assert "out_t" not in tensors(sdpa_flash.program(dims(H=1, loss="sum")))
    assert "dout_t" in tensors(sdpa_flash.program(dims(H=1, loss="sum")))  # stride-0 grad
    assert {"dout_t", "out_t"} <= set(tensors(sdpa_flash.program(dims(H=4))))


# ---- sdpa-efficient, by hand -------------------------------------------------------------
# B=2, H=4, N=100, D=64, fp16: ND = 2 x 4 x 100 x 64 x 2 B = 102,400 (200 x 512);
# logsumexp (2, 4, ceil(100/32)*32 = 128) float32 = 4,096; delta (2, 4, 100) float32 = 3,200
# -> 3,584. Backward kernel 64x64 (kMaxK 64 >= 64; 100 is not a multiple of 64: not the
# seqaligned one), dK/dV in registers; dQ split-key tiles: ceil(100/64) x ceil(64/64) x
# (4 + 64 x 64) = 2 x 1 x 4100 = 8,200 floats per (b, h): 2 x 4 x 8200 x 4 B = 262,400
# -> 262,656.
def test_efficient_by_hand():
    b = predict(Config(impl="sdpa-efficient", dtype="fp16",
                       shape={"batch": 2, "heads": 4, "seq_len": 100, "head_dim": 64}))
    nd = 102_400
    assert b.saved_bytes == 4_096  # the logsumexp; seed and offset live on the CPU
    assert b.forward_peak_bytes == 5 * nd + 4_096  # q, k, v, grad_out, out; lse = 516,096
    # + grad copy (H > 1), dq, dk, dv in (B, N, H, D), delta, workspace = 1,191,936
    assert b.backward_peak_bytes == 9 * nd + 4_096 + 3_584 + 262_656
    assert b.workspace_bytes == 0


def test_efficient_forward_only_computes_no_logsumexp():
    b = predict(Config(impl="sdpa-efficient", dtype="fp16", protocol=Protocol(forward_only=True),
                       shape={"batch": 2, "heads": 4, "seq_len": 100, "head_dim": 64}))
    assert b.forward_peak_bytes == 4 * 102_400  # q, k, v, out: lse is (2, 4, 0) under no_grad
    assert b.saved_bytes == 0


def test_efficient_workspace_with_register_spill():
    # d=160 bf16: kernel 128x64 k65536, dK/dV accumulated in float32 (kOutputInRF false).
    # splits = min(ceil(1000/64) = 16, 200 // (2 x 4) = 25) = 16
    # gk = gv = 16 x round64(1000) x round128(160) = 16 x 1024 x 256 = 4,194,304 floats
    # gq = ceil(1000/128) x ceil(160/64) x (4 + 128 x 64) = 8 x 3 x 8196 = 196,704 floats
    # 2 x 4 x (2 x 4,194,304 + 196,704) x 4 B = 274,729,984
    d = dims(B=2, H=4, N=1000, D=160, dtype="bfloat16")
    assert sdpa_efficient.workspace_bytes(d) == 274_729_984
    assert tensors(sdpa_efficient.program(d))["out_accum"].dtype == "float32"  # d > 128


def test_efficient_fp32_delta_is_torch_code():
    t = tensors(sdpa_efficient.program(dims(dtype="float32")))
    assert t["do*o"].shape == (2, 100, 4, 64) and t["delta"].shape == (2, 4, 100)
    assert "delta" not in tensors(sdpa_efficient.program(dims(H=1, dtype="float32")))  # a view
    assert "out_accum" not in t  # fp32 accumulates in the output itself


def test_efficient_rejects_what_it_does_not_cover():
    with pytest.raises(ValueError, match="multiple of 8"):
        sdpa_efficient.program(dims(D=20))
    with pytest.raises(ValueError, match="compute capability"):
        sdpa_efficient.program(dims(), gpu=sdpa_flash.Gpu(128, (8, 9)))
    with pytest.raises(ValueError, match="kv_heads"):
        Config(impl="sdpa-efficient", shape={"heads": 4, "kv_heads": 2})


def test_efficient_refuses_head_dims_past_its_largest_kernel():
    """No kernel of cutlassB.h has kMaxK above 65,536: a head dim of 65,544 (a multiple of
    8) is refused in one line, as torch finds no kernel to launch, not an assertion."""
    with pytest.raises(ValueError, match=r"head_dim 65544 > 65536: .* kMaxK"):
        sdpa_efficient.program(dims(D=65544, N=16))


# ---- the autograd skeleton on the meta device ----------------------------------------------
def _flash_skeleton(q, k, v, causal):
    """attention.cpp's flash branch with the aten op's meta kernel: pad, op, slice."""
    import torch.nn.functional as F
    import torch

    d = q.size(-1)
    pad = (-d) % 8
    if pad:
        q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False,
                                                             scale=d ** -0.5)[0]
    return out[..., :d] if pad else out


def _efficient_skeleton(q, k, v, causal):
    """attention.cpp's efficient branch: logsumexp only when a grad is needed."""
    import torch

    lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, lse, 0.0,
                                                                  causal)[0]


def _check_skeleton(monkeypatch, impl, module, skeleton, config, **kw):
    from memcalc.validation import figures_of
    from memcalc.validation.emulated import measure

    meta = dataclasses.replace(IMPLS[impl], build=lambda d: module.program(d, on="meta", **kw))
    monkeypatch.setitem(IMPLS, impl, meta)
    trace = measure(config, fn=lambda q, k, v: skeleton(q, k, v, config.causal))
    return figures_of(predict(config)), figures_of(trace)


CASES = [  # (heads, kv_heads, seq_len, kv_len, head_dim, loss, forward_only)
    (4, None, 1000, None, 64, "grad", False), (4, None, 1000, None, 20, "sum", False),
    (1, None, 1000, None, 64, "sum", False), (4, 2, 1000, None, 20, "grad", False),
    (4, None, 1, None, 64, "grad", False), (4, None, 1000, 700, 40, "grad", False),
    (4, None, 1000, None, 20, "grad", True),
]


@pytest.mark.parametrize("case", CASES)
def test_flash_skeleton_equals_meta_trace(monkeypatch, case):
    pytest.importorskip("torch")
    H, Hk, N, M, D, loss, fo = case
    config = Config(impl="sdpa-flash", causal=M is None, dtype="fp16",
                    shape={"batch": 2, "heads": H, "kv_heads": Hk, "seq_len": N, "kv_len": M,
                           "head_dim": D}, protocol=Protocol(loss=loss, forward_only=fo))
    model, trace = _check_skeleton(monkeypatch, "sdpa-flash", sdpa_flash, _flash_skeleton, config)
    assert model == trace


@pytest.mark.parametrize("case", [c for c in CASES if c[1] is None and c[4] % 8 == 0])
@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_efficient_skeleton_equals_meta_trace(monkeypatch, case, dtype):
    pytest.importorskip("torch")
    H, _, N, M, D, loss, fo = case
    config = Config(impl="sdpa-efficient", causal=True, dtype=dtype,
                    shape={"batch": 2, "heads": H, "seq_len": N, "kv_len": M, "head_dim": D},
                    protocol=Protocol(loss=loss, forward_only=fo))
    model, trace = _check_skeleton(monkeypatch, "sdpa-efficient", sdpa_efficient,
                                   _efficient_skeleton, config, grad=not fo)
    assert model == trace


def test_a_missing_layout_copy_is_caught(monkeypatch):
    """Without AccumulateGrad's copies of the (B, N, H, d) grads the skeleton must differ."""
    pytest.importorskip("torch")
    monkeypatch.setattr(sdpa_efficient, "accumulate", lambda d: [])
    monkeypatch.setattr(registry, "_PROGRAMS", {})  # programs are kept: build it again
    config = Config(impl="sdpa-efficient", dtype="fp16",
                    shape={"batch": 2, "heads": 4, "seq_len": 1000, "head_dim": 64})
    model, trace = _check_skeleton(monkeypatch, "sdpa-efficient", sdpa_efficient,
                                   _efficient_skeleton, config)
    nd = 1_024_000  # 2 x 4 x 1000 x 64 x 2 B
    # traced: q, k, v, grad_out, out, dq, dk, dv and the copy of q.grad (lse, seed and
    # offset already released) = 9 x nd; broken model: its peak is at dv, with the
    # (2, 4, 1024) float32 logsumexp (32,768) and the meta seed and offset (2 x 512)
    assert trace["backward_peak_bytes"] == 9 * nd
    assert model["backward_peak_bytes"] == 8 * nd + 32_768 + 1_024


# ---- the meta registrations on fake CUDA tensors -------------------------------------------
def test_fake_cuda_outputs_match_the_models():
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = (torch.empty(2, 4, 100, 64, dtype=torch.float16, device="cuda")
                   for _ in range(3))
        out, lse, cq, ck, mq, mk, rng, unused, _ = \
            torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            out, q, k, v, out, lse, cq, ck, mq, mk, 0.0, True, rng, unused)
        e_out, e_lse, seed, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, True)
        e_grads = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            e_out, q, k, v, None, e_out, e_lse, seed, seed, 0.0, [True] * 3 + [False], True)

    def size(t):
        return t.numel() * t.element_size()

    flash = tensors(sdpa_flash.program(dims(causal=True)))
    for name, fake in [("out", out), ("lse", lse), ("rng_state", rng), ("philox_offset", unused),
                       ("dq", grads[0]), ("dk", grads[1]), ("dv", grads[2])]:
        assert (flash[name].bytes, flash[name].dtype) == (size(fake), str(fake.dtype)[6:]), name
    assert grads[0].stride() == q.stride()  # flash grads keep q's layout: no copy

    eff = tensors(sdpa_efficient.program(dims(causal=True)))
    assert eff["lse"].shape == tuple(e_lse.shape) == (2, 4, 128)  # ceil(100 / 32) x 32
    transposed = (100 * 4 * 64, 64, 4 * 64, 1)  # (B, N, H, d)-contiguous, seen as (B, H, N, d)
    assert e_out.stride() == transposed and e_grads[0].stride() == transposed
    assert eff["q.grad"].shape == (2, 4, 100, 64)  # so AccumulateGrad copies
    # the registration puts seed and offset on the device; the CUDA kernel on the CPU
    assert seed.device.type == "cuda" and "seed" not in eff


def test_models_cover_loss_and_forward_only_without_errors():
    for impl, causal, loss, fo in itertools.product(["sdpa-flash", "sdpa-efficient"],
                                                    [False, True], ["grad", "sum"], [False, True]):
        b = predict(Config(impl=impl, causal=causal, dtype="bf16", shape=BIG,
                           protocol=Protocol(loss=loss, forward_only=fo)))
        assert b.peak_bytes >= 4 * ND  # at least q, k, v and out (or grad_out)


def test_split_kv_follows_the_presets_sm_count():
    """B=1, H=3, N=4096: 3 x ceil(4096/64) = 192 blocks fill an H100's 2 x 132 SMs poorly,
    so num_splits_heuristic picks 4 splits there, none on an A100 (2 x 108)."""
    from memcalc.config import make_config

    def forward_peak(gpu):
        config = make_config(impl="sdpa-flash", dtype="bf16", batch=1, heads=3, seq_len=4096,
                             gpu=gpu)
        return predict(config).forward_peak_bytes

    # the two fp32 split accumulators on the H100: (4, 1, 3, 4096) x 4 B = 196,608 and
    # (4, 1, 3, 4096, 32) x 4 B = 6,291,456 (head dim 16 rounded up to 32)
    assert forward_peak("h100-80gb") - forward_peak("a100-80gb") == 196_608 + 6_291_456


# --- sdpa-efficient with a bool attn_mask (--mask padding | full) -----------------------------

def test_a_padding_mask_is_converted_padded_to_8_keys_and_saved():
    """M = 100 keys: where(mask, 0, -inf) (8, 1, 1, 100) fp16 = 1,600 B, padded to (8, 1, 1,
    104) = 1,664 B (a 2,048-B block), which the node saves: saved = lse (8 x 4 x 128 x 4 =
    16,384 B) + 2,048 B."""
    from memcalc.impls.sdpa_efficient import mask_events

    c = make_config(impl="sdpa-efficient", mask="padding", seq_len=100, heads=4, dtype="fp16",
                    gpu="a100-80gb")
    events, kept = mask_events(c.dims)
    shapes = {e.name: e.shape for e in events if hasattr(e, "shape")}
    assert kept == "mask_pad" and shapes["mask_pad"] == (8, 1, 1, 104)
    assert shapes["mask_float"] == (8, 1, 1, 100) and shapes["mask -inf"] == ()
    assert predict(c).saved_bytes == 16_384 + 2_048
    full = make_config(impl="sdpa-efficient", mask="full", seq_len=1000, heads=4, dtype="fp16",
                       gpu="a100-80gb")
    assert mask_events(full.dims)[1] == "mask_float"  # 1,000 keys: aligned, no pad


@pytest.mark.parametrize("mask, dims", [("padding", "B,1,1,M"), ("full", "B,1,N,M")])
@pytest.mark.parametrize("n, options", [(100, {}), (1000, {"loss": "sum"}),
                                        (100, {"forward_only": True})])
def test_a_traced_masked_call_equals_the_model(mask, dims, n, options, tmp_path):
    """F.scaled_dot_product_attention(q, k, v, attn_mask=mask) on the A100 preset (fp16:
    flash takes no mask, so the efficient kernel), traced with the mask as an input: every
    figure equals breakdown --impl sdpa-efficient --mask. The kernel is the model's on
    both sides (the tracer replays its events): what is checked is attention.cpp's mask
    preparation, traced from torch's own code, against ``mask_events``; the kernel's hand
    count is ``test_efficient_by_hand``."""
    pytest.importorskip("torch")
    from memcalc.engine.inputs import parse_input
    from memcalc.tracing import Calling, load_function, trace

    (tmp_path / "masked.py").write_text(
        "import torch.nn.functional as F\n"
        "def attn(q, k, v, mask):\n"
        "    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)\n")
    fn = load_function(f"{tmp_path}/masked.py:attn")
    c = make_config(impl="sdpa-efficient", mask=mask, seq_len=n, heads=4, dtype="fp16",
                    gpu="a100-80gb", **options)
    inputs = tuple(parse_input(x) for x in ("q=B,H,N,D", "k=B,K,M,D", "v=B,K,M,D",
                                            f"mask={dims}:bool"))
    assert figures_of(trace(fn, c, calling=Calling(inputs=inputs))) == figures_of(predict(c))
