"""The flash-attn packages in a trace: ``flash_attn.flash_attn_func`` (FlashAttention-2, its
packed and varlen twins) and ``flash_attn_interface.flash_attn_func`` (FlashAttention-3,
Hopper), as the packages run them.

Their CUDA extensions cannot run on the meta device, nor be imported without CUDA, so while
a user's file is imported and traced (``stand_ins``), ``import flash_attn`` and ``import
flash_attn_interface`` give stand-in modules, whatever is installed. A stand-in function
checks what memcalc's models cover and calls an ``autograd.Function`` that does what the
package's does (``FlashAttnFunction``): pads q, k, v, calls the package's custom op, saves
what it saves; its backward makes the grads and calls the backward op into them. Those
steps are ordinary torch ops, traced as they run; the ops themselves are
``flash_attn_ops``': the models of ``mha_fwd`` / ``mha_bwd`` (``memcalc/impls/
flash_attn.py``, ``flash_attn3.py``). So a checkpoint policy is asked about
``flash_attn::_flash_attn_forward`` and checkpointing drops what the Function saved, as on
a GPU.
"""

from __future__ import annotations

import sys
import types
from importlib.machinery import ModuleSpec
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from memcalc.impls import flash_attn as fa2
from memcalc.impls import flash_attn3 as fa3
from memcalc.tracing import flash_attn_ops as ops
from memcalc.tracing import hf_flash
from memcalc.tracing.cuda_paths import active_paths, rule
from memcalc.tracing.errors import NotModelled
from memcalc.tracing.flash_attn_ops import FA2, FA3, dims_of


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """flash-attn 2.x ``flash_attn_func``, for a trace (the signature of v2.8.3)."""
    paths = active_paths("flash_attn.flash_attn_func")
    return flash_attn_rule(paths, flash_attn_func, (q, k, v), dict(
        dropout_p=dropout_p, softmax_scale=softmax_scale, window_size=window_size,
        softcap=softcap, alibi_slopes=alibi_slopes, causal=causal, deterministic=deterministic,
        return_attn_probs=return_attn_probs))


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """flash-attn 2.x ``flash_attn_qkvpacked_func`` on qkv (B, N, 3, H, D), for a trace."""
    paths = active_paths("flash_attn.flash_attn_qkvpacked_func")
    return flash_attn_rule(paths, flash_attn_qkvpacked_func, (qkv,), dict(
        dropout_p=dropout_p, softmax_scale=softmax_scale, window_size=window_size,
        softcap=softcap, alibi_slopes=alibi_slopes, causal=causal, deterministic=deterministic,
        return_attn_probs=return_attn_probs))


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """flash-attn 2.x ``flash_attn_kvpacked_func`` on q (B, N, H, D) and kv (B, M, 2, Hk, D),
    for a trace."""
    paths = active_paths("flash_attn.flash_attn_kvpacked_func")
    return flash_attn_rule(paths, flash_attn_kvpacked_func, (q, kv), dict(
        dropout_p=dropout_p, softmax_scale=softmax_scale, window_size=window_size,
        softcap=softcap, alibi_slopes=alibi_slopes, causal=causal, deterministic=deterministic,
        return_attn_probs=return_attn_probs))


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):
    """flash-attn 2.x ``flash_attn_varlen_func`` on q (total_q, H, D) and k, v (total_k, Hk,
    D) holding ``cu_seqlens_q.numel() - 1`` sequences, for a trace."""
    paths = active_paths("flash_attn.flash_attn_varlen_func")
    return flash_attn_varlen_rule(paths, flash_attn_varlen_func, (q, k, v), dict(
        cu_seqlens=(cu_seqlens_q, cu_seqlens_k), max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        dropout_p=dropout_p, softmax_scale=softmax_scale, window_size=window_size,
        softcap=softcap, alibi_slopes=alibi_slopes,
        causal=causal, deterministic=deterministic, return_attn_probs=return_attn_probs,
        block_table=block_table))


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash-attn 2.x ``flash_attn_varlen_qkvpacked_func`` on qkv (total, 3, H, D)."""
    paths = active_paths("flash_attn.flash_attn_varlen_qkvpacked_func")
    return flash_attn_varlen_rule(paths, flash_attn_varlen_qkvpacked_func, (qkv,), dict(
        cu_seqlens=(cu_seqlens,), max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
        dropout_p=dropout_p, softmax_scale=softmax_scale, window_size=window_size,
        softcap=softcap, alibi_slopes=alibi_slopes, causal=causal,
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
        max_seqlen_k=max_seqlen_k, dropout_p=dropout_p, softmax_scale=softmax_scale, window_size=window_size,
        softcap=softcap, alibi_slopes=alibi_slopes, causal=causal, deterministic=deterministic,
        return_attn_probs=return_attn_probs))


def flash_attn3_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None,
                     k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0,
                     softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False,
                     sm_margin=0, return_attn_probs=False):
    """FlashAttention-3 ``flash_attn_interface.flash_attn_func``, for a trace."""
    paths = active_paths("flash_attn_interface.flash_attn_func")
    return flash_attn3_rule(paths, flash_attn3_func, (q, k, v), dict(
        softmax_scale=softmax_scale, causal=causal, qv=qv, window_size=window_size, attention_chunk=attention_chunk,
        softcap=softcap, num_splits=num_splits, deterministic=deterministic,
        return_attn_probs=return_attn_probs))


def _not_modelled(package: str, name: str):
    def refuse(*args, **kwargs):
        raise NotModelled(f"{package}.{name}: not modelled yet; flash_attn_func on (B, N, H, D) "
                          f"tensors is")
    refuse.__name__ = name
    return refuse


def _padded(name: str):
    """``flash_attn.bert_padding``'s (un)padding of a padded batch: refused in one line (the
    unpadded sizes depend on the mask's values, which the meta device does not hold)."""
    def refuse(*args, **kwargs):
        raise NotModelled(f"flash_attn.bert_padding.{name}: a padded batch under flash-attn "
                          f"(Hugging Face's flash_attention_2 with a padding mask) is not "
                          f"modelled; trace it without the mask, or with sdpa")
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
    padding = types.ModuleType("flash_attn.bert_padding")  # what transformers imports
    padding.pad_input, padding.unpad_input = _padded("pad_input"), _padded("unpad_input")
    fa2_module.bert_padding = padding
    fa3_module = types.ModuleType("flash_attn_interface")
    fa3_module.flash_attn_func = flash_attn3_func
    for name in ("flash_attn_qkvpacked_func", "flash_attn_varlen_func",
                 "flash_attn_with_kvcache"):
        setattr(fa3_module, name, _not_modelled("flash_attn_interface", name))
    modules = {"flash_attn": fa2_module, "flash_attn.flash_attn_interface": inner,
               "flash_attn.bert_padding": padding, "flash_attn_interface": fa3_module}
    for name, module in modules.items():  # what importlib.util.find_spec reads of them
        module.__spec__ = ModuleSpec(name, None, is_package=name == "flash_attn")
    return modules


