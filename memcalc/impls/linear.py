"""The linear-attention family: feature map ``phi(x) = elu(x) + 1``, no N x M scores.

Reference code: ``memcalc/validation/reference/linear.py`` (``linear`` and ``linear-causal``
are the common notebook functions as written; ``linear-causal-chunked`` a chunked form).

* ``linear``: ``kv = phi(k)^T v`` ``(B, H, D, D)``, ``k_sum``, ``out = phi(q) kv / (phi(q)
  k_sum + eps)``. Bidirectional only: ``causal=True`` is a ValueError.
* ``linear-causal``: the plain cumulative sum. The outer product ``phi(k) v^T`` and its
  cumsum are both ``(B, H, N, D, D)``; the cumsum is saved for backward.
* ``linear-causal-chunked``: chunks of ``Dims.chunk`` rows (the last may be shorter):
  ``tril(q_c k_c^T) v_c`` inside a chunk, a running ``(D, D)`` state across chunks. Saves
  one ``(c, c)`` score block and one ``(D, D)`` state per chunk.

The two causal implementations are causal whatever ``causal`` says (there is no mask to
build: the flag selects nothing) and need ``kv_len == seq_len``. None supports GQA (the
einsums need as many k/v heads as q heads).

The backward events follow torch 2.13's derivative formulas (``tools/autograd/derivatives.yaml``)
in the order the autograd engine runs the nodes: ready nodes by decreasing sequence number
(``torch/csrc/autograd/engine.cpp``); a grad arriving at a node that already holds one is
added into a new tensor (``InputBuffer::add``, ``torch/csrc/autograd/input_buffer.cpp``; out
of place in every trace here).
"""

from __future__ import annotations

from memcalc.engine.deadline import tick
from memcalc.impls.registry import register
from memcalc.impls.common import with_loss
from memcalc.impls.reductions import reduced
from memcalc.engine.program import (Dims, Program, Role, cublas, first_unpack, free, last_save, new, release)

A, S, O, G, T = Role.activation, Role.saved, Role.output, Role.gradient, Role.temporary


def check(d: Dims, causal_impl: bool) -> None:
    """Reject what the reference code cannot run (``ValueError``, one line, names the option)."""
    if d.causal and not causal_impl:
        raise ValueError("--causal: linear is bidirectional; use linear-causal or "
                         "linear-causal-chunked")
    if causal_impl and d.M != d.N:
        raise ValueError(f"--kv-len: causal linear attention needs kv_len == seq_len "
                         f"({d.M} != {d.N})")


def feature_maps(d: Dims) -> list:
    """``q = F.elu(q) + 1``, ``k = F.elu(k) + 1``. ``EluBackward0`` saves its input (the
    leaf), so ``elu`` dies at once; the ``+ 1`` results are saved by the later matmuls."""
    return [
        new("elu_q", (d.B, d.H, d.N, d.D), d.dtype, T, "elu"),  # (B, H, N, D)
        new("phi_q", (d.B, d.H, d.N, d.D), d.dtype, S, "add"),  # (B, H, N, D) elu(q) + 1
        free("elu_q"),
        new("elu_k", (d.B, d.H, d.M, d.D), d.dtype, T, "elu"),  # (B, H, M, D)
        new("phi_k", (d.B, d.H, d.M, d.D), d.dtype, S, "add"),  # (B, H, M, D) elu(k) + 1
        free("elu_k"),
    ]


def normalize(d: Dims, num: str, norm_shape: tuple[int, ...]) -> list:
    """``norm`` (a bmm of ``norm_shape``), then ``out = num / (norm + eps)``.
    ``DivBackward0`` saves both operands, packed before the div allocates: the forward's
    last save."""
    rows = (d.B, d.H, d.N, 1)
    return [
        new("norm", norm_shape, d.dtype, T, "bmm"),  # (..., 1) q . k_sum per row
        cublas(),
        new("den", rows, d.dtype, S, "add"),  # (B, H, N, 1) norm + eps
        last_save(),
        new("out", (d.B, d.H, d.N, d.D), d.dtype, O, "div"),  # (B, H, N, D)
    ]


