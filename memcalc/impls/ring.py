"""Context parallelism: what one rank allocates in PyTorch's ring attention.

``torch/distributed/tensor/experimental/_context_parallel/_attention.py`` (torch 2.13 to
2.15), ``_templated_ring_attention`` and ``_templated_ring_attention_backward``, as
``context_parallel`` runs a fused SDPA kernel on each of ``P`` ranks. The sequence is
sharded with causal load balancing: each rank holds two chunks of ``N / 2P`` rows (``n =
N / P`` in all), so N is a multiple of 2P. Step ``i`` of ``P`` attends the rank's q to the
K/V of rank ``rank - i``: all of both at step 0 (causal), then the first half of K/V
(``i <= rank``) or the second half of q (``i > rank``, a "partial" step).

Per step, written here in the order torch's code runs it:

* the K/V exchange: ``torch.cat`` of k and v flattened, then the rotater. ``allgather``
  (the default, ``_AllGatherRotater``) gathers every rank's K/V once, P x the cat, held
  through the loop; ``alltoall`` (``_AllToAllRotater``) receives one rank's per step. A
  collective's input stays alive until its output is waited for (ProcessGroupNCCL's
  stash, torch 2.8 on: ``memcalc/tracing/collectives.py``);
* the kernel (``memcalc/impls/sdpa_flash.py``'s, ``sdpa_cudnn.py``'s or
  ``sdpa_efficient.py``'s model) at the step's rows;
* ``_SDPAMerger``: the step's output in float32, merged with the running one through
  ``sigmoid``/``logsigmoid`` temporaries, a partial step's result ``torch.cat`` into the
  full rows (``_partial_update``).

The forward returns (and autograd saves) the philox tensors of one step: the last one's up
to torch 2.13, the first one's from torch 2.14 (``FIRST_STEP_REST``), which then stay alive
through the loop beside each later step's.

The backward keeps float32 grad_q/grad_k/grad_v accumulators, runs the kernel's backward
per step, and sends the running dK/dV on (always ``all_to_all``: ``_AllToAllRotater``).

Python frees a tensor when its last reference goes; ``Frame`` follows the references of
torch's code (its variables, the merger's and the rotaters' fields, the stashes), so that
each tensor dies where it dies in torch. ``memcalc trace --cp`` runs torch's own code
(``memcalc/tracing/context_parallel.py``); tests/test_impls_ring.py checks every
allocation and free of this model against it.
"""

from __future__ import annotations

from dataclasses import dataclass

from memcalc.engine.program import Dims, Release, Role, free, release
from memcalc.impls.accepted import context_parallel
from memcalc.impls.frame import Frame, prefixed, roled
from memcalc.impls.device import gpu_of
from memcalc.impls.sdpa_select import NEWEST

F32 = "float32"
T, S, O, G = Role.temporary, Role.saved, Role.output, Role.gradient
METHODS = ("allgather", "alltoall")  # torch's rotaters (_RotateMethod)
# torch 2.14 keeps the first step's ``*rest`` (the philox tensors) and returns it:
# ``saved_rest = rest`` when still None (torch 2.14.1 and 2.15.0,
# torch/distributed/tensor/experimental/_context_parallel/_attention.py lines 423, 482-483,
# 488: ``return *sdpa_merger.results(), *saved_rest``); 2.13 returned the last step's
# (``*rest``, line 485). The first step's then live beside the previous step's (from step 2
# on) and the last step's (at the output's conversion): two 512 B blocks more with flash or
# cuDNN (seed and offset).
FIRST_STEP_REST = (2, 14)
# the kernels the ring calls (``_sdpa_handler``'s three), each modelled here
KERNELS = ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient")


def same_ring(torch: tuple[int, int]) -> bool:
    """Whether the installed torch runs release ``torch``'s ring code as modelled here (the
    same side of ``FIRST_STEP_REST``): a trace now then gives back what it measured."""
    from memcalc.impls.sdpa import installed_release

    installed = installed_release().torch[:2]
    return (installed >= FIRST_STEP_REST) == (tuple(torch) >= FIRST_STEP_REST)


