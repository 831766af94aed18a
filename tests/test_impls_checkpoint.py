"""``checkpoint-<impl>``: non-reentrant activation checkpointing, generated from the registry.

Hand counts on the seeds' benchmark (B=8, H=1, N=16384, d=16, fp32, H100):
NN = 8 x 16384 x 16384 x 4 B = 8,589,934,592; ND = 8 x 16384 x 16 x 4 B = 8,388,608;
WS = 33,554,432 (one cuBLAS workspace).
"""

import pytest

from memcalc.config import Config
from memcalc.impls import IMPLS, impl_names
from memcalc.impls.checkpoint import PREFIX, UNSUPPORTED
from memcalc.impls import registry
from memcalc.engine.replay import Ledger
from memcalc.analysis.predict import predict
from memcalc.validation import figures_of

NN, ND, WS = 8_589_934_592, 8_388_608, 33_554_432


def wrappers() -> list[str]:
    return [n for n in impl_names() if n.startswith(PREFIX)]


def test_every_traced_implementation_is_wrapped():
    """Every traced implementation of memcalc/impls (not functions registered at run time
    by ``memcalc trace``)."""
    names = [n for n in impl_names() if IMPLS[n].build.__module__.startswith("memcalc.impls.")]
    expected = {PREFIX + n for n in names if IMPLS[n].traced and not n.startswith(PREFIX)
                and n not in UNSUPPORTED}
    assert set(wrappers()) == expected
    assert {"checkpoint-naive", "checkpoint-sdpa-math", "checkpoint-linear-causal-chunked",
            "checkpoint-naive-weights"} <= expected
    assert IMPLS["checkpoint-sdpa-math"].gqa


def test_softmax_saves_nothing_but_keeps_its_peak():
    b = predict(Config(impl="checkpoint-naive-softmax"))
    assert b.saved_bytes == 0  # the weights (NN) are dropped and recomputed
    # the forward is unchanged: s and p alive at out = p @ v; q, k, v, grad_out, out; 2 ws
    assert b.forward_peak_bytes == 2 * NN + 2 * WS + 4 * ND + ND  # 17,288,921,088
    # the recomputation holds at most s and p, less than the inner backward's p, dp, ds and
    # ds's grad * p temporary
    assert b.backward_peak_bytes == 4 * NN + 2 * WS + 4 * ND + 2 * ND  # 34,477,178,880
    assert b.backward_peak_bytes == predict(Config(impl="naive-softmax")).backward_peak_bytes


def test_naive_drops_the_argmax_early():
    inner, wrapped = predict(Config(impl="naive")), predict(Config(impl="checkpoint-naive"))
    # max's int64 indices (8 x 16384 x 8 B = 1 MiB) die with .values, and the row sum
    # (8 x 16384 x 4 B = 0.5 MiB) after the division: not alive at the forward peak
    assert inner.forward_peak_bytes - wrapped.forward_peak_bytes == 1_048_576 + 524_288


def test_custom_function_recomputes_its_output():
    """``save_for_backward`` packs after the Function's forward returns, so the
    recomputation allocates a second output before it stops."""
    from memcalc.impls.checkpoint import recomputed

    assert recomputed("out") in backward_names("checkpoint-naive-weights")
    assert recomputed("out") not in backward_names("checkpoint-naive-softmax")


def backward_names(impl: str) -> list[str]:
    """The tensors the backward of ``impl`` allocates, by name."""
    from memcalc.engine.program import Dims, Tensor

    program = IMPLS[impl].build(Dims.of(Config(impl=impl, shape={"seq_len": 256})))
    return [e.name for e in program.backward if isinstance(e, Tensor)]


def steps(history) -> list[tuple[int, tuple[int, ...]]]:
    """Allocation by allocation: the block allocated and the blocks freed just before it
    (frees between two allocations commute)."""
    out, freed = [], []
    for e in history:
        if e.kind == "free":
            freed.append(e.component.allocated)
        elif e.kind == "alloc":
            out.append((e.component.allocated, tuple(sorted(freed))))
            freed = []
    return out


def traced_steps(config):
    from memcalc.tracing.tracer import Tracer, TracerProbe, run_traced
    from memcalc.validation.reference import reference_fn

    tracer = Tracer(config.workspace_bytes)
    run_traced(config, reference_fn(config), tracer, TracerProbe(tracer))
    return steps(tracer.ledger.history)


def model_steps(config):
    ledger = Ledger(config.workspace_bytes, record=True)
    predict(config, ledger=ledger)
    return steps(ledger.history)


SMALL = {"batch": 2, "heads": 3, "seq_len": 200, "head_dim": 16}


