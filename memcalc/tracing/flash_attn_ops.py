"""The flash-attn packages' custom ops in a trace, run as memcalc's models of their kernels.

flash-attn 2.8.3 (``flash_attn/flash_attn_interface.py``) and FlashAttention-3 (``hopper/``
at ``0251105a``) declare their CUDA kernels as PyTorch custom ops (``torch.library.
custom_op``): ``flash_attn::_flash_attn_forward``, ``_flash_attn_backward`` and their varlen
twins, ``flash_attn_3::_flash_attn_forward`` and ``_flash_attn_backward``. Their Python
``autograd.Function`` calls them, so a ``TorchDispatchMode`` (a selective-checkpoint policy,
PyTorch's memory trackers) sees each call as that op. While a trace runs (``defined``) the
ops exist with the packages' schemas (the packages' own where one is imported), and the
tracer hands each call to ``OPS`` here, which replays the model of ``mha_fwd`` / ``mha_bwd``
(``memcalc/impls/flash_attn.py``, ``flash_attn3.py``) and returns the op's real outputs.
What the Functions do around the ops (padding, the grads they allocate, what they save) is
traced as it runs (``memcalc/tracing/flash_attn.py``).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

from memcalc.engine.program import Dims
from memcalc.impls import flash_attn as fa2
from memcalc.impls import flash_attn3 as fa3
from memcalc.tracing.kernels import Kernel, empty_like, meta_copies, needs_grad, sized

FA2, FA3 = "flash-attn", "flash-attn3"

# the ops' schemas, as torch.library.infer_schema writes them from the packages' signatures
# (flash_attn_interface.py v2.8.3 L76-437; hopper/flash_attn_interface.py 0251105a L59-283)
SCHEMAS = {
    "flash_attn::_flash_attn_forward":
        "(Tensor q, Tensor k, Tensor v, float dropout_p, float softmax_scale, bool causal, "
        "SymInt window_size_left, SymInt window_size_right, float softcap, "
        "Tensor? alibi_slopes, bool return_softmax) -> (Tensor, Tensor, Tensor, Tensor)",
    "flash_attn::_flash_attn_varlen_forward":
        "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
        "SymInt max_seqlen_q, SymInt max_seqlen_k, float dropout_p, float softmax_scale, "
        "bool causal, SymInt window_size_left=-1, SymInt window_size_right=-1, "
        "float softcap=0.0, Tensor? alibi_slopes=None, bool return_softmax=False, "
        "Tensor? block_table=None, Tensor? leftpad_k=None, Tensor? seqused_k=None, "
        "bool zero_tensors=False) -> (Tensor, Tensor, Tensor, Tensor)",
    "flash_attn::_flash_attn_backward":
        "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, "
        "Tensor(a6!)? dq, Tensor(a7!)? dk, Tensor(a8!)? dv, float dropout_p, "
        "float softmax_scale, bool causal, SymInt window_size_left, "
        "SymInt window_size_right, float softcap, Tensor? alibi_slopes, bool deterministic, "
        "Tensor? rng_state=None) -> Tensor",
    "flash_attn::_flash_attn_varlen_backward":
        "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, "
        "Tensor(a6!)? dq, Tensor(a7!)? dk, Tensor(a8!)? dv, Tensor cu_seqlens_q, "
        "Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float dropout_p, "
        "float softmax_scale, bool causal, SymInt window_size_left, "
        "SymInt window_size_right, float softcap, Tensor? alibi_slopes, bool deterministic, "
        "Tensor? rng_state=None, bool zero_tensors=False) -> Tensor",
    "flash_attn_3::_flash_attn_forward":
        "(Tensor q, Tensor k, Tensor v, Tensor? k_new=None, Tensor? v_new=None, "
        "Tensor? qv=None, Tensor? out_=None, Tensor? cu_seqlens_q=None, "
        "Tensor? cu_seqlens_k=None, Tensor? cu_seqlens_k_new=None, Tensor? seqused_q=None, "
        "Tensor? seqused_k=None, SymInt? max_seqlen_q=None, SymInt? max_seqlen_k=None, "
        "Tensor? page_table=None, Tensor? kv_batch_idx=None, Tensor? leftpad_k=None, "
        "Tensor? rotary_cos=None, Tensor? rotary_sin=None, Tensor? seqlens_rotary=None, "
        "Tensor? q_descale=None, Tensor? k_descale=None, Tensor? v_descale=None, "
        "float? softmax_scale=None, bool causal=False, SymInt window_size_left=-1, "
        "SymInt window_size_right=-1, SymInt attention_chunk=0, float softcap=0.0, "
        "bool rotary_interleaved=True, Tensor? scheduler_metadata=None, "
        "SymInt num_splits=1, bool? pack_gqa=None, SymInt sm_margin=0) "
        "-> (Tensor, Tensor, Tensor, Tensor)",
    "flash_attn_3::_flash_attn_backward":
        "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, "
        "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, Tensor? sequed_q=None, "
        "Tensor? sequed_k=None, SymInt? max_seqlen_q=None, SymInt? max_seqlen_k=None, "
        "Tensor(a12!)? dq=None, Tensor(a13!)? dk=None, Tensor(a14!)? dv=None, "
        "float? softmax_scale=None, bool is_causal=False, SymInt window_size_left=-1, "
        "SymInt window_size_right=-1, float softcap=0.0, bool deterministic=False, "
        "SymInt sm_margin=0) -> Tensor",
}


def op(name: str):
    """The op ``name`` (``"flash_attn::_flash_attn_forward"``) as ``torch.ops`` holds it."""
    namespace, short = name.split("::")
    return getattr(getattr(torch.ops, namespace), short).default


def _exists(name: str) -> bool:
    try:
        op(name)
    except (AttributeError, RuntimeError):
        return False
    return True


@contextmanager
def defined():
    """Inside, the ops exist: the packages' own where they are imported, else defined here
    (with no kernel: only a trace runs them) and removed after, so that a package imported
    later in the same process can define its own."""
    with ExitStack() as stack:
        libraries = {}
        for name, schema in SCHEMAS.items():
            namespace, short = name.split("::")
            if _exists(name):
                continue
            if namespace not in libraries:
                libraries[namespace] = torch.library.Library(namespace, "FRAGMENT")
                stack.callback(libraries[namespace]._destroy)
            libraries[namespace].define(short + schema)
        yield


def arguments(name: str, args: tuple, kwargs: dict) -> dict:
    """A call's arguments by name, with the schema's defaults for those not given."""
    schema = torch._C.parse_schema(name + SCHEMAS[name])
    given = dict(zip((a.name for a in schema.arguments), args), **kwargs)
    return {a.name: given.get(a.name, a.default_value) for a in schema.arguments}


@dataclass
class Op(Kernel):
    """One call of a package's op on the tensors it gets (padded already, by its Function):
    the model's ``mha_fwd`` or ``mha_bwd`` events, every tensor made returned, not kept."""

    op: bool = True

    def mha_fwd(self) -> tuple:
        """The output, softmax_lse and the last two outputs: FA2's debug mask (empty) and
        rng_state, FA3's split accumulators (``torch.tensor([])``: none at num_splits=1)."""
        events = fa2.mha_fwd(self.d) if self.backend == FA2 else fa3.mha_fwd(self.d)
        self.replay(events, {"out": lambda: empty_like(self.q)}, True)
        out, lse = self.live.pop("out"), self.live.pop("lse")
        if self.backend == FA2:
            return out, lse, _empty(self.q.dtype), self.live.pop("rng_state")
        return out, lse, _empty(torch.float32), _empty(torch.float32)

    def mha_bwd(self, dout: torch.Tensor) -> torch.Tensor:
        """Into the grads the Function gave; returns softmax_d."""
        copy = dout.stride(-1) != 1  # maybe_contiguous
        events = fa2.mha_bwd(self.d, copy) if self.backend == FA2 else fa3.mha_bwd(self.d, copy)
        self.replay(events, {}, True)
        return self.live.pop("softmax_d")


