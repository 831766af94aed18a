"""Every module of ``torch.nn`` and every torch function and ``Tensor`` method PyTorch's own
tests know how to call, run through a trace's modes on the GPU's code paths, plain and
under CUDA autocast: what runs on the meta device must run in a trace, and what the meta
device refuses must be refused with torch's own words, never with a RecursionError or an
error raised inside memcalc. The calls and their arguments are PyTorch's: the OpInfo
database (``torch/testing/_internal/common_methods_invocations.py``, ``op_db``) and the
ModuleInfo database (``common_modules.py``, ``module_db``), first sample of each (every
sample of the attention modules). Then a whole model built of ``nn.MultiheadAttention``
with its loss and AdamW, traced and solved (``examples/torch_nn/mha_lm.py``)."""

import contextlib
import json
import runpy
import traceback
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("expecttest")  # torch.testing._internal needs it (the test extra has it)

from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402
from torch.testing._internal.common_modules import module_db  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

import memcalc  # noqa: E402
from memcalc.cli import main  # noqa: E402
from memcalc.config import gpu_preset  # noqa: E402
from memcalc.tracing.autocast import BANNED  # noqa: E402
from memcalc.tracing.cuda_paths import CudaPaths  # noqa: E402
from memcalc.tracing.deferred import deferred  # noqa: E402
from memcalc.tracing.tracer import Tracer, function_modes  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")  # the deprecated ops op_db calls

MEMCALC = str(Path(memcalc.__file__).parent)
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torch_nn" / "mha_lm.py"
# modules whose every sample runs (batch_first or not, masks, need_weights, ...)
ATTENTION = ("nn.MultiheadAttention", "nn.TransformerEncoderLayer",
             "nn.TransformerDecoderLayer", "nn.Transformer", "nn.TransformerEncoder")
# what CUDA's autocast itself refuses, as on a GPU
REFUSED_UNDER_AUTOCAST = {
    # autocast_mode.cpp: binary_cross_entropy_banned
    "nn.functional.binary_cross_entropy": BANNED["binary_cross_entropy"],
    "nn.BCELoss": BANNED["binary_cross_entropy"],
    # its OpInfo's op is pinv(a @ b.mT): autocast runs the matmul in bfloat16, which pinv
    # refuses on any device
    "linalg.pinv.singular": "linalg.pinv(BFloat16{[3, 3]}): expected a tensor with 2 or more "
                            "dimensions of float, double, cfloat or cdouble types",
}


@contextlib.contextmanager
def plain():
    """The meta device alone: what torch itself does (``None``: no autocast region)."""
    yield None


@contextlib.contextmanager
def traced(autocast: bool):
    """A trace's modes along an H100's code paths; yields the autocast region to call the
    function under (built outside it, as a user's inputs are)."""
    tracer = Tracer(0, None, CudaPaths(gpu_preset("h100-80gb")))
    with deferred(), tracer, function_modes(tracer):
        yield torch.autocast("cuda", torch.bfloat16) if autocast else None


def outcome(ctx, make, call) -> tuple[str, bool] | None:
    """``None`` when ``call(make())`` runs inside ``ctx``, else the error it raised as
    ``(its first line, whether memcalc's own code raised it)``: ``make`` builds the
    arguments outside the autocast region."""
    try:
        with ctx as region:
            made = make()
            with region or contextlib.nullcontext():
                call(made)
    except (Exception, RecursionError) as error:  # noqa: BLE001 - every refusal is compared
        raised_in = traceback.extract_tb(error.__traceback__)[-1].filename
        ours = isinstance(error, RecursionError) or raised_in.startswith(MEMCALC)
        return f"{type(error).__name__}: {error}".splitlines()[0], ours
    return None


def differences(cases) -> dict[str, str]:
    """``{case (autocast): what the trace did}`` for each ``(name, make, call)`` that a
    trace refuses with memcalc's own error (one raised in memcalc's code, or a
    RecursionError) where the meta device alone runs it or refuses it in other words; the
    refusals of CUDA's autocast itself (``REFUSED_UNDER_AUTOCAST``) are expected. A refusal
    of torch's own is the meta device's limit, not a trace's; a call the trace runs is
    never one (it answers some the meta device alone cannot, such as ``aten::equal``, from
    the values it keeps: ``memcalc/tracing/shadows.py``)."""
    found = {}
    for name, make, call in cases:
        alone = outcome(plain(), make, call)
        for autocast in (False, True):
            got = outcome(traced(autocast), make, call)
            expected = REFUSED_UNDER_AUTOCAST.get(name, "") if autocast else ""
            if got is None or not got[1] or (alone and got[0] == alone[0]) or \
                    (expected and got[0].endswith(expected.splitlines()[0])):
                continue
            found[f"{name} ({'autocast' if autocast else 'plain'})"] = \
                f"{got[0]} (meta alone: {alone and alone[0]})"
    return found