@pytest.mark.parametrize("loss", ["grad", "sum"])
@pytest.mark.parametrize("impl", wrappers())
def test_every_wrapper_equals_the_trace_event_by_event(impl, loss):
    causal = not impl.endswith("-linear")  # linear is bidirectional only
    config = Config(impl=impl, dtype="fp16", causal=causal, shape=SMALL, chunk=64,
                    protocol={"loss": loss})
    assert model_steps(config) == traced_steps(config)


def test_saved_tensors_die_before_the_engines_sum_to(monkeypatch):
    """Without checkpoint ``DivBackward0``'s operands live until the engine's
    ``release_variables``, after it reduced the divisor's grad; under checkpoint they die
    when the node's ``apply`` returns, before that ``sum``."""
    from memcalc.impls import checkpoint

    config = Config(impl="checkpoint-linear", dtype="fp16", shape=SMALL, protocol={"loss": "sum"})
    assert model_steps(config) == traced_steps(config)
    monkeypatch.setattr(checkpoint, "early_releases", lambda events: events)
    monkeypatch.setattr(registry, "_PROGRAMS", {})  # programs are kept: build it again
    assert model_steps(config) != traced_steps(config)


def test_a_release_moves_before_the_frees_and_sums_that_end_its_node():
    """Each release moves before the frees and ``sum`` allocations right before it, and
    no further: not past an allocation of another op, nor past another release."""
    from memcalc.impls.checkpoint import early_releases
    from memcalc.engine.program import Role, free, new, release

    a, b = (new(n, (2,), "float32", Role.temporary, "mm") for n in "ab")
    s = new("s", (1,), "float32", Role.temporary, "sum")
    fx, fy, r1, r2, r3 = free("x"), free("y"), release("r1"), release("r2"), release("r3")
    assert early_releases([a, fx, s, r1, b, r2, fy, r3]) == [a, r1, fx, s, b, r2, r3, fy]
    assert early_releases([fx, r1, r2]) == [r1, r2, fx]  # the second stops at the first


def test_recomputation_stops_early(monkeypatch):
    """The recomputation stops once the last saved tensor is packed again (``early_stop``):
    recomputing the whole forward, ``out = p @ v`` included, disagrees with the trace."""
    from memcalc.impls import checkpoint

    config = Config(impl="checkpoint-naive-softmax", dtype="fp16", shape=SMALL)
    assert model_steps(config) == traced_steps(config)
    monkeypatch.setattr(checkpoint, "stop_index", lambda name, forward: len(forward))
    monkeypatch.setattr(registry, "_PROGRAMS", {})  # programs are kept: build it again
    assert model_steps(config) != traced_steps(config)


@pytest.mark.parametrize("impl", ["checkpoint-sdpa-math", "checkpoint-linear-causal-chunked"])
@pytest.mark.parametrize("seq_len", [1000, 1050, 3001])
def test_odd_lengths_equal_trace(impl, seq_len):
    from memcalc.validation.emulated import measure

    shape = {"batch": 2, "heads": 4, "kv_heads": 2 if impl.endswith("math") else None,
             "seq_len": seq_len, "head_dim": 16}
    config = Config(impl=impl, dtype="bf16", causal=True, chunk=100, shape=shape)
    assert figures_of(predict(config)) == figures_of(measure(config))
    assert predict(config).saved_bytes == 0


def _user_checkpoint(fn, selective: bool):
    """``fn`` under ``torch.utils.checkpoint`` as a user writes it in a model: non-reentrant,
    or selective with a policy that recomputes every op (what non-reentrant does)."""
    from functools import partial

    from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                        create_selective_checkpoint_contexts)

    def recompute(ctx, op, *args, **kwargs):
        return CheckpointPolicy.PREFER_RECOMPUTE

    context = {"context_fn": partial(create_selective_checkpoint_contexts, recompute)} \
        if selective else {}

    def step(q, k, v, causal=False):
        return checkpoint(fn, q, k, v, causal, use_reentrant=False, **context)

    return step


@pytest.mark.parametrize("selective", [False, True])
@pytest.mark.parametrize("impl, dtype, causal", [("naive", "fp32", False),
                                                 ("naive-softmax", "fp16", True),
                                                 ("sdpa-math", "fp16", True)])
def test_checkpointing_in_user_code_equals_the_model(impl, dtype, causal, selective):
    """A user's checkpointed attention, traced on the GPU's code paths (the recomputation
    in the backward follows them too), equals checkpoint-<impl> on every figure."""
    from memcalc.tracing import trace
    from memcalc.validation import figures_of
    from memcalc.validation.reference import REFERENCES, reference_fn

    reference_fn(Config(impl=impl))  # loads the reference code
    config = Config(impl=f"checkpoint-{impl}", dtype=dtype, causal=causal, shape=SMALL)
    traced = trace(_user_checkpoint(REFERENCES[impl], selective), config)
    assert figures_of(traced) == figures_of(predict(config))
