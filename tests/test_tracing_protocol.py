"""The measurement protocol (``memcalc/tracing/protocol.py``): inputs, warm-up, resets, reads."""

import weakref

import pytest

torch = pytest.importorskip("torch")
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from memcalc.engine.dims import Dims  # noqa: E402
from memcalc.engine.inputs import Input  # noqa: E402
from memcalc.tracing.tracer import Tracer, TracerProbe  # noqa: E402
from memcalc.tracing.protocol import Measured, Training, make_inputs, run_protocol  # noqa: E402

SHAPE, KV_SHAPE = (1, 2, 8, 4), (1, 2, 6, 4)


def dims(dtype="float32", kv_len=8, loss="grad", forward_only=False):
    """The sizes of SHAPE (B=1, H=2, N=8, D=4), keys KV_SHAPE when kv_len=6."""
    return Dims(B=1, H=2, N=8, M=kv_len, D=4, dtype=dtype, causal=False, loss=loss, Hk=2,
                chunk=64, forward_only=forward_only)


class Ops(TorchDispatchMode):
    """Logs each aten op with the shape and dtype of what it returns."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((func.overloadpacket.__name__, tuple(out.shape), out.dtype))
        return out


class LogProbe:
    """Scripted counters that write each read into ``log``, beside the step's own events;
    a reset also notes how many of the step's outputs are still alive."""

    def __init__(self, log, outputs, allocated, max_allocated, max_reserved):
        self.log, self.outputs = log, outputs
        self.values = {"allocated": iter(allocated), "max_allocated": iter(max_allocated),
                       "max_reserved": iter(max_reserved)}

    def _read(self, name):
        self.log.append(name)
        return next(self.values[name])

    def allocated(self):
        return self._read("allocated")

    def max_allocated(self):
        return self._read("max_allocated")

    def max_reserved(self):
        return self._read("max_reserved")

    def reset_peak(self, phase=""):
        self.log.append(f"reset ({sum(r() is not None for r in self.outputs)} alive)")

    def block_bytes(self, tensor):
        self.log.append("block_bytes")
        return 512


def logged_attn(log, outputs):
    """``q.exp() * k`` that logs its forward (and the grad mode) and its backward."""

    def attn(q, k, v):
        log.append(f"forward grad={torch.is_grad_enabled()}")
        out = q.exp() * k
        if out.requires_grad:
            out.register_hook(lambda g: log.append("backward"))
        outputs.append(weakref.ref(out))
        return out

    return attn


class ZeroProbe:
    """Counters that all read 0 (for tests of what the protocol does, not of what it reads)."""

    def allocated(self):
        return 0

    def max_allocated(self):
        return 0

    def max_reserved(self):
        return 0

    def reset_peak(self, phase=""):
        pass

    def block_bytes(self, tensor):
        return 0


def test_make_inputs_allocates_q_k_v_then_grad_out():
    with Ops() as seen:
        (q, k, v), dout = make_inputs(torch, dims(kv_len=6), "meta",
                                      out_like=((1, 8, 2, 4), "float64"))
    # on the meta device, which holds no values, empty (randn's block without its Python
    # reference, which imports sympy)
    assert seen.ops == [("empty", SHAPE, torch.float32), ("empty", KV_SHAPE, torch.float32),
                        ("empty", KV_SHAPE, torch.float32),
                        ("empty", (1, 8, 2, 4), torch.float64)]  # grad_out as out_like says
    assert all(t.is_leaf and t.requires_grad and t.device.type == "meta" for t in (q, k, v))
    assert not dout.requires_grad


def test_make_inputs_grad_out_is_shaped_like_q_unless_told():
    (q, k, v), dout = make_inputs(torch, dims("bfloat16", kv_len=6), "meta")
    assert (dout.shape, dout.dtype) == (q.shape, torch.bfloat16)
    assert (k.shape, v.shape) == (KV_SHAPE, KV_SHAPE)
    inference = make_inputs(torch, dims(forward_only=True), "meta",
                            out_like=((1, 8, 2, 4), "float64"))
    assert inference.grad_out is None  # no grad_out without a backward, whatever out_like says
    assert not any(t.requires_grad for t in inference.leaves)
    assert make_inputs(torch, dims(), "meta", out_like=((), "float32")).grad_out is None  # a loss


def test_make_inputs_takes_any_inputs_with_their_fills():
    """Inputs as declared, in order: floating ones random leaves that need grad (unless
    turned off), integer and bool ones filled, never needing grad."""
    inputs = (Input("x", ("B", "N", "H*D")), Input("ids", ("B", "N"), "int64"),
              Input("pos", ("1", "N"), "int64", fill="arange"),
              Input("mask", ("B", "N"), "int64", fill="padded"),
              Input("bias", ("N",), grad=False))
    (x, ids, pos, mask, bias), dout = make_inputs(torch, dims(), "cpu", inputs,
                                                  out_like=((1, 8, 8), "float32"))
    assert x.shape == (1, 8, 8) and x.requires_grad and x.is_leaf  # H*D = 2 x 4
    assert torch.equal(ids, torch.ones(1, 8, dtype=torch.int64))
    assert pos.tolist() == [list(range(8))]
    assert mask.tolist() == [[1] * 6 + [0] * 2]  # the last quarter of the first row
    assert not bias.requires_grad and dout.shape == (1, 8, 8)