def first_sample(op):
    """``(args, kwargs)`` of ``op``'s first OpInfo sample, float32 on meta."""
    sample = next(iter(op.sample_inputs("meta", torch.float32,
                                        requires_grad=op.supports_autograd)))
    return (sample.input, *sample.args), sample.kwargs


def op_cases(variant: str):
    """``(name, make, call)`` for each op of ``op_db`` with that variant (``op``: the torch
    function, ``method_variant``: the ``Tensor`` method)."""
    for op in op_db:
        fn = getattr(op, variant)
        if fn is not None:
            yield (f"{op.name}.{op.variant_test_name}".rstrip("."), lambda op=op: first_sample(op),
                   lambda made, fn=fn: fn(*made[0], **made[1]))


@pytest.mark.slow  # minutes: every op_db / module_db entry, three times
def test_every_torch_function_runs_in_a_trace_as_on_meta():
    assert differences(op_cases("op")) == {}


@pytest.mark.slow  # minutes: every op_db / module_db entry, three times
def test_every_tensor_method_runs_in_a_trace_as_on_meta():
    """``Tensor.unflatten`` (``torch/_tensor.py``) checks for torch functions, then calls the
    C++ method, which names the Python method again: a trace redispatched it without end
    (``nn.MultiheadAttention`` calls it)."""
    assert differences(op_cases("method_variant")) == {}


def x():
    return torch.empty(4, 6, device="meta", requires_grad=True)


# Tensor methods written in Python (torch/_tensor.py) that op_db does not call: each with
# the arguments a user passes
PYTHON_METHODS = {
    "__format__": lambda t: format(t, ""), "__repr__": repr, "__len__": len,
    "__iter__": lambda t: list(iter(t)), "__reversed__": reversed,
    "__contains__": lambda t: 0.0 in t, "__hash__": hash, "__dir__": dir,
    "__deepcopy__": lambda t: __import__("copy").deepcopy(t),
    "register_hook": lambda t: t.register_hook(lambda g: g),
    "backward": lambda t: (t * 2).sum().backward(),
    "resize": lambda t: t.detach().resize(24), "resize_as": lambda t: t.detach().resize_as(t),
    "split": lambda t: t.split(2), "unflatten": lambda t: t.unflatten(-1, (2, 3)),
    "unique_consecutive": lambda t: t.unique_consecutive(), "dim_order": lambda t: t.dim_order(),
    "__rsub__": lambda t: 1 - t, "__rdiv__": lambda t: 1 / t, "__rpow__": lambda t: 2 ** t,
    "__pow__": lambda t: t ** 2, "__ipow__": lambda t: t.detach().__ipow__(2),
    "__rmod__": lambda t: 3 % t, "__floordiv__": lambda t: t // 2,
    "__rfloordiv__": lambda t: 2 // t, "__rmatmul__": lambda t: t.__rmatmul__(t.mT),
    "norm": lambda t: t.norm(), "storage": lambda t: t.untyped_storage().nbytes(),
}


def test_tensor_methods_written_in_python_run_in_a_trace_as_on_meta():
    assert differences((name, x, call) for name, call in PYTHON_METHODS.items()) == {}


def module_step(info, index: int):
    """``(make, call)`` of sample ``index`` of ``info``'s ModuleInfo: the module built on
    meta and trained, its float outputs summed and backpropagated."""
    def make():
        given = info.module_inputs_func(info, device="meta", dtype=torch.float32,
                                        requires_grad=True, training=True)[index]
        with torch.device("meta"):
            module = info.module_cls(*given.constructor_input.args,
                                     **given.constructor_input.kwargs)
        return module.train(), given.forward_input

    def call(made):
        module, forward = made
        outputs = [o for o in tree_leaves(module(*forward.args, **forward.kwargs))
                   if isinstance(o, torch.Tensor) and o.requires_grad]
        if outputs:
            sum(o.float().sum() for o in outputs).backward()

    return make, call


