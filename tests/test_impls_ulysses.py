"""DeepSpeed-Ulysses (``memcalc.impls.ulysses``): one rank's step of DeepSpeed's
``DistributedAttention`` over SDPA's flash kernel, against a trace of DeepSpeed's own code on
a fake process group, allocation by allocation; and the figures of ``breakdown``."""

from importlib.util import find_spec

import pytest

from memcalc.analysis.predict import predict
from memcalc.config import make_config

MiB = 1 << 20


def config(**options):
    sizes = dict(impl="sdpa-flash", batch=1, heads=32, head_dim=128, dtype="bf16", causal=True,
                 seq_len=131072, cp=4, cp_method="ulysses")
    return make_config(**{**sizes, **options})


def test_four_ranks_hold_every_row_of_a_quarter_of_the_heads():
    """4 ranks of 32,768 rows, 32 heads: each attends all 131,072 rows of 8 heads. At the
    backward peak (the kernel's backward), in MiB: dq_accum, 131,072 x 8 x 128 x 4 B: 512;
    q, k, v, grad_out, 32,768 x 32 x 128 x 2 B: 4 x 256; q, k, v all-to-all'd and the
    kernel's output, 131,072 x 8 x 128 x 2 B: 4 x 256 (B = 1: the received buffers are the
    results, no copy after); the output back in rows: 256; the grad all-to-all'd: 256; dq,
    dk, dv: 3 x 256; logsumexp and softmax_d, 8 x 131,072 x 4 B: 2 x 4; the philox tensors:
    2 x 512 B. No rank is busier; the ring holds the gathered K/V besides (10,208,936,960)."""
    b = predict(config())
    mib = 512 + 4 * 256 + 4 * 256 + 256 + 256 + 3 * 256 + 2 * 4
    assert b.backward_peak_bytes == mib * MiB + 2 * 512 == 4_034_921_472
    assert b.rank_peaks == (b.backward_peak_bytes,) * 4
    assert b.peak_bytes < predict(config(cp_method="allgather")).peak_bytes


def test_a_batch_of_two_copies_after_each_all_to_all():
    """B = 2: the permute after the all-to-all is not contiguous, so q's layer is a copy of
    the received buffer, 2 x 131,072 x 8 x 128 x 2 B = 512 MiB, which the kernel's node
    saves; with B = 1 the received buffer is the layer itself."""
    two = {c.name: c.bytes for c in predict(config(batch=2)).saved}
    assert two["q to heads"] == 512 * MiB and "q to heads: received" not in two
    one = {c.name: c.bytes for c in predict(config()).saved}
    assert one["q to heads: received"] == 256 * MiB and "q to heads" not in one


def test_the_math_path_saves_the_matmuls_clones_with_a_batch():
    """SDPA's math backend under Ulysses, 8 heads of 64 over 2 ranks (h = 4), 512 rows,
    bf16. With B = 2, matmul cannot fold batch and heads of the (B, N, h, D) views, so it
    clones q and k^T scaled and v, in float32 (2 x 4 x 512 x 64 x 4 B = 1 MiB each), and
    the bmms save the clones; the weights p, 2 x 4 x 512 x 512 x 4 B = 8 MiB. With B = 1
    they fold as views: the products themselves are saved (0.5 MiB each), and in float32
    the all-to-all'd v itself (its received buffer: B = 1)."""
    half = MiB // 2  # 0.5 MiB
    two = {c.name: c.bytes for c in predict(config(impl="sdpa-math", batch=2, heads=8,
                                                   head_dim=64, seq_len=512, cp=2)).saved}
    assert two == {"local: qs fold": MiB, "local: ks fold": MiB, "local: v32 fold": MiB,
                   "local: p": 8 * MiB}
    one = {c.name: c.bytes for c in predict(config(impl="sdpa-math", heads=8, head_dim=64,
                                                   seq_len=512, cp=2)).saved}
    assert one == {"local: qs": half, "local: ks": half, "local: v32": half,
                   "local: p": 4 * MiB}
    fp32 = {c.name: c.bytes for c in predict(config(impl="sdpa-math", heads=8, head_dim=64,
                                                    seq_len=512, cp=2, dtype="fp32")).saved}
    assert fp32 == {"local: qs": half, "local: ks": half, "v to heads: received": half,
                    "local: p": 4 * MiB}