@contextmanager
def stand_ins():
    """Inside, ``import flash_attn`` / ``flash_attn_interface`` give the stand-ins (the
    modules they replace are put back after), the packages' ops exist (``ops.defined``),
    and transformers' flash_attention_2 / _3 calls them (``hf_flash``)."""
    modules = _modules()
    before = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        with ops.defined(), hf_flash.stand_in():
            yield
    finally:
        for name, module in before.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


# --- the packages' Functions, around their ops -----------------------------------------------

@dataclass(frozen=True)
class Call:
    """One call of a package's Function: its backend, the packing of its inputs (``""``,
    ``"qkv"``: one ([B,] N, 3, H, D), ``"kv"``: q and one ([B,] M, 2, Hk, D)), how many
    sequences its varlen inputs hold (0: not varlen), the options its ops get, and whether
    autograd will want a backward (the Functions' ``is_grad``)."""

    backend: str
    packed: str
    varlen: int
    options: tuple  # (name, value) pairs: causal, dropout_p, deterministic, max_seqlen_q ...
    grad: bool

    @property
    def inputs(self) -> int:
        return {"qkv": 1, "kv": 2, "": 3}[self.packed]

    def option(self, name: str, default=None):
        return dict(self.options).get(name, default)


def pad8(t: torch.Tensor) -> torch.Tensor:
    """``F.pad`` of the last dim to a multiple of 8, as flash-attn 2's Functions pad q, k, v
    and the grad (FA3 needs a multiple of 8 already): ``t`` itself when it is one."""
    size = t.shape[-1]
    return t if size % 8 == 0 else torch.nn.functional.pad(t, [0, 8 - size % 8])


