"""``flash-attn`` and ``flash-attn3``: the flash-attn packages' kernels, modelled from their
sources, and the trace of code that calls them (the stand-ins) equal to the models."""

import pytest

from memcalc.analysis.predict import predict
from memcalc.config import make_config
from memcalc.engine.program import Tensor
from memcalc.impls import flash_attn3, get_impl

EXAMPLE = "examples/attention/flash_attn_user.py"
BNHD = ("q=B,N,H,D", "k=B,M,K,D", "v=B,M,K,D")


def config(impl="flash-attn", **options):
    sizes = dict(batch=2, heads=8, seq_len=4096, head_dim=128, dtype="bf16")
    return make_config(impl=impl, **{**sizes, **options})


def tensors(c, phase="backward"):
    program = get_impl(c.impl).program(c.dims)
    return {t.name: t for t in getattr(program, phase) if isinstance(t, Tensor)}


def test_saved_for_backward_is_the_logsumexp_and_the_rng_state():
    """The issue's figure: softmax_lse 2 x 8 x 4096 x 4 B = 262,144 B, rng_state (2,) int64
    = 16 B in one 512-B block: 262,656 B."""
    b = predict(config())
    assert b.saved_bytes == 2 * 8 * 4096 * 4 + 512 == 262_656
    assert {c.name for c in b.saved} == {"lse", "rng_state"}


def test_each_backward_buffer_is_a_named_component():
    """mha_bwd: softmax_d (B, H, round128(N)) and dq_accum (B, round128(N), H, round32(D))
    float32; dq, dk, dv; for grouped heads dk/dv expanded to every query head."""
    live = {c.name: c for c in predict(config()).backward_live}
    assert live["dq_accum"].bytes == 2 * 4096 * 8 * 128 * 4  # 33,554,432
    assert live["softmax_d"].bytes == 2 * 8 * 4096 * 4  # 262,144
    assert {"dq", "dk", "dv"} <= set(live)
    odd = tensors(config(seq_len=1030))  # rows round up to 128: 1,152 (to 64 would be 1,088)
    assert odd["softmax_d"].shape == (2, 8, 1152) and odd["dq_accum"].shape == (2, 1152, 8, 128)
    gqa = tensors(config(kv_heads=2))
    assert gqa["dk_expanded"].shape == gqa["dv_expanded"].shape == (2, 4096, 8, 128)
    assert gqa["dk"].shape == (2, 4096, 2, 128)


def test_deterministic_keeps_one_zeroed_dq_accumulator_per_split_of_the_sms():
    """nsplits = ceil(132 SMs / (B H)) = ceil(132 / 16) = 9 on the H100 preset."""
    t = tensors(config(deterministic=True))["dq_accum"]
    assert t.shape == (9, 2, 4096, 8, 128) and t.op == "zeros"


def test_a_head_dim_not_a_multiple_of_8_is_padded_and_its_grads_cloned():
    """D = 100 -> 104: q, k, v padded and saved; the grads are slices of padded buffers,
    cloned by AccumulateGrad into (B, N, H, 100); dq_accum's head dim round32(104) = 128."""
    c = config(head_dim=100)
    forward, backward = tensors(c, "forward"), tensors(c)
    assert forward["q_pad"].shape == (2, 4096, 8, 104) and forward["out"].shape[-1] == 104
    assert backward["q.grad"].shape == (2, 4096, 8, 100) and backward["q.grad"].op == "clone"
    assert backward["dq_accum"].shape == (2, 4096, 8, 128)
    # each pad asks 2 x 4096 x 8 x 104 x 2 = 13,631,488 B (13 MiB): a 14 MiB segment (large
    # requests round up to 2 MiB), whose 1 MiB rest is not split off (not > 1 MiB): a
    # 14,680,064-B block each; then lse 262,144 B and rng_state's 512-B block
    assert predict(c).saved_bytes == 3 * 14 * 2**20 + 262_144 + 512 == 44_302_848


def test_flash_attn3_sizes_its_buffers_by_the_hopper_backward_tiles():
    """hd 128: kBlockM 80 (64 causal), kBlockN 128; N = 4096 -> round(4096, 80) = 4160 rows:
    softmax_d, softmax_lse_log2 (2, 8, 4160), dq_accum (2, 8, 4160 x 128); the dq semaphore
    (ceil(4096 / 80) = 52, 2, 8) int32."""
    t = tensors(config("flash-attn3"))
    assert t["softmax_d"].shape == t["softmax_lse_log2"].shape == (2, 8, 4160)
    assert t["dq_accum"].shape == (2, 8, 4160 * 128)
    assert t["dq_semaphore"].shape == (52, 2, 8) and t["dq_semaphore"].dtype == "int32"
    assert flash_attn3.tiles(config("flash-attn3", causal=True).dims) == (64, 128)