# --- against DeepSpeed's own code ---------------------------------------------------------

# only these tests need torch and DeepSpeed: the model's above run without them (a
# module-level importorskip skipped those too)
needs_deepspeed = pytest.mark.skipif(
    find_spec("torch") is None or find_spec("deepspeed") is None,
    reason="needs torch and DeepSpeed (pip install 'memcalc[deepspeed]')")

GRID = [dict(cp=2, seq_len=512), dict(cp=4, seq_len=1024, batch=2),
        dict(cp=2, seq_len=512, kv_heads=2), dict(cp=4, seq_len=4000, batch=3, kv_heads=4),
        dict(cp=2, seq_len=512, causal=False, dtype="fp16"), dict(cp=2, seq_len=512, loss="sum"),
        dict(cp=2, seq_len=512, batch=2, loss="sum"), dict(cp=8, seq_len=2048, batch=1),
        dict(cp=2, seq_len=2, loss="sum"),  # one row a rank: the permutes keep contiguity
        dict(cp=2, seq_len=512, forward_only=True, batch=2),
        dict(cp=2, seq_len=512, impl="flash-attn"), dict(cp=4, seq_len=1024, impl="flash-attn",
                                                         batch=2, kv_heads=4, loss="sum"),
        dict(cp=2, seq_len=512, impl="flash-attn", deterministic=True, batch=2),
        dict(cp=2, seq_len=512, impl="sdpa-cudnn", batch=2, kv_heads=2, loss="sum"),
        dict(cp=4, seq_len=1024, impl="sdpa-efficient", dtype="fp32"),
        dict(cp=2, seq_len=512, impl="sdpa-efficient", batch=2, forward_only=True),
        # the math path and the naive family on (B, N, h, D) views: matmul's folds copy
        # with B > 1 and are views with B = 1 (fp32: v itself saved), one head a rank
        # (h = 1) folds as a view whatever B; GQA repeats k and v contiguous
        dict(cp=2, seq_len=512, impl="sdpa-math", batch=2),
        dict(cp=2, seq_len=512, impl="sdpa-math", dtype="fp32"),
        dict(cp=2, seq_len=512, impl="sdpa-math", dtype="fp32", batch=2, loss="sum"),
        dict(cp=4, seq_len=1024, impl="sdpa-math", batch=3, kv_heads=4, causal=False),
        dict(cp=4, seq_len=1024, impl="sdpa-math", heads=4, batch=2, dtype="fp32"),
        dict(cp=2, seq_len=512, impl="sdpa-math", kv_heads=2, dtype="fp32", batch=2),
        dict(cp=2, seq_len=512, impl="sdpa-math", batch=2, forward_only=True),
        dict(cp=2, seq_len=512, impl="naive", batch=2, dtype="fp16"),
        dict(cp=2, seq_len=512, impl="naive-softmax"),
        dict(cp=4, seq_len=1024, impl="naive-softmax", batch=2, loss="sum", causal=False),
        dict(cp=2, seq_len=512, impl="naive-weights", batch=2),
        dict(cp=2, seq_len=512, impl="naive-weights", dtype="fp32", forward_only=True),
        # the math path pads no head dim: any is modelled
        dict(cp=2, seq_len=512, impl="sdpa-math", head_dim=100, batch=2),
        dict(cp=2, seq_len=512, impl="naive-softmax", head_dim=36, dtype="fp32")]


