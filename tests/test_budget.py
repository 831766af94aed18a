"""The budget (device memory less the reserve), the presets it reads, and "fits"."""

import json
import re

import pytest
from pydantic import ValidationError

import memcalc
from memcalc.engine.allocator import MiB
from memcalc.analysis.budget import (DEFAULT_RESERVE_BYTES, Budget, check, fit, fits, parse_gb, parse_size)
from memcalc.config import Config, Device
from memcalc.gpus import gpu_presets
from memcalc.analysis.predict import predict
from cli_helpers import assert_refused, run

GiB = 1024 * MiB


@pytest.mark.parametrize("text, nbytes", [
    ("512MiB", 536_870_912),  # 512 x 2^20
    ("0", 0),
    ("300", 300),  # a bare number is bytes, as the API's int is
    ("1.5GiB", 1_610_612_736),  # 3 x 2^29
    ("200MB", 209_715_200),  # MB is MiB: 200 x 2^20 (one meaning per unit, as --gpu-gb's GB)
    ("1GB", 1_073_741_824),  # 2^30
    ("4096 B", 4096),
    ("1_024MiB", 1_073_741_824),  # written as sizes are: 1,024 x 2^20
    ("1e3", 1000),
    ("2TB", 2_199_023_255_552),  # 2 x 2^40
])
def test_parse_size(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["1,,x", "-5", "12parsecs", "1.0000001B", "", "1__0", "1e"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="--reserve"):
        parse_size(text)


def test_gpu_gb_counts_binary_gigabytes():
    assert Budget.given(Device(), "80", 0).memory_bytes == 85_899_345_920  # 80 x 2^30
    assert Budget.given(Device(), "79.5", 0).memory_bytes == 85_362_475_008  # 159 x 2^29
    for bad in ("0", "-1", "x", "1/0", "1/3", "0.0000000009"):  # 9e-10 x 2^30 < 1 B
        with pytest.raises(ValueError, match="--gpu-gb"):
            parse_gb(bad)


def test_gpu_gb_as_pytorch_prints_it_is_rounded_down_to_a_byte():
    """PyTorch's OOM message rounds GiB to two places ("total capacity of 79.11 GiB"): a
    user copies that figure; it is read exactly and rounded down, and the budget says so."""
    b = Budget.given(Device(), 79.11, 0)
    # 79.11 x 2^30 = 7911 x 1,073,741,824 / 100 = 84,943,715,696.64 -> 84,943,715,696
    assert b.memory_bytes == 84_943_715_696
    assert b.device.startswith("79.11 GiB (--gpu-gb, rounded down to a whole byte;")
    assert "rounded" not in Budget.given(Device(), "79.5").device


def test_default_budget_of_a_preset():
    b = Budget.of(Device(gpu="h100-80gb"))
    assert b.reserve_bytes == DEFAULT_RESERVE_BYTES == 536_870_912  # 512 MiB
    # h100-80gb: PyTorch's 'total capacity of 79.11 GiB' read as 81004 MiB (the smallest
    # whole MiB that prints so); 81004 x 2^20 - 512 x 2^20 = 80492 x 2^20
    assert b.budget_bytes == 84_401_979_392
    assert "total capacity PyTorch reports" in b.describe()
    assert "NVIDIA H100" in b.describe()


def test_gpu_gb_budget_says_what_gb_means():
    b = Budget.of(Device(gpu="a100-80gb"), reserve_bytes=0, memory_gb=parse_gb("40"))
    assert b.budget_bytes == 42_949_672_960  # 40 x 2^30
    assert "40 GiB (--gpu-gb" in b.describe() and "a100-80gb" in b.describe()


def test_gpu_gb_is_shown_as_given_exactly():
    """A GB figure is a whole number of bytes over 2^30: a finite decimal, shown whole (a
    float's six digits showed 2^-10 GB as 0.000976562)."""
    b = Budget.of(Device(), reserve_bytes=0, memory_gb=parse_gb("0.0009765625"))
    assert b.budget_bytes == 1_048_576  # 2^-10 x 2^30 = 2^20
    assert b.device.startswith("0.0009765625 GiB (--gpu-gb;")
    assert Budget.of(Device(), memory_gb=parse_gb("79.5")).device.startswith("79.5 GiB")


def test_a_size_has_one_meaning_in_the_api_and_the_cli(capsys):
    """A bare number is bytes whether an int, a text or an option; GB is GiB in --reserve as
    in --gpu-gb, and the budget line says how a GB was read."""
    texts = [Budget.given(Device(), 80, r).reserve_bytes for r in (1024, "1024", "1KiB")]
    assert texts == [1024, 1024, 1024]
    assert Budget.given(Device(), 80, "1GB").reserve_bytes == Budget.given(
        Device(), 80, "1GiB").reserve_bytes == 1_073_741_824  # 2^30
    code, out, _ = run(capsys, "breakdown", "--seq", "1024", "--gpu-gb", "80", "--reserve", "1GB")
    assert code == 0 and "1 GB = 1 GiB" in " ".join(out.split())
    assert "80 GiB (--gpu-gb" in out and "GB (GB" not in out


def test_a_gpu_gb_the_default_reserve_fills_names_gpu_gb():
    """--gpu-gb 0.5 is all CUDA context: the option given is named, with formatted sizes."""
    with pytest.raises(ValueError) as e:
        Budget.given(Device(), "0.5")
    assert str(e.value) == ("--gpu-gb: 0.5 GiB (536,870,912 B) is all taken by the default "
                            "--reserve for the CUDA context, 536,870,912 B (512.00 MiB); "
                            "allowed: more than that, or a smaller --reserve")  # 2^29 B both


def test_reserve_must_leave_memory():
    with pytest.raises(ValidationError, match="--reserve"):
        Budget(device="x", memory_bytes=GiB, reserve_bytes=GiB)


def test_presets_memory_matches_their_source():
    # every preset: smi_memory_bytes = the MiB figure nvidia-smi shows x 2^20; memory_bytes
    # the smallest whole MiB that PyTorch's OOM message prints as the quoted "total
    # capacity of X GiB" (ceil((X - 0.005) x 1024) MiB), or what a live run measured, or
    # nvidia-smi's where neither is known
    from fractions import Fraction

    for g in gpu_presets().values():
        mib = int(re.search(r"memory\.total (\d+) MiB", g.smi_source).group(1))
        assert g.smi_memory_bytes == mib * MiB, g.name
        quoted = re.search(r"total capacity of (\d+\.\d\d) GiB", g.source)
        measured = re.match(r"measured: .*total_memory = (\d+)", g.source)
        if measured:  # read on the card itself by a live run: that figure, to the byte
            assert g.memory_kind == "torch" and g.memory_bytes == int(measured.group(1))
            assert g.memory_bytes < g.smi_memory_bytes, g.name
        elif g.memory_kind == "torch":
            x = Fraction(quoted.group(1))
            assert g.memory_bytes == -(-(x - Fraction(5, 1000)) * 1024 // 1) * MiB, g.name
            assert g.memory_bytes < g.smi_memory_bytes, g.name
        else:
            assert g.memory_kind == "nvidia-smi" and g.memory_bytes == g.smi_memory_bytes


# --- fits ---------------------------------------------------------------------------------

SMALL = Config(impl="naive-softmax", shape={"batch": 1, "seq_len": 4096})
# its reserved peak, unbounded: the one figure the tests below pivot on: five 64 MiB
# segments for the N x N tensors (4096^2 x 4 B each: in the backward p, dp, the softmax's
# grad and its grad * p temporary), a 32 MiB one for a cuBLAS workspace, two 2 MiB
# small-pool segments = 5 x 67,108,864 + 33,554,432 + 2 x 2,097,152
R_SMALL = 373_293_056


def test_fits_within_the_reserved_peak():
    b = predict(SMALL)
    assert b.reserved_peak_bytes == R_SMALL
    f = fit(SMALL, R_SMALL, b)
    assert f.fits and not f.retried and f.headroom_bytes == 0  # budget == reserved peak


def test_fits_after_release_and_retry():
    # 1 MiB below the reserved peak: a segment request fails, the allocator frees its cached
    # segments and retries, and the step completes
    f = fit(SMALL, R_SMALL - MiB)
    assert f.fits and f.retried and f.headroom_bytes == -1_048_576


def test_does_not_fit_when_the_blocks_alone_exceed():
    b = predict(SMALL)
    f = fit(SMALL, b.peak_bytes - 1)  # below max_memory_allocated: nothing can save it
    assert not f.fits
    assert f.oom_request_bytes > 0 and f.oom_reserved_bytes + f.oom_request_bytes > b.peak_bytes - 1


@pytest.mark.parametrize("impl", ["naive", "naive-softmax", "naive-weights"])
@pytest.mark.parametrize("n", [1000, 2048, 4097])
def test_fit_agrees_with_the_one_replay_definition(impl, n):
    config = Config(impl=impl, shape={"batch": 2, "seq_len": n})
    r = predict(config).reserved_peak_bytes
    for budget in (r + 1, r, r - MiB, r - 8 * MiB, r - 64 * MiB, r // 2):
        assert fit(config, budget).fits == fits(config, budget)


def test_check_judges_a_breakdown_which_then_shows_its_budget():
    c = check(SMALL, Budget(device="test", memory_bytes=R_SMALL + DEFAULT_RESERVE_BYTES))
    data = c.to_dict()
    assert data["budget_bytes"] == R_SMALL and data["fits"] is True
    assert data["peak_bytes"] == predict(SMALL).peak_bytes
    assert "fits: reserved peak" in c.to_markdown() and "budget " in str(c.footnotes())
    plain = predict(SMALL)  # no budget given: none shown, none in its JSON
    assert "budget_bytes" not in plain.to_dict() and "budget" not in str(plain.footnotes())


def test_the_api_breakdown_in_a_budget_shows_it_as_the_command_does(capsys):
    """``memcalc.breakdown(gpu_gb=40)`` said "fits" in its repr but its tables, HTML and
    JSON left the budget out: ``memcalc breakdown --gpu-gb 40`` prints both."""
    b = memcalc.breakdown(seq_len=1024, gpu_gb=40)
    code, out, _ = run(capsys, "breakdown", "--seq", "1024", "--gpu-gb", "40", "--json")
    assert code == 0 and b.to_dict() == json.loads(out)
    assert "40 GiB (--gpu-gb" in b._repr_html_() and "fits: reserved peak" in b._repr_html_()
    # no budget given: the preset's, as the command's default (its JSON had no "fits")
    code, out, _ = run(capsys, "breakdown", "--seq", "1024", "--json")
    assert memcalc.breakdown(seq_len=1024).to_dict() == json.loads(out)


# --- CLI ----------------------------------------------------------------------------------

def test_breakdown_reports_the_fit(capsys):
    code, out, _ = run(capsys, "breakdown", "--seq", "20000", "--gpu-gb", "80", "--json")
    data = json.loads(out)
    assert code == 0
    assert data["budget_bytes"] == 85_362_475_008  # 80 x 2^30 - 512 x 2^20
    assert data["fits"] is False  # the seeds' naive step at N=20000 needs 83.5 GiB reserved
    code, out, _ = run(capsys, "breakdown", "--seq", "16384", "--reserve", "0")
    assert code == 0 and "fits: reserved peak" in out


@pytest.mark.parametrize("argv, option", [
    (["--reserve", "1,,x"], "--reserve"),
    (["--reserve", "100GiB"], "--reserve"),
    (["--gpu-gb", "0"], "--gpu-gb"),
    (["--gpu-gb", "eighty"], "--gpu-gb"),
])
def test_bad_budget_options(capsys, argv, option):
    code, out, err = run(capsys, "breakdown", "--seq", "1024", *argv)
    assert_refused(code, out, err, option)


def test_a_rank_that_runs_out_is_named():
    """Under --cp each rank's step is replayed on its own GPU; the one that runs out is
    named in the fit (one GPU's OOM names none). FlashAttention's ring over 4 ranks at
    1,048,576 tokens (32 heads of 128, bf16) in 20 GiB: rank 0's all-gathered K and V,
    2 x 1,048,576 x 32 x 128 x 2 B = 17,179,869,184 B, do not fit on top of what it
    reserved before."""
    from memcalc.config import make_config

    config = make_config(impl="sdpa-flash", causal=True, cp=4, seq_len=1 << 20, heads=32,
                         head_dim=128, dtype="bf16", batch=1)
    ring = fit(config, 20 << 30)
    assert (ring.oom_rank, ring.oom_request_bytes) == (0, 17_179_869_184)
    assert ring.describe().startswith("OOM on rank 0: a 17,179,869,184 B segment")
    one = fit(config.replace(cp=1, seq_len=1 << 16), 1 << 29)
    assert not one.fits and one.oom_rank is None and one.describe().startswith("OOM: a ")
