"""The measurement protocol's replay (``memcalc.engine.replay``): inputs, warm-up, measured
forward and backward, on the seeds' benchmark (B=8, H=1, N=16384, d=16, fp32, H100); the
naive family's own figures are in ``test_impls_naive.py``.

Names: NN = 8 x 16384 x 16384 x 4 B = 8,589,934,592 (one N x N fp32 tensor);
ND = 8 x 16384 x 16 x 4 B = 8,388,608 (q, k, v, grad_out, out, one grad);
WS = 32 MiB = 33,554,432 (one H100 cuBLAS workspace; two threads hold one).
"""

import pytest

from memcalc.engine.allocator import CachingAllocator
from memcalc.config import Config, Protocol
from memcalc.impls.registry import IMPLS
from memcalc.engine.replay import Ledger
from memcalc.analysis.predict import predict
from memcalc.engine.program import Role

NN, ND, WS = 8_589_934_592, 8_388_608, 33_554_432


def test_forward_only_saves_nothing_and_has_one_workspace():
    b = predict(Config(impl="naive-softmax", protocol=Protocol(forward_only=True)))
    assert b.saved_bytes == 0
    assert b.backward_peak_bytes == 0
    assert b.forward_peak_bytes == 2 * NN + WS + 3 * ND + ND  # s, p; one workspace; q, k, v; out
    assert b.workspace_bytes == WS


def test_a100_workspace_default():
    b = predict(Config(impl="naive-softmax", device={"gpu": "a100-80gb"}))
    assert b.workspace_bytes == 2 * (4096 * 1024 * 2 + 16 * 1024 * 8)  # 2 x 8,519,680


def test_components_add_up_to_the_peak():
    b = predict(Config(impl="naive", causal=True, shape={"seq_len": 1050, "heads": 3}))
    assert sum(c.allocated for c in b.components) == b.peak_bytes


def test_ledger_history_records_every_event():
    ledger = Ledger(WS, record=True)
    predict(Config(impl="naive-softmax", shape={"seq_len": 256}), ledger=ledger)
    kinds = [e.kind for e in ledger.history]
    # alive after the step: q, k, v, grad_out, the two workspaces and the three leaf grads
    assert kinds.count("alloc") == kinds.count("free") + 9
    assert ledger.history[-1].allocated == 7 * (8 * 256 * 16 * 4) + 2 * WS  # 7 x 8 x 256 x 16 x 4 B
    assert [e.label for e in ledger.history if e.kind == "phase"] == [
        "warm-up", "forward", "backward", "end"]


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_mirrored_measured_step_gives_the_full_replays_figures(impl, monkeypatch):
    """The measured step repeats the warm-up's small-pool decisions without making them
    again (``CachingAllocator.mirror_small_pool``); with ``may_mirror`` off it makes them
    all. Both give the same breakdown, to every block of every live set, for each
    implementation: at a length whose tensors are all small (one chunk of 64 rows at
    seq_len 100, so the chunked loop runs twice) and at one with large ones."""
    mirrored = []
    spy = CachingAllocator.mirror_small_pool
    monkeypatch.setattr(CachingAllocator, "mirror_small_pool",
                        lambda self: mirrored.append(spy(self)) or mirrored[-1])
    masked = impl == "flex"  # a causal BlockMask, from its kernel's 128 rows
    for seq_len in ((128 if masked else 100), 1500):
        config = Config(impl=impl, dtype="fp16", shape={"seq_len": seq_len},  # chunks of 64
                        mask="causal" if masked else "none")
        assert predict(config) == _never_mirrored(config, monkeypatch)
    assert mirrored == [True, False] * 2  # mirrored, then not


def _never_mirrored(config, monkeypatch, capacity=None):
    """``predict`` with every small-pool decision of the measured step made."""
    made = CachingAllocator.__init__

    def never(self, *args, **kwargs):
        made(self, *args, **kwargs)
        self.may_mirror = False

    with monkeypatch.context() as patched:
        patched.setattr(CachingAllocator, "__init__", never)
        return predict(config, capacity=capacity)


def test_the_live_set_at_a_peak_is_kept_from_the_first_reset():
    """The ledger logs changes for the live set at a peak only once the peak was reset:
    the protocol reads it after a reset, and a warm-up's changes would all be discarded."""
    ledger = Ledger(WS)
    with pytest.raises(RuntimeError, match="first reset_peak"):
        ledger.peak_live
    ledger.reset_peak()
    assert ledger.peak_live == ()


def test_a_small_workspace_made_in_the_warm_up_is_not_mirrored(monkeypatch):
    """A cuBLAS workspace of 16 KiB x 8 = 131,072 B comes from the small pool and is made
    in the warm-up only: the measured step's small requests then differ from the
    warm-up's, the allocator sees a block the warm-up left (its premise fails) and replays
    every decision, with the figures of a capped replay."""
    mirrored = []
    spy = CachingAllocator.mirror_small_pool
    monkeypatch.setattr(CachingAllocator, "mirror_small_pool",
                        lambda self: mirrored.append(spy(self)) or mirrored[-1])
    config = Config(impl="naive", shape={"seq_len": 300},
                    protocol=Protocol(cublas_workspace_config=":16:8"))
    assert config.workspace_bytes == 16 * 1024 * 8
    assert predict(config) == predict(config, capacity=1 << 50)
    assert mirrored == [False, False]


