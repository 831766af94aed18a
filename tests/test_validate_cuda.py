"""The live CUDA path, without a GPU: its arithmetic through a fake probe, its OOM handling,
its re-targeting to the device, and its refusal when CUDA is absent."""

import pytest

torch = pytest.importorskip("torch")

from memcalc.cli import main
from memcalc.config import Config
from memcalc.validation import cuda

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

    def reset_peak(self):
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


def test_check_retargets_to_the_live_device():
    config = Config(impl="naive", shape={"batch": 1, "seq_len": 8, "head_dim": 4})
    check = cuda.check(config, torch=torch, probe=ScriptedProbe(), device="cpu", env=ENV)
    assert check.config.device.spec.compute_capability == (8, 0)
    assert check.config.protocol.cublas_workspace_config == ":4096:8"
    assert check.measured["peak_bytes"] == 9000
    assert check.differences["peak_bytes"] == 9000 - check.predicted["peak_bytes"]


def test_out_of_memory_is_a_data_point():
    def attn(q, k, v):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    config = Config(impl="naive", shape={"batch": 1, "seq_len": 8, "head_dim": 4})
    check = cuda.check(config, torch=torch, probe=ScriptedProbe(), device="cpu", env=ENV, fn=attn)
    assert check.outcome == "oom" and check.ok
    assert check.detail.startswith("CUDA out of memory")


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