def test_training_warms_up_unread_then_reads_each_phase():
    """The warm-up step runs forward and backward with no counter read; the measured step
    resets the peak once its warm-up output is dead, reads allocated around the forward, and
    resets again before the backward, whose peak is read after it."""
    log, outputs = [], []
    probe = LogProbe(log, outputs, allocated=[1000, 5000], max_allocated=[9000, 7000],
                     max_reserved=[8192, 10240])
    inputs = make_inputs(torch, dims(), "cpu")
    m = run_protocol(torch, logged_attn(log, outputs), probe, inputs, forward_only=False)
    assert log == ["forward grad=True", "backward",  # warm-up
                   "reset (0 alive)", "allocated", "forward grad=True", "allocated",
                   "block_bytes", "max_allocated", "max_reserved",
                   "reset (1 alive)", "backward", "max_reserved", "max_allocated"]
    assert m == Measured(saved_bytes=5000 - 1000 - 512,  # a1 - a0 - block(out) = 3,488
                         forward_peak_bytes=9000, backward_peak_bytes=7000,
                         reserved_peak_bytes=10240)  # max(8192, 10240)


class LogOptimizer:
    """An optimizer that writes its calls into ``log``, with how many outputs are alive."""

    def __init__(self, log, outputs):
        self.log, self.outputs = log, outputs

    def step(self):
        self.log.append(f"step ({sum(r() is not None for r in self.outputs)} alive)")

    def zero_grad(self, set_to_none=True):
        self.log.append(f"zero_grad set_to_none={set_to_none}")


def test_a_training_loop_holds_its_loss_into_the_next_forward():
    """With an optimizer, each step is a loop's: ``accumulate`` forward and backward passes,
    ``step()`` and ``zero_grad(set_to_none=True)``, the warm-up's the same unread. The loss
    held as ``loss = model(...)`` holds it: through the optimizer (1 alive at its step) and
    into the next forward, dropped only when that returns (the measured step's first reset
    sees the warm-up's still alive); each phase is read from its own reset, the forward and
    backward peaks the highest of the micro-steps."""
    log, outputs = [], []
    probe = LogProbe(log, outputs, allocated=[1000, 5000, 2000, 7000],
                     max_allocated=[9000, 9500, 7000, 6000, 4000],
                     max_reserved=[8192, 10240, 4096, 6144, 2048])
    inputs = make_inputs(torch, dims(), "cpu")
    m = run_protocol(torch, logged_attn(log, outputs), probe, inputs, forward_only=False,
                     training=Training(LogOptimizer(log, outputs), accumulate=2))
    warm = ["forward grad=True", "backward", "forward grad=True", "backward",
            "step (1 alive)", "zero_grad set_to_none=True"]
    micro = ["allocated", "forward grad=True", "allocated", "block_bytes", "max_allocated",
             "max_reserved"]
    assert log == warm + ["reset (1 alive)", *micro, "reset (1 alive)", "backward",
                          "max_allocated", "max_reserved",
                          "reset (1 alive)", *micro, "reset (1 alive)", "backward",
                          "max_allocated", "max_reserved",
                          "reset (1 alive)", "step (1 alive)", "zero_grad set_to_none=True",
                          "max_reserved", "max_allocated"]
    assert m == Measured(saved_bytes=7000 - 2000 - 512,  # the last micro-step's a1 - a0 - out
                         forward_peak_bytes=9000,  # max(9000, 7000): micro-steps 1, 2
                         backward_peak_bytes=9500,  # max(9500, 6000)
                         reserved_peak_bytes=10240,  # max(8192, 10240, 4096, 6144, 2048)
                         optimizer_peak_bytes=4000)


@pytest.mark.parametrize("loss", ["grad", "sum"])
def test_warm_up_grads_are_released_before_the_measured_step(loss):
    """The leaf grads and the parameters' are None when the measured forward starts, so the
    grads left at the end are one step's, not two accumulated."""
    w = torch.full((4,), 2.0, requires_grad=True)  # a traced module's parameter
    seen = []

    def attn(q, k, v):
        seen.append([t.grad is None for t in (q, k, v, w)])
        return q * w + k + v

    inputs = make_inputs(torch, dims(loss=loss), "cpu")
    (q, k, v), dout = inputs
    run_protocol(torch, attn, ZeroProbe(), inputs, forward_only=False, parameters=(w,))
    assert seen == [[True] * 4, [True] * 4]
    g = dout if loss == "grad" else torch.ones(SHAPE)  # out.sum() seeds ones
    assert torch.equal(q.grad, g * 2) and torch.equal(k.grad, g) and torch.equal(v.grad, g)
    w1 = w.detach().clone().requires_grad_()  # one step of the same ops, by hand
    (q.detach() * w1).backward(g)
    assert torch.equal(w.grad, w1.grad)