def div_backward(d: Dims, c: int, num: str, den: str, grad: str | None, tag: str = "") -> list:
    """``DivBackward0`` of ``num / den`` over ``c`` rows: grad_den = -g * ((num / den) / den)
    first, then grad_num = g / den; leaves ``dnum{tag}`` and ``dden{tag}``."""
    bhcd, rows, dt = (d.B, d.H, c, d.D), (d.B, d.H, c, 1), d.dtype
    t = tag
    return [
        new(f"a/b{t}", bhcd, dt, T, "div"),  # (B, H, c, D) num / den
        new(f"a/b/b{t}", bhcd, dt, T, "div"),  # (B, H, c, D) (num / den) / den
        new(f"-g{t}", bhcd, dt, T, "neg"),  # (B, H, c, D)
        new(f"-g*a/b/b{t}", bhcd, dt, T, "mul"),  # (B, H, c, D)
        free(f"a/b{t}", f"a/b/b{t}", f"-g{t}"),
        new(f"dnum{t}", bhcd, dt, T, "div"),  # (B, H, c, D) g / den
        *reduced(f"dden{t}", rows, dt, T, d, bhcd, (3,)),  # (B, H, c, 1) sum_to den's shape
        release(num, den),
        free(f"-g*a/b/b{t}", *([grad] if grad else [])),
    ]


def elu_backward(d: Dims, dq: str, dk: str) -> list:
    """``EluBackward0`` of k then of q (k's node is the later one): the leaf grads."""
    return [
        new("dk", (d.B, d.H, d.M, d.D), d.dtype, G, "elu_backward"),  # (B, H, M, D)
        free(dk),
        new("dq", (d.B, d.H, d.N, d.D), d.dtype, G, "elu_backward"),  # (B, H, N, D)
        free(dq),
    ]


@register("linear", "linear attention, elu+1 feature map, (D, D) state (bidirectional)")
def linear(d: Dims) -> Program:
    """``linear_attention_bidir`` as commonly written. Saved: phi(q), phi(k), ``kv`` (B, H, D, D),
    ``k_sum`` (B, H, D), the numerator (B, H, N, D) and ``norm + eps`` (B, H, N, 1)."""
    check(d, causal_impl=False)
    bh, dt = d.B * d.H, d.dtype
    forward = feature_maps(d) + [
        new("kv", (bh, d.D, d.D), dt, S, "bmm"),  # (B*H, D, D) einsum bhnd,bhnv->bhdv
        cublas(),
        *reduced("k_sum", (d.B, d.H, d.D), dt, S, d, (d.B, d.H, d.M, d.D), (2,)),  # (B, H, D)
        new("num", (bh, d.N, d.D), dt, S, "bmm"),  # (B*H, N, D) einsum bhnd,bhdv->bhnv
        *normalize(d, "num", (bh, d.N, 1)),  # norm: (B*H, N, 1) einsum bhnd,bhd->bhn
        free("phi_q", "phi_k", "kv", "k_sum", "num", "norm", "den"),  # locals at return
    ]
    backward = [first_unpack(), *div_backward(d, d.N, "num", "den", None), *[
        # BmmBackward0 of norm = phi_q @ k_sum: mat2's grad first, then self's
        new("dk_sum", (bh, d.D, 1), dt, T, "bmm"),  # (B*H, D, 1)
        cublas(),
        new("dq_norm", (bh, d.N, d.D), dt, T, "bmm"),  # (B*H, N, D)
        release("k_sum"),
        free("dden"),
        # BmmBackward0 of num = phi_q @ kv
        new("dkv", (bh, d.D, d.D), dt, T, "bmm"),  # (B*H, D, D)
        new("dq_num", (bh, d.N, d.D), dt, T, "bmm"),  # (B*H, N, D)
        release("phi_q", "kv"),
        free("dnum"),
        new("dphi_q", (d.B, d.H, d.N, d.D), dt, T, "add"),  # (B, H, N, D) both grads of phi_q
        free("dq_norm", "dq_num"),
        # BmmBackward0 of kv = phi_k^T @ v
        new("dv", (bh, d.M, d.D), dt, G, "bmm"),  # (B*H, M, D) phi_k @ dkv
        new("dk_t", (bh, d.D, d.M), dt, T, "bmm"),  # (B*H, D, M) dkv @ v^T
        release("phi_k"),
        free("dkv"),
        new("dphi_k", (d.B, d.H, d.M, d.D), dt, T, "add"),  # (B, H, M, D) dk_t^T + expanded dk_sum
        free("dk_sum", "dk_t"),
    ], *elu_backward(d, "dphi_q", "dphi_k")]
    return Program(tuple(forward), tuple(with_loss(d, backward)))


