"""The cases of a live run: which exist, in what order, and the three columns of each."""

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from memcalc.engine.allocator import OutOfMemory  # noqa: E402
from memcalc.analysis.breakdown import FIGURES  # noqa: E402
from memcalc.config import Config  # noqa: E402
from memcalc.impls import IMPLS  # noqa: E402
from memcalc.analysis.predict import predict  # noqa: E402
from memcalc.tracing import trace  # noqa: E402
from memcalc.validation import cases, emulated  # noqa: E402
from memcalc.validation.cases import Case, run_case  # noqa: E402
from memcalc.validation.usercode import USER_CODE  # noqa: E402

ENV = {"device": "Fake GPU", "compute_capability": "8.0", "total_memory": str(80 * 2**30),
       "sm_count": "108", "torch": "x", "cuda": "12.x", "CUBLAS_WORKSPACE_CONFIG": ""}
SMALL = {"batch": 2, "heads": 1, "seq_len": 256, "head_dim": 16}
NAIVE = Config(impl="naive", shape=SMALL)
MiB = 1 << 20


@pytest.fixture
def registry_restored():
    """The user-code cases register ``trace:*`` implementations: put the registry back."""
    before = dict(IMPLS)
    yield
    IMPLS.clear()
    IMPLS.update(before)


def summary(case_list):
    return [(c.kind, c.config.impl, c.config.shape.seq_len) for c in case_list]


def test_kinds_run_in_kinds_order_whatever_order_they_are_asked_in():
    asked = cases.all_cases(("grid", "oom-threshold"), [NAIVE], ENV, 128 * MiB)
    kinds = [c.kind for c in asked]
    # 3 OOM impls x (N, N + 1), then the one grid configuration
    assert kinds == ["oom-threshold"] * 6 + ["grid"]
    assert [c.config.impl for c in asked[:6:2]] == list(cases.OOM_IMPLS)


def test_impls_keep_only_the_cases_of_the_named_implementations(registry_restored):
    every = cases.all_cases(cases.KINDS, [NAIVE, NAIVE.replace(impl="naive-softmax")], ENV,
                            128 * MiB, impls=["naive", "trace:dropout"])
    n = every[0].config.shape.seq_len  # naive's threshold under the cap
    assert summary(every) == [("oom-threshold", "naive", n), ("oom-threshold", "naive", n + 1),
                              ("usercode", "trace:dropout", 1024),
                              ("usercode", "trace:dropout", 4096), ("grid", "naive", 256)]


def test_grid_cases_run_each_configuration_once_on_the_device():
    """Presets of the same configuration coincide on one device: one case, first order."""
    configs = [NAIVE.replace(device={"gpu": "a100-40gb"}), NAIVE.replace(seq_len=100), NAIVE]
    grid = cases.grid_cases(configs, ENV)
    assert summary(grid) == [("grid", "naive", 256), ("grid", "naive", 100)]
    device = grid[0].config.device
    assert (device.gpu, device.memory_bytes, device.compute_capability, device.sm_count) == (
        None, 80 * 2**30, (8, 0), 108)
    assert all(c.fn is None and c.capacity is None for c in grid)


def test_fused_cases_are_the_live_grid_on_the_device():
    fused = cases.fused_cases(ENV)
    # live.json: sdpa-flash 2 causal x 2 dtypes x 3 lengths x 2 head dims = 24, sdpa-efficient
    # the same 24, 2 forward-only (one per impl), 2 explicit configurations: 52; sdpa-cudnn
    # the same 24, grouped heads 1, loss="sum" 2 causal x 2 lengths = 4, forward-only 1: 30
    assert len(fused) == 24 + 24 + 2 + 2 + 30
    assert {c.kind for c in fused} == {"fused"}
    assert {c.config.impl for c in fused} == {"sdpa-flash", "sdpa-efficient", "sdpa-cudnn"}
    assert {c.config.device.memory_bytes for c in fused} == {80 * 2**30}
    first, last = fused[0].config, fused[-1].config
    assert (first.impl, first.dtype.value, first.causal, first.shape.seq_len) == (
        "sdpa-flash", "fp16", False, 256)
    assert (last.impl, last.shape.seq_len, last.shape.keys) == ("sdpa-efficient", 1000, 1500)


def test_usercode_cases_are_each_function_at_two_lengths(registry_restored):
    user = cases.usercode_cases(ENV)
    got = [(c.config.impl, c.config.dtype.value, c.config.causal, c.config.shape.seq_len)
           for c in user]
    # causal and not for the two sdpa calls, bf16 for cuDNN, fp16 elsewhere: 4 + 4 + 2 + 2
    assert got == [(f"trace:{key}", dtype, causal, n)
                   for key, dtype, causals in (("sdpa-default", "fp16", (False, True)),
                                               ("sdpa-cudnn", "bf16", (False, True)),
                                               ("dropout", "fp16", (False,)),
                                               ("float-softmax", "fp16", (False,)))
                   for causal in causals for n in (1024, 4096)]
    assert [c.fn for c in user[::2]] == [USER_CODE[k] for k in USER_CODE for _ in
                                         range(2 if k.startswith("sdpa") else 1)]
    shape = user[0].config.shape
    assert (shape.batch, shape.heads, shape.head_dim) == (2, 4, 64)
    assert {c.kind for c in user} == {"usercode"}


