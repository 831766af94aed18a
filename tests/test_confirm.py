"""An OOM answer about traced code, confirmed by direct traces (``memcalc/analysis/confirm.py``)."""

import dataclasses
import math

import pytest

torch = pytest.importorskip("torch")

from cli_helpers import assert_refused, run  # noqa: E402
from memcalc.analysis.budget import Budget, fit  # noqa: E402
from memcalc.analysis.predict import predict  # noqa: E402
from memcalc.analysis.thresholds import solve  # noqa: E402
from memcalc.config import make_config  # noqa: E402
from memcalc.engine.program import Role, Tensor  # noqa: E402
from memcalc.impls import get_impl  # noqa: E402
from memcalc.impls.registry import add  # noqa: E402
from memcalc.tracing import register_function, trace  # noqa: E402

BUDGET = Budget(device="given", memory_bytes=256 << 20, reserve_bytes=0)  # 256 MiB


def attn(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), -1) @ v


def _solved(name: str):
    (solved,) = solve(make_config(impl=name, batch=1), BUDGET, "seq_len", [name]).results
    return solved


def test_the_answer_is_traced_directly_at_it_and_at_the_next_length():
    name = register_function(attn, "confirmed-attn")
    solved = _solved(name)
    n = solved.max_value
    assert solved.note == (f"its program fitted over lengths (traced at 61 to 257 rows, each "
                           f"size an exact polynomial in seq_len); confirmed by direct traces "
                           f"at {n:,} (fits) and {n + 1:,} (does not fit)")
    at = make_config(impl=name, batch=1, seq_len=n)
    direct = trace(attn, at)  # the fit of the trace itself
    assert solved.at_max == fit(at, BUDGET.budget_bytes, direct)


def test_a_fitted_program_a_direct_trace_contradicts_is_searched_again_on_traces():
    """A program that holds 4 MiB more than the code (a fit gone wrong): the answer it gives
    is too short, the direct trace at the next length fits, so the search runs again on
    direct traces, and finds what a correct program finds."""
    name = register_function(attn, "contradicted-attn")
    right = _solved(name).max_value
    impl = get_impl(name)
    extra = Tensor("extra", (4 << 20,), "uint8", Role.temporary, "empty")

    def wrong(d):
        p = impl.build(d)
        return dataclasses.replace(p, forward=(extra, *p.forward))

    add(dataclasses.replace(impl, build=wrong), replace=True)
    solved = _solved(name)
    assert solved.max_value == right
    assert "a direct trace at" in solved.note and "fits: solved again on direct traces" \
        in solved.note
    assert predict(make_config(impl=name, batch=1, seq_len=64)).peak_bytes > 0


def test_multiple_of_searches_the_lengths_you_run(capsys):
    example = "examples/custom_softmax/variants.py:reciprocal"
    code, out, err = run(capsys, "oom", "--trace", example, "--gpu-gb", "1", "--batch", "1",
                         "--multiple-of", "64", "--json")
    assert code == 0, err
    import json

    (r,) = json.loads(out)["results"]
    assert r["max_seq_len"] % 64 == 0 and r["next_seq_len"] == r["max_seq_len"] + 64
    assert r["accepted_step"] == 64 and "confirmed by direct traces" in r["note"]
    assert_refused(*run(capsys, "oom", "--multiple-of", "64"), "--multiple-of 64")
    assert_refused(*run(capsys, "oom", "--trace", example, "--multiple-of", "0"),
                   "--multiple-of")


def test_a_fragile_answer_says_which_shorter_lengths_do_not_fit():
    """cuDNN's ring over 8 ranks, Llama-3-8B's heads: 4,194,304 fits, but 99% and 99.9% of
    it (snapped to the multiples of 16 the ring takes) do not: the reserved segments decide
    there. A plain answer has no such note."""
    config = make_config(impl="sdpa-cudnn", cp=8, cp_method="alltoall", causal=True,
                         dtype="bf16", heads=32, kv_heads=8, head_dim=128, batch=1)
    budget = Budget.of(config.device)
    (solved,) = solve(config, budget, "seq_len", ["sdpa-cudnn"]).results
    assert solved.max_value == 4_194_304
    assert solved.holes == (4_152_352, 4_190_096)  # floor(0.99 N / 16) * 16, of 0.999 N
    report = solve(config, budget, "seq_len", ["sdpa-cudnn"])
    assert any("fragile: 4,152,352 and 4,190,096 do not fit" in n for n in report.footnotes())
    (plain,) = solve(make_config(impl="naive"), budget, "seq_len", ["naive"]).results
    assert plain.holes == ()


def sdpa_causal(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("dtype, step, how", [
    ("bf16", 2 * 2, "each rank's program fitted over its rows (traced at 122 to 514 rows a "
                    "rank"),
    ("fp32", 64 * 2, "its program fitted at multiples of 256 rows from 15,616 (the "
                     "memory-efficient kernel's ring takes multiples of 64 rows a rank)")])
def test_under_context_parallelism_the_answer_is_confirmed_rank_by_rank(dtype, step, how):
    """The ring over 2 ranks, in 256 MiB: each rank's program is its own (causal, the
    ranks hold other halves of the blocks at each step), and the answer is traced directly,
    every rank, at it and at the next length the ring takes: 2 x 2 apart over flash (bf16),
    64 x 2 over the memory-efficient kernel (fp32), which torch's ring runs only there (its
    logsumexp padded to 32 rows): each rank's program is fitted at even lengths over flash,
    at multiples of 256 rows over the memory-efficient kernel. (The confirmation was once skipped under --cp, every rank
    solved as rank 0, and the search tried 289,260 in fp32: a trace error.)"""
    name = register_function(sdpa_causal, f"confirmed-ring-{dtype}")
    config = make_config(impl=name, batch=1, cp=2, causal=True, dtype=dtype)
    (solved,) = solve(config, BUDGET, "seq_len", [name]).results
    n, after = solved.max_value, solved.next_value
    assert n % step == 0 and after == n + step and solved.note.startswith(how)
    assert f"confirmed by direct traces at {n:,} (fits) and {after:,} (does not fit)" \
        in solved.note
    at = config.replace(seq_len=n)
    assert solved.at_max == fit(at, BUDGET.budget_bytes, trace(sdpa_causal, at))