@needs_deepspeed
@pytest.mark.parametrize("options", GRID)
def test_each_ranks_allocations_and_frees_are_deepspeeds(options, ledger_steps):
    """The first and last rank: the model's ledger history (each allocation's bytes, each
    free, in order) is the trace's of DeepSpeed's ``DistributedAttention`` around the
    pinned flash SDPA or ``flash_attn_func``, up to its last allocation."""
    from memcalc.analysis.predict import rank_breakdown
    from memcalc.engine.replay import Ledger
    from memcalc.tracing import traced
    from memcalc.tracing.target import Calling
    from memcalc.validation.context_parallel import rank_call

    c = config(**{"heads": 8, "head_dim": 64, **options})
    fn, inputs = rank_call(c)
    for rank in (0, c.cp - 1):
        history: list = []
        traced(fn, c, calling=Calling(inputs=inputs), history=history, rank=rank)
        ledger = Ledger(c.workspace_bytes, record=True)
        rank_breakdown(c, rank, ledger)
        model, trace = ledger_steps(ledger.history), ledger_steps(history)
        last = max(i for i, (kind, _) in enumerate(model) if kind == "alloc")
        assert trace[:last + 1] == model[:last + 1], (rank, options)


@needs_deepspeed
@pytest.mark.parametrize("example, impl", [("ulysses_user", "sdpa-flash"),
                                           ("ulysses_flash_attn", "flash-attn")])
def test_a_model_file_calling_distributed_attention_traces_as_the_model(example, impl):
    """``memcalc trace`` of a file that builds DeepSpeed's ``DistributedAttention`` itself,
    on its rank's (B, N / P, H, D) rows: the busiest rank and every figure as ``breakdown``,
    with SDPA's flash kernel or flash-attn's ``flash_attn_func`` inside."""
    from memcalc.engine.inputs import parse_input
    from memcalc.tracing import load_function, traced
    from memcalc.tracing.target import Calling
    from memcalc.validation.compare import figures_of

    c = config(impl=impl, heads=8, head_dim=64, seq_len=4096, batch=2, kv_heads=4)
    inputs = tuple(parse_input(t) for t in ("q=B,N,H,D", "k=B,N,K,D", "v=B,N,K,D"))
    target = load_function(f"examples/attention/{example}.py:attn")
    step = traced(target, c, calling=Calling(inputs=inputs)).breakdown
    model = predict(c)
    assert (step.rank, step.rank_peaks) == (model.rank, model.rank_peaks)
    assert figures_of(step) == figures_of(model)


@needs_deepspeed
def test_a_function_without_an_all_to_all_is_refused_under_ulysses():
    """Plain SDPA on a rank's rows is not Ulysses: the trace says so rather than give one
    GPU's step on a shard."""
    from memcalc.tracing import TraceError, load_function, trace

    with pytest.raises(TraceError, match="--cp-method ulysses: the step made no all-to-all"):
        trace(load_function("examples/attention/sdpa_cp.py:attn"),
              config(heads=8, head_dim=64, seq_len=1024))


@needs_deepspeed
def test_attention_written_out_traces_under_ulysses():
    """A user's attention written out, traced as written: DeepSpeed's all-to-alls around
    scores of every row of H / P heads, 8 heads over 2 ranks, 1,024 rows. It keeps its
    unmasked scores in a variable to its return, so its forward peak is naive-softmax's
    (which rebinds them) plus those scores, 2 x 4 x 1,024 x 1,024 x 2 B = 16 MiB, less the
    output bmm's result and its fold of v (with B = 2 a clone), 2 x 4 x 1,024 x 64 x 2 B =
    1 MiB each, alive at the model's peak but not yet made at the trace's (its softmax);
    every other figure is the model's."""
    from memcalc.engine.inputs import parse_input
    from memcalc.tracing import load_function, traced
    from memcalc.tracing.target import Calling

    c = config(heads=8, head_dim=64, seq_len=1024, batch=2, cp=2)
    inputs = tuple(parse_input(t) for t in ("q=B,N,H,D", "k=B,N,H,D", "v=B,N,H,D"))
    step = traced(load_function("examples/attention/ulysses_eager.py:attn"), c,
                  calling=Calling(inputs=inputs)).breakdown
    model = predict(c.model_copy(update={"impl": "naive-softmax"}))
    assert len(set(step.rank_peaks)) == 1
    scores, out = 2 * 4 * 1024 * 1024 * 2, 2 * 4 * 1024 * 64 * 2
    assert step.forward_peak_bytes == model.forward_peak_bytes + scores - 2 * out
    assert (step.saved_bytes, step.backward_peak_bytes) == (model.saved_bytes,
                                                             model.backward_peak_bytes)


