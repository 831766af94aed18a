"""The naive family: attention that materializes the ``N x M`` scores.

Reference code: ``memcalc/validation/reference.py`` (``naive``, ``naive-softmax``,
``naive-weights``). The backward events follow torch 2.13's derivative formulas
(``tools/autograd/derivatives.yaml``) as the autograd engine runs them; ``Dims`` names:
``B`` batch, ``H`` heads, ``N`` query rows, ``M`` key rows, ``D`` head dim.

Each is also built on q, k, v laid out ``(B, N, H, D)`` and seen through ``.transpose(1,
2)`` (``Dims.layout``, DeepSpeed-Ulysses' local attention), where they are not leaves
(``leaves=False``: their grads go on as made): ``matmul`` then clones an operand whose
batch and heads do not fold as a view (``memcalc.impls.common.fold``), and the bmm saves
the clone, or, where it does fold, the caller's tensor itself.
"""

from __future__ import annotations

from memcalc.impls.registry import register
from memcalc.impls.common import dout_copy, fold, folds, freed, softmax_backward, with_loss
from memcalc.impls.reductions import reduced
from memcalc.engine.program import Dims, Program, Role, cublas, free, last_save, new, release

A, S, O, G, T = Role.activation, Role.saved, Role.output, Role.gradient, Role.temporary


def scores(d: Dims, grad: bool = True) -> list:
    """``s = q @ k^T / sqrt(D)``, then the causal mask: leaves the scores in ``s``.
    ``grad=False`` inside a custom Function's forward, where masked_fill saves nothing."""
    bhnm, dt, role = (d.B, d.H, d.N, d.M), d.dtype, S if grad else T
    folded = (fold(d, "q", "q", (d.B, d.H, d.N, d.D), dt, role)  # (B, H, N, D)
              + fold(d, "k^T", "k^T", (d.B, d.H, d.D, d.M), dt, role))  # (B, H, D, M)
    events = [
        *folded,
        new("qk", (d.B * d.H, d.N, d.M), dt, T, "bmm"),  # (B*H, N, M) matmul folds B, H
        cublas(),
        *freed(folded),
        new("s", bhnm, dt, A, "div"),  # (B, H, N, M) qk / sqrt(D)
        free("qk"),
    ]
    if d.causal:
        events += [
            new("ones", (d.N, d.M), "bool", T, "ones"),  # (N, M) torch.ones
            new("mask", (d.N, d.M), "bool", S if grad else T, "triu"),  # (N, M) saved by masked_fill
            free("ones"),
            new("s_masked", bhnm, dt, A, "masked_fill"),  # (B, H, N, M) s with -inf above diag
            free("s", "mask"),
        ]
    return events


def scores_backward(d: Dims, grad: str, leaves: bool = True) -> list:
    """Backward of ``scores`` from the grad of the (masked) scores, named ``grad``.

    Ends with ``dq`` and ``dk``; ``k``'s grad arrives transposed from ``BmmBackward0``,
    so for a leaf ``AccumulateGrad`` copies it into ``k``'s layout
    (``torch/csrc/autograd/functions/accumulate_grad.h``: strides must match); else it goes
    on as it is (``dk_t``)."""
    bhnm, dt = (d.B, d.H, d.N, d.M), d.dtype
    events = []
    if d.causal:
        events += [
            new("ds_masked", bhnm, dt, T, "masked_fill"),  # (B, H, N, M) grad.masked_fill(mask, 0)
            release("mask"),
            free(grad),
        ]
        grad = "ds_masked"
    return events + [
        new("ds", bhnm, dt, T, "div"),  # (B, H, N, M) grad / sqrt(D)
        free(grad),
        new("dk_t", (d.B * d.H, d.D, d.M), dt, T, "bmm"),  # (B*H, D, M) q^T @ ds
        cublas(),
        new("dq", (d.B * d.H, d.N, d.D), dt, G, "bmm"),  # (B*H, N, D) ds @ k
        free("ds"),
        *released(d, leaves, ("q", "q"), ("k^T", "k")),
        *([new("dk", (d.B, d.H, d.M, d.D), dt, G, "new_empty_strided"),  # (B, H, M, D) copy
           free("dk_t")] if leaves else []),
    ]


def saved_inputs(d: Dims) -> tuple[str, ...]:
    """Of q, k, v (not leaves), those whose bmm saves them as they are (folded as views)."""
    return tuple(x for x, operand in (("q", "q"), ("k", "k^T"), ("v", "v")) if folds(d, operand))


def released(d: Dims, leaves: bool, *operands: tuple[str, str]) -> list:
    """Autograd's release of what a bmm saved of each (operand, input): the fold's clone,
    or the input itself where it is not a leaf (a leaf outlives the step)."""
    names = [f"{operand} fold" if not folds(d, operand) else x
             for operand, x in operands if not (leaves and folds(d, operand))]
    return [release(*names)] if names else []