@register("linear-causal", "causal linear attention by cumsum: saves a (B, H, N, D, D) cumsum")
def linear_causal(d: Dims) -> Program:
    """``linear_attention_causal`` as commonly written. Saved: phi(q), phi(k), the ``(B, H, N, D, D)``
    cumsum of ``phi(k) v^T``, the cumsum of phi(k), the numerator and ``norm + eps``; the
    outer product itself is not saved (``MulBackward0`` saves its operands, views of phi(k)
    and v) but is alive with its cumsum at the forward peak."""
    check(d, causal_impl=True)
    bhn, dt = d.B * d.H * d.N, d.dtype
    bhndd, bhnd = (d.B, d.H, d.N, d.D, d.D), (d.B, d.H, d.N, d.D)
    forward = feature_maps(d) + [
        new("kv", bhndd, dt, T, "mul"),  # (B, H, N, D, D) einsum bhnd,bhnv->bhndv
        new("kv_cumsum", bhndd, dt, S, "cumsum"),  # (B, H, N, D, D)
        new("k_cumsum", bhnd, dt, S, "cumsum"),  # (B, H, N, D)
        new("num", (bhn, 1, d.D), dt, S, "bmm"),  # (B*H*N, 1, D) einsum bhnd,bhndv->bhnv
        cublas(),
        *normalize(d, "num", (bhn, 1, 1)),  # norm: (B*H*N, 1, 1) einsum bhnd,bhnd->bhn
        free("kv", "norm", "phi_q", "phi_k", "kv_cumsum", "k_cumsum", "num", "den"),
    ]
    backward = [first_unpack(), *div_backward(d, d.N, "num", "den", None), *[
        # BmmBackward0 of norm = phi_q . k_cumsum, one (1, D) x (D, 1) product per row
        new("dk_cumsum", (bhn, d.D, 1), dt, T, "bmm"),  # (B*H*N, D, 1)
        cublas(),
        new("dq_norm", (bhn, 1, d.D), dt, T, "bmm"),  # (B*H*N, 1, D)
        release("k_cumsum"),
        free("dden"),
        # BmmBackward0 of num = phi_q @ kv_cumsum: an N x D x D grad
        new("dkv_cumsum", (bhn, d.D, d.D), dt, T, "bmm"),  # (B*H*N, D, D)
        new("dq_num", (bhn, 1, d.D), dt, T, "bmm"),  # (B*H*N, 1, D)
        release("phi_q", "kv_cumsum"),
        free("dnum"),
        new("dphi_q", bhnd, dt, T, "add"),  # (B, H, N, D) both grads of phi_q
        free("dq_norm", "dq_num"),
        *cumsum_backward("dk_cumsum", "dk_c", bhnd, dt),  # (B, H, N, D)
        *cumsum_backward("dkv_cumsum", "dkv", bhndd, dt),  # (B, H, N, D, D)
        # MulBackward0 of phi_k[..., None] * v[..., None, :]: both products, then sum_to
        new("dkv*v", bhndd, dt, T, "mul"),  # (B, H, N, D, D) grad * v
        new("dkv*k", bhndd, dt, T, "mul"),  # (B, H, N, D, D) grad * phi_k
        new("dk_outer", (d.B, d.H, d.N, d.D, 1), dt, T, "sum"),  # (B, H, N, D, 1)
        free("dkv*v"),
        new("dv", (d.B, d.H, d.N, 1, d.D), dt, G, "sum"),  # (B, H, N, 1, D) v.grad as is
        release("phi_k"),
        free("dkv", "dkv*k"),
        new("dphi_k", bhnd, dt, T, "add"),  # (B, H, N, D) dk_c + dk_outer
        free("dk_c", "dk_outer"),
    ], *elu_backward(d, "dphi_q", "dphi_k")]
    return Program(tuple(forward), tuple(with_loss(d, backward)))