def test_flash_attn3_grouped_heads_accumulate_dk_dv_in_float32_and_semaphores_when_deterministic():
    """Hk = 2: dk_accum, dv_accum (2, 2, 4096 x 128) float32 zeros; deterministic adds the
    dk, dv semaphores (ceil(4096 / 128) = 32, 2, 2)."""
    t = tensors(config("flash-attn3", kv_heads=2, deterministic=True))
    assert t["dk_accum"].shape == t["dv_accum"].shape == (2, 2, 4096 * 128)
    assert t["dk_semaphore"].shape == (32, 2, 2)
    assert "dk_semaphore" not in tensors(config("flash-attn3", kv_heads=2))


def test_flash_attn3_causal_forward_holds_the_tile_schedulers_counters():
    """sm90, causal: 1 + 2 x round4(B) = 1 + 2 x 4 = 9 int32, freed as mha_fwd returns."""
    t = tensors(config("flash-attn3", causal=True), "forward")
    assert t["tile_count_semaphore"].shape == (9,)
    assert "tile_count_semaphore" not in tensors(config("flash-attn3"), "forward")


@pytest.mark.parametrize("impl, option, refused", [
    ("flash-attn", dict(dtype="fp32"), "--dtype: flash-attn: FlashAttention supports fp16"),
    ("flash-attn", dict(gpu="t4"), "--gpu: flash-attn: FlashAttention needs compute"),
    ("flash-attn", dict(head_dim=264), "--head-dim: flash-attn: head_dim 264 > 256"),
    ("flash-attn3", dict(gpu="a100-80gb"), "--gpu: flash-attn3: memcalc models"),
    ("flash-attn3", dict(head_dim=100), "--head-dim: flash-attn3: head_dim 100 is not a "
                                        "multiple of 8"),
])
def test_what_the_kernels_refuse_is_one_line(impl, option, refused):
    with pytest.raises(ValueError, match=refused):
        predict(config(impl, **option))


# --- the trace of code calling the packages --------------------------------------------

torch = pytest.importorskip("torch")


def traced(fn_name: str, c, inputs=BNHD):
    from memcalc.engine.inputs import parse_input
    from memcalc.tracing import Calling, load_function, trace

    fn = load_function(f"{EXAMPLE}:{fn_name}")
    return trace(fn, c, calling=Calling(inputs=tuple(parse_input(i) for i in inputs)))


CASES = [
    ("attn", "flash-attn", dict()),
    ("attn", "flash-attn", dict(causal=True, kv_heads=2)),
    ("attn", "flash-attn", dict(head_dim=100, seq_len=1000)),
    ("attn", "flash-attn", dict(loss="sum", seq_len=1000)),
    ("attn", "flash-attn", dict(head_dim=100, loss="sum", seq_len=1000)),
    ("attn", "flash-attn", dict(batch=1, heads=2)),  # split-KV accumulators
    ("attn", "flash-attn", dict(forward_only=True)),
    ("attn3", "flash-attn3", dict()),
    ("attn3", "flash-attn3", dict(causal=True, kv_heads=2, loss="sum")),
    ("attn3", "flash-attn3", dict(head_dim=64, seq_len=1000)),
]


@pytest.mark.parametrize("fn_name, impl, options", CASES)
def test_a_file_importing_flash_attn_traces_to_the_models_figures(fn_name, impl, options):
    """The file imports flash_attn and flash_attn_interface, neither installed here: the
    stand-ins run the models, so every figure equals breakdown --impl's: the model against
    itself for the kernel (this checks the stand-ins, the layouts and the autograd around
    them); the kernels' hand counts are the tests above."""
    from memcalc.validation.compare import figures_of

    c = config(impl, **options)
    assert figures_of(traced(fn_name, c)) == figures_of(predict(c))