@needs_deepspeed
def test_deepspeeds_ulysses_for_hugging_face_traces_as_it_runs():
    """``UlyssesSPAttentionHF`` (DeepSpeed's Ulysses for Hugging Face models) around
    transformers' ``sdpa_attention_forward``, traced on its (B, H, N / P, D) rows: 8 heads
    over 2 ranks, 512 rows a rank, bf16, SDPA's cuDNN kernel (torch's pick on an H100). It
    saves what ``DistributedAttention`` around the same kernel saves, and its backward peak
    is the same (cuDNN reads the (B, N, h, D)-strided grad as it is: innermost stride 1);
    at the forward peak it holds transformers' ``transpose(1, 2).contiguous()`` of the
    output more, B x 4 x 1,024 x 64 x 2 B, and the position ids gathered: this rank's
    ``arange`` (512 x 8 B), P = 2 received (B x 512 x 8 B each) and their ``cat`` (B x
    1,024 x 8 B). Every rank's step is the same."""
    pytest.importorskip("transformers")
    from memcalc.engine.inputs import parse_input
    from memcalc.tracing import load_function, traced
    from memcalc.tracing.target import Calling

    inputs = tuple(parse_input(t) for t in ("q=B,H,N,D", "k=B,K,N,D", "v=B,K,N,D"))
    for batch in (1, 2):
        c = config(impl="sdpa-cudnn", heads=8, head_dim=64, seq_len=1024, cp=2, batch=batch)
        step = traced(load_function("examples/attention/ulysses_hf.py:attn"), c,
                      calling=Calling(inputs=inputs)).breakdown
        model = predict(c)
        output_copy = batch * 4 * 1024 * 64 * 2
        positions = 512 * 8 + 2 * batch * 512 * 8 + batch * 1024 * 8
        assert len(set(step.rank_peaks)) == 1
        assert (step.saved_bytes, step.backward_peak_bytes) == (model.saved_bytes,
                                                                 model.backward_peak_bytes)
        assert step.forward_peak_bytes == model.forward_peak_bytes + output_copy + positions


@needs_deepspeed
def test_a_trace_runs_what_deepspeed_does_with_fewer_key_value_heads_than_ranks(capsys):
    """2 key/value heads over 4 ranks: ``breakdown`` refuses it (DeepSpeed's uneven heads are
    not modelled); ``trace`` runs DeepSpeed's own code, whose Hugging Face Ulysses repeats
    each key/value head to one a rank (``kv_replication_factor``)."""
    pytest.importorskip("transformers")
    from memcalc.cli import main

    sizes = "--cp 4 --cp-method ulysses --seq 1024 --heads 8 --kv-heads 2 --head-dim 64 " \
            "--dtype bf16 --batch 1"
    assert main(f"breakdown --impl sdpa-cudnn --causal {sizes}".split()) == 2
    assert "4 ranks must divide the heads (8) and the key/value heads (2)" in \
        capsys.readouterr().err
    inputs = "--input q=B,H,N,D --input k=B,K,N,D --input v=B,K,N,D"
    assert main(f"trace examples/attention/ulysses_hf.py:attn {inputs} {sizes}".split()) == 0
    out = capsys.readouterr().out
    assert "rank 0 of 4 shown: every rank's step is the same" in out


@needs_deepspeed
def test_code_that_needs_a_process_group_is_told_to_trace_under_cp():
    """Without --cp there is no group: DeepSpeed's assertion becomes a hint."""
    from memcalc.engine.inputs import parse_input
    from memcalc.tracing import TraceError, load_function, traced
    from memcalc.tracing.target import Calling

    inputs = tuple(parse_input(t) for t in ("q=B,N,H,D", "k=B,N,H,D", "v=B,N,H,D"))
    with pytest.raises(TraceError, match="needs a process group .* trace it under --cp P"):
        traced(load_function("examples/attention/ulysses_user.py:attn"),
               config(heads=8, head_dim=64, seq_len=1024, cp=1, cp_method="allgather"),
               calling=Calling(inputs=inputs))