def cumsum_backward(grad: str, out: str, shape: tuple[int, ...], dt: str) -> list:
    """``CumsumBackward0`` in torch 2.13: ``flip(cumsum(flip(grad)))`` along the rows,
    three tensors of the grad's size (``cumsum_backward``, FunctionsManual.cpp)."""
    return [
        new(f"{out}:flip", shape, dt, T, "flip"),
        new(f"{out}:cumsum", shape, dt, T, "cumsum"),
        new(out, shape, dt, T, "flip"),
        free(grad, f"{out}:flip", f"{out}:cumsum"),
    ]


def chunk_lengths(d: Dims) -> list[int]:
    """Rows of each chunk: ``chunk`` each, the remainder last (``Tensor.split``)."""
    full, rest = divmod(d.N, d.chunk)
    return [d.chunk] * full + ([rest] if rest else [])


@register("linear-causal-chunked",
          "causal linear attention by chunks: tril(q k^T) v in a chunk, a (D, D) state "
          "carried across chunks", chunked=True)
def linear_causal_chunked(d: Dims) -> Program:
    """Chunked causal linear attention (``Dims.chunk`` rows a chunk). Saved per chunk: the
    ``(B, H, c, c)`` causal scores, the numerator and ``norm + eps``, and the ``(D, D)``
    state and ``(D, 1)`` key sum the chunk read (two zero tensors for the first chunk);
    phi(q) and phi(k) once."""
    check(d, causal_impl=True)
    sizes = chunk_lengths(d)
    forward = feature_maps(d) + [
        new("kv_init", (d.B, d.H, d.D, d.D), d.dtype, S, "new_zeros"),  # (B, H, D, D)
        new("ksum_init", (d.B, d.H, d.D, 1), d.dtype, S, "new_zeros"),  # (B, H, D, 1)
    ]
    for i, c in enumerate(sizes):
        events = chunk_forward(d, i, c, last=i == len(sizes) - 1)
        forward += events
        tick(len(events), work=False)  # a million rows build for a second: a deadline holds
    last = len(sizes) - 1
    forward += [
        new("out", (d.B, d.H, d.N, d.D), d.dtype, O, "cat"),  # (B, H, N, D)
        free(*[f"y{i}" for i in range(len(sizes))], f"n{last}", f"S{last}", f"o{last}",
             _state("kv", last), _state("ksum", last), "phi_q", "phi_k"),
    ]
    backward = [first_unpack()]
    for i in reversed(range(len(sizes))):
        events = chunk_backward(d, i, sizes[i], last=i == last)
        backward += events
        tick(len(events), work=False)
    backward += split_backward(d, len(sizes)) + elu_backward(d, "dq_cat", "dk_cat")
    return Program(tuple(forward), tuple(with_loss(d, backward)))


def _state(name: str, i: int) -> str:
    """The running state chunk ``i`` reads: the previous chunk's update, or the zeros."""
    return f"{name}{i - 1}" if i > 0 else f"{name}_init"


