"""``memcalc.impls.sdpa_select``: the filters and priority order of ``sdp_utils.cpp``."""

import dataclasses

import pytest

from memcalc.impls.sdpa_select import (CUDNN, EFFICIENT, FLASH, MATH, Call, Choice, Flags,
                                         Release, prefer_cudnn, priority, rejection, select)

# every rule below is a function of aten/src/ATen/native/transformers/cuda/sdp_utils.cpp
# (or sdp_utils_cpp.h), named as the module names it
H100, A100 = (9, 0), (8, 0)
NO_ENV: dict = {}


def attn(d: int = 64, dtype: str = "float16", d_v: int | None = None, **change) -> Call:
    """A small dense call: (B, H, N, d) = (2, 8, 16, d); v's head dim ``d_v`` (default d)."""
    shape = (2, 8, 16, d)
    return Call(shape, shape, shape[:3] + (d if d_v is None else d_v,), dtype, **change)


def test_prefer_cudnn_needs_cudnn_after_9_15_0_and_on_cuda_12_minor_0_or_3():
    """check_prefer_cudnn_attention: ``cudnn_version > 91500 && (major == 9 || major == 10)``,
    and before CUDA 13 also ``(!minor || minor == 3)``."""
    assert not prefer_cudnn(H100, Release(cudnn_version=91500), NO_ENV)  # strictly after
    assert prefer_cudnn(H100, Release(cudnn_version=91501), NO_ENV)
    cuda12 = Release(cuda_major=12)
    assert [prefer_cudnn(cc, cuda12, NO_ENV) for cc in [(9, 0), (10, 0), (10, 3), (10, 1)]] == [
        True, True, True, False]
    assert prefer_cudnn((10, 1), Release(cuda_major=13), NO_ENV)  # CUDA 13: any minor
    assert not prefer_cudnn((12, 0), Release(), NO_ENV)  # major 12: never
    assert not prefer_cudnn(A100, Release(), NO_ENV)


def test_priority_is_cudnn_first_when_preferred_else_cudnn_last():
    """priority_order: the context's default (flash, efficient, math, cudnn), or the cuDNN
    order; ``TORCH_CUDNN_SDPA_DEPRIORITIZED=0`` is false to ``c10::utils::check_env``."""
    default, cudnn_first = (FLASH, EFFICIENT, MATH, CUDNN), (CUDNN, FLASH, EFFICIENT, MATH)
    assert priority(A100, Release(), NO_ENV) == default
    assert priority(H100, Release(), NO_ENV) == cudnn_first
    assert priority(H100, Release(), {"TORCH_CUDNN_SDPA_DEPRIORITIZED": "0"}) == cudnn_first
    assert priority(H100, Release(), {"TORCH_CUDNN_SDPA_DEPRIORITIZED": "1"}) == default
    for ignored in ("true", "ON", "yes"):  # not "0" or "1": check_env warns and ignores it
        assert priority(H100, Release(), {"TORCH_CUDNN_SDPA_DEPRIORITIZED": ignored}) == (
            cudnn_first)


def test_choice_reason_names_the_order_and_why_each_earlier_backend_was_not_taken():
    assert select(attn(), A100, env=NO_ENV).reason() == (
        "flash (priority flash > efficient > math > cudnn)")
    choice = select(attn(dtype="float32"), A100, env=NO_ENV)
    assert choice == Choice(EFFICIENT, ((FLASH, "dtype float32 (needs float16 or bfloat16)"),),
                            (FLASH, EFFICIENT, MATH, CUDNN))
    assert choice.reason() == ("efficient (priority flash > efficient > math > cudnn; "
                               "flash: dtype float32 (needs float16 or bfloat16))")