def forward_op(call: Call, q, k, v, cu_seqlens: tuple) -> tuple:
    """The package's forward op on the (padded) q, k, v: FA2's ``(out_padded, lse,
    S_dmask, rng_state)``, FA3's ``(out, lse, out_accum, lse_accum)``."""
    o = call.option
    if call.backend == FA3:
        return ops.op("flash_attn_3::_flash_attn_forward")(
            q, k, v, softmax_scale=o("softmax_scale"), causal=o("causal"), num_splits=1)
    if call.varlen:
        return ops.op("flash_attn::_flash_attn_varlen_forward")(
            q, k, v, *offsets(cu_seqlens), *fa2_options(call, "dropout_p", "softmax_scale",
                                                         "causal", "window", "alibi_slopes"),
            False)
    return ops.op("flash_attn::_flash_attn_forward")(q, k, v, *fa2_options(
        call, "dropout_p", "softmax_scale", "causal", "window", "alibi_slopes"), False)


def backward_op(call: Call, dout, saved: tuple, grads: tuple, cu_seqlens: tuple) -> None:
    """The package's backward op, writing ``grads`` (dq, dk, dv: views of a packed grad for
    the packed Functions); its return value, softmax_d, is dropped as the Functions drop it."""
    o, (q, k, v, out, lse) = call.option, saved[:5]
    if call.backend == FA3:
        ops.op("flash_attn_3::_flash_attn_backward")(
            dout, q, k, v, out, lse, dq=grads[0], dk=grads[1], dv=grads[2],
            softmax_scale=o("softmax_scale"), is_causal=o("causal"))
        return
    names = ("dropout_p", "softmax_scale", "causal", "window", "alibi_slopes", "deterministic")
    if call.varlen:
        ops.op("flash_attn::_flash_attn_varlen_backward")(
            dout, q, k, v, out, lse, *grads, *offsets(cu_seqlens), *fa2_options(call, *names),
            rng_state=saved[-1])
    else:
        ops.op("flash_attn::_flash_attn_backward")(
            dout, q, k, v, out, lse, *grads, *fa2_options(call, *names), rng_state=saved[-1])


def offsets(cu_seqlens: tuple) -> tuple:
    """The varlen ops' cu_seqlens_q and cu_seqlens_k (the qkv-packed Function's one tensor
    twice)."""
    return cu_seqlens * 2 if len(cu_seqlens) == 1 else cu_seqlens


def fa2_options(call: Call, *names: str) -> list:
    """flash-attn 2's ops' arguments ``names`` in order (``"window"``: window_size_left and
    _right, then softcap; the varlen ops': max_seqlen_q and _k first)."""
    o = call.option
    values = [o("max_seqlen_q"), o("max_seqlen_k")] if call.varlen else []
    for name in names:
        window = o("window_size", (-1, -1))
        values += [*window, o("softcap", 0.0)] if name == "window" else [o(name)]
    return values


def grad_buffers(packed: str, q, k, v) -> tuple:
    """The grads a Function makes for the backward op to write, and the views it hands the
    op: ``empty_like`` of q, k, v; one ``dqkv`` ([B,] N, 3, H, dp) for the qkv-packed
    Functions; dq and one ``dkv`` ([B,] M, 2, Hk, dp) for the kv-packed ones."""
    def pack(t, count):  # t's shape with ``count`` slots before its (heads, dim)
        return torch.empty((*t.shape[:-2], count, *t.shape[-2:]), dtype=t.dtype, device=t.device)

    if packed == "qkv":
        dqkv = pack(q, 3)
        return (dqkv,), tuple(dqkv.select(-3, i) for i in range(3))
    if packed == "kv":
        dq, dkv = torch.empty_like(q), pack(k, 2)
        return (dq, dkv), (dq, dkv.select(-3, 0), dkv.select(-3, 1))
    grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    return grads, grads


