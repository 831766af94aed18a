"""``memcalc.tracing.compiled``: ``torch.compile`` in traced code is compiled as inductor
compiles it for the GPU (``memcalc.compiling``), or left uncompiled under ``--compile
eager``, saying so; outside memcalc's commands it is refused in one line."""

import pytest

torch = pytest.importorskip("torch")

import memcalc  # noqa: E402

from cli_helpers import assert_refused, run  # noqa: E402

# each file defines Model: Linear(64, 64) then relu, compiled in its own way
LINEAR = ("import torch\nfrom torch import nn\n\n\n"
          "def block(x):\n    return torch.relu(x)\n\n\n")
FILES = {
    "in the constructor": LINEAR + (
        "class Model(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = nn.Linear(64, 64)\n"
        "        self.act = torch.compile(block)\n"  # line 13
        "\n"
        "    def forward(self, x):\n"
        "        return self.act(self.lin(x))\n"),
    "as a decorator": LINEAR.replace("def block", "@torch.compile\ndef block") + (
        "class Model(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = nn.Linear(64, 64)\n"
        "\n"
        "    def forward(self, x):\n"
        "        return block(self.lin(x))\n"),
    "in place (Module.compile)": LINEAR + (
        "class Model(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = nn.Linear(64, 64)\n"
        "        self.lin.compile()\n"
        "\n"
        "    def forward(self, x):\n"
        "        return block(self.lin(x))\n"),
}
PLAIN = LINEAR + ("class Model(nn.Module):\n"
                  "    def __init__(self):\n"
                  "        super().__init__()\n"
                  "        self.lin = nn.Linear(64, 64)\n"
                  "\n"
                  "    def forward(self, x):\n"
                  "        return block(self.lin(x))\n")
ARGS = ("--input", "x=B,N,64", "--seq", "128", "--json")


def written(tmp_path, name: str, text: str) -> str:
    path = tmp_path / f"{name.split()[0].replace('(', '')}_{abs(hash(name)) % 1000}.py"
    path.write_text(text)
    return f"{path}:Model"


@pytest.mark.parametrize("how", FILES)
def test_code_that_compiles_is_traced_compiled_naming_its_line(tmp_path, capsys, how):
    """Without --compile the code's own calls compile; the notes say so and where."""
    import json

    code, out, err = run(capsys, "trace", written(tmp_path, how, FILES[how]), *ARGS)
    assert code == 0, err
    notes = json.loads(out)["notes"]
    assert any("torch.compile followed as inductor compiles it" in n and ".py:" in n
               for n in notes)


@pytest.mark.parametrize("how", FILES)
def test_compile_eager_traces_the_uncompiled_step_and_says_where(tmp_path, capsys, how):
    """The figures are the same module's without the compile call, to the byte, and the
    notes name the call."""
    import json

    code, out, _ = run(capsys, "trace", written(tmp_path, how, FILES[how]), *ARGS,
                       "--compile", "eager")
    assert code == 0
    compiled = json.loads(out)
    code, out, _ = run(capsys, "trace", written(tmp_path, "plain", PLAIN), *ARGS)
    plain = json.loads(out)
    figures = ("saved_bytes", "forward_peak_bytes", "backward_peak_bytes", "peak_bytes",
               "reserved_peak_bytes")
    assert [compiled[f] for f in figures] == [plain[f] for f in figures]
    assert any("torch.compile left uncompiled (--compile eager)" in n and ".py:" in n
               for n in compiled["notes"])


def test_the_line_named_is_the_users(tmp_path, capsys):
    import json

    code, out, err = run(capsys, "trace", written(tmp_path, "in the constructor",
                                                  FILES["in the constructor"]), *ARGS)
    assert any(n.endswith(".py:13") for n in json.loads(out)["notes"])


def test_a_mode_not_modelled_is_one_line(tmp_path, capsys):
    code, out, err = run(capsys, "trace", written(tmp_path, "plain", PLAIN), *ARGS,
                         "--compile", "max-autotune")
    assert_refused(code, out, err, "--compile max-autotune")


def test_compile_given_without_a_target_is_one_line(capsys):
    code, out, err = run(capsys, "oom", "--impl", "naive", "--compile", "eager")
    assert_refused(code, out, err, "--compile eager")


def test_disable_true_is_no_compilation(tmp_path, capsys):
    """``torch.compile(fn, disable=True)`` gives fn back as torch does: nothing refused."""
    text = FILES["in the constructor"].replace("torch.compile(block)",
                                               "torch.compile(block, disable=True)")
    code, out, err = run(capsys, "trace", written(tmp_path, "disabled", text), *ARGS)
    assert code == 0, err


def attn(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1), -1) @ v


def test_a_function_compiled_before_the_api_call_is_compiled_again_or_unwrapped():
    """torch.compile(attn) run for real (no GPU needed to wrap it): compiled again for the
    trace, or under
    compile="eager" the original function, traced to its figures (saved: p, 64 x 64 x 4 B
    per head: 8 x 8 x 16,384 B = 1,048,576 B, and the softmax's input is not saved)."""
    compiled = torch.compile(attn)
    again = memcalc.trace(compiled, seq_len=64)  # compiled again, for the trace
    eager = memcalc.trace(compiled, seq_len=64, compile="eager")
    assert eager.saved_bytes == memcalc.trace(attn, seq_len=64).saved_bytes
    # inductor fuses the softmax into one kernel: no scores tensor beside its output
    assert again.saved_bytes == eager.saved_bytes and again.peak_bytes < eager.peak_bytes
    assert memcalc.trace(compiled, seq_len=64, step=memcalc.Step(compile="eager")) == eager


def test_a_module_with_a_block_compiled_before_the_api_call_is_refused():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.compile(torch.nn.Linear(8, 8)))
    with pytest.raises(ValueError, match="1: compiled before the trace"):
        memcalc.trace(model, inputs={"x": ("B", "N", 8)}, compile="eager")


def test_the_api_refuses_a_mode_it_does_not_model_naming_compile():
    with pytest.raises(ValueError, match="^compile max-autotune: one of eager, default "):
        memcalc.trace(attn, seq_len=64, compile="max-autotune")