@dataclass(frozen=True)
class Ring:
    """One rank's step: ``d`` the rank's own sizes (``N`` its ``n`` rows), ``P`` ranks, this
    one ``rank``, K/V exchanged by ``method``, each step run on ``kernel`` (``KERNELS``),
    as torch release ``torch`` runs it; ``stash``: the collectives' inputs kept until their
    wait, as NCCL does (False: as a fake process group does, keeping nothing)."""

    d: Dims
    P: int
    rank: int
    method: str = "allgather"
    kernel: str = "sdpa-flash"
    torch: tuple[int, int] = NEWEST
    stash: bool = True

    @property
    def kv(self) -> int:
        """Elements of k and v flattened and concatenated: 2 B Hk n D."""
        return 2 * self.d.B * self.d.Hk * self.d.N * self.d.D

    def rows(self, i: int) -> tuple[int, int, bool]:
        """Step ``i``'s q rows, K/V rows, and whether it is partial (``_templated_ring_attention``:
        step 0 whole and causal; ``i <= rank`` the first half of K/V; else half of q)."""
        n = self.d.N
        if i == 0:
            return n, n, False
        return (n, n // 2, False) if i <= self.rank else (n // 2, n, True)

    def step_dims(self, i: int) -> Dims:
        nq, nk, _ = self.rows(i)
        return self.d.replace(N=nq, M=nk, causal=i == 0)


# --- the forward -------------------------------------------------------------------------

def exchange(f: Frame, ring: Ring, i: int, cat: str) -> None:
    """``rotater.exchange_buffers(cat)``: allgather gathers once (step 0); alltoall sends
    each step's. The collective's input is stashed until the wait."""
    d = ring.d
    if ring.method == "allgather":
        if i == 0:
            f.new("gathered K/V", (ring.P * ring.kv,), d.dtype, "all_gather_into_tensor")
            f.hold("rotater._aggregated_buffer", "gathered K/V")
            f.drop("gathered K/V")
            stashed(f, ring, "stash 0", cat)
        return
    name = f"K/V from rank {(ring.rank - i - 1) % ring.P}"
    f.new(name, (ring.kv,), d.dtype, "all_to_all_single")
    f.hold("rotater._buffer", name)
    f.drop(name)
    stashed(f, ring, f"stash {i}", cat)


def stashed(f: Frame, ring: Ring, stash: str, sent: str) -> None:
    """ProcessGroupNCCL keeps a collective's input until its wait; a fake group does not."""
    if ring.stash:
        f.hold(stash, sent)


def next_buffer(f: Frame, ring: Ring, i: int) -> str:
    """``rotater.next_buffer()``: the wait (its input unstashed) and the K/V of step ``i``."""
    if ring.method == "allgather":
        f.drop("stash 0")
        return "gathered K/V"
    f.drop(f"stash {i - 1}")
    return f"K/V from rank {(ring.rank - i) % ring.P}"


def step_kv(f: Frame, i: int) -> None:
    """``q, k, v, partial = ...``: the step's k and v are views of the buffer ``key`` and
    ``value`` view (the inputs at step 0); they keep it until the next step's."""
    f.hold("k", *f.bound.get("key", ()))
    f.hold("v", *f.bound.get("value", ()))


def rotate_forward(f: Frame, ring: Ring, i: int) -> None:
    """The loop's head: this step's K/V, and the send of it to the next rank."""
    if i > 0:
        buffer = next_buffer(f, ring, i)
        f.hold("next_kv", buffer)
        f.hold("key", buffer)
        f.hold("value", buffer)
    if i < ring.P - 1:
        cat = f.new(f"step {i}: cat K/V", (ring.kv,), ring.d.dtype, "cat")  # next_kv = cat
        f.hold("next_kv", cat)
        f.drop(cat)
        exchange(f, ring, i, cat)
        f.drop("next_kv")  # next_kv = rotater.exchange_buffers(next_kv): None


def kernel_forward(f: Frame, ring: Ring, i: int) -> None:
    """``out, logsumexp, *rest = op(q, k, v)``: the kernel's model; what it returns
    replaces the previous step's, but the first step's ``rest``, kept from torch 2.14
    (``saved_rest``: ``FIRST_STEP_REST``)."""
    d = ring.step_dims(i)
    step_kv(f, i)
    events, rest = kernel_forward_events(ring.kernel, d)
    out, lse, *rest = (f"step {i}: {n}" for n in ("out", "lse", *rest))
    f.kernel(prefixed(events, f"step {i}: "), (out, lse, *rest))
    f.hold("out", out)
    f.hold("logsumexp", lse)
    f.hold("rest", *rest)
    if i == 0 and ring.torch >= FIRST_STEP_REST:
        f.hold("saved_rest", *rest)
    f.drop(out, lse, *rest)


def kernel_forward_events(kernel: str, d: Dims) -> tuple[list, tuple[str, ...]]:
    """The kernel's forward as its model declares it, less the final free of what its node
    saves (the ring keeps those as Python values), and the names of its philox seed and
    offset on the device (the efficient kernel's are CPU scalars without dropout). Under
    context parallelism the logsumexp is always made (``compute_log_sumexp`` forced on:
    ``_scaled_dot_product_ring_efficient_attention``, ``..._cudnn_attention``)."""
    from memcalc.impls import sdpa_cudnn, sdpa_efficient, sdpa_flash  # not at start-up

    if kernel == "sdpa-cudnn":
        return sdpa_cudnn.forward(d, True, sdpa_cudnn.Workspace())[:-1], ("seed", "offset")
    if kernel == "sdpa-efficient":
        return sdpa_efficient.forward(d, "cuda", True)[:-1], ()
    return sdpa_flash.forward(d, gpu_of(d), "cuda")[:-1], ("rng_state", "philox_offset")


def kernel_backward_events(ring: Ring, d: Dims, rows: int) -> list:
    """The kernel's backward on a step of ``rows`` query rows, given the merged output and
    the step's grad, (B, H, n, D)-contiguous or their second chunks: flash copies their
    transposes unless contiguous; cuDNN copies the grad to the output's strides when they
    differ (the stride-0 expand of ``loss="sum"``)."""
    from memcalc.impls import sdpa_cudnn, sdpa_efficient, sdpa_flash

    copy = d.loss == "sum" or not transposed_contiguous(ring.d, rows)
    if ring.kernel == "sdpa-cudnn":
        events = sdpa_cudnn.backward(d, d.loss == "sum", sdpa_cudnn.Workspace())
    elif ring.kernel == "sdpa-efficient":
        events = sdpa_efficient.backward(d, "cuda", copy, leaves=False)
    else:
        events = sdpa_flash.backward(d, "cuda", copy, not transposed_contiguous(ring.d, rows))
    return [e for e in events if not isinstance(e, Release)]


def merge(f: Frame, ring: Ring, i: int) -> None:
    """``sdpa_merger.step(out, logsumexp, partial)`` (``_SDPAMerger._merge_one``)."""
    d, (nq, _, partial) = ring.d, ring.rows(i)
    rows, row = (d.B, d.H, nq, d.D), (d.B, d.H, nq, 1)  # (B, H, nq, D), (B, H, nq, 1)
    block = f"step {i}: out"  # out.to(torch.float32): the out itself when float32
    if d.dtype != F32:
        block = f.new(f"step {i}: out float32", rows, F32, "_to_copy")
    if i == 0:
        f.hold("merger._out", block)
        f.hold("merger._lse", f"step {i}: lse")
        f.drop(block)
        return
    new = f.new  # out - sigmoid(block_lse - lse) * (out - block_out)
    t1 = new(f"step {i}: lse difference", row, F32, "sub")
    t2 = new(f"step {i}: sigmoid", row, F32, "sigmoid")
    f.drop(t1)
    t3 = new(f"step {i}: out difference", rows, F32, "sub")
    t4 = new(f"step {i}: weighted difference", rows, F32, "mul")
    f.drop(t2, t3)
    merged = new(f"step {i}: merged out", rows, F32, "sub")
    f.drop(t4)
    # lse - logsigmoid(lse - block_lse)
    u1 = new(f"step {i}: lse difference, negated", row, F32, "sub")
    u2 = new(f"step {i}: logsigmoid", row, F32, "log_sigmoid_forward")
    f.drop(u1)
    lse = new(f"step {i}: merged lse", row, F32, "sub")
    f.drop(u2)
    if partial:  # _partial_update: torch.cat of the first half and the merged second
        f.new(f"step {i}: lse, whole", (d.B, d.H, d.N, 1), F32, "cat")
        f.hold("merger._lse", f"step {i}: lse, whole")
        f.drop(f"step {i}: lse, whole")
        f.new(f"step {i}: out, whole", (d.B, d.H, d.N, d.D), F32, "cat")
        f.hold("merger._out", f"step {i}: out, whole")
        f.drop(f"step {i}: out, whole")
    else:
        f.hold("merger._out", merged)
        f.hold("merger._lse", lse)
    f.drop(merged, lse, block)


def forward(ring: Ring) -> list:
    """``_templated_ring_attention`` then ``_SDPAMerger.results``: the output in q's dtype
    and the merged logsumexp, which the node saves with one step's philox tensors (the last
    step's; the first step's from torch 2.14)."""
    d, f = ring.d, Frame()
    for i in range(ring.P):
        rotate_forward(f, ring, i)
        kernel_forward(f, ring, i)
        merge(f, ring, i)
    out = f.bound["merger._out"][0]  # merger._out.to(q's dtype): itself when float32
    if d.dtype != F32:
        out = f.new("out", (d.B, d.H, d.N, d.D), d.dtype, "_to_copy")
    rest = "saved_rest" if ring.torch >= FIRST_STEP_REST else "rest"
    saved = (f.bound["merger._lse"][0], *f.bound[rest])
    f.hold("saved", *saved)
    f.hold("output", out)
    f.drop(*[v for v in list(f.bound) if v not in ("saved", "output")])
    f.flush()
    return roled(roled(f.events, saved, S), (out,), O) + [free(*saved)]


# --- the backward ------------------------------------------------------------------------

def rotate_backward(f: Frame, ring: Ring, i: int) -> None:
    """The K/V of step ``i`` again (``kv_rotater``, the forward's method); the cat sent on
    stays bound to ``next_kv`` until the next step's replaces it."""
    if i > 0:
        buffer = next_buffer(f, ring, i)
        f.hold("buffer", buffer)
        f.hold("key", buffer)
        f.hold("value", buffer)
    if i != ring.P - 1:
        cat = f.new(f"step {i}: cat K/V", (ring.kv,), ring.d.dtype, "cat")
        f.hold("next_kv", cat)
        f.drop(cat)
        exchange(f, ring, i, cat)


def kernel_backward(f: Frame, ring: Ring, i: int) -> None:
    """``grad_query_, grad_key_, grad_value_ = op(...)``: the kernel's backward on the
    step's rows; a partial step reads the second half of the logsumexp made contiguous."""
    d, (nq, _, partial) = ring.step_dims(i), ring.rows(i)
    # q, k, v, out_, dout, lse = (...): the tuple is made (a partial step's lse made
    # contiguous, (B, H, n/2)), then bound left to right
    half = f.new(f"step {i}: lse half", (d.B, d.H, nq), F32, "clone") if partial else None
    step_kv(f, i)
    if half:
        f.hold("lse", half)
        f.drop(half)
    else:
        f.drop("lse")  # lse = logsumexp, the saved one
    events = kernel_backward_events(ring, d, nq)
    grads = tuple(f"step {i}: {n}" for n in ("dq", "dk", "dv"))
    f.kernel(prefixed(events, f"step {i}: "), grads)
    for variable, grad in zip(("grad_query_", "grad_key_", "grad_value_"), grads):
        f.hold(variable, grad)
    f.drop(*grads)


def transposed_contiguous(d: Dims, rows: int) -> bool:
    """Whether ``rows`` of a (B, H, n, D)-contiguous tensor (all, or its second chunk),
    transposed to (B, rows, H, D), is contiguous: ``_flash_attention_backward`` copies it
    otherwise (strides (H n D, D, n D, 1) against (rows H D, H D, D, 1), sizes 1 aside)."""
    heads_ok = d.H == 1 or rows == 1 and d.N == 1
    return heads_ok and (d.B == 1 or rows == d.N)


def accumulate(f: Frame, ring: Ring, i: int) -> None:
    """dK/dV: from step 1 on, the running sums arrive from the previous rank (the wait
    unstashes what was sent); a step on half the K/V adds into the first half by
    ``_partial_update`` (a cat); then their cat is sent on. dQ: added in place, or by
    ``_partial_update`` into the second half on a partial step."""
    d, (_, _, partial) = ring.d, ring.rows(i)
    kv = (d.B, d.Hk, d.N, d.D)  # (B, Hk, n, D)
    if i > 0:
        received = f"dK/dV from rank {(ring.rank - i) % ring.P}"
        f.drop(f"dkv stash {i - 1}")
        f.hold("next_grad_kv", received)
        f.hold("grad_key", received)
        f.hold("grad_value", received)
        if i <= ring.rank:
            f.hold("grad_key", f.new(f"step {i}: grad_key", kv, F32, "cat"))
            f.drop(f"step {i}: grad_key")
            f.hold("grad_value", f.new(f"step {i}: grad_value", kv, F32, "cat"))
            f.drop(f"step {i}: grad_value")
    cat = f.new(f"step {i}: cat dK/dV", (ring.kv,), F32, "cat")
    f.hold("next_grad_kv", cat)
    f.drop(cat)
    sent = f"dK/dV from rank {(ring.rank - i - 1) % ring.P}"
    f.new(sent, (ring.kv,), F32, "all_to_all_single")
    f.hold("dkv_rotater._buffer", sent)
    f.drop(sent)
    stashed(f, ring, f"dkv stash {i}", cat)
    if partial:
        f.hold("grad_query", f.new(f"step {i}: grad_query", (d.B, d.H, d.N, d.D), F32, "cat"))
        f.drop(f"step {i}: grad_query")


def backward(ring: Ring, saved: tuple[str, ...]) -> list:
    """``_templated_ring_attention_backward``: float32 accumulators, the steps, then the
    grads in q's dtype: dq made whole, dK/dV received from the last rank and converted,
    k's and v's grads views of it (``AccumulateGrad`` keeps them as they are); autograd
    then releases what the forward ``saved``."""
    d, f = ring.d, Frame()
    q, kv = (d.B, d.H, d.N, d.D), (d.B, d.Hk, d.N, d.D)
    for variable, shape in (("grad_query", q), ("grad_key", kv), ("grad_value", kv)):
        f.new(f"{variable} (float32)", shape, F32, "zeros_like")  # zeros_like(..., float32)
        f.hold(variable, f"{variable} (float32)")
        f.drop(f"{variable} (float32)")
    for i in range(ring.P):
        rotate_backward(f, ring, i)
        kernel_backward(f, ring, i)
        accumulate(f, ring, i)
    grads = converted_grads(f, ring)
    f.hold("grads", *grads)
    f.drop(*[v for v in list(f.bound) if v != "grads"])
    f.flush()
    return roled(f.events, grads, G) + [release(*saved)]


def converted_grads(f: Frame, ring: Ring) -> tuple[str, str]:
    """``grad_query.to(query.dtype)`` and ``dkv_rotater.next_buffer().to(key.dtype)`` (the
    wait unstashes the last dK/dV sent): q's grad and the buffer k's and v's are views of;
    in float32 the accumulator and the received buffer themselves."""
    d = ring.d
    received = f.bound["dkv_rotater._buffer"][0]
    f.drop(f"dkv stash {ring.P - 1}")
    if d.dtype == F32:
        return f.bound["grad_query"][0], received
    f.hold("grad_query", f.new("q.grad", (d.B, d.H, d.N, d.D), d.dtype, "_to_copy"))
    f.hold("next_grad_kv", f.new("k.grad, v.grad", (ring.kv,), d.dtype, "_to_copy"))
    return "q.grad", "k.grad, v.grad"


def refusal(impl: str, user_code: bool, cp: int, method: str, causal: bool, shape,
            tp: int = 1) -> str:
    """Why ``cp`` ranks cannot run this step as modelled (one line naming the option), or
    ""; ``shape`` is the whole sequence's (``memcalc.config.Shape``), over ``tp``
    tensor-parallel ranks; ``user_code``: a user's function, whose SDPA calls run torch's
    own ring attention (``trace --cp``), or whose own code makes DeepSpeed-Ulysses'
    all-to-alls."""
    if cp == 1:
        return ""
    from memcalc.impls import ulysses

    if method == "ulysses":
        refused = ulysses.refusal(impl, user_code, cp, shape, tp)
    else:
        refused = _ring_refusal(impl, user_code, cp, causal, shape)
    return refused or _shape_refusal(shape, padded=not user_code
                                     and impl not in ulysses.WRITTEN_OUT)


def _ring_refusal(impl: str, user_code: bool, cp: int, causal: bool, shape) -> str:
    if impl not in KERNELS and not user_code:
        return (f"cp: context parallelism is modelled over {', '.join(KERNELS)} (the kernels "
                f"PyTorch's ring attention calls at each step), not {impl}")
    if not causal and not user_code:
        return ("cp: PyTorch's context parallelism balances the load of causal attention "
                "only (torch 2.13: \"Load balancing requires `is_causal=True`\"); add --causal")
    rule = context_parallel(cp, "seq_len", "" if user_code else impl)
    if not rule.accepts(shape.seq_len):
        return (f"seq_len: under {cp} ranks N is a multiple of {rule.step // cp} x {cp} = "
                f"{rule.step}: {rule.step_source} (got N = {shape.seq_len:,})")
    return ""


def _shape_refusal(shape, padded: bool) -> str:
    """What either method leaves out: keys of another length, head dims the SDPA composite
    pads (``padded``: the model runs a fused kernel, not the math path nor a user's code)."""
    if shape.kv_len not in (None, shape.seq_len):
        return "kv_len: under context parallelism the keys are the queries' rows (no --kv-len)"
    if padded and shape.head_dim % 8:
        return ("head_dim: under context parallelism a multiple of 8 with a fused kernel (the "
                "padding to 8 the SDPA composite makes is not modelled there; under ulysses the "
                f"math path and the naive family take any; got {shape.head_dim})")
    return ""


def program(d: Dims, kernel: str = "sdpa-flash", torch: tuple[int, int] | None = None,
            stash: bool = True):
    """Rank ``d.cp_rank``'s step of ``d.cp`` under context parallelism over ``kernel``;
    ``d`` holds the rank's own rows. ``torch``: the release whose ring code runs (default:
    the installed one, as for the SDPA rules); ``stash``: ``Ring``'s."""
    from memcalc.engine.program import Program
    from memcalc.impls.common import with_loss
    from memcalc.impls.sdpa import installed_release

    torch = torch or installed_release().torch[:2]
    ring = Ring(d, d.cp, d.cp_rank, d.cp_method, kernel, torch, stash)
    events = forward(ring)  # ends with the free of what the node saves
    return Program(tuple(events), tuple(with_loss(d, backward(ring, events[-1].names))))


def step_program(impl, d: Dims):
    """The program of ``impl``'s step at ``d``: one GPU's, or one rank's under ``--cp``
    (the kernel's own checks first: its one-GPU program at the rank's sizes)."""
    if d.cp == 1 or impl.user_code:
        return impl.program(d)
    if d.cp_method == "ulysses":
        from memcalc.impls import ulysses

        impl.program(ulysses.Ulysses(d, d.cp).local)
        return ulysses.program(d, impl.name)
    impl.program(d)
    return program(d, impl.name)
