"""``flex``: ``torch.nn.attention.flex_attention.flex_attention(q, k, v, block_mask=...)``
under ``torch.compile``, as it trains (inductor's Triton template; N >= 128).

Source-derived (``traced=False``: the compiled kernel cannot run on the meta device), read
from torch 2.13 (``torch/_inductor/kernel/flex/flex_attention.py``, ``IND`` below;
``torch/nn/attention/flex_attention.py``, ``FA``; ``torch/_higher_order_ops/flex_attention.py``):

* the ``BlockMask`` (``create_block_mask(mask_mod, B, H, N, M)``, built before the step, as a
  training loop builds it once per shape): int32 ``kv_num_blocks``, ``full_kv_num_blocks``
  ``(Bm, Hm, ceil(N/128))``, ``kv_indices``, ``full_kv_indices`` ``(Bm, Hm, ceil(N/128),
  ceil(M/128))`` and the transposed ``q_*`` pair of each ``(Bm, Hm, ceil(M/128))``,
  ``(Bm, Hm, ceil(M/128), ceil(N/128))`` (FA ``_dense_to_ordered``, ``_transpose_ordered``;
  ``separate_full_blocks`` by default): dense index tensors, the same sizes for every mask.
  ``Bm = Hm = 1`` (``B=None, H=None``) for causal and sliding-window masks; a document mask
  is per batch row (``Bm = B``);
* forward (IND L346-395): ``logsumexp (B, H, N)`` float32 (kept for the backward),
  ``max_scores (B, H, N)`` float32, allocated though nobody asks for it and freed after the
  kernel, and ``out (B, H, N, D)`` in q's layout. k and v are never expanded for grouped heads;
* backward (IND L647-1099): ``delta = (out * grad_out).sum(-1)`` as ``(B, H, N)`` float32,
  then ``grad_query (B, H, N, D)``, ``grad_value`` and ``grad_key (B, Hk, M, D)``, written
  once by the template (float32 accumulation in registers, no float32 buffers).

Without a mask (``--mask none``, not ``--causal``), ``flex_attention`` builds a one-block
default mask inside the compiled graph (``default_mask``). Checked on an H100 (torch 2.11,
``validation/flex_live.py``): every allocation and free of the step, causal and unmasked,
fp16, bf16 and fp32, N = 1,024 and 4,096.

Not modelled: a BlockMask built inside the step (``create_block_mask`` runs eagerly by default
in 2.13 and builds a dense (N, M) mask, then a padded copy and an int64 copy of it: ``memcalc
trace`` follows that code as it runs), inductor's buffer reuse between kernels (read from
the generated code on a GPU), and N < 128 (the flex-decoding template).
"""

from __future__ import annotations

from memcalc.engine.inputs import input_tensors
from memcalc.engine.program import Dims, Program, Role, Tensor, free, new, release
from memcalc.impls import flex_mask as eager
from memcalc.impls.flex_mask import BLOCK, batch_of, mask_of
from memcalc.impls.common import with_loss
from memcalc.impls.registry import register

S, O, G, T, I = Role.saved, Role.output, Role.gradient, Role.temporary, Role.input
F32, I32 = "float32", "int32"
def check(d: Dims) -> None:
    if d.N < BLOCK:
        raise ValueError(f"--seq: flex: seq_len {d.N} < {BLOCK} takes the flex-decoding "
                         f"template, which is not modelled")


