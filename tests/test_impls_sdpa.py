"""``memcalc.impls.sdpa``: ``F.scaled_dot_product_attention`` on the kernel torch's rules
pick, its figures that kernel's model's, its results saying which and why."""

import json

import pytest

import memcalc
from cli_helpers import assert_refused, run
from memcalc.impls import sdpa
from memcalc.impls.sdpa_select import Release

SIZES = dict(seq_len=2048, head_dim=64, batch=2, heads=4)


@pytest.fixture(autouse=True)
def torch_2_13(monkeypatch):
    """The rules of torch 2.13 (the release CI installs), whatever is installed here."""
    monkeypatch.setattr(sdpa, "installed_release", lambda: Release.of("2.13.0"))


@pytest.mark.parametrize("gpu, dtype, head_dim, kernel", [
    # sm90 in bf16: 2.13 tries cuDNN first (sdp_utils.cpp priority order)
    ("h100-80gb", "bf16", 64, "sdpa-cudnn"),
    # sm80: flash first; cuDNN only on sm90 and newer by default
    ("a100-80gb", "bf16", 64, "sdpa-flash"),
    # fp32: flash and cuDNN take fp16 and bf16 only
    ("h100-80gb", "fp32", 64, "sdpa-efficient"),
    # d=512: past flash's 256 and cuDNN's; the memory-efficient kernel's kMaxK is 65,536
    ("h100-80gb", "bf16", 512, "sdpa-efficient"),
    # d=63 in fp32: not a multiple of the efficient kernel's alignment (4): math
    ("a100-80gb", "fp32", 63, "sdpa-math"),
    # sm75 has no bf16 for flash nor the efficient kernel: math
    ("t4", "bf16", 64, "sdpa-math"),
])
def test_sdpa_runs_the_kernel_torch_picks_and_has_its_figures(gpu, dtype, head_dim, kernel):
    sizes = dict(SIZES, gpu=gpu, dtype=dtype, head_dim=head_dim)
    picked = memcalc.breakdown(impl="sdpa", **sizes)
    direct = memcalc.breakdown(impl=kernel, **sizes)
    assert picked.kernel == kernel and direct.kernel is None
    assert picked.figures() == direct.figures()
    assert picked.reserved_peak_bytes == direct.reserved_peak_bytes
    assert picked.records() == direct.records()


def test_the_release_decides():
    """torch 2.4 ran flash first on sm90 (cuDNN was tried first from 2.5's rules on)."""
    d = memcalc.breakdown(impl="sdpa", dtype="bf16", gpu="h100-80gb", **SIZES).config.dims
    assert sdpa.choice(d).backend == "cudnn"
    old = sdpa.select(sdpa.call_of(d), (9, 0), release=Release.of("2.4"))
    assert old.backend == "flash"


def test_results_name_the_kernel_and_why(capsys):
    code, out, _ = run(capsys, "breakdown", "--impl", "sdpa", "--seq", "2048", "--dtype",
                       "fp32")
    assert code == 0
    assert out.startswith("sdpa (sdpa-efficient): ")
    assert "sdpa: torch 2.13's rules pick efficient (priority cudnn > flash > efficient" in out
    _, js, _ = run(capsys, "breakdown", "--impl", "sdpa", "--seq", "2048", "--json")
    assert json.loads(js)["kernel"] == "sdpa-efficient"  # fp32 by default
    _, plain, _ = run(capsys, "breakdown", "--impl", "naive", "--seq", "2048", "--json")
    assert "kernel" not in json.loads(plain)


def test_a_sweep_says_each_different_pick_where(capsys):
    code, out, _ = run(capsys, "sweep", "--impl", "sdpa", "--seq", "1024,2048", "--dtype",
                       "fp32,bf16")
    assert code == 0
    assert "sdpa at B=8 H=1 N=1024 d=16 bf16: torch 2.13's rules pick cudnn" in out
    assert "sdpa at B=8 H=1 N=1024 d=16 fp32: torch 2.13's rules pick efficient" in out


def test_oom_and_compare_say_the_pick(capsys):
    _, oom, _ = run(capsys, "oom", "--impl", "sdpa", "--gpu-gb", "80", "--dtype", "bf16")
    assert "\nsdpa: torch 2.13's rules pick cudnn" in oom
    _, cmp, _ = run(capsys, "compare", "--impl", "sdpa,naive", "--seq", "1024")
    assert "\nsdpa: torch 2.13's rules pick efficient" in cmp


def test_a_pick_memcalc_does_not_model_is_refused_saying_so(capsys):
    """sm75 in fp16: torch runs the efficient kernel, modelled for sm80 and sm90 only."""
    code, out, err = run(capsys, "breakdown", "--impl", "sdpa", "--gpu", "t4", "--dtype",
                         "fp16", "--seq", "2048")
    assert_refused(code, out, err, "--gpu")
    assert "sdpa runs sdpa-efficient here (torch 2.13's rules pick efficient" in err


def test_without_torch_the_newest_rules_apply(monkeypatch):
    from importlib import metadata

    monkeypatch.undo()  # the real installed_release, its cache cleared
    sdpa.installed_release.cache_clear()

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    try:
        assert sdpa.installed_release() == Release()
    finally:
        sdpa.installed_release.cache_clear()


def test_a_mask_the_picked_kernel_is_not_modelled_with_is_refused(capsys):
    """With a padding mask torch 2.13 still tries cuDNN first on sm90 (its
    ``check_attn_mask_shape`` takes a (B, 1, 1, M) bool mask); memcalc's cuDNN model has
    no attn_mask, so sdpa says so rather than leave the mask out. fp32: the efficient
    kernel, which reads it."""
    code, out, err = run(capsys, "breakdown", "--impl", "sdpa", "--mask", "padding",
                         "--dtype", "bf16", "--seq", "2048")
    assert_refused(code, out, err, "--mask")
    assert "sdpa runs sdpa-cudnn here" in err and "--impl sdpa-efficient reads one" in err
    picked = memcalc.breakdown(impl="sdpa", mask="padding", **SIZES)
    assert picked.figures() == memcalc.breakdown(impl="sdpa-efficient", mask="padding",
                                                 **SIZES).figures()