def chunk_forward(d: Dims, i: int, c: int, last: bool) -> list:
    """One loop iteration of the reference code. A rebound name frees its previous tensor
    (a no-op for saved ones while autograd holds them)."""
    bh, dt = d.B * d.H, d.dtype
    bhc, prev = (d.B, d.H, c), [f"S{i - 1}", f"o{i - 1}", f"n{i - 1}"] if i else []
    events = [
        new(f"qk{i}", (bh, c, c), dt, T, "bmm"),  # (B*H, c, c) q_c @ k_c^T
        cublas(),
        new(f"S{i}", (*bhc, c), dt, S, "tril"),  # (B, H, c, c) saved by S @ v_c
        free(f"qk{i}", *prev[:1]),
        new(f"a{i}", (bh, c, d.D), dt, T, "bmm"),  # (B*H, c, D) S @ v_c
        new(f"b{i}", (bh, c, d.D), dt, T, "bmm"),  # (B*H, c, D) q_c @ kv
        new(f"o{i}", (*bhc, d.D), dt, S, "add"),  # (B, H, c, D) saved by the div
        free(f"a{i}", f"b{i}", *prev[1:2]),
        *reduced(f"ns{i}", (*bhc, 1), dt, T, d, (*bhc, c), (3,)),  # (B, H, c, 1) S.sum(-1)
        new(f"nb{i}", (bh, c, 1), dt, T, "bmm"),  # (B*H, c, 1) q_c @ k_sum
        new(f"n{i}", (*bhc, 1), dt, T, "add"),  # (B, H, c, 1) norm
        free(f"ns{i}", f"nb{i}", *prev[2:]),
        new(f"e{i}", (*bhc, 1), dt, S, "add"),  # (B, H, c, 1) norm + eps, saved by the div
        *([last_save()] if last else []),
        new(f"y{i}", (*bhc, d.D), dt, T, "div"),  # (B, H, c, D) kept in outs until the cat
        free(f"e{i}"),
    ]
    if not last:
        events += [
            new(f"u{i}", (bh, d.D, d.D), dt, T, "bmm"),  # (B*H, D, D) k_c^T @ v_c
            new(f"kv{i}", (d.B, d.H, d.D, d.D), dt, S, "add"),  # (B, H, D, D) next chunk's kv
            free(f"u{i}", _state("kv", i)),
            *reduced(f"ks{i}", (d.B, d.H, d.D), dt, T, d, (d.B, d.H, c, d.D), (2,)),  # (B, H, D) k_c.sum(2)
            new(f"ksum{i}", (d.B, d.H, d.D, 1), dt, S, "add"),  # (B, H, D, 1) next k_sum
            free(f"ks{i}", _state("ksum", i)),
        ]
    return events


