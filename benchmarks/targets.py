"""The speed figures memcalc holds itself to, each against its bound, recorded.

Each figure is measured here as a user meets it (a fresh process where a user starts one)
and written, with its bound and the machine, to ``benchmarks/results.json``; the README's
performance table is rendered from that file (``render``), never typed.

Run from the repository root: ``python benchmarks/run.py --targets`` (about two minutes on
2 cores; ``--suite`` adds the test suite's wall time, about three more).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import bench_startup

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results.json"
CLI = [sys.executable, "-m", "memcalc.cli"]

# (key, what, unit, bound): the figures and the most each may be
FIGURES = [
    ("sweep_1m", "`memcalc.sweep` of 1,000,000 configurations (250,000 lengths to 16M, "
     "head dims 64 and 128, batches 1 and 8), first call", "s", 10.0),
    ("chunked_1e6", "`memcalc breakdown --impl linear-causal-chunked --seq 1000000`, "
     "a fresh process", "s", 5.0),
    ("trace_autocast", "`memcalc trace` of nanoGPT's attention module under `--autocast bf16` "
     "/ `python -c \"import torch\"`", "x", 1.5),
    ("trace_llama", "`memcalc trace` of a 2-layer Llama causal LM with its loss / importing "
     "torch and transformers' Llama", "x", 2.5),
    ("startup", "`memcalc breakdown --seq 16384 --json` / importing pydantic and rich and "
     "building one model", "x", 1.4),
]
SUITE = ("suite", "the test suite, `python -m pytest -n auto` (README's command)", "s", None)

NANOGPT = ["trace", "examples/attention/nanogpt.py:CausalSelfAttention", "--input",
           "x=B,N,768", "--seq", "1024", "--batch", "8", "--autocast", "bf16", "--gpu",
           "a100-40gb", "--json"]
LLAMA = ["trace", "examples/huggingface/llama.py:causal_lm", "--input",
         "input_ids=B,N:int64", "--input", "attention_mask=B,N:int64", "--input",
         "labels=B,N:int64", "--seq", "2048", "--batch", "1", "--autocast", "bf16", "--gpu",
         "a100-80gb", "--json"]
LLAMA_FLOOR = [sys.executable, "-c",
               "import torch; from transformers import LlamaConfig, LlamaForCausalLM"]


def fresh(code: str) -> float:
    """Seconds ``code`` takes in a fresh Python process (what it prints)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    return float(out.stdout.split()[-1])


def sweep_1m() -> float:
    """The million-configuration sweep, as the first call of a fresh process."""
    return fresh("import time, numpy as np, memcalc\n"
                 "n = np.unique(np.linspace(1, 16 << 20, 250_000).astype(np.int64)).tolist()\n"
                 "t = time.perf_counter()\n"
                 "memcalc.sweep(seq_lens=n, head_dims=(64, 128), batches=(1, 8))\n"
                 "print(time.perf_counter() - t)")


def chunked_1e6(runs: int) -> float:
    """The chunked loop at N = 1e6 from the command line, median of ``runs``."""
    argv = CLI + ["breakdown", "--impl", "linear-causal-chunked", "--seq", "1000000"]
    return statistics.median(_wall(argv) for _ in range(runs))


def _wall(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    return time.perf_counter() - start


def factor(args: list[str], floor: list[str], runs: int) -> float:
    """``memcalc args`` over ``floor``, medians of ``runs`` interleaved fresh processes."""
    return bench_startup.measure(runs, args, floor)["factor"]


def suite() -> float:
    """The README's test command, wall seconds."""
    return _wall([sys.executable, "-m", "pytest", "-n", "auto", "-q", "-p", "no:cacheprovider"])


def measure(runs: int = 7, with_suite: bool = False) -> dict:
    """Every figure, measured now."""
    values = {"sweep_1m": sweep_1m(), "chunked_1e6": chunked_1e6(runs),
              "trace_autocast": factor(NANOGPT, bench_startup.TORCH_FLOOR, runs),
              "trace_llama": factor(LLAMA, LLAMA_FLOOR, max(3, runs // 2)),
              # 30 pairs at least: the two medians differ by 40 ms, single runs by 10
              "startup": factor(bench_startup.ARGS, bench_startup.FLOOR, max(30, 6 * runs))}
    if with_suite:
        values["suite"] = suite()
    return values


def record(values: dict, machine: str) -> dict:
    """``values`` with the figures' descriptions and bounds, and the machine: what
    ``results.json`` holds, all measured in one run."""
    figures = {}
    for key, what, unit, bound in FIGURES + [SUITE]:
        value = values.get(key)  # the suite's only when timed in this run (--suite)
        if value is not None:
            figures[key] = {"what": what, "value": round(value, 2), "unit": unit,
                            "bound": bound}
    return {"machine": machine, "figures": figures}


def render(results: dict) -> str:
    """The README's performance table, from ``results.json``'s contents."""
    lines = ["| figure | measured | at most |", "|---|---:|---:|"]
    for f in results["figures"].values():
        bound = "" if f["bound"] is None else f"{f['bound']:g} {f['unit']}"
        lines.append(f"| {f['what']} | {f['value']:.2f} {f['unit']} | {bound} |")
    return "\n".join(lines + ["", results["machine"]])


def report(results: dict) -> str:
    """Each figure against its bound, for the terminal."""
    out = []
    for f in results["figures"].values():
        verdict = "" if f["bound"] is None else (
            "  within" if f["value"] <= f["bound"] else "  OVER")
        bound = "" if f["bound"] is None else f" (at most {f['bound']:g} {f['unit']})"
        out.append(f"{f['value']:8.2f} {f['unit']}{bound}{verdict}: {f['what']}")
    return "\n".join(out)


README_START = "<!-- benchmarks/results.json (python benchmarks/run.py --targets --readme) -->"
README_END = "<!-- end of benchmarks/results.json -->"


PAGES = (ROOT / "README.md", ROOT / "docs" / "performance.md")
"""Where the table is shown: the README and the documentation's performance page."""


def rewrite_readme(results: dict) -> None:
    """Replace the table between the markers of each of ``PAGES`` with ``render(results)``."""
    for page in PAGES:
        head, rest = page.read_text().split(README_START)
        _, tail = rest.split(README_END)
        page.write_text(f"{head}{README_START}\n{render(results)}\n{README_END}{tail}")


def save(results: dict) -> None:
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":  # pragma: no cover - run.py is the entry point
    os.chdir(ROOT)
    print(report(record(measure(), "this machine")))
