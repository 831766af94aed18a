"""The flash-attn packages in a trace: ``flash_attn.flash_attn_func`` (FlashAttention-2) and
``flash_attn_interface.flash_attn_func`` (FlashAttention-3, Hopper), run as memcalc's models
of them (``memcalc/impls/flash_attn.py``, ``flash_attn3.py``).

Their CUDA extensions cannot run on the meta device, nor be imported without CUDA, so while
a user's file is imported for a trace (``stand_ins``), ``import flash_attn`` and ``import
flash_attn_interface`` give stand-in modules, whatever is installed: a stand-in's function
hands its call to the trace's CUDA rules (``memcalc.tracing.cuda_paths``), which replay the
model's events into the tracer's ledger (``kernels.Kernel.replay``), as for a fused SDPA
backend. Its node is an ``autograd.Function`` that saves what ``FlashAttnFunc`` saves; what
autograd does around it (``AccumulateGrad`` of the returned grads) runs as it runs.
"""

from __future__ import annotations

import sys
import types
from importlib.machinery import ModuleSpec
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from memcalc.engine.program import Dims
from memcalc.impls import flash_attn as fa2
from memcalc.impls import flash_attn3 as fa3
from memcalc.impls.sdpa_flash import head_dims
from memcalc.tracing.cuda_paths import active_paths, rule
from memcalc.tracing.errors import NotModelled
from memcalc.tracing.kernels import (Kernel, empty_like, launch, meta_copies, needs_grad,
                                     node, sized)