def output(d: Dims, weights: str, grad: bool = True) -> list:
    """``out = weights @ v``, shape ``(B*H, N, D)`` viewed as ``(B, H, N, D)``."""
    folded = fold(d, "v", "v", (d.B, d.H, d.M, d.D), d.dtype, S if grad else T)  # (B, H, M, D)
    return [*folded, new("out", (d.B * d.H, d.N, d.D), d.dtype, O, "bmm"), cublas(),
            *freed(folded)]


def output_backward(d: Dims, weights: str, last_use: bool = True, leaves: bool = True) -> list:
    """Backward of ``out = weights @ v``: ``dv`` (kept as ``v.grad``) and ``dp``; the
    weights are released here unless another node still holds them. Unless q, k, v are
    leaves the incoming grad is the engine's buffer (``grad``), gone with its last node."""
    dout, events = grad_folded(d, leaves)
    return events + [
        new("dv", (d.B * d.H, d.M, d.D), d.dtype, G, "bmm"),  # (B*H, M, D) p^T @ dout
        *dout_copy(d, "dv", expanded=dout is None),
        new("dp", (d.B * d.H, d.N, d.M), d.dtype, T, "bmm"),  # (B*H, N, M) dout @ v^T
        *dout_copy(d, "dp", expanded=dout is None),
        *([release(weights)] if last_use else []),
        *released(d, leaves, ("v", "v")),
        *([free(dout)] if dout else []),
    ]


def grad_folded(d: Dims, leaves: bool) -> tuple[str | None, list]:
    """The output's grad as the bmms read it, and the events that make it: the engine's
    buffer (``grad``, None where the caller holds it), or ``UnsafeViewBackward0``'s clone
    where it does not fold as a view (matmul's output was ``_unsafe_view``'d)."""
    dout = None if leaves else "grad"
    if folds(d, "q"):
        return dout, []
    return "dout fold", [new("dout fold", (d.B, d.H, d.N, d.D), d.dtype, T,
                             "clone"),  # (B, H, N, D)
                         *([free(dout)] if dout else [])]


@register("naive", "custom softmax keeping exp_x: s.max, exp(s - m), e / e.sum")
def naive(d: Dims) -> Program:
    """Custom-softmax attention (exp of the shifted scores, divided by their row sum)."""
    return program(d, naive_events)


def program(d: Dims, events) -> Program:
    """The program of ``events(d)`` (forward and backward) on leaves, under the loss."""
    forward, backward = events(d)
    return Program(tuple(forward), tuple(with_loss(d, backward)))


def naive_events(d: Dims, leaves: bool = True) -> tuple[list, list]:
    """``naive``'s forward and backward events (``leaves``: see ``scores_backward``)."""
    bhnm, rows, dt = (d.B, d.H, d.N, d.M), (d.B, d.H, d.N, 1), d.dtype
    s = "s_masked" if d.causal else "s"
    forward = scores(d) + [
        new("row_max", rows, dt, A, "max"),  # (B, H, N, 1) max values
        new("row_argmax", rows, "int64", S, "max"),  # (B, H, N, 1) saved by MaxBackward
        free("row_argmax"),  # .values drops the indices
        new("shifted", bhnm, dt, T, "sub"),  # (B, H, N, M) s - m
        new("exp_x", bhnm, dt, S, "exp"),  # (B, H, N, M) saved by ExpBackward (result) and DivBackward
        free("shifted"),
        *reduced("row_sum", rows, dt, S, d, bhnm, (3,)),  # (B, H, N, 1) saved by DivBackward
        new("p", bhnm, dt, S, "div"),  # (B, H, N, M) saved by BmmBackward
        free("row_sum"),
        *output(d, "p"),
        free(s, "row_max", "exp_x", "p"),
    ]
    backward = output_backward(d, "p", leaves=leaves) + [
        # DivBackward0, p = e / r: grad_r = -dp * ((e / r) / r) first, then grad_e = dp / r
        new("e/r", bhnm, dt, T, "div"),  # (B, H, N, M) e / r
        new("e/r/r", bhnm, dt, T, "div"),  # (B, H, N, M) (e / r) / r
        new("-dp", bhnm, dt, T, "neg"),  # (B, H, N, M) -dp
        new("-dp*e/r/r", bhnm, dt, T, "mul"),  # (B, H, N, M) -dp * ((e / r) / r)
        free("e/r", "e/r/r", "-dp"),
        new("dp/r", bhnm, dt, T, "div"),  # (B, H, N, M) dp / r
        *reduced("dr", rows, dt, T, d, bhnm, (3,)),  # (B, H, N, 1) engine's sum_to to r's shape
        release("row_sum"),
        free("dp", "-dp*e/r/r"),
        # SumBackward0 expands dr; the engine's input buffer adds it to de_div
        new("de", bhnm, dt, T, "add"),  # (B, H, N, M) de_div + dr.expand
        free("dp/r", "dr"),
        new("dx", bhnm, dt, T, "mul"),  # (B, H, N, M) ExpBackward0: de * exp_x
        release("exp_x"),
        free("de"),
        # SubBackward0: ds passes dx through; dm = -dx summed to (B, H, N, 1)
        new("-dx", bhnm, dt, T, "neg"),  # (B, H, N, M) -dx
        *reduced("dm", rows, dt, T, d, bhnm, (3,)),  # (B, H, N, 1) sum_to m's shape
        free("-dx"),
        # MaxBackward0: value_selecting_reduction_backward = zeros.scatter(indices, dm)
        new("zeros", bhnm, dt, T, "new_zeros"),  # (B, H, N, M)
        new("dm_scattered", bhnm, dt, T, "scatter"),  # (B, H, N, M)
        release("row_argmax"),
        free("dm", "zeros"),
        new("dscores", bhnm, dt, T, "add"),  # (B, H, N, M) dx + dm_full in the input buffer
        free("dx", "dm_scattered"),
        *scores_backward(d, "dscores", leaves),
    ]
    return forward, backward


