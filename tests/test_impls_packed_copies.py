"""The packed metadata of CUDA's fused copies for FSDP2 (``memcalc/impls/packed_copies.py``):
``pack_vecs``'s int64 tensor, made and freed inside the op."""

from memcalc.engine.program import Free, Tensor
from memcalc.impls.device import A100, H100_SXM, Gpu
from memcalc.impls.packed_copies import ChunkCat, SplitCopy


def _entries(events) -> int:
    made, freed = events
    assert isinstance(made, Tensor) and isinstance(freed, Free) and made.dtype == "int64"
    assert freed.names == (made.name,)
    return made.shape[0]


def test_chunk_cat_packs_five_entries_a_tensor_and_its_blocks():
    """A two-layer GPT block's 12 grads into the reduce-scatter input over 4 ranks, float32:
    5 x 12 + 2 = 62 entries, and each padded chunk's 2,048-byte tiles: c_attn.weight
    ceil(768 / 4) x 256 x 4 B = 196,608 B -> 96; c_proj.weight 64 x 256 x 4 = 65,536 ->
    32; c_fc.weight and mlp.c_proj.weight 262,144 -> 128 each; the 8 vectors (biases of
    192, 64, 256, 64 rows, 4 layer-norm ones of 64) 1 each: 96 + 32 + 256 + 8 = 392."""
    chunks = (196608, 768, 65536, 256, 256, 256, 256, 256, 262144, 1024, 262144, 256)
    assert _entries(ChunkCat(chunks).events("copy-in")) == 62 + 392  # 3,632 B


def test_split_copy_spreads_its_blocks_over_the_gpu():
    """Three splits of 1 MiB, 4 KiB and 1 B a chunk, 8 chunks: 512 + 2 + 1 = 515 tiles.
    On an H100 (132 SMs x 2,048 threads / 128 x 2 = 4,224 blocks at most) the launch is
    ceil(515 x 8 / 4,224) = 1 pass: 515 blocks, 3 x 3 + 1 + 515 = 525 entries. On a GPU of
    10 SMs of 1,024 threads (160 blocks): iter_factor ceil(4,120 / 160) = 26,
    chunks_per_block ceil(sqrt 26) = 6, iters_per_chunk ceil(26 / 6) = 5, so tiles of
    10,240 B: 103 + 1 + 1 = 105 blocks, 9 + 1 + 105 = 115 entries."""
    copy = SplitCopy((1 << 20, 4096, 1), 8)
    assert _entries(copy.events("copy-out", H100_SXM)) == 525
    assert _entries(copy.events("copy-out", Gpu(10, (7, 5)))) == 115
    # an A100's 108 SMs: 3,456 blocks at most, still one pass
    assert _entries(copy.events("copy-out", A100)) == 525