def test_no_runnable_backend_raises_with_every_backends_reason():
    """select_sdp_backend's ``No available kernel``: math disabled, a strided last dim."""
    call = attn(last_strides=(1, 2, 1))
    with pytest.raises(ValueError) as error:
        select(call, A100, Flags(math=False), env=NO_ENV)
    assert str(error.value) == (
        "scaled_dot_product_attention: no available kernel on this GPU ("
        "flash: last dimension not contiguous; efficient: last dimension not contiguous; "
        "math: disabled (torch.backends.cuda / sdpa_kernel); "
        "cudnn: last dimension not contiguous)")


def test_deterministic_algorithms_rule_out_cudnn_only():
    """check_cudnn_deterministic: cuDNN SDPA is not deterministic; the runtime switch is
    checked first (check_runtime_disabled_cudnn)."""
    choice = select(attn(), H100, Flags(deterministic=True), env=NO_ENV)
    assert (choice.backend, choice.rejected) == (
        FLASH, ((CUDNN, "deterministic algorithms requested"),))
    assert rejection(CUDNN, attn(), H100, Release(), Flags(cudnn=False, deterministic=True)) == (
        "disabled (torch.backends.cuda / sdpa_kernel)")
    assert rejection(MATH, attn(), H100, Release(), Flags(deterministic=True)) is None


@pytest.mark.parametrize("backend, cc, why", [
    (FLASH, (7, 5), "flash needs sm80..sm121, device is 7.5"),
    (FLASH, (12, 1), None),
    (FLASH, (12, 2), "flash needs sm80..sm121, device is 12.2"),
    (CUDNN, (7, 5), "cuDNN needs sm80..sm121, device is 7.5"),
    (CUDNN, (12, 1), None),
    (EFFICIENT, (5, 0), None),
    (EFFICIENT, (3, 7), "efficient needs sm50..sm121, device is 3.7"),
    (EFFICIENT, (13, 0), "efficient needs sm50..sm121, device is 13.0"),
])
def test_hardware_ranges_of_check_sm_version(backend, cc, why):
    """check_{flash_attention,cudnn,mem_efficient}_hardware_support: [sm80, sm121] for flash
    and cuDNN, [sm50, sm121] for efficient, both ends inclusive."""
    assert rejection(backend, attn(), cc, Release(), Flags()) == why


@pytest.mark.parametrize("cc, dtype, d, offsets, why", [
    # minimum_gemm_alignment: sm80+ tensor cores, max(4, 128 / 16 bits) = 8 for half
    ((8, 0), "float16", 36, (0, 0, 0), "head dim not a multiple of 8"),
    ((8, 0), "float32", 36, (0, 0, 0), None),  # max(4, 128 / 32 bits) = 4
    ((8, 0), "float32", 34, (0, 0, 0), "head dim not a multiple of 4"),
    ((7, 5), "float16", 36, (0, 0, 0), "head dim not a multiple of 8"),  # sm7x half: tensor cores
    ((7, 5), "float32", 33, (0, 0, 0), None),  # sm7x float32: no tensor cores, alignment 1
    ((6, 0), "float16", 33, (0, 0, 0), None),  # sm6x: no tensor cores, alignment 1
    # check_data_ptr_alignment_mem_efficient: storage_offset x element_size % (align x size)
    ((8, 0), "float16", 64, (0, 4, 0), "storage offsets not aligned"),  # 4 x 2 B % 16 B
    ((8, 0), "float16", 64, (0, 8, 0), None),  # 8 x 2 B = 16 B
    ((8, 0), "float32", 64, (0, 0, 2), "storage offsets not aligned"),  # 2 x 4 B % 16 B
    ((8, 0), "float32", 64, (0, 0, 4), None),  # 4 x 4 B = 16 B
    ((7, 5), "float16", 64, (0, 4, 0), None),  # checked on sm80 and newer only
])
def test_efficient_head_dim_and_offsets_follow_minimum_gemm_alignment(cc, dtype, d, offsets, why):
    itemsize = 4 if dtype == "float32" else 2
    call = attn(d, dtype, storage_offsets=offsets, itemsize=itemsize)
    assert rejection(EFFICIENT, call, cc, Release(), Flags()) == why


