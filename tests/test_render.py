"""Rendered output at a fixed console width, and the integer-only unit formatting."""

import io

from rich.console import Console

from memcalc.config import Config
from memcalc.timeline import predict
from memcalc.units import human, mib, share


def render(obj, width=200) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None)
    console.print(obj)
    return console.file.getvalue()


def test_breakdown_table_rows():
    text = render(predict(Config(impl="naive-softmax")))
    lines = text.splitlines()
    assert lines[0].startswith("naive-softmax: B=8 H=1 N=16384 d=16 fp32 on NVIDIA H100")
    row = next(line for line in lines if line.strip().startswith("p "))
    # p: 8 x 1 x 16384 x 16384 x 4 B = 8,589,934,592 = 8,192 MiB; share of the peak
    # 8,589,934,592 / 25,887,244,288 = 33.18...% -> 33.2%
    assert "8 x 1 x 16384 x 16384 x 4 B" in row and "8,192.00" in row and "33.2%" in row
    saved = next(line for line in lines if "saved for backward" in line)
    assert "8589934592" in saved and "8.00 GiB" in saved


def test_html_for_jupyter():
    assert "<pre" in predict(Config(shape={"seq_len": 256}))._repr_html_()


def test_units_are_exact():
    assert mib(8_589_934_592) == "8,192.00"
    assert mib(524_288) == "0.50"
    assert mib(1) == "0.00"
    assert human(512) == "512 B"
    assert human(25_887_244_288) == "24.11 GiB"  # 25,887,244,288 / 2^30 = 24.1093...
    assert share(1, 3) == "33.3%"
    assert share(2, 3) == "66.7%"
