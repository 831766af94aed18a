"""Readable names for components: which op and which autograd node made each one.

The implementations name their tensors after the math (``exp_x``, ``e/r``, ``-dp``); the
op that allocates each is declared beside it (``Component.op``). This module adds, for the
names of the naive family, the autograd node whose backward formula allocates the tensor
(torch 2.13, ``tools/autograd/derivatives.yaml``: ``div.Tensor``'s grad of ``other`` is
``-grad * ((self / other) / other)``, which is where ``e/r``, ``e/r/r``, ``-dp`` and
``-dp*e/r/r`` come from), and a one-line legend of the short names a table shows.
Rendering only: it changes no figure.
"""

from __future__ import annotations

from memcalc.engine.program import Role

# (name, op) -> who made it: "node: what it is"
_MADE_BY = {
    ("exp_x", "exp"): "exp: e = exp(s - m), kept by ExpBackward0 and DivBackward0",
    ("row_sum", "sum"): "sum: r = e.sum(-1), kept by DivBackward0",
    ("row_argmax", "max"): "max: argmax indices, kept by MaxBackward0",
    ("p", "div"): "div: p = e / r, kept by BmmBackward0",
    ("p", "_softmax"): "softmax: p, kept by SoftmaxBackward0 and BmmBackward0",
    ("s", "div"): "div: s = q @ k^T / sqrt(d)",
    ("qk", "bmm"): "bmm: q @ k^T",
    ("out", "bmm"): "bmm: out = p @ v",
    ("dv", "bmm"): "BmmBackward0: grad of v",
    ("dp", "bmm"): "BmmBackward0: grad of p",
    ("e/r", "div"): "DivBackward0: grad of r (e / r)",
    ("e/r/r", "div"): "DivBackward0: grad of r (e / r / r)",
    ("-dp", "neg"): "DivBackward0: grad of r (-dp)",
    ("-dp*e/r/r", "mul"): "DivBackward0: grad of r (-dp * e/r/r)",
    ("dp/r", "div"): "DivBackward0: grad of e (dp / r)",
    ("dr", "sum"): "DivBackward0: grad of r, summed to r's shape",
    ("de", "add"): "autograd engine: the two grads of e added",
    ("dx", "mul"): "ExpBackward0: grad of s - m",
    ("-dx", "neg"): "SubBackward0: grad of m (-dx)",
    ("dm", "sum"): "SubBackward0: grad of m, summed to m's shape",
    ("zeros", "new_zeros"): "MaxBackward0: zeros to scatter dm into",
    ("dm_scattered", "scatter"): "MaxBackward0: grad of s through m",
    ("dscores", "add"): "autograd engine: the two grads of s added",
    ("dscores", "_softmax_backward_data"): "SoftmaxBackward0: grad of s",
    ("dsm", "_softmax_backward_data"): "softmax backward: grad of s",
    ("ds", "div"): "DivBackward0: grad of q @ k^T (ds / sqrt(d))",
    ("ds_masked", "masked_fill"): "MaskedFillBackward0: grad of s",
    ("dk_t", "bmm"): "BmmBackward0: grad of k^T",
    ("dq", "bmm"): "BmmBackward0: grad of q",
    ("dk", "new_empty_strided"): "AccumulateGrad: grad of k copied to k's layout",
    ("dk", "bmm"): "BmmBackward0: grad of k",
}

# the legend's parts, each shown when the table shows any of its names
_LEGEND_PARTS = (
    ({"exp_x", "row_sum", "e/r", "dp/r", "de"},
     "s scores, m row max, e = exp_x = exp(s - m), r = row_sum, p = e / r"),
    ({"dp", "dscores", "dsm", "ds", "ds_masked", "dk_t", "dx", "-dx", "dm", "dr", "de", "dp/r"},
     "dX is the grad of X"),
    ({"e/r", "e/r/r", "-dp", "-dp*e/r/r"},
     "e/r, e/r/r, -dp and -dp*e/r/r are the terms of DivBackward0's grad of r = -dp * e / r^2 "
     "(torch's derivatives.yaml)"),
)