@pytest.mark.parametrize("cc, release, d, d_v, grad, why", [
    # check_cudnn_tensor_shapes: 128 unless sm90/sm10x, cuDNN > 9.22 and a d256 frontend
    (H100, Release(), 128, 128, True, None),
    (H100, Release(), 136, 136, True, "head dim > 128"),  # 9.19 is not > 9.22
    (H100, Release(), 192, 128, True, None),  # the 192/128 case, cuDNN >= 9.11
    (H100, Release(cudnn_version=91002), 192, 128, True, "head dim > 128"),
    (H100, Release(cudnn_version=92300), 256, 256, True, None),
    (H100, Release(cudnn_version=92300, frontend_d256=False), 256, 256, True, "head dim > 128"),
    (A100, Release(cudnn_version=92300), 256, 256, True, "head dim > 128"),  # not sm90/10x
    ((10, 7), Release(cudnn_version=92500), 256, 256, True, "head dim > 128"),  # old sm107
    ((10, 7), Release(cudnn_version=92600), 256, 256, True, None),
    (H100, Release(), 100, 100, True, "head dim not a multiple of 8"),
    # check_cudnn_d256_bprop_head_dim: a backward for <= 128, 192/128 and 256/256 only
    (H100, Release(cudnn_version=92300), 160, 160, True, "no cuDNN backward for these head dims"),
    (H100, Release(cudnn_version=92300), 160, 160, False, None),
    (H100, Release(cudnn_version=92300), 192, 128, True, None),
])
def test_cudnn_head_dim_limits(cc, release, d, d_v, grad, why):
    call = attn(d, "bfloat16", d_v, requires_grad=grad)
    assert rejection(CUDNN, call, cc, release, Flags()) == why


@pytest.mark.parametrize("change, release, why", [
    # check_cudnn_dropout: a multiple of 1/16
    (dict(dropout=0.1), Release(), "dropout not a multiple of 1/16"),
    (dict(dropout=0.125), Release(), None),  # 2/16
    # can_use_cudnn_attention: no dropout for 91100 < version < 91400
    (dict(dropout=0.125), Release(cudnn_version=91200), "cuDNN 9.11-9.13 has no SDPA dropout"),
    (dict(dropout=0.125), Release(cudnn_version=91100), None),
    (dict(dropout=0.125), Release(cudnn_version=91400), None),
    # check_cudnn_tensor_shapes: no key length 1, no query length 1 with dropout
    (dict(k=(2, 8, 1, 64), v=(2, 8, 1, 64)), Release(), "key length 1"),
    (dict(q=(2, 8, 1, 64), dropout=0.125), Release(), "query length 1 with dropout"),
    (dict(q=(2, 8, 1, 64)), Release(), None),
])
def test_cudnn_dropout_and_sequence_length_rules(change, release, why):
    call = dataclasses.replace(attn(dtype="bfloat16"), **change)
    assert rejection(CUDNN, call, H100, release, Flags()) == why


@pytest.mark.parametrize("mask, needs_grad, why", [
    ((16, 24), False, None),  # 2-D (N, M)
    ((1, 24), False, None),  # rows broadcast
    ((2, 1, 16, 1), False, None),  # (B, 1, N, 1)
    ((1, 8, 16, 24), False, None),  # (1, H, N, M)
    ((4, 8, 16, 24), False, "attn_mask shape (4, 8, 16, 24)"),  # batch 4 is neither 1 nor 2
    ((1, 16, 24), False, "attn_mask shape (1, 16, 24)"),  # 3-D
    ((24,), False, "attn_mask shape (24,)"),  # 1-D: a reason, not an IndexError
    ((24, 16), False, "attn_mask shape (24, 16)"),  # (M, N): rows and keys swapped
    ((16, 24), True, "attn_mask requires grad"),
])
def test_cudnn_attn_mask_shapes(mask, needs_grad, why):
    """check_attn_mask_shape (sdp_utils_cpp.h): 2-D or 4-D, each dim 1 or the call's;
    16 query rows against 24 keys."""
    call = Call((2, 8, 16, 64), (2, 8, 24, 64), (2, 8, 24, 64), "bfloat16", mask=mask,
                mask_requires_grad=needs_grad)
    assert rejection(CUDNN, call, H100, Release(), Flags()) == why


