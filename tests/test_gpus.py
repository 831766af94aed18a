"""GPU presets: loaded from memcalc/data/gpus.json, found by forgiving names, validated."""

import json
from importlib import resources

import pytest
from pydantic import ValidationError

from memcalc.gpus import GPU, MEMORY_KINDS, gpu_preset, gpu_presets

# every entry of memcalc/data/gpus.json but "_doc", in sorted order ("-" sorts before digits
# and letters: "a100-..." before "a10g", "h100-..." before "h20" before "h200")
KNOWN = ("a100-40gb, a100-80gb, a10g, a800-80gb, b200, gh200, h100-80gb, h100-nvl, h100-pcie, "
         "h20, h200, l4, l40s, rtx-4090, rtx-5090, t4")


def raw_presets() -> dict:
    return json.loads(resources.files("memcalc").joinpath("data/gpus.json").read_text())


def test_the_presets_are_the_entries_of_gpus_json_by_name():
    presets = gpu_presets()
    assert ", ".join(sorted(presets)) == KNOWN  # 16 presets; "_doc" is not one
    assert all(g.name == key for key, g in presets.items())


def test_every_field_of_an_entry_is_loaded_unchanged():
    """The model adds only the name; JSON's [major, minor] becomes a tuple."""
    for key, entry in raw_presets().items():
        if key.startswith("_"):
            continue
        expected = {**entry, "compute_capability": tuple(entry["compute_capability"])}
        assert gpu_presets()[key].model_dump(exclude={"name"}) == expected, key


@pytest.mark.parametrize("name, label, cc, sms, kind", [
    # gpus.json; sm_count is cudaDeviceProp.multiProcessorCount per NVIDIA's specifications
    ("h100-80gb", "NVIDIA H100 80GB HBM3 (SXM)", (9, 0), 132, "torch"),  # Hopper SXM5
    ("h100-pcie", "NVIDIA H100 PCIe", (9, 0), 114, "nvidia-smi"),  # Hopper, fewer SMs
    ("h200", "NVIDIA H200", (9, 0), 132, "torch"),  # total_memory as a live run read it
    ("a100-40gb", "NVIDIA A100-SXM4-40GB", (8, 0), 108, "torch"),  # Ampere GA100
    ("l40s", "NVIDIA L40S", (8, 9), 142, "nvidia-smi"),  # Ada
    ("t4", "Tesla T4", (7, 5), 40, "torch"),  # Turing
    ("b200", "NVIDIA B200", (10, 0), 148, "nvidia-smi"),  # Blackwell datacenter
    ("rtx-5090", "NVIDIA GeForce RTX 5090", (12, 0), 170, "torch"),  # Blackwell consumer
])
def test_preset_device_figures(name, label, cc, sms, kind):
    g = gpu_preset(name)
    assert (g.label, g.compute_capability, g.sm_count, g.memory_kind) == (label, cc, sms, kind)


@pytest.mark.parametrize("spelling", ["H100-80GB", "h100_80gb", " H100 80GB ", "H100_80gb"])
def test_gpu_preset_forgives_case_underscores_and_spaces(spelling):
    assert gpu_preset(spelling) is gpu_presets()["h100-80gb"]


@pytest.mark.parametrize("name, message", [
    ("a100", "unknown GPU 'a100' (did you mean 'a100-40gb' or 'a100-80gb'?); known: " + KNOWN),
    ("h10-80gb", "unknown GPU 'h10-80gb' (did you mean 'h100-80gb'?); known: " + KNOWN),
    ("tpu", "unknown GPU 'tpu'; known: " + KNOWN),  # nothing close: the list alone
])
def test_unknown_gpu_suggests_and_lists_the_known_ones(name, message):
    """A ValueError (which ``config.Device`` turns into a validation error naming ``gpu``):
    names that start with the word, else the closest by difflib, then every preset."""
    with pytest.raises(ValueError) as info:
        gpu_preset(name)
    assert str(info.value) == message


def test_a_device_given_by_hand_needs_no_source_figures():
    g = GPU(name="custom", label="my card", memory_bytes=17_179_869_184,  # 16 x 2^30
            compute_capability=(8, 6), source="given by the user")
    assert (g.memory_kind, g.sm_count, g.smi_memory_bytes, g.smi_source) == ("given", None, None, "")
    assert set(MEMORY_KINDS) == {"torch", "nvidia-smi", "given"}  # a description for each kind


@pytest.mark.parametrize("field, value", [
    ("memory_bytes", 0),
    ("sm_count", 0),
    ("smi_memory_bytes", 0),
    ("memory_kind", "measured"),
    ("memory_gb", 80),  # not a field
])
def test_gpu_refuses_a_bad_field(field, value):
    good = dict(name="x", label="x", memory_bytes=1, compute_capability=(8, 0), source="s")
    with pytest.raises(ValidationError, match=field):
        GPU(**{**good, field: value})


def test_a_preset_cannot_be_changed():
    with pytest.raises(ValidationError, match="frozen"):
        gpu_preset("t4").memory_bytes = 16_106_127_360  # t4's nvidia-smi total: 15360 x 2^20
    assert gpu_preset("t4").memory_bytes == 15_629_025_280  # 14905 x 2^20, gpus.json's t4


def test_the_gpus_command_says_where_each_memory_figure_is_from(capsys, monkeypatch):
    """The memory column holds PyTorch's total capacity or, where no report quotes it,
    nvidia-smi's total (its header said "memory PyTorch can use" for both)."""
    from memcalc.cli import main

    monkeypatch.setenv("COLUMNS", "200")
    assert main(["gpus"]) == 0
    out = capsys.readouterr().out
    assert "memory (B)" in out and "PyTorch can use (B)" not in out
    assert ("memory, from torch: the total capacity PyTorch reports; nvidia-smi: nvidia-smi's "
            "total; PyTorch may see ~0.5 GiB less") in out
