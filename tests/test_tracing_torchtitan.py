"""torchtitan's own Llama 3 code traced as torchtitan runs it
(``examples/training/torchtitan_llama3.py``): its model classes, its selective activation
checkpointing (``SelectiveAC``), its FSDP (``apply_fsdp_to_decoder``) and its loss. Skipped
without torchtitan (``pip install --no-deps torchtitan==0.3.0``; ``.ci/run`` installs it)."""

import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchtitan")

import memcalc  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples/training/torchtitan_llama3.py"
TOKENS = {"tokens": ("B", "N", "int64"), "labels": ("B", "N", "int64")}


def example():
    spec = importlib.util.spec_from_file_location("torchtitan_llama3", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def traced(sharding: str, step: str = "Llama3Step"):
    """torchtitan's ``debugmodel`` (256 wide, 16 heads of 16), its first 2 blocks, batch 2
    of 256 tokens, over 2 FSDP ranks, with AdamW, on an H100 (SDPA takes cuDNN first, as
    torchtitan's ``ScaledDotProductAttention`` asks)."""
    titan = example()
    return memcalc.trace(getattr(titan, step)("debugmodel", 2), inputs=TOKENS, seq_len=256,
                         batch=2, optimizer="adamw", fsdp=2,
                         fsdp_apply=getattr(titan, sharding), gpu="h100-80gb")


# each block's cuDNN call under bfloat16 parameters, (B, H, N, d) = (2, 16, 256, 16):
OUT = 2 * 16 * 256 * 16 * 2  # 262,144 B
LSE = 2 * 16 * 256 * 4  # 32,768 B: (B, H, N, 1) float32
SEED = OFFSET = 8  # int64 (), one 512-B block each


def attention_saved(b) -> list[tuple[str, int]]:
    return sorted((c.name.split(" (")[0], c.bytes) for c in b.saved if c.name.startswith("cudnn"))


def test_selective_checkpointing_keeps_each_blocks_attention_as_torchtitan_asks():
    """SelectiveAC's save list names aten._scaled_dot_product_cudnn_attention: each block
    keeps the op's outputs (its output, statistics, seed and offset); full checkpointing
    keeps none of them, nor the statistics its node saved."""
    each = [("cudnn lse", LSE), ("cudnn offset", OFFSET), ("cudnn out", OUT),
            ("cudnn seed", SEED)]
    assert attention_saved(traced("selective")) == sorted(each * 2)
    assert attention_saved(traced("full")) == []


def test_checkpointing_saves_less_the_more_it_recomputes():
    saved = [traced(s).saved_bytes for s in ("full", "selective", "no_ac")]
    assert saved == sorted(saved) and len(set(saved)) == 3


def test_the_chunked_loss_is_traced_as_torchtitan_runs_it():
    """0.3.0's trainer default, ChunkedLossWrapper: each chunk's head, loss and backward
    inside the loss, then the decoder's backward through a Function of its own. The whole
    sequence's logits (2 x 256 x 2,048) never exist at once: its peak is below the plain
    loss's."""
    chunked, plain = traced("selective", "ChunkedLlama3Step"), traced("selective")
    assert chunked.peak_bytes < plain.peak_bytes
    assert chunked.forward_peak_bytes > 0 and chunked.backward_peak_bytes > 0


def test_torchtitans_apply_compile_under_fsdp_traces_the_compiled_blocks():
    """``apply_compile`` compiles each block in place, after checkpointing and before FSDP
    wraps it: the blocks run as inductor compiled them, each block's cuDNN attention output
    saved (SelectiveAC's policy, followed by the partitioner; and without checkpointing, the
    partitioner's own choice), the compiled step keeping less than the eager one in each
    case; the rest of the step (FSDP's all-gathers, the loss, AdamW) runs eagerly."""
    for compiled, eager in (("compiled", "selective"), ("compiled_no_ac", "no_ac")):
        compiled, eager = traced(compiled), traced(eager)
        assert compiled.saved_bytes < eager.saved_bytes
        assert [n for n, _ in attention_saved(compiled)].count("cudnn out") == 2