# the fused SDPA kernels' own tensors (memcalc/impls/sdpa_flash.py, sdpa_efficient.py,
# memcalc/impls/sdpa_cudnn.py), by (name, op): what each is, not the allocator call that made it
_KERNEL = {
    ("out", "empty_like"): "the output", ("out", "empty"): "the output",
    ("lse", "empty"): "logsumexp, kept for the backward",
    ("rng_state", "empty"): "dropout RNG seed and offset, kept",
    ("philox_offset", "empty"): "dropout RNG offset, kept",
    ("philox_seed", "empty"): "dropout RNG seed, kept",
    ("lse_accum", "empty"): "split-KV logsumexp accumulator",
    ("out_accum", "empty"): "float32 output accumulator",
    ("softmax_d", "empty"): "backward: rowsum(dO * O)",
    ("delta", "empty"): "backward: rowsum(dO * O)",
    ("delta", "contiguous"): "backward: rowsum(dO * O)",
    ("do*o", "mul"): "backward: dO * O", ("rowsum", "sum"): "backward: rowsum(dO * O)",
    ("dq_accum", "empty"): "backward: float32 accumulator of dq",
    ("dq_accum", "zeros"): "backward: float32 accumulators of dq, one per split (deterministic)",
    ("dk_accum", "zeros"): "backward: float32 accumulator of dk over the query heads",
    ("dv_accum", "zeros"): "backward: float32 accumulator of dv over the query heads",
    ("softmax_lse_log2", "empty"): "backward: logsumexp in base 2",
    ("dq_semaphore", "empty"): "backward: int32 semaphores of the dq tiles",
    ("dk_semaphore", "zeros"): "backward: int32 semaphores of the dk tiles (deterministic)",
    ("dv_semaphore", "zeros"): "backward: int32 semaphores of the dv tiles (deterministic)",
    ("tile_count_semaphore", "zeros"): "the tile scheduler's int32 counters",
    ("out", "flex_attention"): "the output",
    ("lse", "flex_attention"): "logsumexp (base 2), kept for the backward",
    ("max_scores", "flex_attention"): "row maxima, allocated though unused",
    ("delta", "sum"): "backward: rowsum(dO * O)",
    ("dq", "flex_attention_backward"): "backward: dq",
    ("dk", "flex_attention_backward"): "backward: dk",
    ("dv", "flex_attention_backward"): "backward: dv",
    ("dk_expanded", "empty"): "backward: dk per query head, summed to the key heads",
    ("dv_expanded", "empty"): "backward: dv per query head, summed to the key heads",
    ("dq", "empty_like"): "backward: dq", ("dk", "empty_like"): "backward: dk",
    ("dv", "empty_like"): "backward: dv", ("dq", "empty"): "backward: dq",
    ("dk", "empty"): "backward: dk", ("dv", "empty"): "backward: dv",
    ("dout_t", "contiguous"): "backward: grad_out copied to the kernel's layout",
    ("dout_t", "permute"): "backward: grad_out copied to the kernel's layout",
    ("out_t", "contiguous"): "backward: the output copied to the kernel's layout",
    ("workspace", "empty"): "backward kernel's workspace",
    ("cudnn_workspace", "allocate"): "cuDNN's workspace (backward: a float32 dQ "
                                     "accumulator and statistics)",
}
_KERNELS = ("flash", "efficient", "cudnn", "flash-attn", "flash-attn3")
# a kernel's own buffers, not a copy of ours
_ALLOCATING = ("empty", "empty_like", "zeros", "flex_attention", "flex_attention_backward",
               "allocate")


def made_by(component) -> str:
    """``node: what`` for a known name, what a fused kernel's tensor is, else the op
    (``input (randn)`` for an input)."""
    known = _MADE_BY.get((component.name, component.op))
    if known:  # under no_grad (a forward-only step) no node keeps it
        return known if component.role is Role.saved else known.split(", kept by ")[0]
    kernel = _kernel_tensor(component)
    if kernel:
        return kernel
    if component.role is Role.input:
        return f"input ({component.op})"
    return "cuBLAS handle pool" if component.op == "cublas" else component.op


def _kernel_tensor(component) -> str:
    """``flash kernel: backward: float32 accumulator of dq``: a fused kernel's own tensor,
    named as a trace names it (``flash dq_accum (...)``) or as its model does; else ``""``."""
    words = component.name.split(" (")[0].split(" ")
    kernel = words[0] if len(words) == 2 and words[0] in _KERNELS else ""
    what = _KERNEL.get((words[-1], component.op)) if len(words) <= 2 else None
    if what is None or (not kernel and component.op not in _ALLOCATING):
        return ""
    return f"{kernel or 'fused'} kernel: {what}"


def legend(components) -> list[str]:
    """The legend line, of the parts that explain names the table shows (none: no line)."""
    shown = {c.name for c in components}
    parts = [text for names, text in _LEGEND_PARTS if shown & names]
    return ["names: " + "; ".join(parts)] if parts else []
