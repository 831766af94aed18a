"""``memcalc.trace``, the Python API of ``memcalc trace``: what a notebook passes it."""

import math
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import memcalc  # noqa: E402


def attn(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), -1) @ v


def attn_causal(q, k, v, causal=False):
    return attn(q, k, v)


class Projected(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, q, k, v):
        return attn(self.proj(q), k, v)


def test_options_are_refused_as_the_command_refuses_them():
    """causal=True reached a function without a causal argument as nothing (the result
    said causal), impl= was ignored: both refused, as ``memcalc trace`` refuses them."""
    with pytest.raises(ValueError, match="causal: the function takes neither causal"):
        memcalc.trace(attn, seq_len=64, causal=True)
    assert memcalc.trace(attn_causal, seq_len=64, causal=True).config.causal
    with pytest.raises(TypeError, match="takes no impl"):
        memcalc.trace(attn, seq_len=64, impl="naive")
    with pytest.raises(TypeError, match="not int"):
        memcalc.trace(42)


def test_a_budget_is_judged_as_for_breakdown():
    """gpu_gb and reserve were unexpected keywords; the result shows the budget."""
    b = memcalc.trace(attn, seq_len=1024, batch=1, gpu_gb=80, reserve="1GiB")
    assert b.to_dict()["budget_bytes"] == 80 * 2**30 - 2**30  # 80 GiB less 1 GiB
    assert b.fits and "fits: reserved peak" in b.to_markdown()


def test_a_module_class_or_instance_is_traced_under_its_own_name():
    """A class was called with (q, k, v) as its constructor's arguments; an instance was
    named ``trace:function``. The instance keeps its weights."""
    by_class = memcalc.trace(Projected, seq_len=64)
    assert by_class.config.impl == "trace:Projected"
    # proj.weight: 16 x 16 x 4 B = 1,024 B; proj.bias: 16 x 4 B = 64 B
    assert [(c.name, c.bytes) for c in by_class.forward_live if c.role == "parameter"] == [
        ("proj.weight", 1024), ("proj.bias", 64)]
    model = Projected()
    weight = model.proj.weight.detach().clone()
    assert memcalc.trace(model, seq_len=64).config.impl == "trace:Projected"
    assert model.proj.weight.device.type == "cpu" and torch.equal(model.proj.weight, weight)


def test_help_lists_the_options():
    import inspect

    parameters = inspect.signature(memcalc.trace).parameters
    assert list(parameters)[:20] == ["fn", "inputs", "no_grad", "autocast", "param_dtype",
                                     "step", "optimizer", "grad_accum", "clip_grad_norm",
                                     "compile", "activation_budget", "mesh", "fsdp",
                                     "reshard_after_forward", "fsdp_param_dtype",
                                     "fsdp_reduce_dtype", "fsdp_apply", "fsdp_tp", "gpu_gb",
                                     "reserve"]
    assert "seq_len" in parameters
    assert "impl" not in parameters


class Masked(torch.nn.Module):
    def forward(self, q, k, v, is_causal=False):
        s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
        if is_causal:
            n = s.shape[-1]
            mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
            s = s.masked_fill(mask, float("-inf"))
        return torch.softmax(s, -1) @ v


def test_causal_reaches_a_modules_forward():
    """``causal=True`` never reached an nn.Module (its ``__call__`` takes ``**kwargs``,
    read as taking it): the figures were those of the unmasked step. The mask, 1 x 1024 x
    1024 bools (1,048,576 B), is alive at the forward peak now; a module whose forward
    takes no such argument is refused, as a function is."""
    plain = memcalc.trace(Masked(), seq_len=1024).forward_peak_bytes
    masked = memcalc.trace(Masked(), seq_len=1024, causal=True).forward_peak_bytes
    assert masked - plain == 1024 * 1024  # the bool mask
    with pytest.raises(ValueError, match="causal: the function takes neither"):
        memcalc.trace(Projected(), seq_len=64, causal=True)


