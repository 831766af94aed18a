"""Bring-your-own attention: tracing a user's function, fitting its program, its errors."""

import json
from fractions import Fraction
from pathlib import Path

import pytest

pytest.importorskip("torch")

from memcalc.cli import main
from memcalc.config import Config, make_config
from memcalc.analysis.predict import predict
from memcalc.tracing import TraceError, fit, load_function, register_function, trace
from memcalc.validation import figures_of

ROOT = Path(__file__).resolve().parents[1]
NAIVE = f"{ROOT}/memcalc/validation/reference/naive.py:naive"


def test_tracing_the_reference_file_equals_the_builtin_model():
    fn = load_function(NAIVE)
    config = Config(impl=register_function(fn, "ref"), shape={"batch": 2, "seq_len": 1050})
    builtin = predict(config.model_copy(update={"impl": "naive"}))
    assert figures_of(trace(fn, config)) == figures_of(builtin)


@pytest.mark.parametrize("seq_len", [1000, 3001, 8192])
def test_fitted_program_equals_a_direct_trace(seq_len):
    fn = load_function(f"{ROOT}/examples/custom_softmax/variants.py:reciprocal")
    name = register_function(fn, "reciprocal")
    config = Config(impl=name, causal=False, dtype="bf16",
                    shape={"batch": 3, "heads": 2, "seq_len": seq_len})
    assert figures_of(predict(config)) == figures_of(trace(fn, config))