def test_code_binds_the_configurations_options():
    def attn(q, k, v, is_causal=False):
        return q if is_causal else k

    q, k, v = (torch.zeros(1) for _ in range(3))
    assert Case("usercode", NAIVE.replace(causal=True), attn).code()(q, k, v) is q
    # (out, weights) as attention modules return: the first is the output
    assert Case("usercode", NAIVE, lambda q, k, v: (v, k)).code()(q, k, v) is v
    causal = cases.grid_cases([NAIVE.replace(causal=True)], ENV)[0]
    # the reference code, causal: traced it is the default trace of the configuration
    assert emulated.measure(causal.config, fn=causal.code()).figures() == \
        emulated.measure(causal.config).figures()


def test_model_is_the_prediction_the_trace_or_why_not():
    def attn(q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v

    assert Case("grid", NAIVE).model() == (predict(NAIVE).figures(), "")
    assert Case("usercode", NAIVE, attn).model() == (trace(attn, NAIVE).figures(),
                                                     "memcalc trace")
    flash = NAIVE.replace(impl="sdpa-flash")  # fp32: the flash kernel has none
    figures, why = Case("fused", flash).model()
    assert figures is None and why.startswith("ValueError: ") and "\n" not in why


def test_emulated_column_records_each_outcome(monkeypatch):
    case = cases.grid_cases([NAIVE], ENV)[0]
    assert case.emulated() == (emulated.measure(case.config).figures(), "measured", "")
    capped = Case("oom-threshold", case.config, capacity=4 * MiB)  # < one 8,519,680 B workspace
    with pytest.raises(OutOfMemory) as error:
        emulated.measure(case.config, capacity=4 * MiB)
    assert capped.emulated() == (None, "oom", str(error.value))

    def broken(config, capacity=None):
        raise RuntimeError("first line\nsecond line")

    monkeypatch.setattr(emulated, "measure", broken)
    assert case.emulated() == (None, "error", "RuntimeError: first line")


class StubGpu:
    """``cuda.LiveGpu``'s interface, scripted: the live figures (or an error to raise) and
    each op's scratch (or an error to raise); it counts the scratch reads."""

    oom_errors = (MemoryError,)
    device = "meta"

    def __init__(self, figures=None, error=None, scratch=None):
        self.figures, self.error, self.scratch_result = figures, error, scratch
        self.scratch_reads = 0

    def measure(self, config, fn, capacity=None, inputs=None, loop=None):
        if self.error is not None:
            raise self.error
        return SimpleNamespace(**self.figures)

    def scratch(self, config, fn, inputs=None, loop=None):
        self.scratch_reads += 1
        if isinstance(self.scratch_result, Exception):
            raise self.scratch_result
        return self.scratch_result


def test_scratch_is_read_only_where_the_live_run_is_unexplained():
    case = cases.grid_cases([NAIVE], ENV)[0]
    model = predict(case.config).figures()  # the emulated trace's too
    faithful = StubGpu(model, scratch={"mm": 4096})
    assert run_case(case, faithful).scratch == {} and faithful.scratch_reads == 0
    higher = StubGpu({**model, "peak_bytes": model["peak_bytes"] + 512}, scratch={"mm": 4096})
    assert run_case(case, higher).scratch == {"mm": 4096} and higher.scratch_reads == 1
    fused = cases.grid_cases([NAIVE.replace(impl="sdpa-efficient")], ENV)[0]  # meta can't run
    gpu = StubGpu(predict(fused.config).figures(), scratch={"mm": 4096})
    check = run_case(fused, gpu)  # the model agrees, but no emulated column says why
    assert check.emulated_outcome == "absent" and check.differences == dict.fromkeys(FIGURES, 0)
    assert check.scratch == {"mm": 4096}
    failing = StubGpu({**model, "peak_bytes": 0}, scratch=RuntimeError("no counters"))
    check = run_case(case, failing)  # a diagnostic that fails loses nothing else
    assert check.scratch == {} and check.outcome == "measured" and check.measured["peak_bytes"] == 0
    oom = StubGpu(error=MemoryError("out of memory\nTried to allocate 2.00 MiB"))
    check = run_case(case, oom)
    assert (check.outcome, check.detail, check.scratch, oom.scratch_reads) == (
        "oom", "out of memory", {}, 0)


def test_a_case_and_its_check_share_the_key_a_rerun_skips():
    case = cases.oom_cases(ENV, 128 * MiB)[0]  # naive at its N, which fits
    check = run_case(case, StubGpu(predict(case.config).figures()))
    assert check.key == case.key
    assert case.key.startswith(f"oom-threshold|{128 * MiB}|")  # 134,217,728
    assert (check.capacity_bytes, check.expected, check.case) == (128 * MiB, "fits",
                                                                  "oom-threshold")
    assert set(check.measured) == set(FIGURES)


def test_the_flash_attn_packages_live_cases_run_only_where_the_package_is_installed(monkeypatch):
    """live.json lists flash-attn and flash-attn3; without the packages (here) their cases
    are left out, with them each is called with (B, N, H, d) tensors."""
    import importlib.util

    from memcalc.impls.flash_attn import BNHD

    env = {"device": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0",
           "sm_count": "132", "total_memory": str(84_938_850_304), "CUBLAS_WORKSPACE_CONFIG": ""}
    impls = {c.config.impl for c in cases.fused_cases(env)}
    assert impls == {"sdpa-flash", "sdpa-efficient", "sdpa-cudnn"}
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name in ("flash_attn", "flash_attn_interface")
                        else real(name, *a))
    with_packages = cases.fused_cases(env)
    fa = [c for c in with_packages if c.config.impl == "flash-attn"]
    assert {c.config.impl for c in with_packages} >= {"flash-attn", "flash-attn3"}
    assert fa[0].inputs is BNHD and any(c.config.protocol.deterministic for c in fa)
    assert any(c.config.shape.kv_heads == 2 for c in fa)