class Hidden(torch.nn.Module):
    """A module of hidden states (B, N, 16), as real attention modules are."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x, mask=None):
        q, k, v = self.qkv(x).split(16, dim=-1)
        return attn(q, k, v)


def test_inputs_reach_any_signature():
    b = memcalc.trace(Hidden, inputs={"x": ("B", "N", 16)}, seq_len=64, batch=2)
    x = next(c for c in b.forward_live if c.name == "x")
    assert (x.shape, x.dtype) == ((2, 64, 16), "float32")  # 2 x 64 x 16 x 4 B = 8,192 B
    assert b.config.label() == "B=2 N=64 fp32"  # heads and head_dim are not read
    masked = memcalc.trace(Hidden, inputs={"x": ("B", "N", 16), "mask": ("B", "N", "bool")},
                           seq_len=64, batch=2)
    mask = next(c for c in masked.forward_live if c.name == "mask")
    assert (mask.bytes, mask.allocated) == (2 * 64, 512)  # 128 bools, one 512-B block


def test_inputs_are_refused_in_the_apis_words():
    with pytest.raises(ValueError, match=r"^forward\(x, mask=None\) does not take \(q, k, v\): "
                                         r"give each of its inputs as inputs=\{'x': "):
        memcalc.trace(Hidden, seq_len=64)
    with pytest.raises(ValueError, match=r"^inputs\['y'\]: forward\(x, mask=None\) has no "
                                         r"parameter 'y'"):
        memcalc.trace(Hidden, inputs={"y": ("B", "N", 16)})
    with pytest.raises(ValueError, match="^inputs: a mapping"):
        memcalc.trace(Hidden, inputs=["x=B,N,16"])
    with pytest.raises(ValueError, match="^no_grad: 'x': give inputs= first"):
        memcalc.trace(attn, no_grad="x")
    with pytest.raises(ValueError, match="^autocast: 'fp32' is not an autocast dtype"):
        memcalc.trace(Hidden, inputs={"x": ("B", "N", 16)}, autocast="fp32")


def test_autocast_and_no_grad():
    """Under autocast the linear's weight is cast to bf16 once (a component of its own);
    with x needing no gradient the linear saves x's cast only (for the weight's grad), so
    the weight's cast is an activation that dies with the autocast region."""
    b = memcalc.trace(Hidden, inputs={"x": ("B", "N", 16)}, no_grad="x", autocast="bf16",
                      seq_len=64, batch=2)
    roles = {c.name.split(" (test_")[0]: c.role.value for c in b.forward_live}
    assert roles["autocast qkv.weight as bfloat16 (cached)"] == "activation"
    assert roles["autocast x as bfloat16"] == "saved"  # not cached: x needs no grad
    assert not [c for c in b.backward_live if c.role == "gradient" and c.shape == (2, 64, 16)]


def test_param_dtype_is_model_to_dtype():
    """Pure bf16 training: the module's weight (48 x 16 x 2 B = 1,536 B) and bias (48 x 2 B
    = 96 B) in bf16."""
    b = memcalc.trace(Hidden, inputs={"x": ("B", "N", 16, "bf16")}, param_dtype="bf16",
                      seq_len=64, batch=2)
    state = {c.name: (c.dtype, c.bytes) for c in b.forward_live if c.role == "parameter"}
    assert state == {"qkv.weight": ("bfloat16", 1536), "qkv.bias": ("bfloat16", 96)}
    with pytest.raises(ValueError, match="^param_dtype: unknown dtype 'bf17'"):
        memcalc.trace(Hidden, inputs={"x": ("B", "N", 16)}, param_dtype="bf17")


def test_the_steps_options_are_one_model_or_keywords():
    """``memcalc.Step`` groups the loop's options (optimizer, accumulation, clipping): the
    same step as the keywords; both at once, or a bad value, is refused naming it."""
    from memcalc.tracing import load_function

    gpt = load_function(f"{Path(__file__).resolve().parents[1]}/examples/training/gpt.py:TinyGPT")
    ids = {"idx": ("B", "N", "int64"), "targets": ("B", "N", "int64")}
    grouped = memcalc.trace(gpt, inputs=ids, seq_len=64, batch=1,
                            step=memcalc.Step(optimizer="adamw", grad_accum=2, clip_grad_norm=1.0))
    keywords = memcalc.trace(gpt, inputs=ids, seq_len=64, batch=1, optimizer="adamw",
                             grad_accum=2, clip_grad_norm=1.0)
    assert grouped.figures() == keywords.figures()
    with pytest.raises(ValueError, match="step: it holds optimizer"):
        memcalc.trace(gpt, inputs=ids, seq_len=64, step=memcalc.Step(), optimizer="adamw")
    with pytest.raises(ValueError, match="clip_grad_norm"):
        memcalc.Step(clip_grad_norm=0)


@pytest.mark.parametrize("given", [
    {"compile": "default", "activation_budget": 0.5},
    {"step": memcalc.Step(compile="default", activation_budget=0.5)}])
def test_an_activation_budget_is_the_clis_compile_budget(capsys, given):
    """``activation_budget=0.5`` (or in a ``Step``): the compiled step at that budget,
    figure by figure what ``memcalc trace --compile-budget 0.5`` gives."""
    import json

    pytest.importorskip("triton")
    from cli_helpers import run
    from memcalc.tracing import load_function

    block = f"{Path(__file__).resolve().parents[1]}/examples/attention/gpt_block.py:Block"
    code, out, err = run(capsys, "trace", block, "--input", "x=B,N,768", "--seq", "256",
                         "--batch", "2", "--compile-budget", "0.5", "--json")
    assert code == 0, err
    cli = json.loads(out)
    api = memcalc.trace(load_function(block), inputs={"x": ("B", "N", 768)}, seq_len=256,
                        batch=2, **given)
    assert (api.saved_bytes, api.peak_bytes, api.reserved_peak_bytes) == (
        cli["saved_bytes"], cli["peak_bytes"], cli["reserved_peak_bytes"])


@pytest.mark.parametrize("given, message", [
    ({"activation_budget": 2}, "activation_budget 2.0: each budget a fraction from 0 to 1"),
    ({"activation_budget": "half"}, "activation_budget: a fraction from 0 to 1, not 'half'"),
    ({"activation_budget": 0.5, "compile": "eager"},
     "activation_budget: 0.5 is the compiled step's; not with compile='eager'"),
    ({"activation_budget": 0.5, "step": memcalc.Step()}, "step: it holds optimizer")])
def test_a_bad_activation_budget_is_one_line_naming_it(given, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        memcalc.trace(Masked, seq_len=64, **given)
