"""CUDA autocast on the meta device: the casts ``torch.autocast("cuda", ...)`` makes on a GPU.

torch's own autocast casts only CUDA tensors (``is_autocast_eligible`` in
``aten/src/ATen/autocast_mode.h``), and on a machine without CUDA ``torch.autocast("cuda")``
disables itself with a warning, so a trace on the meta device would run a mixed-precision
step in float32. During a trace, ``enabled_on_meta`` lets ``torch.autocast("cuda", ...)``
set its state as on a GPU (the user's own ``with torch.autocast(...)``, and
``--autocast``), and ``Autocast`` (a torch-function mode) applies CUDA's policy to the meta
tensors while that state says so, with the cast cache:

* ``POLICY``: which ops run in the autocast dtype, which in float32, which take
  ``dtype=float32``, which promote to the widest input (``autocast_mode.h``, torch 2.13:
  ``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``,
  ``AT_FORALL_PROMOTE``; ``rms_norm`` joined the float32 list in torch 2.12);
* the cast cache (``cached_cast`` in ``autocast_mode.cpp``): a float32 leaf that needs grad
  (a parameter) cast to the autocast dtype is cast once and the copy held until the
  outermost autocast region exits (``clear_cache``), each such copy a component named after
  its parameter.

Ops are matched by name at the Python level, where the mode sees them, so a C++ composite
that calls a listed op inside (``cross_entropy_loss``) is followed by hand (``COMPOSITES``).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

LOWER = frozenset({
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr",
    "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm",
    "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell",
    "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention"})
FP32 = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm",
    "rms_norm", "group_norm", "frobenius_norm", "nuclear_norm", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "nll_loss_nd",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist",
    "renorm", "logsumexp", "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
    "upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d", "upsample_bicubic2d"})
SET_OPT_DTYPE = frozenset({"prod", "softmax", "log_softmax", "cumprod", "cumsum",
                           "linalg_vector_norm", "linalg_matrix_norm", "sum"})
PROMOTE = frozenset({"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot",
                     "grid_sampler", "index_put", "tensordot", "scatter_add"})
# Python spellings of listed ops (nll_loss_nd is CompositeImplicit around nll_loss)
ALIASES = {"__pow__": "pow", "__rpow__": "pow", "__matmul__": "matmul", "__rmatmul__": "matmul"}
BANNED = {"binary_cross_entropy": (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_"
    "logits\nor torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and "
    "BCEWithLogits are\nsafe to autocast.")}  # autocast_mode.cpp, binary_cross_entropy_banned


# torch's own (C) queries, for memcalc's calls on every op: a trace patches the public names
# to answer the meta device as CUDA (``enabled_on_meta``)
IS_ENABLED, AUTOCAST_DTYPE = torch.is_autocast_enabled, torch.get_autocast_dtype

def policy_of(name: str, release: tuple[int, int]) -> str | None:
    """``lower``, ``fp32``, ``set_opt_dtype``, ``promote`` or None for op ``name`` in
    torch ``release`` (``rms_norm`` is float32 from 2.12 on, run as given before)."""
    name = ALIASES.get(name, name)
    if name == "rms_norm" and release < (2, 12):
        return None
    for kind, names in (("lower", LOWER), ("fp32", FP32), ("set_opt_dtype", SET_OPT_DTYPE),
                        ("promote", PROMOTE)):
        if name in names:
            return kind
    return None


def enabled() -> bool:
    """Whether CUDA autocast is on here (``torch.is_autocast_enabled("cuda")``)."""
    return IS_ENABLED("cuda")


def eligible(t) -> bool:
    """``is_eligible``: a floating tensor of the device (the meta device stands for CUDA),
    not float64."""
    return (isinstance(t, torch.Tensor) and t.device.type == "meta" and t.is_floating_point()
            and t.dtype is not torch.float64)


class Autocast(TorchFunctionMode):
    """CUDA's autocast policy over the meta tensors while autocast is on; ``tracer``
    names the cached casts after their parameters."""

    def __init__(self, tracer, release: tuple[int, int]):
        super().__init__()
        self.tracer = tracer
        self.release = release
        self.cache: dict[int, tuple] = {}  # id(source) -> (weakref to source, the cast)
        self.noted: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from memcalc.tracing.tracer import call_within

        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if enabled() and name in BANNED:
            raise RuntimeError(BANNED[name])
        kind = policy_of(name, self.release) if enabled() else None
        composite = COMPOSITES.get(name) if enabled() else None
        if composite is not None and eligible(args[0] if args else None):
            return composite(self, args, kwargs)
        if kind is None:
            return call_within(self, func, types, args, kwargs)
        args, kwargs = self.cast(kind, args, kwargs)
        return call_within(self, func, types, args, kwargs)

    def _note(self) -> None:
        """Say once per dtype that CUDA's policy was followed, where autocast was on."""
        from memcalc.tracing.tracer import _where

        paths = self.tracer.paths
        dtype = str(AUTOCAST_DTYPE("cuda")).removeprefix("torch.")
        if paths is not None and dtype not in self.noted:
            self.noted.add(dtype)
            paths.note(f"autocast to {dtype} (first at {_where()[0]}): CUDA's policy "
                       f"(aten/src/ATen/autocast_mode.h), its casts listed as 'autocast ...', "
                       f"a parameter's cast once per autocast region (the cast cache)")

    def cast(self, kind: str, args, kwargs) -> tuple:
        """``args`` and ``kwargs`` as ``kind``'s wrapper passes them on."""
        low = AUTOCAST_DTYPE("cuda")
        if kind == "set_opt_dtype":
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            given = any(isinstance(a, torch.dtype) for a in args) or \
                kwargs.get("dtype") is not None
            if eligible(first) and not given:
                self._note()
                kwargs = {**kwargs, "dtype": torch.float32}
            return args, kwargs
        to = torch.float32 if kind == "fp32" else low
        if kind == "promote":
            tensors = [t for t in _tensors((args, kwargs)) if eligible(t)]
            to = torch.float32 if any(t.dtype is torch.float32 for t in tensors) else low
        return self._mapped(args, to), {k: self._mapped(v, to) for k, v in kwargs.items()}

    def _mapped(self, value, to):
        if isinstance(value, (list, tuple)):
            return type(value)(self._mapped(v, to) for v in value)
        return self.cached_cast(value, to) if eligible(value) else value

    def cached_cast(self, t, to):
        """``cached_cast``: ``t`` in dtype ``to``; a float32 leaf that needs grad, cast to
        the autocast dtype, once per region (its copy kept until the region's end)."""
        if t.dtype is to:
            return t
        low = AUTOCAST_DTYPE("cuda")
        cacheable = (to is low and t.dtype is torch.float32 and t.requires_grad and t.is_leaf
                     and not t._is_view() and torch.is_autocast_cache_enabled()
                     and not (self.release >= (2, 11) and torch.is_inference_mode_enabled()))
        if not cacheable:
            return self._cast(t, to, False)
        hit = self.cache.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        with torch.enable_grad():  # torch 2.11: the cached cast keeps its graph (#158232)
            cast = self._cast(t, to, True)
        self.cache[id(t)] = (weakref.ref(t), cast)
        return cast

    def _cast(self, source, to, cached: bool):
        """``source.to(to)``, its block named after ``source`` (a parameter's name, or the
        op that made it) in the tracer's ledger: ``autocast c_attn.weight as bfloat16``."""
        from memcalc.tracing.tracer import located_name

        self._note()
        self.tracer.collect_frees()  # what died before this op, as at every op's start
        with self.tracer.quiet():
            cast = source.to(to)
        src = self.tracer.ledger.live.get(source.untyped_storage()._cdata)
        what = located_name(src.component.name)[0] if src is not None else "a tensor"
        dtype = str(to).removeprefix("torch.")
        self.tracer.track(cast, "_to_copy",
                          f"autocast {what} as {dtype}{' (cached)' if cached else ''}")
        return cast

    def clear(self) -> None:
        """``clear_cache``: the outermost autocast region exited; its cached casts die
        (unless autograd saved them)."""
        self.cache.clear()


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)


