"""The analytical model equals the emulated trace of the reference code, to the byte."""


import pytest
from breakers import row_sum_as_int64

pytest.importorskip("torch")

from memcalc.config import Config, Protocol
from memcalc.analysis.predict import predict
from memcalc.validation import figures_of, validate
from memcalc.validation.emulated import measure


def _grid_impls() -> list[str]:
    from memcalc.impls import impl_names
    from memcalc.validation.grid import default_grid

    return [name for name in impl_names() if default_grid().expand([name])]


@pytest.mark.parametrize("impl", _grid_impls())
def test_default_grid_has_no_mismatch(impl):
    """The shipped grid, an implementation's part a test (``pytest -n auto`` shares them
    among its workers; the whole grid was a fifth of the suite's time in one test)."""
    report = validate(backend="emulated", impls=[impl])
    assert report.checks and [c.config for c in report.checks if not c.ok] == []


def test_the_parts_are_the_whole_grid():
    from memcalc.validation.grid import default_grid

    grid = default_grid()
    assert sum(len(grid.expand([name])) for name in _grid_impls()) == len(grid.expand(None))
    assert len(grid.expand(None)) >= 200


@pytest.mark.parametrize("seq_len", [1000, 1050, 3001])
@pytest.mark.parametrize("impl", ["naive", "naive-softmax", "naive-weights"])
def test_odd_lengths_kv_len_and_live_sets(impl, seq_len):
    config = Config(impl=impl, causal=True, dtype="bf16",
                    shape={"batch": 3, "heads": 2, "seq_len": seq_len, "kv_len": seq_len + 7})
    model, trace = predict(config), measure(config)
    assert figures_of(model) == figures_of(trace)
    assert sorted(c.allocated for c in model.components) == sorted(
        c.allocated for c in trace.components)
    assert sorted(c.allocated for c in model.saved) == sorted(c.allocated for c in trace.saved)


def test_a_broken_formula_is_caught(monkeypatch):
    """Declare the row sum as int64 instead of the dtype: validation must fail."""
    row_sum_as_int64(monkeypatch)
    configs = [Config(impl="naive", shape={"batch": 2, "seq_len": 4096})]
    report = validate(backend="emulated", configs=configs)
    assert report.mismatches == 1
    # 2 x 1 x 4096 x 1 rows: 32,768 B as fp32, 65,536 B as int64; both 512-multiples
    assert report.checks[0].differences["saved_bytes"] == 32_768 - 65_536


def test_trace_names_ops_and_source_lines():
    trace = measure(Config(impl="naive", shape={"batch": 1, "seq_len": 512}))
    sources = {c.op: c.source for c in trace.saved}
    assert sources["exp"].endswith("e = torch.exp(s - m)")


def test_trace_memory_does_not_depend_on_seq_len():
    big = measure(Config(impl="naive-softmax", shape={"seq_len": 2**20},
                         protocol=Protocol(forward_only=True)))
    # two 8 x 2^20 x 2^20 x 4 B = 32 TiB tensors (s and p) alive at once, traced on meta
    assert big.forward_peak_bytes > 2 * 8 * 2**20 * 2**20 * 4


def test_a_storages_python_object_lives_exactly_as_long_as_the_storage():
    """What the tracer's frees rest on: torch keeps a storage's Python object while a view
    or autograd holds the storage, and frees it with the storage (the tracer's weak
    reference to it then tells the death)."""
    import weakref

    import torch

    died = []
    x = torch.randn(4, 4, device="meta", requires_grad=True)
    y = x.exp()  # ExpBackward0 saves its output
    weakref.finalize(y.untyped_storage(), died.append, "y")
    view = y.view(16)
    del y
    assert died == []  # the view holds it
    loss = view.sum()
    del view
    assert died == []  # autograd holds it (saved for backward)
    loss.backward()
    assert died == ["y"]  # released by its node


def test_trace_frees_the_dead_in_the_order_they_were_tracked():
    """Several storages that die between two ops are freed in the order they were made."""
    import torch

    from memcalc.tracing.tracer import Tracer

    tracer = Tracer(workspace_bytes=0)
    with tracer:
        a, b, c = (torch.empty(256, device="meta") for _ in range(3))  # 1 KiB each
        del c, a  # between two ops
        torch.empty(1, device="meta")
    frees = [e[1] for e in tracer.events if e[0] == "free"]
    allocs = [e[1] for e in tracer.events if e[0] == "alloc"]
    assert frees[:2] == [allocs[0], allocs[2]]  # a, then c
    assert [e[0] for e in tracer.events[:5]] == ["alloc"] * 3 + ["free"] * 2  # at the next op


# --- composites: what the installed torch's own kernel runs ----------------------------

SOFTMAX_INPUT = (2, 3, 5, 7)  # float32: 840 B; its bool mask 210 B; row mask (2, 3, 5, 1) 30 B


def _profiled_safe_softmax() -> list[tuple[str, int]]:
    """The ops ``aten::_safe_softmax`` calls on the installed torch (its CompositeExplicit
    kernel, the same on CPU and CUDA), each with the bytes it left allocated, from
    ``torch.profiler`` on a small CPU tensor; ops that allocate nothing are left out."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.ops.aten._safe_softmax(torch.randn(SOFTMAX_INPUT), -1)
    top = next(e for e in prof.events() if e.name == "aten::_safe_softmax")
    return [(c.name.removeprefix("aten::").lstrip("_"), c.cpu_memory_usage)
            for c in top.cpu_children if c.cpu_memory_usage]


def _traced_safe_softmax(composite) -> list[tuple[str, int]]:
    """The allocations ``composite`` makes under the tracer, on the meta device."""
    import torch

    from memcalc.tracing.tracer import Tracer

    tracer = Tracer(0)
    x = torch.empty(SOFTMAX_INPUT, device="meta")
    with tracer:
        composite(x, -1)
    return [(e[2].op.lstrip("_"), e[2].bytes) for e in tracer.events if e[0] == "alloc"]


def test_the_traced_safe_softmax_runs_the_installed_torchs_ops():
    """The composite the tracer runs for ``_safe_softmax`` allocates what the installed
    torch's own kernel does, op by op: torch 2.6 to 2.13 run softmax (840 B), isneginf (210 B),
    all (30 B), a 0-d zero (4 B) and a where into the softmax's storage (0 B)."""
    from memcalc.tracing.tracer import SAFE_SOFTMAX

    assert _traced_safe_softmax(SAFE_SOFTMAX) == _profiled_safe_softmax()


def test_the_model_of_safe_softmax_runs_the_installed_torchs_ops():
    """memcalc/impls/sdpa_math.py declares the ops of the installed torch's kernel, in order,
    with their bytes: the model and the tracer cannot share a wrong composite unseen."""
    from memcalc.engine.dims import Dims
    from memcalc.impls.sdpa_math import safe_softmax
    from memcalc.engine.program import Tensor

    B, H, N, M = SOFTMAX_INPUT
    d = Dims(B=B, H=H, N=N, M=M, D=16, dtype="float32", causal=False, loss="grad", Hk=H, chunk=64)
    declared = [(t.op.lstrip("_"), t.bytes) for t in safe_softmax(d, "qk") if isinstance(t, Tensor)]
    assert declared == _profiled_safe_softmax()


def test_the_older_safe_softmax_is_told_apart():
    """torch 2.5: a -inf scalar, eq, and an out-of-place where: the check sees it."""
    from memcalc.tracing.tracer import _safe_softmax_eq

    assert _traced_safe_softmax(_safe_softmax_eq) != _profiled_safe_softmax()
