"""Context parallelism (``memcalc.impls.ring``): one rank's step of PyTorch's ring attention,
against ``memcalc trace --cp`` running torch's own ``_templated_ring_attention`` on a fake
process group, allocation by allocation; and the figures of ``breakdown --cp``."""

import pytest

from memcalc.analysis.predict import predict
from memcalc.config import make_config

MiB = 1 << 20


def config(**options):
    sizes = dict(impl="sdpa-flash", batch=1, heads=32, head_dim=128, dtype="bf16", causal=True,
                 seq_len=131072)
    return make_config(**{**sizes, **options})


def test_the_busiest_rank_holds_the_gathered_kv_of_the_whole_sequence():
    """The issue's case: 4 ranks of 32,768 rows each. At the backward peak of rank 1 (ranks
    1-3 tie; rank 0's partial steps are smaller), every tensor alive, in MiB:
    gathered K/V, every rank's k and v: 2 x 32 x 131,072 x 128 x 2 B = 2,048;
    step 0's float32 cat of dK/dV, still stashed, and the dK/dV received: 2 x 1,024
    (2 x 32 x 32,768 x 128 x 4 B each); the float32 grad_q/grad_k/grad_v: 3 x 512;
    step 1's cat of K/V (bf16, 2 x 32 x 32,768 x 128 x 2 B): 512; step 1's dq_accum (32,768
    x 32 x 128 x 4 B): 512; q, k, v, grad_out, out: 5 x 256 (32 x 32,768 x 128 x 2 B);
    step 0's dq, dk, dv: 3 x 256; step 1's dout and out copies and dq: 3 x 256; step 1's
    dk, dv over half the keys: 2 x 128; the merged logsumexp and step 1's softmax_d, 32 x
    32,768 x 4 B: 2 x 4; the philox tensors: 2 x 512 B."""
    b = predict(config(cp=4))
    mib = 2048 + 2 * 1024 + 3 * 512 + 512 + 512 + 5 * 256 + 3 * 256 + 3 * 256 + 2 * 128 + 2 * 4
    assert b.backward_peak_bytes == mib * MiB + 2 * 512 == 10_208_936_960
    assert b.rank == 1 and b.rank_peaks[1:] == (b.backward_peak_bytes,) * 3
    gathered = {c.name: c.bytes for c in b.backward_live}["gathered K/V"]
    assert gathered == 2 * 32 * 131072 * 128 * 2
    assert b.peak_bytes < predict(config()).peak_bytes  # 12,918,457,344 on one GPU


def test_alltoall_receives_one_ranks_kv_at_a_time():
    """_AllToAllRotater: no gathered buffer; the K/V of one rank (2 x 32 x 32,768 x 128 x 2 B
    = 512 MiB) per step."""
    live = {c.name: c.bytes for c in predict(config(cp=4, cp_method="alltoall")).backward_live}
    assert "gathered K/V" not in live
    assert live["K/V from rank 0"] == 512 * MiB


def test_from_torch_2_14_the_ring_returns_the_first_steps_philox_tensors():
    """``FIRST_STEP_REST``: torch 2.14's ``_templated_ring_attention`` keeps step 0's
    ``rest`` (``saved_rest``) and returns it; 2.13 returned the last step's. Autograd saves
    as many bytes either way, but from step 2 on step 0's rng_state and philox_offset (16 B
    and 8 B, a 512 B block each) live beside the previous step's: every rank's forward peak
    is 2 x 512 = 1,024 B higher at 4 ranks, nothing else changes."""
    from memcalc.analysis.predict import rank_breakdown
    from memcalc.impls import ring
    from memcalc.validation.compare import figures_of

    c = config(cp=4)
    for rank in range(4):
        d = c.dims.replace(cp_rank=rank)
        old, new = (ring.forward(ring.Ring(d, 4, rank, torch=t))[-1].names
                    for t in ((2, 13), (2, 14)))
        assert old[1:] == ("step 3: rng_state", "step 3: philox_offset")
        assert new[1:] == ("step 0: rng_state", "step 0: philox_offset") and old[0] == new[0]
        before, after = (figures_of(rank_breakdown(c, rank, program=ring.program(d, torch=t)))
                         for t in ((2, 13), (2, 15)))
        assert {k: after[k] - before[k] for k in before if after[k] != before[k]} == {
            "forward_peak_bytes": 2 * 512}