def chunk_backward(d: Dims, i: int, c: int, last: bool) -> list:
    """The backward of chunk ``i``: the nodes of its state update (unless last), then its
    output's. The grads of the state it read (``dkv{i}``/``dks{i}`` hold those of the
    state chunk ``i - 1`` wrote) go on to the previous chunk; chunk 0 read zeros."""
    bh, dt, first = d.B * d.H, d.dtype, i == 0
    bhcd = (d.B, d.H, c, d.D)
    events = [] if last else [
        # update kv_i = kv + k_c^T @ v_c, k_sum_i = k_sum + k_c.sum(2): the k_sum node
        # runs first (its grad reaches k_c as an expand), then BmmBackward0
        new(f"dv_u{i}", (bh, c, d.D), dt, T, "bmm"),  # (B*H, c, D) k_c @ dkv
        cublas(),
        new(f"dk_u{i}", (bh, d.D, c), dt, T, "bmm"),  # (B*H, D, c) dkv @ v_c^T
        *([free(f"dkv{i + 1}")] if first else []),
        new(f"dkc_u{i}", bhcd, dt, T, "add"),  # (B, H, c, D) expanded dks + dk_u^T
        free(*([f"dks{i + 1}"] if first else []), f"dk_u{i}"),
    ]
    events += div_backward(d, c, f"o{i}", f"e{i}", None, tag=str(i))
    events += state_read_backward(d, i, c, "ks", (d.D, 1), last)
    events += state_read_backward(d, i, c, "kv", (d.D, d.D), last)
    events += [
        new(f"dq_nb{i}", bhcd, dt, T, "add"),  # (B, H, c, D) the two grads of q_c so far
        free(f"dq_ks{i}", f"dq_kv{i}"),
        # BmmBackward0 of S @ v_c
        new(f"dv_a{i}", (bh, c, d.D), dt, T, "bmm"),  # (B*H, c, D) S^T @ dout
        new(f"dS{i}", (bh, c, c), dt, T, "bmm"),  # (B*H, c, c) dout @ v_c^T
        release(f"S{i}"),
        free(f"dnum{i}"),
        *([] if last else [
            new(f"dvc{i}", bhcd, dt, T, "add"),  # (B, H, c, D) dv_u + dv_a
            free(f"dv_u{i}", f"dv_a{i}")]),
        new(f"dS_sum{i}", (d.B, d.H, c, c), dt, T, "add"),  # (B, H, c, c) dS + expanded dden
        free(f"dden{i}", f"dS{i}"),
        new(f"dS_tril{i}", (d.B, d.H, c, c), dt, T, "tril"),  # (B, H, c, c) TrilBackward0
        free(f"dS_sum{i}"),
        # BmmBackward0 of q_c @ k_c^T; chunk 0's is the last node holding phi(q), phi(k)
        new(f"dk_s{i}", (bh, d.D, c), dt, T, "bmm"),  # (B*H, D, c) q_c^T @ dS
        new(f"dq_s{i}", (bh, c, d.D), dt, T, "bmm"),  # (B*H, c, D) dS @ k_c
        *([release("phi_q", "phi_k")] if first else []),
        free(f"dS_tril{i}"),
        new(f"dqc{i}", bhcd, dt, T, "add"),  # (B, H, c, D) the chunk's q grad
        free(f"dq_nb{i}", f"dq_s{i}"),
    ]
    if not last:
        events += [
            new(f"dkc{i}", bhcd, dt, T, "add"),  # (B, H, c, D) the chunk's k grad
            free(f"dkc_u{i}", f"dk_s{i}"),
        ]
    return events


def state_read_backward(d: Dims, i: int, c: int, kind: str, state: tuple[int, int],
                        last: bool) -> list:
    """``BmmBackward0`` of ``q_c @ k_sum`` (``kind="ks"``) or ``q_c @ kv`` (``"kv"``): the
    state's grad (none for chunk 0: zeros need none), then q_c's, then the release of the
    state. The state's grad adds to the one passed through from the later chunk's update."""
    bh, dt = d.B * d.H, d.dtype
    name = "ksum" if kind == "ks" else "kv"
    g, g_in = f"d{kind}{i}", f"d{kind}{i + 1}"
    events = []
    if i > 0:
        events += [new(g if last else f"{g}:own", (bh, *state), dt, T, "bmm"), cublas()]
    events += [
        new(f"dq_{kind}{i}", (bh, c, d.D), dt, T, "bmm"),  # (B*H, c, D)
        cublas(),
        release(_state(name, i)),
    ]
    if i > 0 and not last:
        events += [
            new(g, (d.B, d.H, *state), dt, T, "add"),  # (B, H, ...) own + passed-through grad
            free(g_in, f"{g}:own"),
        ]
    return events


def split_backward(d: Dims, chunks: int) -> list:
    """``SplitBackward0`` of v, then k, then q: each cats its chunks' grads."""
    last = chunks - 1
    dv = [f"dv_a{last}"] + [f"dvc{i}" for i in range(last)]
    dk = [f"dk_s{last}"] + [f"dkc{i}" for i in range(last)]
    dq = [f"dqc{i}" for i in range(chunks)]
    return [
        new("dv", (d.B, d.H, d.N, d.D), d.dtype, G, "cat"),  # (B, H, N, D)
        free(*dv),
        new("dk_cat", (d.B, d.H, d.N, d.D), d.dtype, T, "cat"),  # (B, H, N, D)
        free(*dk),
        new("dq_cat", (d.B, d.H, d.N, d.D), d.dtype, T, "cat"),  # (B, H, N, D)
        free(*dq),
    ]
