"""``memcalc.impls.flex_mask``: ``create_block_mask`` run eagerly in the step (``flex
--block-mask dense``), against ``memcalc trace`` of code that calls torch's own
``create_block_mask`` in the step (the tracer runs it on the meta device, with CUDA's
reduction buffers), figure by figure."""

import json

import pytest

from memcalc.analysis.predict import predict
from memcalc.config import make_config
from memcalc.engine.program import Tensor
from memcalc.impls import get_impl


def config(**options):
    sizes = dict(impl="flex", batch=2, heads=4, seq_len=1000, head_dim=64, dtype="bf16",
                 mask="causal", block_mask="dense")
    return make_config(**{**sizes, **options})


def test_the_dense_peak_is_the_mask_its_padded_copy_and_an_int64_copy():
    """N = M = 4,096, causal: at the forward peak the N x M bool mask (4096^2 x 1 B), the
    padded copy (the same: 4,096 is whole blocks), the padded mask converted to int64 for
    the block sums (4096^2 x 8 B), and the block sums (32 x 32 x 8 B = 8 KiB)."""
    c = config(seq_len=4096)
    alive = {p.name: p.allocated for p in predict(c).forward_live}
    assert alive["mask"] == alive["padded"] == 4096 * 4096 == 16_777_216
    assert alive["block sums: int64 copy"] == 4096 * 4096 * 8 == 134_217_728
    assert alive["block sums"] == 32 * 32 * 8 == 8192


def test_sliding_holds_an_int64_distance_over_every_pair():
    """``q - kv`` is int64: 1,000 x 700 x 8 = 5,600,000 B beside the bool ``q >= kv``."""
    forward = {t.name: t for t in get_impl("flex").program(
        config(kv_len=700, mask="sliding:256").dims).forward if isinstance(t, Tensor)}
    assert forward["distance"].bytes == 1000 * 700 * 8 == 5_600_000


@pytest.mark.parametrize("options, refused", [
    (dict(mask="none"), "block_mask: dense is create_block_mask run in the step"),
    (dict(impl="naive", mask="none"), "block_mask: dense is create_block_mask"),
    (dict(block_mask="sparse"), "block_mask: Input should be 'given' or 'dense'"),
])
def test_what_dense_refuses_is_one_line(options, refused):
    with pytest.raises(ValueError, match=refused):
        config(**options)


torch = pytest.importorskip("torch")

USER = '''import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

compiled = torch.compile(flex_attention)


def causal(q, k, v):
    def mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    block_mask = create_block_mask(mod, None, None, q.shape[2], k.shape[2], device=q.device)
    return compiled(q, k, v, block_mask=block_mask)


def sliding(q, k, v):
    def mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= 256)

    block_mask = create_block_mask(mod, None, None, q.shape[2], k.shape[2], device=q.device)
    return compiled(q, k, v, block_mask=block_mask)


def document(q, k, v, doc):
    def mod(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    block_mask = create_block_mask(mod, q.shape[0], None, q.shape[2], k.shape[2],
                                   device=q.device)
    return compiled(q, k, v, block_mask=block_mask)
'''


@pytest.mark.parametrize("mask, n, m", [
    ("causal", 1000, 1000), ("causal", 1000, 700), ("causal", 4096, 4096),
    ("causal", 130, 3000), ("sliding:256", 1000, 700), ("sliding:256", 2048, 2048),
    ("document:300", 1000, 1000), ("document:300", 3000, 700),
])
def test_the_model_equals_the_trace_of_create_block_mask_in_the_step(tmp_path, capsys,
                                                                    mask, n, m):
    """``create_block_mask`` runs torch's own code in the trace; the compiled kernel is the
    model's on both sides (the stand-in runs it), so what this checks is the mask's
    tensors; the kernel's hand count is ``test_impls_flex.py``'s H100 recording."""
    from memcalc.cli import main

    (tmp_path / "user.py").write_text(USER)
    name = mask.split(":")[0]
    doc = ["--input", "q=B,H,N,D", "--input", "k=B,H,M,D", "--input", "v=B,H,M,D",
           "--input", "doc=B,N:int64:arange"] if name == "document" else []
    code = main(["trace", f"{tmp_path}/user.py:{name}", "--seq", str(n), "--kv-len", str(m),
                 "--heads", "4", "--head-dim", "64", "--dtype", "bf16", "--batch", "2",
                 *doc, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    traced = json.loads(out)
    model = predict(config(seq_len=n, kv_len=m, mask=mask)).figures()
    assert {k: traced[k] for k in model} == model


@pytest.mark.parametrize("mask, n", [("causal", 1000), ("sliding:256", 700),
                                     ("document:300", 1000)])
def test_each_allocation_and_free_is_the_traces_in_order(tmp_path, mask, n):
    """Stronger than the figures: the allocator ledger's history (every allocation and free,
    requested bytes, in order, warm-up and measured step) of the model and of the trace."""
    from memcalc.engine.inputs import parse_input
    from memcalc.engine.replay import Ledger
    from memcalc.tracing import Calling, load_function, traced

    (tmp_path / "user.py").write_text(USER)
    name = mask.split(":")[0]
    c = config(seq_len=n, mask=mask)
    inputs = tuple(parse_input(text) for text in (
        "q=B,H,N,D", "k=B,H,M,D", "v=B,H,M,D", "doc=B,N:int64:arange")) \
        if name == "document" else None
    history: list = []
    traced(load_function(f"{tmp_path}/user.py:{name}"), config(seq_len=n, impl="sdpa-flash",
                                                                mask="none", block_mask="given"),
           history=history, **(dict(calling=Calling(inputs=inputs)) if inputs else {}))
    ledger = Ledger(c.workspace_bytes, record=True)
    predict(c, ledger=ledger)

    def sequence(entries):  # the measured step, from its forward on
        start = [i for i, e in enumerate(entries) if (e.kind, e.label) == ("phase", "forward")]
        return [(e.kind, e.component.bytes) for e in entries[start[-1]:] if e.kind != "phase"]

    model, trace = sequence(ledger.history), sequence(history)
    assert trace[:len(model)] == model
    assert {kind for kind, _ in trace[len(model):]} == {"free"}  # the protocol's end