def _empty(dtype) -> torch.Tensor:
    """``torch.empty((0,))``: an output the call does not fill (0 bytes, no block)."""
    return torch.empty(0, dtype=dtype, device="meta")


def dims_of(q, k, causal: bool, deterministic: bool, gpu, varlen: int = 0) -> Dims:
    """The model's sizes for a call on ``(B, N, H, D)`` tensors, or on ``(total, H, D)``
    ones holding ``varlen`` sequences (B = 1, N and M the totals), on the emulated GPU."""
    def heads_first(t):  # (B, N, H, D) -> (B, H, N, D); (total, H, D) -> (1, H, total, D)
        b, n, h, dim = (1, *t.shape) if varlen else t.shape
        return (b, h, n, dim)

    d = sized(heads_first(q), heads_first(k), str(q.dtype).removeprefix("torch."), causal,
              needs_grad(q, k), gpu, deterministic)
    return d.replace(varlen=varlen)


def _call(paths, backend: str, a: dict, varlen: bool = False) -> Op:
    """The model of one call on ``a``'s q, k, v (``(B, N, H, D)``, or ``(total, H, D)``
    holding ``cu_seqlens_q.numel() - 1`` sequences), on the emulated GPU."""
    causal = a["causal"] if "causal" in a else a["is_causal"]
    d = dims_of(a["q"], a["k"], causal, a.get("deterministic") or False, paths.gpu,
                a["cu_seqlens_q"].numel() - 1 if varlen else 0)
    paths.kernels[backend] = None
    return Op(backend, d, None, paths, *meta_copies(paths.tracer, (a["q"], a["k"], a["v"])))


def forward_kernel(name: str, backend: str, varlen: bool = False):
    """What the tracer runs for a forward op: ``mha_fwd``'s model."""
    def run(paths, *args, **kwargs):
        return _call(paths, backend, arguments(name, args, kwargs), varlen).mha_fwd()
    return run


def backward_kernel(name: str, backend: str, varlen: bool = False):
    """What the tracer runs for a backward op: ``mha_bwd``'s model."""
    def run(paths, *args, **kwargs):
        a = arguments(name, args, kwargs)
        return _call(paths, backend, a, varlen).mha_bwd(a["dout"])
    return run


# what the tracer runs for each op (``CudaPaths.kernel``), by its qualified name
OPS = {name: (forward_kernel if name.endswith("forward") else backward_kernel)(
    name, FA3 if name.startswith("flash_attn_3") else FA2, "varlen" in name)
    for name in SCHEMAS}