def test_reserved_and_peak_take_the_larger_phase_when_it_is_the_forward():
    probe = LogProbe([], [], allocated=[0, 0], max_allocated=[9000, 7000],
                     max_reserved=[12288, 4096])
    inputs = make_inputs(torch, dims(loss="sum"), "cpu")
    m = run_protocol(torch, lambda q, k, v: q * k, probe, inputs, forward_only=False)
    assert m.reserved_peak_bytes == 12288  # max(12288 forward, 4096 backward)
    assert m.peak_bytes == 9000  # max(9000 forward, 7000 backward)


def test_forward_only_runs_twice_under_no_grad_and_never_backward():
    log, outputs = [], []
    probe = LogProbe(log, outputs, allocated=[1000, 2024], max_allocated=[6000],
                     max_reserved=[8192])
    inputs = make_inputs(torch, dims(loss="sum"), "cpu")
    m = run_protocol(torch, logged_attn(log, outputs), probe, inputs, forward_only=True)
    assert log == ["forward grad=False",  # warm-up, its output dead before the reset
                   "reset (0 alive)", "allocated", "forward grad=False", "allocated",
                   "block_bytes", "max_allocated", "max_reserved"]
    # 2024 - 1000 - 512 = 512: what the forward left besides out; no backward phase
    assert m == Measured(saved_bytes=512, forward_peak_bytes=6000, backward_peak_bytes=0,
                         reserved_peak_bytes=8192)
    assert all(t.grad is None for t in inputs.leaves)


class Reads:
    """A probe that keeps the values ``allocated()`` returned."""

    def __init__(self, probe):
        self.probe, self.allocated_reads = probe, []

    def __getattr__(self, name):
        return getattr(self.probe, name)

    def allocated(self):
        self.allocated_reads.append(self.probe.allocated())
        return self.allocated_reads[-1]


@pytest.mark.parametrize("forward_only", [False, True])
def test_figures_on_the_allocator_model(forward_only):
    """On the meta device through the allocator model: a first call that leaves a workspace
    and frees a 16 KiB scratch (the warm-up absorbs both), a 4 KiB temporary every call.
    fp32 (1, 2, 8, 4) = 256 B: every tensor of the step takes a 512-B block."""
    workspace = []

    def attn(q, k, v):
        if not workspace:
            workspace.append(q.new_empty(128))  # 512 B, kept like a cuBLAS workspace
            q.new_empty(4096)  # 16,384 B, first call only, dropped at once
        q.new_empty(1024)  # 4,096 B, every call, dropped at once
        return q.exp() * k  # e = q.exp() is saved (by exp and by mul)

    tracer = Tracer(workspace_bytes=0)
    probe = Reads(TracerProbe(tracer))
    with tracer:
        inputs = make_inputs(torch, dims(forward_only=forward_only), "meta")
        m = run_protocol(torch, attn, probe, inputs, forward_only)
        del inputs
    if forward_only:
        # before: q, k, v, workspace = 4 x 512 = 2,048; after: + out (e died under no_grad)
        assert probe.allocated_reads == [2048, 2048 + 512]
        assert m == Measured(saved_bytes=0,  # 2,560 - 2,048 - 512 (out)
                             forward_peak_bytes=2048 + 4096,  # + tmp = 6,144
                             backward_peak_bytes=0,
                             reserved_peak_bytes=2 << 20)  # one 2 MiB small-pool segment
    else:
        # before: q, k, v, grad_out, workspace = 5 x 512 = 2,560 (no grads, no warm-up out);
        # after: + e + out = 3,584
        assert probe.allocated_reads == [2560, 2560 + 2 * 512]
        assert m == Measured(saved_bytes=512,  # 3,584 - 2,560 - 512 (out): e
                             forward_peak_bytes=2560 + 4096,  # + tmp = 6,656
                             # 3,584 + grad of e, k.grad, q.grad = 3,584 + 3 x 512 = 5,120
                             backward_peak_bytes=3584 + 3 * 512,
                             reserved_peak_bytes=2 << 20)  # one 2 MiB small-pool segment


def test_a_parameters_grad_left_by_an_earlier_step_is_released_first():
    """A module traced twice (``memcalc oom --trace`` traces one instance at six lengths)
    kept the first trace's grads, and the second accumulated into them (``add_`` in
    AccumulateGrad): a step starts from ``zero_grad(set_to_none=True)``."""
    w = torch.zeros(4, requires_grad=True)
    w.grad = torch.ones(4)
    seen = []

    def attn(q, k, v):
        seen.append(w.grad is None)
        return q * w

    run_protocol(torch, attn, ZeroProbe(), make_inputs(torch, dims(), "cpu"), forward_only=False,
                 parameters=(w,))
    assert seen == [True, True]