def test_fit_recovers_exact_polynomials():
    xs = (61, 97, 131, 173, 211, 257)
    poly = fit(xs, [8 * x * x * 4 + 3 * x + 512 for x in xs])  # 32 N^2 + 3 N + 512
    assert poly.coefficients == (Fraction(512), Fraction(3), Fraction(32))
    assert fit(xs, [-(-x // 64) * 64 for x in xs]) is None  # padded to 64: not polynomial


def test_padded_sizes_are_fitted_at_multiples_of_256_and_traced_elsewhere(tmp_path):
    """A buffer padded to 64 rows is no polynomial in N, but is one at multiples of 256:
    the program is fitted there (from 15,616 rows), and other lengths are traced directly;
    either way the figures are a direct trace's."""
    from memcalc.impls import get_impl

    source = tmp_path / "padded.py"
    source.write_text(
        "import torch.nn.functional as F\n"
        "def attn(q, k, v):\n"
        "    pad = -q.size(-2) % 64\n"
        "    return F.pad(q, (0, 0, 0, pad))[..., : q.size(-2), :] * 1 + v\n")
    fn = load_function(f"{source}:attn")
    config = Config(impl=register_function(fn, "padded"), shape={"seq_len": 100})
    for n in (100, 20_480, 20_481):  # below the fitted lengths, a multiple of 256, not one
        at = config.replace(seq_len=n)
        assert figures_of(predict(at)) == figures_of(trace(fn, at))
    how = get_impl(config.impl).how(config.dims)
    assert how.startswith("its program fitted at multiples of 256 rows from 15,616 (the "
                          "size of constant_pad_nd (padded.py:4) is not a polynomial in seq_len)")


@pytest.mark.parametrize("body, message", [
    ("    return q * q.sum().item()\n", "line 3 of user.py (return q * q.sum().item()) "
     "cannot run on the meta device: RuntimeError: Tensor.item() cannot be called on meta "
     "tensors. Hint: data-dependent code"),
    ("    return q.cpu().numpy()\n", "cannot run on the meta device: NotImplementedError"),
    # a CPU tensor the function reaches by a closure: not the data-dependent-code hint
    ("    return (lambda: torch.ones(1) + q)()\n", "is not on the expected device cpu!. "
     "Hint: a tensor or module on the CPU is traced on meta copies only when the function "
     "refers to it by a module-level name"),
    # the code's own raise: as it is, not blamed on the meta device, no hint
    ("    raise RuntimeError('custom kernel')\n", "line 3 of user.py (raise RuntimeError('cus"
     "tom kernel')) raised RuntimeError: custom kernel\n"),
    ("    raise NotImplementedError('todo')\n", "raised NotImplementedError: todo\n"),
    # an error of the code on the inputs it was given: what it was called with
    ("    return {}['x']\n", "raised KeyError: 'x' (called with q (8, 1, 128, 16) float32, "
     "k (8, 1, 128, 16) float32, v (8, 1, 128, 16) float32)\n"),
    ("    return q @ torch.ones(8, 8, device=q.device)\n", "line 3 of user.py (return q @ "
     "torch.ones(8, 8, device=q.device)) raised RuntimeError: "),
    # code that needs CUDA itself (a custom kernel's launcher, say): the hint for it, after
    # the CPU build's AssertionError ("Torch not compiled with CUDA enabled") or the CUDA
    # build's RuntimeError without a GPU ("Found no NVIDIA driver on your system")
    ("    torch.cuda.synchronize()\n    return q\n", ". If it runs on a GPU: data-dependent "
     "code"),
    # an output that needs no grad: there is no backward to trace
    ("    return (q * 2).detach()\n", "the output needs no gradient (detached, or made under "
     "no_grad), so there is no backward to trace; --forward-only traces inference"),
])
def test_meta_failures_name_the_line(tmp_path, capsys, body, message):
    (tmp_path / "user.py").write_text("import torch\ndef attn(q, k, v):\n" + body)
    code = main(["trace", f"{tmp_path}/user.py:attn", "--seq", "128"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err


def test_a_mask_on_the_cudnn_backend_is_converted_and_saved(tmp_path, capsys):
    """fp16 on an H100: torch picks cuDNN; the bool (64, 64) mask becomes where(mask, 0,
    -inf) in fp16 (64 x 64 x 2 = 8,192 B), which the node saves until the backward
    (attention.cpp convert_boolean_attn_mask; derivatives.yaml attn_bias)."""
    (tmp_path / "user.py").write_text(
        "import torch\nimport torch.nn.functional as F\n"
        "def attn(q, k, v):\n"
        "    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device)\n"
        "    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)\n")
    code = main(["trace", f"{tmp_path}/user.py:attn", "--seq", "64", "--dtype", "fp16",
                 "--json"])
    saved = {c["name"].split(" (")[0]: c for c in json.loads(capsys.readouterr().out)["saved"]}
    assert code == 0 and saved["where"]["bytes"] == 64 * 64 * 2 == 8192
    assert saved["where"]["shape"] == [64, 64]


def test_a_call_memcalc_does_not_model_names_the_line_and_why_with_no_meta_hint(tmp_path,
                                                                                 capsys):
    """The efficient backend (fp32 on an H100) takes a value head dim unlike the query's;
    memcalc's programs have one head dim, so the trace stops there, saying so."""
    (tmp_path / "user.py").write_text(
        "import torch.nn.functional as F\n"
        "def attn(q, k, v):\n"
        "    return F.scaled_dot_product_attention(q, k, v[..., :8])\n")
    code = main(["trace", f"{tmp_path}/user.py:attn", "--seq", "64", "--batch", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Hint" not in err
    assert err.endswith("line 3 of user.py (return F.scaled_dot_product_attention(q, k, "
                        "v[..., :8])): scaled_dot_product_attention: a value head dim (8) "
                        "unlike the query's (16) is not modelled for the efficient backend\n")


@pytest.mark.parametrize("target, message", [
    ("missing.py:attn", "no file"),
    ("{tmp}/user.py:nope", "has no function 'nope'"),
    ("{tmp}/user.py:two_args", "two_args(q, k) does not take (q, k, v): give each of its "
     "inputs as --input NAME=DIMS[:DTYPE], e.g. --input q=B,N,768 (letters: B --batch, "
     "N --seq, M --kv-len, H --heads, K --kv-heads, D --head-dim)"),
    ("{tmp}/broken.py:attn", "importing"),
    ("no_colon", "expected FILE.py:FUNCTION"),
    ("memcalc_no_such_module:attn", "importing"),
])
def test_bad_targets_are_one_line(tmp_path, capsys, target, message):
    (tmp_path / "user.py").write_text("def two_args(q, k):\n    return q\n")
    (tmp_path / "broken.py").write_text("import not_a_module_anywhere\n")
    code = main(["trace", target.format(tmp=tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_a_target_without_its_function_names_what_the_file_defines(tmp_path, capsys):
    """Read without running the file (it would print ``ran``): its public top-level
    functions and classes; a misspelt name gets the closest (imports are not offered)."""
    (tmp_path / "user.py").write_text(
        "import math\nfrom fractions import Fraction\nprint('ran')\n"
        "def attention(q, k, v):\n    return q\n"
        "def _helper(q):\n    return q\n"
        "class Block:\n    pass\n")
    assert main(["trace", f"{tmp_path}/user.py"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.endswith(
        "expected FILE.py:FUNCTION or MODULE:FUNCTION; user.py defines attention, Block\n")
    assert main(["trace", f"{tmp_path}/user.py:atention"]) == 2
    err = capsys.readouterr().err
    assert err.endswith("has no function 'atention' (did you mean 'attention'?); it defines "
                        "attention, Block\n")


def test_oom_trace_agrees_with_direct_traces(capsys):
    """``memcalc oom --trace``: the step traced directly fits at max_seq_len and not one
    row later, with the allocator model capped at the budget."""
    import json

    from memcalc.engine.allocator import OutOfMemory
    from memcalc.config import make_config
    from memcalc.validation.emulated import measure

    spec = f"{ROOT}/examples/custom_softmax/variants.py:reciprocal"
    assert main(["oom", "--trace", spec, "--gpu-gb", "2", "--batch", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    n, budget = data["results"][0]["max_seq_len"], data["budget_bytes"]
    fn = load_function(spec)

    def fits(seq_len):
        config = make_config(impl=register_function(fn, "direct"), seq_len=seq_len, batch=1)
        try:
            measure(config, fn, capacity=budget)
        except OutOfMemory:
            return False
        return True

    assert fits(n) and not fits(n + 1)


def test_oom_trace_of_a_module_with_weights_agrees_with_direct_traces(capsys):
    """A module's parameters and buffers are in the fitted program as in a direct trace:
    nanoGPT's slow attention from its hidden states, solved, then traced directly (CUDA
    paths, as the search's samples) at N and N + 1 in the budget."""
    import json

    args = [f"{ROOT}/examples/attention/nanogpt.py:SlowCausalSelfAttention", "--input",
            "x=B,N,768", "--batch", "1", "--gpu-gb", "3", "--json"]
    assert main(["oom", "--trace", *args]) == 0
    result = json.loads(capsys.readouterr().out)["results"][0]
    n = result["max_seq_len"]

    def direct(seq_len):
        assert main(["trace", *args, "--seq", str(seq_len)]) == 0
        return json.loads(capsys.readouterr().out)

    at, after = direct(n), direct(n + 1)
    assert at["fits"] and not after["fits"]
    assert at["peak_bytes"] == result["peak_bytes_at_max"]
    # resident: c_attn (768 x 2304 + 2304), c_proj (768 x 768 + 768) float32 and the causal
    # mask (1, 1, 16384, 16384) float32
    resident = [c for c in at["components"] if c["role"] in ("parameter", "buffer")]
    assert sum(c["bytes"] for c in resident) == (768 * 2304 + 2304 + 768 * 768 + 768
                                                 + 16384 * 16384) * 4


LAZY_MASK = '''
import torch
import torch.nn as nn

_mask = None


class Lazy(nn.Module):
    """Hugging Face GPT-2's eager _attn (transformers 4.x) with its causal mask buffer built
    on the first call."""

    def forward(self, q, k, v):
        if getattr(self, "bias", None) is None:
            self.register_buffer("bias", torch.tril(torch.ones(
                (4096, 4096), dtype=torch.bool, device=q.device)).view(1, 1, 4096, 4096),
                persistent=False)
        w = torch.matmul(q, k.transpose(-1, -2))
        w = w / torch.full([], v.size(-1) ** 0.5, dtype=w.dtype, device=w.device)
        n = k.size(-2)
        mask_value = torch.full([], torch.finfo(w.dtype).min, dtype=w.dtype, device=w.device)
        w = torch.where(self.bias[:, :, n - q.size(-2):n, :n], w, mask_value)
        return torch.matmul(torch.softmax(w, dim=-1), v)


def lazy(q, k, v):
    """The same with a module-level mask set on the first call."""
    global _mask
    if _mask is None:
        _mask = torch.tril(torch.ones((4096, 4096), dtype=torch.bool, device=q.device))
    w = torch.where(_mask[:q.size(-2), :k.size(-2)], q @ k.transpose(-1, -2), -1e9)
    return torch.softmax(w, dim=-1) @ v
'''


@pytest.mark.parametrize("name", ["Lazy", "lazy"])
def test_state_built_on_the_first_call_is_built_in_the_warm_up(tmp_path, name):
    """On a GPU the protocol's warm-up is the first call: it builds the mask, whose
    16 MiB ``ones`` temporary leaves a cached segment the step's N x N tensors are carved
    from. The scratch forward that learns grad_out's shape must not build it first, and
    the trace leaves the user's module and names as they were."""
    (tmp_path / "lazy_mask.py").write_text(LAZY_MASK)
    fn = load_function(f"{tmp_path}/lazy_mask.py:{name}")
    config = make_config(batch=2, heads=3, seq_len=333, head_dim=64, gpu="a100-80gb")
    first, second = trace(fn, config), trace(fn, config)
    assert figures_of(first) == figures_of(second)
    assert any(c.op == "tril" for c in first.backward_live)  # the mask, made in the warm-up
    if name == "Lazy":
        # 45,143,552 B, an independent reference's figure for this step (its 2,661,336 B
        # softmax grad served by the 2,934,784 B tail the ones temporary's segment left),
        # and one more 2 x 3 x 333 x 333 x 4 B block (2,661,376 B): CUDA's grad * p
        # temporary inside _softmax_backward_data, which the reference leaves out
        assert first.backward_peak_bytes == 45_143_552 + 2_661_376
        assert getattr(fn, "bias", None) is None
    else:
        assert fn.__globals__["_mask"] is None


def test_trace_names_the_release_whose_sdpa_rules_it_applies(capsys):
    """On the H100 preset the SDPA example runs flash under torch 2.4's rules (cuDNN is off
    there) and cuDNN under the newest (preferred on sm90 with cuDNN > 9.15); the note names
    the release; an unknown one is one line."""
    example = str(Path(__file__).parent.parent / "examples/attention/sdpa.py") + ":attn"
    shape = ["--seq", "256", "--heads", "2", "--head-dim", "64", "--dtype", "bf16"]
    for version, backend in (("2.4", "flash"), ("2.14", "cudnn"), ("2.15", "cudnn")):
        assert main(["trace", example, *shape, "--torch", version]) == 0
        out = capsys.readouterr().out.replace("\n", " ")
        assert f"torch {version}'s rules: {backend} (priority" in out
    assert main(["trace", example, *shape, "--torch", "1.13"]) == 2
    assert capsys.readouterr().err == (
        "memcalc: error: --torch: no SDPA rules for 1.13 (known: 2.4 to 2.15)\n")


def test_oom_trace_samples_under_the_release_asked_for(monkeypatch, capsys):
    """``oom --trace --torch 2.14``: every sampled trace follows 2.14's SDPA rules; without
    --trace the option is refused in one line."""
    import memcalc.tracing.fitted as tracing

    seen, real = [], tracing._sample_events
    monkeypatch.setattr(tracing, "_sample_events",
                        lambda *args: seen.append(args[4].release) or real(*args))
    example = str(Path(__file__).parent.parent / "examples/attention/sdpa.py") + ":attn"
    assert main(["oom", "--trace", example, "--gpu", "b200", "--dtype", "bf16",
                 "--torch", "2.14"]) == 0
    assert seen and {r.torch for r in seen} == {(2, 14)}
    capsys.readouterr()
    assert main(["oom", "--torch", "2.4"]) == 2
    assert "--torch 2.4: an option of a traced target" in capsys.readouterr().err