@pytest.mark.parametrize("fn_name, inputs, options, grad", [
    ("attn_qkvpacked", ("qkv=B,N,3,H,D",), dict(), ("dqkv", (2, 4096, 3, 8, 128))),
    ("attn_qkvpacked", ("qkv=B,N,3,H,D",), dict(head_dim=100, seq_len=1000),
     ("dqkv", (2, 1000, 3, 8, 104))),
    ("attn_kvpacked", ("q=B,N,H,D", "kv=B,M,2,K,D"), dict(causal=True, kv_heads=2),
     ("dkv", (2, 4096, 2, 2, 128))),
])
def test_the_packed_functions_make_one_grad_of_the_packed_shape(fn_name, inputs, options, grad):
    """flash_attn_qkvpacked_func / _kvpacked_func (FlashAttnQKVPackedFunc, ...KVPackedFunc):
    q, k, v are slices of the packed input (nothing copied) and the backward makes one dqkv
    (B, N, 3, H, dp), or dq and one dkv (B, M, 2, Hk, dp), for mha_bwd to write through its
    slices. At these sizes every grad and input is a whole number of 512-B blocks either
    way (dq: 2 x 4096 x 8 x 128 x 2 B = 16 MiB; padded: 2 x 1000 x 8 x 104 x 2 B =
    3,328,000 B), so the allocated figures are flash_attn_func's (breakdown --impl
    flash-attn); only the segments differ, one packed block against three."""
    c = config(**options)
    step = traced(fn_name, c, inputs)
    # the backward's own tensors (named by the node, or the leaf's grad it became)
    made = [p.shape for p in step.backward_live if "Backward)" in p.name or ".grad" in p.name]
    assert grad[1] in made, grad[0]
    model = predict(c)
    for figure in ("saved_bytes", "forward_peak_bytes", "backward_peak_bytes"):
        assert getattr(step, figure) == getattr(model, figure), figure


def test_the_split_kv_case_above_does_split():
    """B H ceil(N / 64) = 1 x 2 x 64 = 128 blocks < 0.8 x 2 x 132 SMs = 211.2: two splits of
    the 32 key blocks (128 x 2 / 264 = 0.97 of a wave, the first at 85 % of the best)."""
    names = tensors(config(batch=1, heads=2), "forward")
    assert names["out_accum"].shape == (2, 1, 2, 4096, 128)  # (S, B, H, N, round32(D))
    assert names["lse_accum"].shape == (2, 1, 2, 4096)


def test_deterministic_reaches_the_trace_from_the_call():
    from memcalc.tracing.flash_attn import dims_of
    from memcalc.gpus import gpu_preset

    q = torch.empty(2, 16, 4, 64, device="meta", requires_grad=True)
    d = dims_of(q, q, causal=True, deterministic=True, gpu=gpu_preset("h100-80gb"))
    assert (d.B, d.N, d.H, d.D, d.deterministic, d.causal) == (2, 16, 4, 64, True, True)


def test_the_stand_ins_leave_sys_modules_as_they_were():
    import sys

    from memcalc.tracing.flash_attn import stand_ins

    before = {m: sys.modules.get(m) for m in ("flash_attn", "flash_attn_interface")}
    with stand_ins():
        import flash_attn

        assert flash_attn.flash_attn_func.__module__ == "memcalc.tracing.flash_attn"
    assert {m: sys.modules.get(m) for m in before} == before


def test_outside_a_trace_the_stand_in_says_so_in_one_line():
    from memcalc.tracing.errors import NotModelled
    from memcalc.tracing.flash_attn import flash_attn_func

    q = torch.empty(1, 8, 2, 64, device="meta")
    with pytest.raises(NotModelled, match="runs only inside a trace"):
        flash_attn_func(q, q, q)


# --- the varlen functions: sequences packed into (total, H, D) ------------------------------

VARLEN = ("q=B*N,H,D", "k=B*M,K,D", "v=B*M,K,D")


def test_packed_sequences_hold_128_more_rows_per_sequence_in_the_backward_accumulators():
    """attn_varlen packs 4 sequences of N = 4096 rows (B = 4 here, so the same rows as
    flash_attn_func's batch). mha_varlen_bwd spaces the sequences 128 rows apart in
    softmax_d (H, total + 128 b) and dq_accum (total + 128 b, H, dr): 128 x 4 x 8 x 4 B =
    16,384 B and 128 x 4 x 8 x 128 x 4 B = 2,097,152 B more than mha_bwd's (B, H, 4096) and
    (B, 4096, H, 128), both alive at the backward peak; the rest allocates alike (lse (H, total)
    has the bytes of (B, H, N)), so every other figure is flash_attn_func's."""
    c = config(batch=4)
    step, model = traced("attn_varlen", c, VARLEN), predict(c)
    # and the node keeps the two (5,) int32 cu_seqlens: one 512-B block each
    assert step.backward_peak_bytes == model.backward_peak_bytes + 16_384 + 2_097_152 + 2 * 512
    made = {p.name.split(" (")[0]: p.shape for p in step.backward_live}
    assert made["flash-attn dq_accum"] == (4 * 4096 + 4 * 128, 8, 128)
    assert made["flash-attn softmax_d"] == (8, 4 * 4096 + 4 * 128)
    assert step.saved_bytes == model.saved_bytes + 2 * 512
    assert step.forward_peak_bytes == model.forward_peak_bytes + 2 * 512


