"""CUDA's embedding backward, its own buffers (``memcalc/impls/embedding.py``), against the
source's arithmetic and what an H100 measured."""

import json
from pathlib import Path

from memcalc.engine.allocator import round_size
from memcalc.engine.program import Free, Tensor
from memcalc.impls.embedding import EmbeddingBackward

ROOT = Path(__file__).resolve().parents[1]
H100 = ROOT / "validation/results/nvidia-h100-80gb-hbm3-2.11.0-cu130.json"


def shapes(call: EmbeddingBackward) -> dict[str, tuple]:
    return {e.name.removeprefix("e: "): (e.shape, e.dtype) for e in call.events("e")
            if isinstance(e, Tensor)}


def test_up_to_3072_indices_one_kernel_adds_into_the_result():
    assert EmbeddingBackward(3072, 50304, 768, "float32", "int64", False).events("e") == []
    copied = EmbeddingBackward(2048, 2, 256, "float32", "int64", False, indices_copied=True)
    assert shapes(copied) == {"indices copy": ((2048,), "int64")}  # BERT's token types
    assert shapes(EmbeddingBackward(64, 10, 8, "float32", "int64", True)) != {}  # counted


def test_past_3072_it_sorts_and_sums_segments():
    """8,192 bf16 grads of 4,096 into 50,304 rows: every index buffer one int64 a row, 8,192
    segments at most (fewer rows than weights), 8,192 / 10 + 8,192 = 9,011 partial segments,
    their sums in float32 (bfloat16's accumulate type)."""
    call = EmbeddingBackward(8192, 50304, 4096, "bfloat16", "int64", False)
    assert shapes(call) == {
        "sorted_indices": ((8192,), "int64"), "orig_indices": ((8192,), "int64"),
        "range": ((8192,), "int64"), "segment_offsets": ((8192,), "int64"),
        "num_of_segments": ((), "int64"), "unique keys": ((8192,), "int64"),
        "partials_per_segment": ((8192,), "int64"),
        "partials_per_segment_offset": ((8192,), "int64"),
        "num_of_partial_segments": ((), "int64"), "partial_segment_offset": ((9011,), "int64"),
        "grad_weight_per_segment": ((9011, 4096), "float32")}
    frees = [e.names for e in call.events("e") if isinstance(e, Free)]
    assert frees[:2] == [("e: range",), ("e: unique keys",)]  # the sort's, unique_by_key's
    assert len(frees[-1]) == 9  # the rest as the kernel returns
    segments = shapes(EmbeddingBackward(8192, 1000, 256, "float32", "int64", False))
    assert segments["partials_per_segment"] == ((1000,), "int64")  # min(indices, weights)


def held_at_most(call: EmbeddingBackward) -> int:
    """The most bytes its buffers hold at once, in allocator blocks."""
    live, most = {}, 0
    for e in call.events("e"):
        if isinstance(e, Tensor):
            live[e.name] = round_size(e.bytes)
            most = max(most, sum(live.values()))
        else:
            for name in e.names:
                del live[name]
    return most


def test_an_h100_held_what_the_model_says_beyond_the_result():
    """The live run's op brackets (``cuda.op_scratch``: an op's peak less what is allocated
    after it) for Hugging Face BERT (256 wide, 1,000 words, 4,096 positions, 2 token types)
    at batch 2: its three embeddings' backwards, the largest of them. At 1,024 rows: 2,048
    indices, one kernel each, but the token types are a buffer expanded over the batch, so
    copied contiguous: 2,048 x 8 B. At 4,096 rows the positions' (4,096 indices into 4,096
    rows): three index buffers, the segment counts (4,096 each) and offsets (409 + 4,096 =
    4,505), two 0-d counts and 4,505 x 256 x 4 B of partial sums, 4,814,336 B."""
    report = json.loads(H100.read_text())
    measured = {c["config"]["shape"]["seq_len"]: c["scratch"]["embedding_dense_backward"]
                for c in report["checks"] if c["config"]["impl"] == "trace:model:hf-bert-padded"}
    for n, expected in ((1024, 16_384), (4096, 4_814_336)):
        calls = [EmbeddingBackward(2 * n, 1000, 256, "float32", "int64", False),  # words
                 EmbeddingBackward(n, 4096, 256, "float32", "int64", False),  # positions
                 EmbeddingBackward(2 * n, 2, 256, "float32", "int64", False, True)]  # types
        assert max(held_at_most(c) for c in calls) == measured[n] == expected