def test_tensor_parallelism_is_one_gpu_with_its_share_of_the_heads():
    """--tp 4 over 32 heads (8 key/value heads): each rank is a step of 8 heads over 2."""
    for impl in ("sdpa-flash", "naive"):
        split = predict(config(impl=impl, seq_len=4096, kv_heads=8 if impl != "naive" else None,
                               tp=4))
        alone = predict(config(impl=impl, seq_len=4096, heads=8,
                               kv_heads=2 if impl != "naive" else None))
        for figure in ("saved_bytes", "forward_peak_bytes", "backward_peak_bytes",
                       "reserved_peak_bytes"):
            assert getattr(split, figure) == getattr(alone, figure), (impl, figure)


BASE = "breakdown --impl sdpa-flash --causal --seq 1024 --heads 32 --head-dim 128 --dtype bf16"


@pytest.mark.parametrize("argv, refused", [
    (BASE.replace("--causal ", "") + " --cp 4", "--cp: PyTorch's context parallelism balances"),
    (BASE.replace("sdpa-flash", "naive") + " --cp 4",
     "--cp: context parallelism is modelled over sdpa-flash, sdpa-cudnn, sdpa-efficient"),
    (BASE.replace("sdpa-flash", "sdpa-efficient").replace("1024", "1152") + " --cp 4",
     "--seq: under 4 ranks N is a multiple of 64 x 4 = 256"),
    (BASE.replace("1024", "1004") + " --cp 4", "--seq: under 4 ranks N is a multiple of 2 x 4"),
    (BASE.replace("sdpa-flash", "flex") + " --cp 4 --cp-method ulysses",
     "--cp-method: ulysses is modelled with sdpa-flash, sdpa-cudnn, sdpa-efficient, flash-attn, "
     "sdpa-math, naive, naive-softmax, naive-weights as the local attention, not flex"),
    (BASE.replace("32", "6") + " --cp 4 --cp-method ulysses", "--cp: 4 ranks must divide the heads"),
    (BASE.replace("32", "4") + " --cp 4 --cp-method ulysses --tp 2",
     "--cp: 4 ranks must divide the heads (2) and the key/value heads (2) a tensor-parallel"),
    (BASE.replace("1024", "1022") + " --cp 4 --cp-method ulysses",
     "--seq: under 4 ranks a multiple of 4"),
    (BASE.replace("128", "100") + " --cp 4", "--head-dim: under context parallelism"),
    (BASE + " --tp 3", "--tp: 3 ranks must divide the heads"),
])
def test_what_the_model_refuses_is_one_line(argv, refused, capsys):
    from memcalc.cli import main

    assert main(argv.split()) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"memcalc: error: {refused}") and err.count("\n") == 1


# --- against torch's own ring attention --------------------------------------------------

torch = pytest.importorskip("torch")

SDPA = "examples/attention/sdpa_cp.py:attn"

GRID = [dict(cp=2, seq_len=512), dict(cp=2, seq_len=512, cp_method="alltoall"),
        dict(cp=3, seq_len=768), dict(cp=3, seq_len=768, cp_method="alltoall"),
        dict(cp=4, seq_len=1024), dict(cp=4, seq_len=1024, cp_method="alltoall"),
        dict(cp=2, seq_len=512, heads=1, batch=2), dict(cp=3, seq_len=3000, head_dim=64),
        dict(cp=2, seq_len=512, loss="sum"), dict(cp=2, seq_len=512, dtype="fp16"),
        dict(cp=3, seq_len=768, impl="sdpa-cudnn"),
        dict(cp=4, seq_len=1024, impl="sdpa-cudnn", cp_method="alltoall"),
        dict(cp=2, seq_len=512, impl="sdpa-cudnn", loss="sum", heads=1, batch=2),
        dict(cp=4, seq_len=1024, kv_heads=2), dict(cp=2, seq_len=512, kv_heads=2,
                                                   impl="sdpa-cudnn", cp_method="alltoall"),
        dict(cp=2, seq_len=256, impl="sdpa-efficient"),
        dict(cp=3, seq_len=576, impl="sdpa-efficient", dtype="fp32", cp_method="alltoall"),
        dict(cp=2, seq_len=256, impl="sdpa-efficient", loss="sum", heads=1, batch=2)]