class FlashAttnFunction(torch.autograd.Function):
    """What the packages' Functions do around their ops (``FlashAttnFunc`` and its packed and
    varlen twins, flash_attn_interface.py v2.8.3 L440-995; FA3's ``FlashAttnFunc``,
    hopper/flash_attn_interface.py L552-639): q, k, v (views of a packed input) padded to a
    multiple of 8, the forward op, ``save_for_backward(q, k, v, out_padded, softmax_lse,
    [cu_seqlens,] rng_state)`` when a backward will run, the output sliced back; backward:
    the grads made, the grad padded, the backward op into them, the grads sliced. One named
    subclass per Function, so that its node is named as torch names it."""

    @staticmethod
    def forward(ctx, call: Call, *tensors):
        inputs, cu_seqlens = tensors[:call.inputs], tensors[call.inputs:]
        size = inputs[0].shape[-1]
        q, k, v = (pad8(t.detach()) for t in unpacked(inputs))
        outputs = forward_op(call, q, k, v, cu_seqlens)
        if call.grad:
            rng_state = outputs[3:] if call.backend == FA2 else ()
            ctx.call, ctx.count = call, len(tensors)
            ctx.save_for_backward(q, k, v, *outputs[:2], *cu_seqlens, *rng_state)
        return outputs[0][..., :size]

    @staticmethod
    def backward(ctx, dout, *_):
        saved, call = ctx.saved_tensors, ctx.call
        grads, views = grad_buffers(call.packed, *saved[:3])
        backward_op(call, pad8(dout), saved, views, saved[5:5 + ctx.count - call.inputs])
        size = dout.shape[-1]
        return (None, *(g[..., :size] for g in grads), *[None] * (ctx.count - call.inputs))


def function(name: str) -> type:
    """The Function ``name`` (``FlashAttnFunc``), its node ``FlashAttnFuncBackward``."""
    return type(name, (FlashAttnFunction,), {})


FUNCTIONS = {(FA2, "", False): function("FlashAttnFunc"),
             (FA3, "", False): function("FlashAttnFunc"),
             (FA2, "qkv", False): function("FlashAttnQKVPackedFunc"),
             (FA2, "kv", False): function("FlashAttnKVPackedFunc"),
             (FA2, "", True): function("FlashAttnVarlenFunc"),
             (FA2, "qkv", True): function("FlashAttnVarlenQKVPackedFunc"),
             (FA2, "kv", True): function("FlashAttnVarlenKVPackedFunc")}


def run(backend: str, inputs: tuple, options: dict, varlen: int = 0,
        cu_seqlens: tuple = ()) -> torch.Tensor:
    """A package's function on its inputs: ``(q, k, v)``, or a packed ``(qkv,)`` ([B,] N, 3,
    H, D) or ``(q, kv)`` with kv ([B,] M, 2, Hk, D); ``cu_seqlens``: the varlen functions'
    offsets, which the node saves."""
    packed = {1: "qkv", 2: "kv", 3: ""}[len(inputs)]
    scale = options.pop("softmax_scale", None) or inputs[0].shape[-1] ** -0.5
    call = Call(backend, packed, varlen, tuple({**options, "softmax_scale": scale}.items()),
                torch.is_grad_enabled() and any(t.requires_grad for t in inputs))
    return FUNCTIONS[backend, packed, bool(varlen)].apply(call, *inputs, *cu_seqlens)


def unpacked(inputs: tuple) -> tuple:
    """q, k, v of a call: given, or the slices of a packed qkv (``qkv[:, :, 0]`` ...; the
    varlen functions' ``qkv[:, 0]``: the pack is the third dim from the end either way) or
    kv as the packed Functions take them (views: nothing copied)."""
    if len(inputs) == 1:
        return tuple(inputs[0][..., i, :, :] for i in range(3))
    if len(inputs) == 2:
        return (inputs[0], inputs[1][..., 0, :, :], inputs[1][..., 1, :, :])
    return inputs


def options(kwargs: dict) -> dict:
    """What a call's ops get of the function's arguments."""
    names = ("dropout_p", "softmax_scale", "causal", "deterministic", "window_size",
             "softcap", "alibi_slopes", "max_seqlen_q", "max_seqlen_k")
    return {name: kwargs[name] for name in names if name in kwargs}


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
    return run(FA2, tuple(args), options(kwargs), sequences, kept)


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
    return run(FA3, (q, k, v), options(kwargs))