FA2, FA3 = "flash-attn", "flash-attn3"


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """flash-attn 2.x ``flash_attn_func``, for a trace (the signature of v2.8.3)."""
    paths = active_paths("flash_attn.flash_attn_func")
    return flash_attn_rule(paths, flash_attn_func, (q, k, v), dict(
        dropout_p=dropout_p, causal=causal, deterministic=deterministic,
        return_attn_probs=return_attn_probs))


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """flash-attn 2.x ``flash_attn_qkvpacked_func`` on qkv (B, N, 3, H, D), for a trace."""
    paths = active_paths("flash_attn.flash_attn_qkvpacked_func")
    return flash_attn_rule(paths, flash_attn_qkvpacked_func, (qkv,), dict(
        dropout_p=dropout_p, causal=causal, deterministic=deterministic,
        return_attn_probs=return_attn_probs))


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """flash-attn 2.x ``flash_attn_kvpacked_func`` on q (B, N, H, D) and kv (B, M, 2, Hk, D),
    for a trace."""
    paths = active_paths("flash_attn.flash_attn_kvpacked_func")
    return flash_attn_rule(paths, flash_attn_kvpacked_func, (q, kv), dict(
        dropout_p=dropout_p, causal=causal, deterministic=deterministic,
        return_attn_probs=return_attn_probs))


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):
    """flash-attn 2.x ``flash_attn_varlen_func`` on q (total_q, H, D) and k, v (total_k, Hk,
    D) holding ``cu_seqlens_q.numel() - 1`` sequences, for a trace."""
    paths = active_paths("flash_attn.flash_attn_varlen_func")
    return flash_attn_varlen_rule(paths, flash_attn_varlen_func, (q, k, v), dict(
        cu_seqlens=(cu_seqlens_q, cu_seqlens_k), max_seqlen_q=max_seqlen_q, dropout_p=dropout_p,
        causal=causal, deterministic=deterministic, return_attn_probs=return_attn_probs,
        block_table=block_table))


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash-attn 2.x ``flash_attn_varlen_qkvpacked_func`` on qkv (total, 3, H, D)."""
    paths = active_paths("flash_attn.flash_attn_varlen_qkvpacked_func")
    return flash_attn_varlen_rule(paths, flash_attn_varlen_qkvpacked_func, (qkv,), dict(
        cu_seqlens=(cu_seqlens,), max_seqlen_q=max_seqlen, dropout_p=dropout_p, causal=causal,
        deterministic=deterministic, return_attn_probs=return_attn_probs))


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False):
    """flash-attn 2.x ``flash_attn_varlen_kvpacked_func`` on q (total_q, H, D) and kv
    (total_k, 2, Hk, D)."""
    paths = active_paths("flash_attn.flash_attn_varlen_kvpacked_func")
    return flash_attn_varlen_rule(paths, flash_attn_varlen_kvpacked_func, (q, kv), dict(
        cu_seqlens=(cu_seqlens_q, cu_seqlens_k), max_seqlen_q=max_seqlen_q,
        dropout_p=dropout_p, causal=causal, deterministic=deterministic,
        return_attn_probs=return_attn_probs))


def flash_attn3_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None,
                     k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0,
                     softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False,
                     sm_margin=0, return_attn_probs=False):
    """FlashAttention-3 ``flash_attn_interface.flash_attn_func``, for a trace."""
    paths = active_paths("flash_attn_interface.flash_attn_func")
    return flash_attn3_rule(paths, flash_attn3_func, (q, k, v), dict(
        causal=causal, qv=qv, window_size=window_size, attention_chunk=attention_chunk,
        softcap=softcap, num_splits=num_splits, deterministic=deterministic,
        return_attn_probs=return_attn_probs))


def _not_modelled(package: str, name: str):
    def refuse(*args, **kwargs):
        raise NotModelled(f"{package}.{name}: not modelled yet; flash_attn_func on (B, N, H, D) "
                          f"tensors is")
    refuse.__name__ = name
    return refuse


def _modules() -> dict[str, types.ModuleType]:
    """``flash_attn`` (with its ``flash_attn_interface`` submodule) and FA3's top-level
    ``flash_attn_interface``."""
    fa2_module = types.ModuleType("flash_attn")
    fa2_module.__path__ = []  # a package: ``flash_attn.flash_attn_interface`` imports
    fa2_module.__version__ = "2.8.3 (memcalc's model)"
    inner = types.ModuleType("flash_attn.flash_attn_interface")
    for module in (fa2_module, inner):
        module.flash_attn_func = flash_attn_func
        module.flash_attn_qkvpacked_func = flash_attn_qkvpacked_func
        module.flash_attn_kvpacked_func = flash_attn_kvpacked_func
        module.flash_attn_varlen_func = flash_attn_varlen_func
        module.flash_attn_varlen_qkvpacked_func = flash_attn_varlen_qkvpacked_func
        module.flash_attn_varlen_kvpacked_func = flash_attn_varlen_kvpacked_func
        module.flash_attn_with_kvcache = _not_modelled("flash_attn", "flash_attn_with_kvcache")
    fa2_module.flash_attn_interface = inner
    fa3_module = types.ModuleType("flash_attn_interface")
    fa3_module.flash_attn_func = flash_attn3_func
    for name in ("flash_attn_qkvpacked_func", "flash_attn_varlen_func",
                 "flash_attn_with_kvcache"):
        setattr(fa3_module, name, _not_modelled("flash_attn_interface", name))
    modules = {"flash_attn": fa2_module, "flash_attn.flash_attn_interface": inner,
               "flash_attn_interface": fa3_module}
    for name, module in modules.items():  # what importlib.util.find_spec reads of them
        module.__spec__ = ModuleSpec(name, None, is_package=name == "flash_attn")
    return modules


@contextmanager
def stand_ins():
    """Inside, ``import flash_attn`` / ``flash_attn_interface`` give the stand-ins (the
    modules they replace are put back after)."""
    modules = _modules()
    before = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name, module in before.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


# --- the calls, as the trace's CUDA rules run them -----------------------------------------

def dims_of(q, k, causal: bool, deterministic: bool, gpu, varlen: int = 0) -> Dims:
    """The model's sizes for a call on ``(B, N, H, D)`` tensors, or on ``(total, H, D)``
    ones holding ``varlen`` sequences (B = 1, N and M the totals), on the emulated GPU."""
    def heads_first(t):  # (B, N, H, D) -> (B, H, N, D); (total, H, D) -> (1, H, total, D)
        b, n, h, dim = (1, *t.shape) if varlen else t.shape
        return (b, h, n, dim)

    d = sized(heads_first(q), heads_first(k), str(q.dtype).removeprefix("torch."), causal,
              needs_grad(q, k), gpu, deterministic)
    return d.replace(varlen=varlen)


@dataclass
class Run(Kernel):
    """One call: the model's forward and the backward of its node, with the real tensors it
    hands out (the output, the grads) made with the strides the kernel gives them;
    ``packed``: ``qkv`` or ``kv`` for the packed functions (their grads: ``fa2.grads``)."""

    packed: str = ""

    def forward(self) -> torch.Tensor:
        d, grad = self.d, not self.d.forward_only
        padded, _ = head_dims(d)
        self.padded = self.backend == FA2 and padded != d.D
        shape = (*self.q.shape[:-1], padded)  # q's, padded: ([B,] N, H, dp)
        make = (lambda: torch.empty(shape, dtype=self.q.dtype, device="meta")) \
            if self.padded else (lambda: empty_like(self.q))  # empty_like(q): q's strides
        events = fa2.forward(d) if self.backend == FA2 else fa3.forward(d)
        self.replay(events, {"out": make}, grad)
        out = self.live.pop("out")
        if self.padded:
            self.kept["out"] = out  # saved as out_padded; the caller gets its slice
            return out[..., : d.D]
        return out

    def backward(self, grad_out: torch.Tensor) -> tuple:
        d, copy = self.d, grad_out.stride(-1) != 1  # maybe_contiguous
        events = fa2.node_backward(d, copy, self.packed) if self.backend == FA2 else \
            fa3.node_backward(d, copy)
        padded, _ = head_dims(d)  # empty_like of the saved q, k, v: the padded copies'
        real = {n: (lambda t=t: torch.empty((*t.shape[:-1], padded), dtype=t.dtype, device="meta"))
                if self.padded else (lambda t=t: empty_like(t))
                for n, t in zip(("dq", "dk", "dv"), (self.q, self.k, self.v))}
        self.replay(events, real, True)
        self.kept.clear()
        names = [t.name for t in fa2.grads(d, self.packed)] if self.backend == FA2 else \
            ["dq", "dk", "dv"]
        grads = tuple(self.live.pop(n) for n in names)
        return tuple(g[..., : d.D] for g in grads) if self.padded else grads


# the packages' Functions: save q, k, v (views of a packed input; or their padded copies)
# and the output
NODES = {FA2: node("FlashAttnFunc"), FA3: node("FlashAttn3Func"),
         "qkv": node("FlashAttnQKVPackedFunc"), "kv": node("FlashAttnKVPackedFunc"),
         "varlen": node("FlashAttnVarlenFunc"), "varlen qkv": node("FlashAttnVarlenQKVPackedFunc"),
         "varlen kv": node("FlashAttnVarlenKVPackedFunc")}


def run(paths, backend: str, inputs: tuple, d: Dims, kept: tuple = ()) -> torch.Tensor:
    """Run ``backend``'s model on the call's inputs: ``(q, k, v)``, or a packed ``(qkv,)``
    ([B,] N, 3, H, D) or ``(q, kv)`` with kv ([B,] M, 2, Hk, D), read through their
    slices; ``kept``: what else the node saves (the varlen functions' cu_seqlens)."""
    packed = {1: "qkv", 2: "kv", 3: ""}[len(inputs)]
    q, k, v = unpacked(inputs)
    paths.kernels[backend] = None
    call = Run(backend, d, None, paths, *meta_copies(paths.tracer, (q, k, v)),
               inputs=len(inputs), packed=packed)
    function = " ".join(w for w in ("varlen" if d.varlen else "", packed) if w) or backend
    return launch(call, NODES[function], not d.forward_only, *inputs, *kept)


def unpacked(inputs: tuple) -> tuple:
    """q, k, v of a call: given, or the slices of a packed qkv (``qkv[:, :, 0]`` ...; the
    varlen functions' ``qkv[:, 0]``: the pack is the third dim from the end either way) or
    kv as the packed Functions take them (views: nothing copied)."""
    if len(inputs) == 1:
        return tuple(inputs[0][..., i, :, :] for i in range(3))
    if len(inputs) == 2:
        return (inputs[0], inputs[1][..., 0, :, :], inputs[1][..., 1, :, :])
    return inputs


def _flags(where: str, dropout=0.0, probs=False, **more):
    """The arguments the models do not cover: one line each (``where``: the function)."""
    refused = {"dropout_p > 0 (its split-KV and RNG paths)": dropout > 0,
               "return_attn_probs": probs, **more}
    for what, given in refused.items():
        if given:
            raise NotModelled(f"{where}: {what} is not modelled")


@rule("flash_attn_func", "flash_attn/flash_attn_interface.py FlashAttnFunc, "
      "csrc/flash_attn/flash_api.cpp (v2.8.3)", "flash-attn's flash_attn_func allocates what "
      "memcalc's flash-attn model declares")
def flash_attn_rule(paths, func, args, kwargs):
    q, k, v = unpacked(args)
    _flags(f"flash_attn.{func.__name__}", kwargs.get("dropout_p", 0.0),
           probs=kwargs.get("return_attn_probs"))
    return _run_fa2(paths, func, args, kwargs, q, k)


@rule("flash_attn_varlen_func", "flash_attn/flash_attn_interface.py FlashAttnVarlenFunc, "
      "csrc/flash_attn/flash_api.cpp mha_varlen_fwd/_bwd (v2.8.3)", "flash-attn's "
      "flash_attn_varlen_func allocates what memcalc's flash-attn model declares for "
      "packed sequences")
def flash_attn_varlen_rule(paths, func, args, kwargs):
    q, k, v = unpacked(args)
    cu_seqlens, where = kwargs["cu_seqlens"], f"flash_attn.{func.__name__}"
    sequences = cu_seqlens[0].numel() - 1  # mha_varlen_fwd: batch_size
    _flags(where, kwargs.get("dropout_p", 0.0), kwargs.get("return_attn_probs"), **{
        "block_table (a paged KV cache)": kwargs.get("block_table") is not None,
        "max_seqlen_q = 1 with grouped heads (decoding: q regrouped, split-KV)":
            kwargs["max_seqlen_q"] == 1 and q.shape[-2] != k.shape[-2]})
    if q.dim() != 3 or sequences < 1:
        raise NotModelled(f"{where}: q must be (total, heads, head_dim) and cu_seqlens hold "
                          f"at least 2 offsets, not q {tuple(q.shape)} and "
                          f"{cu_seqlens[0].numel()} offsets")
    return _run_fa2(paths, func, args, kwargs, q, k, sequences, tuple(cu_seqlens))


def _run_fa2(paths, func, args, kwargs, q, k, sequences: int = 0, kept: tuple = ()):
    """A flash-attn 2 call as the model runs it: its sizes (``sequences`` packed, for the
    varlen functions), the kernel's checks, a note, the run."""
    d = dims_of(q, k, kwargs.get("causal", False), kwargs.get("deterministic", False),
                paths.gpu, sequences)
    fa2.check(d, FA2)
    packed = f", {sequences} sequences" if sequences else ""
    paths.note(f"{func.__name__} {tuple(args[0].shape)} {d.dtype}{packed}"
               f"{' causal' if d.causal else ''}: memcalc's flash-attn model (flash-attn 2.8.3)")
    return run(paths, FA2, tuple(args), d, kept)


@rule("flash_attn3_func", "hopper/flash_attn_interface.py FlashAttnFunc, hopper/flash_api.cpp",
      "FlashAttention-3's flash_attn_func allocates what memcalc's flash-attn3 model declares")
def flash_attn3_rule(paths, func, args, kwargs):
    q, k, v = args[:3]
    _flags("flash_attn_interface.flash_attn_func", probs=kwargs.get("return_attn_probs"), **{
        "a local window_size": tuple(kwargs.get("window_size", (-1, -1))) != (-1, -1),
        "softcap": kwargs.get("softcap", 0.0) != 0.0,
        "num_splits other than 1": kwargs.get("num_splits", 1) != 1,
        "qv": kwargs.get("qv") is not None,
        "attention_chunk": kwargs.get("attention_chunk", 0) != 0})
    d = dims_of(q, k, kwargs.get("causal", False), kwargs.get("deterministic", False), paths.gpu)
    fa3.check(d)
    paths.note(f"flash_attn_interface.flash_attn_func {tuple(q.shape)} {d.dtype}"
               f"{' causal' if d.causal else ''}: memcalc's flash-attn3 model")
    return run(paths, FA3, (q, k, v), d)