def test_grouped_heads_cudnn_allows_different_key_and_value_heads_flash_does_not():
    """check_batch_size_and_num_heads_dense<supports_gqa, requires_same_num_heads>: cuDNN is
    instantiated with requires_same_num_heads=false, flash and efficient with true."""
    q, k, v = (2, 8, 16, 64), (2, 2, 16, 64), (2, 4, 16, 64)
    call = Call(q, k, v, "bfloat16", enable_gqa=True)
    assert rejection(CUDNN, call, H100, Release(), Flags()) is None
    for backend in (FLASH, EFFICIENT):
        assert rejection(backend, call, H100, Release(), Flags()) == (
            "key/value heads do not divide query heads")
    odd = Call(q, k, (2, 3, 16, 64), "bfloat16", enable_gqa=True)  # 8 % 3 != 0
    assert rejection(CUDNN, odd, H100, Release(), Flags()) == (
        "key/value heads do not divide query heads")
    other_batch = Call(q, (1, 8, 16, 64), (1, 8, 16, 64), "bfloat16")
    assert rejection(CUDNN, other_batch, H100, Release(), Flags()) == "batch sizes differ"


# --- the rules of each release (--torch) ----------------------------------------------------

B200 = (10, 0)


def test_a_release_brings_its_wheels_cudnn_and_cuda():
    """PINS: the default PyPI wheel's runtime cuDNN and CUDA major version."""
    assert Release.of("2.13.0+cu130") == Release(92000, 13, False, (2, 13))
    assert Release.of("2.4") == Release(90100, 12, False, (2, 4))
    assert Release.of("2.14").frontend_d256 and Release.of("2.5.0").torch == (2, 5, 0)
    assert Release.of("2.5.1").torch == (2, 5)
    assert Release.of("2.15.0+cu132") == Release(92600, 13, True, (2, 15))  # cuDNN 9.26.0
    for bad, why in (("3.0", "no SDPA rules for 3.0"), ("two", "not a release")):
        with pytest.raises(ValueError, match=f"--torch: .*{why}"):
            Release.of(bad)


@pytest.mark.parametrize("version, cc, order", [
    ("2.4", H100, (CUDNN, FLASH, EFFICIENT, MATH)),  # listed first, off by default
    ("2.5.0", H100, (CUDNN, FLASH, EFFICIENT, MATH)),  # preferred on sm90 ...
    ("2.5.0", A100, (FLASH, CUDNN, EFFICIENT, MATH)),  # ... second elsewhere
    ("2.5", H100, (FLASH, EFFICIENT, MATH, CUDNN)),  # 2.5.1: opt-in (#138522)
    ("2.9", H100, (FLASH, EFFICIENT, MATH, CUDNN)),  # its rule compiled out of the wheel
    ("2.10", H100, (FLASH, EFFICIENT, MATH, CUDNN)),  # the rule, but cuDNN 9.10.2 <= 9.15
    ("2.11", H100, (CUDNN, FLASH, EFFICIENT, MATH)),  # cuDNN 9.19 > 9.15
    ("2.12", (10, 1), (FLASH, EFFICIENT, MATH, CUDNN)),  # minor 1: not before 2.13
    ("2.13", (10, 1), (CUDNN, FLASH, EFFICIENT, MATH)),  # CUDA 13: any minor
])
def test_each_release_orders_the_backends_its_way(version, cc, order):
    assert priority(cc, Release.of(version), NO_ENV) == order


