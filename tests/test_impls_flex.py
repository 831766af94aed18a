"""``flex``: compiled FlexAttention with a BlockMask, modelled from torch's sources; the
BlockMask's tensors checked against torch's own ``create_block_mask``."""

import json
from pathlib import Path

import pytest

from memcalc.analysis.predict import predict
from memcalc.config import make_config
from memcalc.engine.program import Tensor
from memcalc.impls import get_impl
from memcalc.impls.flex import block_mask


def config(**options):
    sizes = dict(impl="flex", batch=2, heads=8, seq_len=4096, head_dim=128, dtype="bf16",
                 mask="causal")
    return make_config(**{**sizes, **options})


def events(c, phase):
    return {t.name: t for t in getattr(get_impl(c.impl).program(c.dims), phase)
            if isinstance(t, Tensor)}


def test_causal_lists_a_float32_logsumexp_and_int32_block_indices():
    """logsumexp (B, H, N) = (2, 8, 4096) float32, the one tensor saved: 2 x 8 x 4096 x 4 =
    262,144 B; the BlockMask's indices (1, 1, 4096/128, 4096/128) = (1, 1, 32, 32) int32."""
    c = config()
    forward = events(c, "forward")
    assert forward["lse"].shape == (2, 8, 4096) and forward["lse"].dtype == "float32"
    assert predict(c).saved_bytes == 2 * 8 * 4096 * 4 == 262_144
    inputs = {t.name: t for t in get_impl(c.impl).program(c.dims).inputs}
    assert inputs["kv_indices"].shape == (1, 1, 32, 32) and inputs["kv_indices"].dtype == "int32"
    assert inputs["full_q_num_blocks"].shape == (1, 1, 32)


def test_grouped_heads_get_their_grads_at_the_key_heads_without_expanding():
    backward = events(config(kv_heads=2), "backward")
    assert backward["dk"].shape == backward["dv"].shape == (2, 2, 4096, 128)
    assert backward["delta"].shape == (2, 8, 4096) and backward["delta"].dtype == "float32"


def test_a_document_mask_is_per_batch_row():
    assert block_mask(config(mask="document:512").dims)[1].shape == (2, 1, 32, 32)


def test_without_a_mask_the_default_mask_is_four_int32_elements_saved():
    """``--mask none``: the compiled graph's one-block default mask, (1, 1, 1) counts and
    (1, 1, 1, 1) indices and their transposes, saved with the logsumexp: 4 x 512-B blocks
    + 2 x 8 x 4096 x 4 = 262,144 B; none of the BlockMask inputs."""
    c = config(mask="none")
    forward = events(c, "forward")
    assert forward["q_indices"].shape == (1, 1, 1, 1) and forward["q_indices"].dtype == "int32"
    assert predict(c).saved_bytes == 4 * 512 + 262_144 == 264_192
    assert not {t.name for t in get_impl(c.impl).program(c.dims).inputs} & {"kv_indices"}


RESULTS = sorted((Path(__file__).parents[1] / "validation" / "results").glob("flex-*.json"))


def _recorded():
    for path in RESULTS:
        for row in json.loads(path.read_text())["rows"]:
            yield pytest.param(row, id=f"{row['dtype'][6:]}-d{row['d']}-N{row['n']}-"
                                       f"{'causal' if row['causal'] else 'unmasked'}")


@pytest.mark.parametrize("row", list(_recorded()))
def test_an_h100_recorded_each_allocation_of_the_step(row):
    """``validation/flex_live.py`` on an H100 (torch 2.11): the allocator's own history of the
    compiled step, allocation by allocation (requested bytes, in order), and both peaks."""
    c = config(batch=row["b"], heads=row["h"], seq_len=row["n"], head_dim=row["d"],
               dtype=row["dtype"].removeprefix("torch."),
               mask="causal" if row["causal"] else "none")
    program = get_impl(c.impl).program(c.dims)
    for phase in ("fwd", "bwd"):
        live = [size for action, size, _ in row[phase] if action == "alloc"]
        made = [t.bytes for t in getattr(program, "forward" if phase == "fwd" else "backward")
                if isinstance(t, Tensor)]
        assert made == live
    figures = predict(c).figures()
    assert (figures["forward_peak_bytes"], figures["backward_peak_bytes"]) == \
        (row["fwd_peak"], row["bwd_peak"])


@pytest.mark.parametrize("options, refused", [
    (dict(seq_len=100), "--seq: flex: seq_len 100 < 128"),
    (dict(mask="sliding"), "mask: not a mask"),
    (dict(impl="naive", mask="causal"), "mask: naive takes no causal mask; the masks each "
                                        "reads: sdpa-efficient: padding, full; sdpa: "
                                        "padding, full; flex: causal"),
])
def test_what_flex_refuses_is_one_line(options, refused):
    with pytest.raises(ValueError, match=refused):
        predict(config(**options))


torch = pytest.importorskip("torch")


@pytest.mark.parametrize("mask, n, m", [("causal", 4096, 4096), ("sliding:256", 1000, 700),
                                        ("document:300", 1000, 1000)])
def test_the_block_mask_is_what_torchs_create_block_mask_makes(mask, n, m):
    """torch's own create_block_mask on the CPU (the dense mask of n x m bools is small
    here): the same eight int32 tensors, names, shapes and dtypes, for every mask kind."""
    from torch.nn.attention.flex_attention import create_block_mask

    B = 2
    if mask == "causal":
        def mod(b, h, q, kv):
            return q >= kv
    elif mask.startswith("sliding"):
        def mod(b, h, q, kv):
            return (q >= kv) & (q - kv <= 256)
    else:
        doc = torch.arange(max(n, m)).repeat(B, 1) // 300

        def mod(b, h, q, kv):
            return doc[b, q] == doc[b, kv]
    per_batch = B if mask.startswith("document") else None
    made = create_block_mask(mod, per_batch, None, n, m, device="cpu")
    c = config(mask=mask, seq_len=n, kv_len=m, batch=B)
    model = {t.name: (t.shape, t.dtype) for t in block_mask(c.dims)}
    real = {name: (tuple(getattr(made, name).shape), str(getattr(made, name).dtype)[6:])
            for name in model}
    assert model == real


def test_the_block_indices_grow_as_n_times_m():
    """(N/128, M/128) int32: four times larger when both lengths double, so N x M."""
    from memcalc.analysis.quadratic import quadratic_names

    assert quadratic_names(config()) == {"kv_indices", "full_kv_indices", "q_indices",
                                         "full_q_indices"}
