"""Reference code of the linear-attention family (``memcalc/impls/linear.py``).

``linear`` and ``linear-causal`` are the seeds' notebook code as written
(``linear_attention_bidir``, ``linear_attention_causal``: feature map ``elu(x) + 1``,
``eps = 1e-6``). ``linear-causal-chunked`` is the chunked form a user writes to avoid the
``(B, H, N, D, D)`` cumulative sum: within a chunk the causal scores ``tril(q k^T)``, across
chunks a running ``(D, D)`` state and a running key sum.

Causality is a property of the implementation, not of the ``causal`` option: ``linear``
rejects ``causal=True``; the two causal ones are causal whatever the option says (they have
no mask to build). The causal ones need ``kv_len == seq_len``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memcalc.validation.reference import reference


def check_linear(q, k, v, causal: bool, needs_causal_shape: bool) -> None:
    """The checks ``memcalc/impls/linear.py`` makes on ``Dims``, on tensors."""
    if causal and not needs_causal_shape:
        raise ValueError("--causal: linear is bidirectional; use linear-causal or "
                         "linear-causal-chunked")
    if needs_causal_shape and k.size(-2) != q.size(-2):
        raise ValueError("--kv-len: causal linear attention needs kv_len == seq_len")


@reference("linear")
def linear_attention_bidir(q, k, v, causal=False, eps=1e-6):
    """Linear attention - O(d²) intermediate state."""
    check_linear(q, k, v, causal, False)
    q = F.elu(q) + 1
    k = F.elu(k) + 1

    kv = torch.einsum('bhnd,bhnv->bhdv', k, v)  # (B, H, D, D)
    k_sum = k.sum(dim=2)

    out = torch.einsum('bhnd,bhdv->bhnv', q, kv)
    norm = torch.einsum('bhnd,bhd->bhn', q, k_sum).unsqueeze(-1)
    return out / (norm + eps)


@reference("linear-causal")
def linear_attention_causal(q, k, v, causal=True, eps=1e-6):
    """Causal linear attention - uses cumsum."""
    check_linear(q, k, v, causal, True)
    q = F.elu(q) + 1
    k = F.elu(k) + 1

    kv = torch.einsum('bhnd,bhnv->bhndv', k, v)  # (B, H, N, D, D)
    kv_cumsum = torch.cumsum(kv, dim=2)
    k_cumsum = torch.cumsum(k, dim=2)

    out = torch.einsum('bhnd,bhndv->bhnv', q, kv_cumsum)
    norm = torch.einsum('bhnd,bhnd->bhn', q, k_cumsum).unsqueeze(-1)
    return out / (norm + eps)


@reference("linear-causal-chunked")
def linear_attention_causal_chunked(q, k, v, causal=True, chunk=64, eps=1e-6):
    """Causal linear attention by chunks of ``chunk`` rows (the last one may be shorter):
    exact, with ``(D, D)`` state per chunk instead of per row."""
    check_linear(q, k, v, causal, True)
    q = F.elu(q) + 1
    k = F.elu(k) + 1

    B, H, _, D = q.shape
    kv = q.new_zeros(B, H, D, v.size(-1))  # sum of k_j v_j^T over the previous chunks
    k_sum = q.new_zeros(B, H, D, 1)  # sum of k_j over the previous chunks
    outs = []
    chunks = list(zip(q.split(chunk, dim=2), k.split(chunk, dim=2), v.split(chunk, dim=2)))
    for i, (qc, kc, vc) in enumerate(chunks):
        scores = (qc @ kc.transpose(-2, -1)).tril()  # (B, H, c, c) causal within the chunk
        out = scores @ vc + qc @ kv
        norm = scores.sum(-1, keepdim=True) + qc @ k_sum
        outs.append(out / (norm + eps))
        if i + 1 < len(chunks):
            kv = kv + kc.transpose(-2, -1) @ vc
            k_sum = k_sum + kc.sum(dim=2).unsqueeze(-1)
    return torch.cat(outs, dim=2)
