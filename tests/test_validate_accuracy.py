"""memcalc.validation.accuracy: the accuracy page, from the recorded GPU runs."""

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")  # the traced cases are given back by tracing them

from memcalc.validation.accuracy import OTHERS, live_reports, page  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "validation" / "results"


def test_every_live_grid_case_is_counted_and_given_back():
    """The H200's grid: as many cases as the report measured, each given back."""
    report = json.loads((RESULTS / "nvidia-h200-2.11.0-cu130.json").read_text())
    n = sum(1 for c in report["checks"] if c["case"] == "grid" and c["outcome"] == "measured")
    assert f"| NVIDIA H200 | 2.11.0+cu130 | grid | {n:,} | {n:,} |" in page(RESULTS)


def test_what_is_not_given_back_is_listed_with_why():
    text = page(RESULTS)
    assert "kept the parameters' grads" in text.split("## What differed, and why")[1]


def test_every_recorded_file_is_on_the_page():
    """A live report in the first table, every other file named with its test."""
    text = page(RESULTS)
    live = {p.name for p, _ in live_reports(RESULTS)}
    for path in RESULTS.glob("*.json"):
        assert path.name in live or f"`{path.name}`" in text, path.name
    assert all(Path(__file__).parent.parent.joinpath(test).exists()
               for _, test in OTHERS.values())
