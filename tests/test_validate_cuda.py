"""The live CUDA path, without a GPU: its arithmetic through a fake probe, its OOM handling,
its re-targeting to the device, and its refusal when CUDA is absent."""

from contextlib import nullcontext

import pytest

torch = pytest.importorskip("torch")

from memcalc.cli import main
from memcalc.config import Config
from memcalc.validation import cases, cuda

ENV = {"device": "Fake GPU", "compute_capability": "8.0", "total_memory": str(80 * 2**30),
       "torch": "x", "cuda": "12.x", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


class ScriptedProbe:
    """Counters that return scripted values and log the order they are read in."""

    def __init__(self):
        self.calls = []
        self.allocated_values = iter([1000, 5000])  # a0 before forward, a1 after it
        self.max_values = iter([7000, 9000])  # forward peak, backward peak
        self.reserved_values = iter([8192, 10240])

    def allocated(self):
        self.calls.append("allocated")
        return next(self.allocated_values)

    def max_allocated(self):
        self.calls.append("max_allocated")
        return next(self.max_values)

    def max_reserved(self):
        return next(self.reserved_values)

    def reset_peak(self, phase=""):
        self.calls.append("reset")

    def block_bytes(self, tensor):
        self.calls.append("block_bytes")
        return 1536


def test_measure_reads_the_counters_in_protocol_order():
    config = Config(impl="naive-softmax", shape={"batch": 1, "seq_len": 8, "head_dim": 4})
    probe = ScriptedProbe()
    m = cuda.measure(config, torch=torch, probe=probe, device="cpu")
    assert probe.calls == ["reset", "allocated", "allocated", "block_bytes", "max_allocated",
                           "reset", "max_allocated"]
    assert m.saved_bytes == 5000 - 1000 - 1536  # a1 - a0 - block(out)
    assert (m.forward_peak_bytes, m.backward_peak_bytes, m.peak_bytes) == (7000, 9000, 9000)
    assert m.reserved_peak_bytes == 10240  # max over both phases


def scripted_gpu():
    """A ``LiveGpu`` on the CPU whose counters are the scripted probe's."""
    return cuda.LiveGpu(torch=torch, cuda=torch.cuda, device="cpu",
                        probe_for=lambda config, capacity: (nullcontext(), ScriptedProbe()))


def test_check_retargets_to_the_live_device():
    config = Config(impl="naive", shape={"batch": 1, "seq_len": 8, "head_dim": 4})
    case = cases.grid_cases([config], {**ENV, "sm_count": "108"})[0]
    check = cases.run_case(case, scripted_gpu())
    assert check.config.device.spec.compute_capability == (8, 0)
    assert check.config.protocol.cublas_workspace_config == ":4096:8"
    assert check.measured["peak_bytes"] == 9000
    assert check.differences["peak_bytes"] == 9000 - check.predicted["peak_bytes"]
    assert check.predicted == check.emulated  # the meta trace agrees with the model


def test_out_of_memory_is_a_data_point():
    def attn(q, k, v):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    config = Config(impl="naive", shape={"batch": 1, "seq_len": 8, "head_dim": 4})
    outcome, measured, detail = cases._live(cases.Case("grid", config, fn=attn), scripted_gpu())
    assert (outcome, measured) == ("oom", None)
    assert detail.startswith("CUDA out of memory")


def test_exact_capacity_survives_the_fraction():
    total = 85_520_809_984  # the H100 80GB HBM3 preset's total_memory
    capacity = cuda.exact_capacity(2 << 30, total)
    assert capacity % (2 << 20) == 0 and 0 < capacity <= 2 << 30
    # what setMemoryFraction computes from the fraction memcalc passes: static_cast<size_t>
    assert int(capacity / total * total) == capacity


def test_exact_capacity_steps_past_an_inexact_product():
    """Find a total where 2 GiB / total * total lands one byte short, and check that the
    capacity steps down to one that is exact."""
    target = 2 << 30
    total = next(t for t in range(85_520_809_984, 85_520_809_984 + 10_000)
                 if int(target / t * t) != target)
    capacity = cuda.exact_capacity(target, total)
    assert capacity < target and int(capacity / total * total) == capacity


def test_op_scratch_is_peak_less_allocated_after_each_op():
    class Counters:
        """Scripted per op: (peak during the op, allocated after it)."""

        def __init__(self, readings):
            self.readings, self.current = iter(readings), None

        def synchronize(self):
            pass

        def reset_peak_memory_stats(self):
            self.current = next(self.readings)

        def max_memory_allocated(self):
            return self.current[0]

        def memory_allocated(self):
            return self.current[1]

    x = torch.ones(4)
    # add: no scratch; mul: a 4,096 B workspace above its output
    seen = cuda.op_scratch(torch, Counters([(1024, 1024), (9216, 5120)]), lambda: (x + 1) * 2)
    assert seen == {"mul": 9216 - 5120}


def test_block_bytes_walks_the_snapshot():
    class FakeCuda:
        def memory_snapshot(self):
            return [{"address": 4096, "blocks": [{"size": 512, "state": "active_allocated"},
                                                 {"size": 2048, "state": "active_allocated"}]}]

    class FakeTensor:
        def untyped_storage(self):
            return type("S", (), {"data_ptr": lambda self: 4096 + 512})()

    assert cuda.CudaProbe(FakeCuda()).block_bytes(FakeTensor()) == 2048


def test_cli_without_cuda_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert main(["validate", "--backend", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "CUDA is not available" in err


@pytest.mark.parametrize("argv, message", [
    (["--backend", "cuda", "--max-seconds", "0"], "--max-seconds: a positive number"),
    (["--backend", "cuda", "--max-seconds", "nan"], "--max-seconds: a positive number"),
    (["--backend", "cuda", "--cases", "grid,bogus"], "--cases: unknown kind of case 'bogus'"),
    (["--max-seconds", "60"], "--max-seconds: only with --backend cuda"),
    (["--cases", "fused"], "--cases fused: a live case (--backend cuda)"),
    (["--backend", "cuda", "--cases", "cp"], "--cases cp: context parallelism runs live on"),
])
def test_cli_rejects_bad_live_options(capsys, argv, message):
    assert main(["validate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_cli_runs_the_live_cases_on_a_fake_gpu(capsys, monkeypatch, tmp_path):
    """The whole command, ``torch.cuda`` replaced by the fake GPU: OOM thresholds of naive,
    written to <gpu>-<torch>.json in --out, resumed (nothing to do) by a second run."""
    from fake_gpu import FakeGpu

    from memcalc.validation import calibration

    monkeypatch.setattr(cuda, "_torch", lambda: torch)
    monkeypatch.setattr(cuda, "LiveGpu", lambda torch: FakeGpu())
    monkeypatch.setattr(calibration, "used_before_context", lambda: (0, "nvml"))
    argv = ["validate", "--backend", "cuda", "--cases", "oom-threshold", "--impl", "naive",
            "--out", f"{tmp_path}/", "--json"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert '"case": "oom-threshold"' in first and '"complete": true' in first
    files = list(tmp_path.iterdir())
    assert [f.name for f in files] == [f"fake-gpu-{torch.__version__.replace('+', '-')}.json"]
    assert main(argv) == 0
    second = capsys.readouterr().out
    assert second.count('"case": "oom-threshold"') == first.count('"case": "oom-threshold"') == 2
    assert second.count('"largest_allocation_bytes"') == 2  # one calibration per run


def test_model_codes_parameter_grads_are_reset_as_the_tracer_resets_them():
    """The first live run (an H200) kept a module's parameter grads from the warm-up: its
    model-code figures held them all. The harness now hands the module's parameters to the
    protocol, which sets their grads to None before the measured step."""
    import torch

    from memcalc.tracing.state import on_device, trained
    from memcalc.validation.modelcode import FusedQKV

    module = FusedQKV()
    module.c_proj.bias.requires_grad_(False)
    with on_device(module, "cpu") as state:  # the harness's: the module on the device
        got = [t for _, t in trained(state)]
    assert [tuple(p.shape) for p in got] == [(768, 256), (768,), (256, 256)]
    with on_device(lambda q, k, v: q, "cpu") as state:
        assert trained(state) == ()
    assert all(isinstance(p, torch.nn.Parameter) for p in got)