@pytest.mark.parametrize("options", GRID)
def test_each_ranks_allocations_and_frees_are_torchs(options, ledger_steps):
    """Every rank: the model's ledger history (each allocation's bytes, each free, in order)
    is the trace's of torch's ring attention up to its last allocation (after it, the
    protocol's end frees the rest), over the flash kernel and over cuDNN's (the reference
    code pins the backend)."""
    from memcalc.analysis.predict import rank_breakdown
    from memcalc.engine.replay import Ledger
    from memcalc.tracing import traced
    from memcalc.validation.reference import reference_fn

    c = config(**{"heads": 8, **options})
    for rank in range(c.cp):
        history: list = []
        traced(reference_fn(c), c, history=history, rank=rank)
        ledger = Ledger(c.workspace_bytes, record=True)
        rank_breakdown(c, rank, ledger)
        model, trace = ledger_steps(ledger.history), ledger_steps(history)
        last = max(i for i, (kind, _) in enumerate(model) if kind == "alloc")
        assert trace[:last + 1] == model[:last + 1], (rank, options)


def test_the_trace_shows_the_busiest_rank_as_the_model_does():
    from memcalc.tracing import load_function, traced
    from memcalc.validation.compare import figures_of

    c = config(heads=8, gpu="a100-80gb", cp=4, seq_len=8192)
    step = traced(load_function(SDPA), c).breakdown
    model = predict(c)
    assert (step.rank, step.rank_peaks) == (model.rank, model.rank_peaks)
    assert figures_of(step) == figures_of(model)


@pytest.mark.slow
def test_validate_cases_cp_checks_every_rank_against_torch(capsys):
    """memcalc validate --cases cp: each (configuration, rank) of the grid, the model's five
    figures against the trace of torch's ring attention; 0 mismatches. Minutes: a slow test
    (``-m slow``), as the command shown in docs/guides/several-gpus.md; the ranks of one
    configuration against torch's are the tests above."""
    from memcalc.validation import validate
    from memcalc.validation.context_parallel import grid, ulysses_checked, ulysses_grid

    report = validate(cases=("cp",))
    configs = grid() + (ulysses_grid() if ulysses_checked() else [])
    assert len(report.checks) == sum(c.cp for c in configs) and report.mismatches == 0


def test_the_json_names_the_rank_shown_and_every_ranks_figures(capsys):
    import json

    from memcalc.cli import main

    assert main((BASE + " --cp 4 --json").split()) == 0
    out = json.loads(capsys.readouterr().out)
    model = predict(config(seq_len=1024, cp=4, batch=8))  # the CLI's default batch
    assert (out["rank"], out["rank_peak_bytes"], out["rank_reserved_peak_bytes"]) == (
        model.rank, list(model.rank_peaks), list(model.rank_reserved))
    assert out["config"]["cp"] == 4


def test_the_math_backend_under_cp_is_refused_in_one_line(tmp_path):
    """The math path would run as DTensor ops on the sharded tensors, not torch's ring: a
    trace must not give it the one-GPU figures of a shard."""
    from memcalc.tracing import TraceError, load_function, trace

    path = tmp_path / "math.py"
    path.write_text("import torch.nn.functional as F\n"
                    "from torch.nn.attention import SDPBackend, sdpa_kernel\n\n"
                    "def attn(q, k, v, causal=True):\n"
                    "    with sdpa_kernel(SDPBackend.MATH):\n"
                    "        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)\n")
    with pytest.raises(TraceError, match="--cp: the math backend under context parallelism"):
        trace(load_function(f"{path}:attn"), config(heads=4, head_dim=64, seq_len=1024, cp=2))