def test_reported_components_keep_their_declarations():
    """Each saved tensor is reported with its own name and its kind's fields: p and exp_x
    are both (8, 1, 16384, 16384) fp32 tensors, and each keeps its op."""
    saved = {c.name: c for c in predict(Config(impl="naive")).saved}
    exp_x, p = saved["exp_x"], saved["p"]
    assert (exp_x.op, p.op) == ("exp", "div")
    for c in (exp_x, p):
        assert (c.shape, c.dtype, c.role.value, c.source) == ((8, 1, 16384, 16384), "float32",
                                                              "saved", "")
        assert c.bytes == c.allocated == NN  # already a multiple of 512 B: its own block


def test_under_no_grad_nothing_is_reported_as_saved():
    """A forward-only step listed exp_x and p as saved, "kept by ExpBackward0", next to
    saved for backward = 0: under no_grad they are activations, as the tracer says."""
    from memcalc.config import make_config
    from memcalc.output.legend import made_by

    b = predict(make_config(seq_len=256, forward_only=True))
    roles = {c.name: c.role for c in b.forward_live}
    assert roles["exp_x"] is Role.activation and Role.saved not in roles.values()
    assert b.saved_bytes == 0
    exp_x = next(c for c in b.forward_live if c.name == "exp_x")
    assert made_by(exp_x) == "exp: e = exp(s - m)"
    with_grad = next(c for c in predict(make_config(seq_len=256)).forward_live
                     if c.name == "exp_x")
    assert with_grad.role is Role.saved and "kept by ExpBackward0" in made_by(with_grad)


def _capped(config, capacity, mirror: bool, monkeypatch):
    """``predict`` under ``capacity`` with the measured step's small pool mirrored where
    exact (``mirror``), or every decision made; its figures and live sets, or the OOM."""
    from memcalc.engine.allocator import OutOfMemory

    try:
        b = (predict(config, capacity=capacity) if mirror
             else _never_mirrored(config, monkeypatch, capacity))
    except OutOfMemory as oom:
        return ("oom", oom.requested, oom.reserved)
    return (b.saved_bytes, b.forward_peak_bytes, b.backward_peak_bytes, b.reserved_peak_bytes,
            [(c.name, c.allocated) for c in b.forward_live + b.backward_live])


def test_a_capped_replay_mirrors_the_small_pool_and_replays_again_when_it_must_release(
        monkeypatch):
    """Under a capacity the measured step now mirrors the warm-up's small-pool decisions
    too (a capped chunked replay at a million rows: 4.3 s -> 3.4 s). sdpa-math at 640
    rows, batch 8, head_dim 64, fp16 reserves 130,023,424 B by the end of its warm-up and
    144,703,488 B in its measured step: a capacity between them makes the measured step
    release cached segments, which a mirrored pool cannot (``MirrorBroken``), so it is
    replayed with every decision made. Either way, the same figures as never mirroring."""
    from memcalc.analysis import predict as predict_module
    from memcalc.engine import allocator
    from memcalc.engine.allocator import MiB
    from memcalc.config import make_config

    broken = []
    replayed = predict_module._replayed_in

    def spy(config, ledger, *program):
        try:
            return replayed(config, ledger, *program)
        except allocator.MirrorBroken:
            broken.append(config)
            raise

    for config, start, end in [
            (make_config(impl="sdpa-math", seq_len=640, batch=8, head_dim=64, dtype="fp16"),
             118, 140),
            (make_config(impl="linear-causal-chunked", seq_len=640, batch=2), 2, 40)]:
        for capacity in range(start * MiB, end * MiB, 2 * MiB):
            with monkeypatch.context() as patched:
                patched.setattr(predict_module, "_replayed_in", spy)
                mirrored = _capped(config, capacity, True, monkeypatch)
            assert mirrored == _capped(config, capacity, False, monkeypatch), capacity
    assert broken  # the replay again was taken


def test_ctrl_c_in_a_replay_leaves_no_collection_to_walk_what_it_made(monkeypatch):
    """Interrupted, a replay unwinds with its program held by the traceback: turning the
    collector on walked every object made while it was paused (1.2 s between Ctrl-C and
    the report at 10 million rows). They are frozen instead, and the next replay thaws
    them; the collector is on again either way."""
    import gc

    import memcalc.analysis.predict as predict_module

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(predict_module, "_replayed", interrupted)
    assert gc.isenabled()
    before = gc.get_freeze_count()
    with pytest.raises(KeyboardInterrupt):
        predict(Config(shape={"seq_len": 256}))
    assert gc.isenabled() and gc.get_freeze_count() > before
    monkeypatch.undo()
    predict(Config(shape={"seq_len": 256}))
    assert gc.isenabled() and gc.get_freeze_count() == before