def test_flash_takes_at_most_65535_batches_or_heads_from_2_15():
    """``check_flash_attention_grid_size`` (2.15), as cuDNN's ``check_cudnn_tensor_shapes``
    from 2.13: 65,536 heads of (B, H, N, d) = (1, 65536, 16, 64) run flash on 2.14, the
    memory-efficient kernel on 2.15 (cuDNN refuses them too)."""
    wide = Call((1, 65536, 16, 64), (1, 65536, 16, 64), (1, 65536, 16, 64), "float16")
    assert select(wide, A100, release=Release.of("2.14"), env=NO_ENV).backend == FLASH
    choice = select(wide, A100, release=Release.of("2.15"), env=NO_ENV)
    assert choice.backend == EFFICIENT
    assert dict(choice.rejected)[FLASH] == "batch or heads > 65535"


def test_torch_2_4_never_trains_on_cudnn():
    """check_runtime_enabled_cudnn and check_cudnn_requires_grad: off unless
    TORCH_CUDNN_SDPA_ENABLED=1, and then for inference only; so flash is taken."""
    r = Release.of("2.4")
    assert select(attn(), H100, release=r, env=NO_ENV).backend == FLASH
    from memcalc.impls import sdpa_select

    assert sdpa_select._cudnn_opt_in(attn(requires_grad=False), H100, r,
                                     {"TORCH_CUDNN_SDPA_ENABLED": "1"}) is None


def test_grouped_heads_run_on_efficient_only_from_2_14_and_on_flash_from_2_5():
    """check_batch_size_and_num_heads_dense<false, true> for efficient through 2.13: an fp32
    grouped call (which flash refuses) runs on math there, on efficient in 2.14."""
    gqa = Call((2, 8, 16, 64), (2, 2, 16, 64), (2, 2, 16, 64), "float32", enable_gqa=True)
    assert select(gqa, A100, release=Release.of("2.13"), env=NO_ENV).backend == MATH
    assert select(gqa, A100, release=Release.of("2.14"), env=NO_ENV).backend == EFFICIENT
    half = dataclasses.replace(gqa, dtype="float16")
    assert select(half, A100, release=Release.of("2.5"), env=NO_ENV).backend == FLASH
    assert select(half, A100, release=Release.of("2.4"), env=NO_ENV).backend == MATH


def test_a_b200_takes_math_before_2_7():
    """check_sm_version: the fused kernels end at sm90 through 2.6."""
    assert select(attn(), B200, release=Release.of("2.6"), env=NO_ENV).backend == MATH
    assert select(attn(), B200, release=Release.of("2.8"), env=NO_ENV).backend in (FLASH, CUDNN)


@pytest.mark.parametrize("version, d, why", [
    ("2.7", 192, "head dim > 128"),
    ("2.8", 192, None),  # 256 on sm90 with cuDNN > 9.5
    ("2.13", 256, None),  # 256 on sm90 with cuDNN >= 9.10
    ("2.14", 256, "head dim > 128"),  # needs cuDNN > 9.22 and the frontend: 9.19 here
])
def test_cudnns_head_dim_limit_by_release(version, d, why):
    r = dataclasses.replace(Release.of(version), cudnn_version=91900)
    assert rejection(CUDNN, attn(d=d), H100, r, Flags()) == why


def test_cudnn_refuses_a_length_of_1_from_2_6_and_determinism_from_2_5():
    one = attn(requires_grad=False)
    one = dataclasses.replace(one, q=(2, 8, 1, 64))
    assert rejection(CUDNN, one, H100, Release.of("2.8"), Flags()) == "sequence length 1"
    assert rejection(CUDNN, one, H100, Release.of("2.9"), Flags()) is None  # only kv or dropout
    assert rejection(CUDNN, attn(), H100, Release.of("2.13"), Flags(deterministic=True)) == (
        "deterministic algorithms requested")