def test_packed_sequences_padded_and_grouped_are_the_models_tensors():
    """3,000 rows as 4 sequences of 750, H = 8 over Hk = 2, D = 100 padded to 104: the
    backward peak's every tensor, from mha_varlen_bwd's shapes (B = 1, N = M = 3,000)."""
    c = config(batch=1, seq_len=3000, kv_heads=2, head_dim=100)
    made = {p.name.split(" (")[0]: (p.shape, p.bytes) for p in traced(
        "attn_varlen", c, VARLEN).backward_live}
    assert made["flash-attn dq_accum"] == ((3512, 8, 128), 3512 * 8 * 128 * 4)  # 3,000 + 4 x 128
    assert made["flash-attn softmax_d"] == ((8, 3512), 8 * 3512 * 4)  # 112,384
    assert made["flash-attn dk_expanded"] == ((3000, 8, 104), 3000 * 8 * 104 * 2)  # 4,992,000
    # the Function's dk (empty_like of the padded k), which mha_varlen_bwd writes
    assert made["empty_like"] == ((3000, 2, 104), 3000 * 2 * 104 * 2)  # 1,248,000
    assert made["flash-attn lse"] == ((8, 3000), 8 * 3000 * 4)  # (H, total_q): 96,000


def test_the_varlen_deterministic_accumulator_splits_the_sms_over_the_sequences():
    """nsplits = ceil(132 SMs / (b H)) with b the sequences: ceil(132 / (3 x 8)) = 6."""
    from memcalc.gpus import gpu_preset
    from memcalc.impls.flash_attn import dq_accum
    from memcalc.tracing.flash_attn import dims_of

    q = torch.empty(3000, 8, 64, device="meta", requires_grad=True)
    d = dims_of(q, q, causal=False, deterministic=True, gpu=gpu_preset("h100-80gb"), varlen=3)
    assert (d.B, d.N, d.M, d.varlen) == (1, 3000, 3000, 3)
    assert dq_accum(d)[0].shape == (6, 3000 + 3 * 128, 8, 64)


def test_the_packed_varlen_function_makes_one_grad_of_the_packed_shape(tmp_path):
    """flash_attn_varlen_qkvpacked_func on qkv (total, 3, H, D): q, k, v are qkv[:, i]
    (views) and FlashAttnVarlenQKVPackedFunc's backward one dqkv (total, 3, H, dp)."""
    path = tmp_path / "packed.py"
    path.write_text(
        "import torch\nfrom flash_attn import flash_attn_varlen_qkvpacked_func\n\n"
        "def attn(qkv, causal=False):\n"
        "    cu = torch.tensor([0, 100, 1000], dtype=torch.int32, device=qkv.device)\n"
        "    return flash_attn_varlen_qkvpacked_func(qkv, cu, 900, causal=causal)\n")
    from memcalc.engine.inputs import parse_input
    from memcalc.tracing import Calling, load_function, trace

    step = trace(load_function(f"{path}:attn"), config(batch=1, seq_len=1000, head_dim=64),
                 calling=Calling(inputs=(parse_input("qkv=N,3,H,D"),)))
    made = {p.name.split(" (")[0]: p.shape for p in step.backward_live}
    assert made["qkv.grad"] == (1000, 3, 8, 64)  # the Function's dqkv, the leaf's grad as is
    assert made["flash-attn dq_accum"] == (1000 + 2 * 128, 8, 64)


@pytest.mark.parametrize("call, refused", [
    ("flash_attn_varlen_func(q, q, q, cu, cu, 500, 500, dropout_p=0.1)", "dropout_p"),
    ("flash_attn_varlen_func(q, q, q, cu, cu, 500, 500, block_table=cu)", "block_table"),
    ("flash_attn_varlen_func(q, k, k, cu, cu, 1, 1)", "decoding"),
    ("flash_attn_with_kvcache(q, q, q)", "not modelled yet"),
])
def test_what_the_varlen_stand_ins_refuse_is_one_line(tmp_path, call, refused):
    from memcalc.engine.inputs import parse_input
    from memcalc.tracing import Calling, TraceError, load_function, trace

    path = tmp_path / "refused.py"
    path.write_text(
        "import torch\nfrom flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache"
        "\n\ndef attn(q, k):\n"
        "    cu = torch.tensor([0, 500, 1000], dtype=torch.int32, device=q.device)\n"
        f"    return {call}\n")
    c = config(batch=1, seq_len=1000, head_dim=64, kv_heads=2)
    with pytest.raises(TraceError, match=refused):
        trace(load_function(f"{path}:attn"), c,
              calling=Calling(inputs=(parse_input("q=N,H,D"), parse_input("k=N,K,D"))))