def block_mask(d: Dims) -> list[Tensor]:
    """The BlockMask's eight int32 index tensors, in the order ``create_block_mask`` makes
    them (kv, full kv, then their transposes)."""
    rows, cols = -(-d.N // BLOCK), -(-d.M // BLOCK)
    b = batch_of(d)  # B=None: 1, but for a document mask
    made = []
    for prefix in ("", "full_"):
        made += [Tensor(f"{prefix}kv_num_blocks", (b, 1, rows), I32, I, "create_block_mask"),
                 Tensor(f"{prefix}kv_indices", (b, 1, rows, cols), I32, I, "create_block_mask")]
    for prefix in ("", "full_"):
        made += [Tensor(f"{prefix}q_num_blocks", (b, 1, cols), I32, I, "create_block_mask"),
                 Tensor(f"{prefix}q_indices", (b, 1, cols, rows), I32, I, "create_block_mask")]
    return made  # (Bm, 1, N/128) counts and (Bm, 1, N/128, M/128) indices, and transposed


DEFAULT_MASK = ("q_num_blocks", "q_indices", "kv_num_blocks", "kv_indices")


def default_mask() -> list:
    """``flex_attention`` without a block_mask builds one inside the compiled graph
    (FA ``_create_empty_block_mask``: one block covering every row and column, no full
    blocks, and its transpose), which the backward saves. Inductor's allocations, as an H100
    measured them (torch 2.11): an int64 scratch element, then the four int32 elements."""
    made = "flex_attention (default mask)"
    return [
        new("mask_scratch", (1,), "int64", T, made),  # (1,) inductor's, freed at once
        new("kv_num_blocks", (1, 1, 1), I32, S, made),  # (1, 1, 1) ones
        new("kv_indices", (1, 1, 1, 1), I32, S, made),  # (1, 1, 1, 1) zeros
        new("q_num_blocks", (1, 1, 1), I32, S, made),  # (1, 1, 1) its transpose's counts
        free("mask_scratch"),
        new("q_indices", (1, 1, 1, 1), I32, S, made),  # (1, 1, 1, 1) and indices
        free(*DEFAULT_MASK),  # kept for the backward
    ]


def forward(d: Dims, default: bool = False) -> list:
    """The kernel's outputs in the order an H100 allocated them (torch 2.11): the logsumexp,
    the unused max_scores, then out; ``default``: the mask is built first (above)."""
    return [
        *(default_mask() if default else ()),
        new("lse", (d.B, d.H, d.N), F32, S, "flex_attention"),  # (B, H, N) logsumexp
        new("max_scores", (d.B, d.H, d.N), F32, T, "flex_attention"),  # (B, H, N) unused
        new("out", (d.B, d.H, d.N, d.D), d.dtype, O, "flex_attention"),  # (B, H, N, D)
        free("max_scores"),
        free("lse"),  # kept for the backward
    ]


def backward(d: Dims, default: bool = False) -> list:
    return [
        new("delta", (d.B, d.H, d.N), F32, T, "sum"),  # (B, H, N) rowsum(out * grad_out)
        new("dq", (d.B, d.H, d.N, d.D), d.dtype, G, "flex_attention_backward"),  # (B, H, N, D)
        new("dv", (d.B, d.Hk, d.M, d.D), d.dtype, G, "flex_attention_backward"),  # (B, Hk, M, D)
        new("dk", (d.B, d.Hk, d.M, d.D), d.dtype, G, "flex_attention_backward"),  # (B, Hk, M, D)
        free("delta"),
        *([release(*DEFAULT_MASK)] if default else ()),
        release("lse"),
    ]


@register("flex", "FlexAttention, compiled (torch.compile): saves the (B, H, N) logsumexp; "
          "a BlockMask of int32 block indices", gqa=True, traced=False,
          masks=("causal", "sliding", "document"),
          source="PyTorch's inductor FlexAttention template (torch 2.13)")
def flex(d: Dims) -> Program:
    """Saved: logsumexp; the BlockMask's index tensors exist before the step; backward:
    float32 delta, dq, dk, dv at the key/value heads."""
    check(d)
    default = mask_of(d) == "none"
    if d.block_mask == "dense":  # create_block_mask in the step: its tensors, saved
        built = (*eager.build(d), *forward(d), free(*eager.OUTPUTS))
        return Program(built, tuple(with_loss(d, [*backward(d), release(*eager.OUTPUTS)])),
                       (*input_tensors(d), *eager.inputs(d)))
    return Program(tuple(forward(d, default)), tuple(with_loss(d, backward(d, default))),
                   (*input_tensors(d), *([] if default else block_mask(d))))