@register("naive-softmax", "torch.softmax on the scores: saves the weights only")
def naive_softmax(d: Dims) -> Program:
    """``p = torch.softmax(s, -1)``; ``SoftmaxBackward0`` saves its result only."""
    return program(d, softmax_events)


def softmax_events(d: Dims, leaves: bool = True) -> tuple[list, list]:
    """``naive-softmax``'s forward and backward events."""
    bhnm, dt = (d.B, d.H, d.N, d.M), d.dtype
    s = "s_masked" if d.causal else "s"
    forward = scores(d) + [
        new("p", bhnm, dt, S, "_softmax"),  # (B, H, N, M) saved by SoftmaxBackward and BmmBackward
        *output(d, "p"),
        free(s, "p"),
    ]
    backward = output_backward(d, "p", last_use=False, leaves=leaves) + [
        *softmax_backward("dscores", bhnm, dt),  # (B, H, N, M), and grad * p inside
        release("p"),
        free("dp"),
        *scores_backward(d, "dscores", leaves),
    ]
    return forward, backward


@register("naive-weights", "custom autograd.Function saving q, k, v and the weights only")
def naive_weights(d: Dims) -> Program:
    """``_WeightsOnly`` in the reference code: the forward runs without autograd, the
    backward recomputes nothing and builds ``ds`` with ``_softmax_backward_data``."""
    return program(d, weights_events)


def weights_events(d: Dims, leaves: bool = True) -> tuple[list, list]:
    """``naive-weights``' forward and backward events. Its backward's matmuls run without
    autograd: a fold's clone is a temporary of its bmm. The incoming grad lives to the
    node's end (``leaves`` changes nothing: its grads are made in q's, k's, v's layout)."""
    bhnm, dt = (d.B, d.H, d.N, d.M), d.dtype
    s = "s_masked" if d.causal else "s"
    forward = scores(d, grad=False) + [
        new("p", bhnm, dt, S, "_softmax"),  # (B, H, N, M) ctx.save_for_backward
        free(s),
        *output(d, "p", grad=False),
        free("p"),
        last_save(),  # a custom Function packs ctx.saved_tensors after its forward returns
    ]
    bhnd, bhmd, bhdm = (d.B, d.H, d.N, d.D), (d.B, d.H, d.M, d.D), (d.B, d.H, d.D, d.M)
    backward = [
        *temporary(d, "q", "dout", bhnd, [
            new("dv", (d.B * d.H, d.M, d.D), dt, G, "bmm"),  # (B*H, M, D) p^T @ dout
            *dout_copy(d, "dv", expanded=folds(d, "q"))]),
        *temporary(d, "q", "dout", bhnd, temporary(d, "v^T", "v^T", bhdm, [
            new("dp", (d.B * d.H, d.N, d.M), dt, T, "bmm"),  # (B*H, N, M) dout @ v^T
            *dout_copy(d, "dp", expanded=folds(d, "q"))])),
        *softmax_backward("dsm", bhnm, dt),  # (B, H, N, M), and dp * p inside
        new("ds", bhnm, dt, T, "div"),  # (B, H, N, M) / sqrt(D)
        free("dsm", "dp"),
        *temporary(d, "k", "k", bhmd, [
            new("dq", (d.B * d.H, d.N, d.D), dt, G, "bmm")]),  # (B*H, N, D) ds @ k
        *temporary(d, "q", "q", bhnd, [
            new("dk", (d.B * d.H, d.M, d.D), dt, G, "bmm"),  # (B*H, M, D) ds^T @ q
            free("ds"),
            release("p")]),
    ]
    return forward, backward


def temporary(d: Dims, operand: str, name: str, shape: tuple, events: list) -> list:
    """``events`` (a bmm) on ``name`` folded by ``matmul`` where no autograd records it:
    the fold's clone, if any, made before them and freed after."""
    folded = fold(d, operand, name, shape, d.dtype, T)
    return [*folded, *events, *freed(folded)]