def cross_entropy_loss(mode: Autocast, args, kwargs):
    """``cross_entropy_loss`` (``aten/src/ATen/native/LossNLL.cpp``), CompositeImplicit, as
    autocast meets its inner ops: ``log_softmax(self, class_dim, self.scalar_type())``
    keeps the input's dtype (the dtype is given, so ``fp32_set_opt_dtype`` leaves it), and
    ``nll_loss`` casts that to float32. Class-probability targets and label smoothing take
    other paths: run as they are."""
    names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
    bound = {**dict(zip(names, args)), **kwargs}
    x, target = bound["input"], bound["target"]
    if bound.get("label_smoothing", 0.0) or x.shape == target.shape:
        return torch._C._nn.cross_entropy_loss(*args, **kwargs)
    log_p = torch.log_softmax(x, 0 if x.dim() == 1 else 1, x.dtype)
    weight = bound.get("weight")
    return torch._C._nn.nll_loss_nd(mode.cached_cast(log_p, torch.float32), target,
                                    mode.cached_cast(weight, torch.float32) if eligible(weight)
                                    else weight, bound.get("reduction", 1),
                                    bound.get("ignore_index", -100))


COMPOSITES = {"cross_entropy_loss": cross_entropy_loss}


@contextmanager
def enabled_on_meta(mode: Autocast):
    """``torch.autocast("cuda", ...)`` enabled as on a GPU while a trace runs: its checks of
    the device (``torch/amp/autocast_mode.py``: ``amp_definitely_not_available``,
    ``is_bf16_supported``) answer as a CUDA build would, and its ``clear_autocast_cache``
    clears ``mode``'s cache too; code asking autocast about its tensors' device
    (``torch.is_autocast_enabled(q.device.type)``, as transformers' flash-attention
    integration does) is answered for CUDA, which the meta device stands for; put back
    after."""
    import torch.cuda.amp.common as common

    saved = (common.amp_definitely_not_available, torch.cuda.is_bf16_supported,
             torch.clear_autocast_cache, torch.is_autocast_enabled, torch.get_autocast_dtype)

    def clear():
        saved[2]()
        mode.clear()

    common.amp_definitely_not_available = lambda: False
    torch.cuda.is_bf16_supported = lambda *a, **k: True
    torch.clear_autocast_cache = clear
    torch.is_autocast_enabled, torch.get_autocast_dtype = (_as_cuda(f) for f in saved[3:])
    try:
        yield
    finally:
        common.amp_definitely_not_available, torch.cuda.is_bf16_supported, \
            torch.clear_autocast_cache, torch.is_autocast_enabled, \
            torch.get_autocast_dtype = saved


def _as_cuda(query):
    """``query`` (``torch.is_autocast_enabled``, ``torch.get_autocast_dtype``) asked about
    ``"meta"`` answering for ``"cuda"``."""
    def asked(*args, **kwargs):
        args = tuple("cuda" if a == "meta" else a for a in args)
        kwargs = {k: "cuda" if v == "meta" else v for k, v in kwargs.items()}
        return query(*args, **kwargs)
    return asked