def module_cases():
    for info in module_db:
        count = len(info.module_inputs_func(info, device="meta", dtype=torch.float32,
                                            requires_grad=True, training=True))
        for index in range(count if info.name in ATTENTION else min(count, 1)):
            yield (info.name if index == 0 else f"{info.name}[{index}]",
                   *module_step(info, index))


@pytest.mark.slow  # minutes: every op_db / module_db entry, three times
def test_every_nn_module_trains_in_a_trace_as_on_meta():
    names = {info.name for info in module_db}
    assert set(ATTENTION) <= names  # the attention modules are among those run
    assert differences(module_cases()) == {}


def test_refusals_are_checked():
    """The comparison can fail: a call the meta device runs but a trace refuses with a
    RecursionError is named."""
    def refused(made):
        if torch.overrides._get_current_function_mode_stack():  # inside a trace only
            raise RecursionError("maximum recursion depth exceeded")

    line = "RecursionError: maximum recursion depth exceeded (meta alone: None)"
    assert differences([("probe", x, refused)]) == {"probe (plain)": line,
                                                    "probe (autocast)": line}


# ---- a whole model of nn.MultiheadAttention, its loss and AdamW ----------------------------

STEP = ("--input", "idx=B,N:int64", "--input", "targets=B,N:int64", "--batch", "4",
        "--optimizer", "adamw")
VOCAB, WIDTH, LAYERS = 8192, 256, 2  # examples/torch_nn/mha_lm.py


def trace_json(capsys, target: str, *options) -> dict:
    code = main(["trace", f"{EXAMPLE}:{target}", *STEP, *options, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def parameter_bytes() -> int:
    """float32 parameters of MhaLM, counted from its layers."""
    embedding = head = VOCAB * WIDTH
    attention = 3 * WIDTH * WIDTH + 3 * WIDTH + WIDTH * WIDTH + WIDTH  # in_proj, out_proj
    mlp = WIDTH * 4 * WIDTH + 4 * WIDTH + 4 * WIDTH * WIDTH + WIDTH
    norms = 2 * 2 * WIDTH
    return 4 * (embedding + head + LAYERS * (attention + mlp + norms) + 2 * WIDTH)


@pytest.mark.parametrize("autocast", [(), ("--autocast", "bf16")])
def test_a_multihead_attention_model_trains_in_a_trace(capsys, autocast):
    """Each block's ``nn.MultiheadAttention`` (``need_weights=False``, causal) runs one SDPA
    call of (B, heads, N, width / heads) = (4, 4, 1024, 64); the weights are resident and
    AdamW's two moments are each as large as them."""
    data = trace_json(capsys, "MhaLM", "--seq", "1024", *autocast)
    sdpa = [n for n in data["notes"] if n.startswith("scaled_dot_product_attention at mha_lm")]
    assert len(sdpa) == 1 and "(4, 4, 1024, 64)" in sdpa[0] and "causal" in sdpa[0]
    by_role = {}
    for c in data["components"]:
        by_role[c["role"]] = by_role.get(c["role"], 0) + c["bytes"]
    # every parameter tensor is a multiple of 512 B here (256 * 4 = 1,024 B the smallest),
    # so blocks equal bytes
    assert by_role["parameter"] == parameter_bytes()
    assert by_role["optimizer state"] == 2 * parameter_bytes()


def test_an_encoder_of_torch_nn_layers_trains_in_a_trace(capsys):
    data = trace_json(capsys, "EncoderLM", "--seq", "1024")
    assert data["fits"] and data["peak_bytes"] > 0


def test_a_multihead_attention_model_is_solved(capsys):
    """``oom --trace`` answers, and the answer is the boundary: a trace at it fits and one
    row more does not (both read from memcalc.trace, not searched)."""
    code = main(["oom", "--trace", f"{EXAMPLE}:MhaLM", *STEP, "--gpu-gb", "16", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    n = json.loads(out)["results"][0]["max_seq_len"]
    assert n is not None

    model = runpy.run_path(str(EXAMPLE))["MhaLM"]

    def fits(seq: int) -> bool:
        return memcalc.trace(model, seq_len=seq, batch=4, optimizer="adamw", gpu_gb=16,
                             inputs={"idx": ("B", "N", "int64"),
                                     "targets": ("B", "N", "int64")}).fits

    assert fits(n) and not fits(n + 1)
