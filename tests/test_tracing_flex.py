"""``memcalc.tracing.flex``: compiled FlexAttention in a trace, as memcalc's flex model."""

import pytest

torch = pytest.importorskip("torch")

from memcalc.cli import main  # noqa: E402

USER = '''import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

compiled = torch.compile(flex_attention)


def causal(b, h, q, kv):
    return q >= kv


def attn(q, k, v):
    block_mask = create_block_mask(causal, None, None, q.shape[2], k.shape[2], device=q.device)
    return compiled(q, k, v, block_mask=block_mask)


def unmasked(q, k, v):
    return compiled(q, k, v)


def with_lse(q, k, v):
    from torch.nn.attention.flex_attention import AuxRequest

    block_mask = create_block_mask(causal, None, None, q.shape[2], k.shape[2], device=q.device)
    out, aux = compiled(q, k, v, block_mask=block_mask, return_aux=AuxRequest(lse=True))
    assert aux.lse.shape == q.shape[:3] and aux.lse.dtype == torch.float32
    return out
'''


def traced(tmp_path, capsys, name, *options):
    import json

    (tmp_path / "user.py").write_text(USER)
    code = main(["trace", f"{tmp_path}/user.py:{name}", "--seq", "1000", "--heads", "4",
                 "--head-dim", "64", "--dtype", "bf16", "--batch", "2", *options, "--json"])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else err)


def test_a_compiled_flex_call_saves_its_logsumexp_and_the_block_mask(tmp_path, capsys):
    """torch.compile(flex_attention) in the user's file: the stand-in runs the model. Saved:
    the BlockMask's eight int32 tensors (N = M = 1,000: ceil(1000 / 128) = 8 blocks; each
    at most 8 x 8 x 4 = 256 B, a 512-B block) and the float32 logsumexp 2 x 4 x 1,000 x 4 =
    32,000 B (a 32,256-B block): 8 x 512 + 32,256 = 36,352 B. dk, dv at the 2 key heads."""
    code, data = traced(tmp_path, capsys, "attn", "--kv-heads", "2")
    assert code == 0, data
    assert data["saved_bytes"] == 8 * 512 + 32_256 == 36_352
    assert any("memcalc's flex model" in note for note in data["notes"])
    from memcalc.config import make_config
    from memcalc.tracing import load_function, trace

    config = make_config(impl="sdpa-flash", seq_len=1000, heads=4, kv_heads=2, head_dim=64,
                         dtype="bf16", batch=2)  # the sizes (a traced target reads no impl)
    step = trace(load_function(f"{tmp_path}/user.py:attn"), config)
    grads = {c.name.split(" (")[0]: c.shape for c in step.backward_live}
    assert grads["flex dk"] == grads["flex dv"] == (2, 2, 1000, 64)
    assert grads["flex dq"] == (2, 4, 1000, 64)


def test_flex_without_a_block_mask_equals_the_model_with_mask_none(tmp_path, capsys):
    """No block_mask: the compiled graph builds its one-block default mask, four int32
    elements saved (512-B blocks): what ``breakdown --impl flex --mask none`` says, on every
    figure. The kernel is the model's on both sides (the stand-in runs it): this checks
    the default mask and the call; the hand count is ``test_impls_flex.py``'s, each
    allocation of the step as an H100 recorded it."""
    from memcalc.analysis.predict import predict
    from memcalc.config import make_config

    code, data = traced(tmp_path, capsys, "unmasked")
    assert code == 0, data
    # 4 x 512 (the default mask) + 32,256 (logsumexp 2 x 4 x 1,000 x 4 = 32,000 B)
    assert data["saved_bytes"] == 4 * 512 + 32_256 == 34_304
    model = predict(make_config(impl="flex", seq_len=1000, heads=4, head_dim=64,
                                dtype="bf16", batch=2)).figures()
    assert {k: data[k] for k in model} == model


def test_the_stand_in_is_only_there_while_the_file_is_imported():
    import torch.nn.attention.flex_attention as module

    from memcalc.tracing import flex

    real, mask, compile_ = module.flex_attention, module.create_block_mask, torch.compile
    with flex.stand_in():
        assert module.flex_attention is flex.flex_attention
        assert torch.compile(flex.flex_attention) is flex.flex_attention
        with pytest.raises(ValueError, match="create_block_mask compiled"):
            torch.compile(mask)(lambda b, h, q, kv: q >= kv, None, None, 256, 256)
        with pytest.raises(ValueError, match="create_block_mask compiled"):
            module.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 256, 256,
                                     _compile=True)
    assert (module.flex_attention, module.create_block_mask, torch.compile) == (
        real, mask, compile_)


def test_the_logsumexp_asked_for_is_a_float32_tensor_of_its_own(tmp_path, capsys):
    """return_aux=AuxRequest(lse=True): the kernel's base-2 lse times ln 2, (B, H, N) float32,
    returned beside the output (the traced function checks its shape and dtype)."""
    code, data = traced(tmp_path, capsys, "with_lse")
    assert code == 0, data
