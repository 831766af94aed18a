"""What ``memcalc trace`` calls (``memcalc/tracing/target.py``): inputs bound to the
target's parameters, and the one output the backward starts from."""

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from memcalc.cli import main  # noqa: E402
from memcalc.config import make_config  # noqa: E402
from memcalc.engine.inputs import QKV, inputs_of  # noqa: E402
from memcalc.tracing import TraceError, trace  # noqa: E402
from memcalc.tracing.target import Bound, Calling, check_inputs, primary  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NANOGPT = f"{ROOT}/examples/attention/nanogpt.py"


def test_inputs_go_to_their_parameters_by_name():
    def step(x, mask=None, *, scale=1.0):
        return x, mask, scale

    inputs = inputs_of(["mask=B,N:bool", "x=B,N,8"])
    call = Bound(lambda **kw: (kw["x"],), inputs)  # **kwargs takes them by name
    a, b = torch.zeros(1), torch.ones(1)
    assert call(a, b) is b  # mask=a, x=b: the first tensor returned is x
    assert check_inputs(step, inputs) == inputs
    assert Bound(step, inputs)(a, b) is b


def test_q_k_v_go_positionally_whatever_the_parameters_are_called():
    call = Bound(lambda query, key, value: query @ key.T @ value, QKV)
    q = torch.eye(2)
    assert torch.equal(call(q, q, q), q)
    assert check_inputs(lambda query, key, value: None, None) is QKV


@pytest.mark.parametrize("fn, inputs, message", [
    (lambda x: x, None, "<lambda>(x) does not take (q, k, v): give each of its inputs as "
                        "--input NAME=DIMS[:DTYPE], e.g. --input x=B,N,768"),
    (lambda x: x, ["y=B"], "--input y: <lambda>(x) has no parameter 'y'"),
    (lambda x, mask: x, ["x=B"], "<lambda>(x, mask) needs mask: add --input mask=DIMS[:DTYPE]"),
])
def test_a_signature_the_inputs_do_not_fit_is_one_line(fn, inputs, message):
    with pytest.raises(TraceError) as error:
        check_inputs(fn, inputs_of(inputs) if inputs else None)
    assert str(error.value).startswith(message)


class Output(dict):
    """A Hugging Face ``ModelOutput`` is a dict whose keys are its fields."""


@pytest.mark.parametrize("returned, index, what", [
    (lambda t: t[0], 0, ""),
    (lambda t: (t[1], None), 1, "tuple: its [0] (2,)"),
    (lambda t: [None, t[2]], 2, "list: its [1] (2,)"),
    (lambda t: Output(logits=t[0], loss=t[2]), 2, "Output: its loss"),
    (lambda t: {"hidden": t[1]}, 1, "dict: its ['hidden'] (2,)"),
])
def test_the_output_is_the_loss_or_the_first_tensor(returned, index, what):
    tensors = [torch.zeros(2) for _ in range(3)]
    out, said = primary(returned(tensors))
    assert out is tensors[index] and said == what


def test_a_tuple_with_one_0d_floating_tensor_gives_it_as_the_loss():
    """nanoGPT's ``logits, loss = model(X, Y)``: the loop calls ``loss.backward()``."""
    logits, loss = torch.zeros(2, 3), torch.zeros(())
    assert primary((logits, loss)) == (loss, "tuple: its [1] (a 0-d loss)")
    count = torch.zeros((), dtype=torch.int64)  # not floating: no loss, the first tensor
    assert primary((logits, count))[0] is logits
    assert primary((logits, loss, torch.zeros(())))[0] is logits  # two: which one is not said


def test_an_output_without_a_tensor_is_refused():
    with pytest.raises(TraceError, match="must return a tensor .* not NoneType"):
        primary(None)


def test_a_module_returning_a_tuple_is_traced_from_its_first_tensor_and_says_so(tmp_path):
    (tmp_path / "pair.py").write_text(
        "import torch\n"
        "def attn(x):\n"
        "    y = x * 2\n"
        "    return y, y.detach()\n")
    code = main(["trace", f"{tmp_path}/pair.py:attn", "--input", "x=B,N,16", "--batch", "2",
                 "--seq", "64", "--json"])
    assert code == 0


def test_nanogpt_traces_from_its_hidden_states():
    """nanoGPT's CausalSelfAttention(x): x (B, T, 768) fp32 is the input; its output
    (B, T, 768) shapes grad_out; c_attn's and c_proj's weights and biases are resident."""
    from memcalc.tracing import load_function

    fn = load_function(f"{NANOGPT}:CausalSelfAttention")
    calling = Calling(inputs_of(["x=B,N,768"]))
    b = trace(fn, make_config(seq_len=128, batch=2), calling=calling)
    named = {c.name: c for c in b.forward_live}
    assert named["x"].shape == (2, 128, 768) and named["grad_out"].shape == (2, 128, 768)
    assert named["c_attn.weight"].bytes == 2304 * 768 * 4  # 7,077,888
    assert named["c_proj.bias"].bytes == 768 * 4


def test_a_module_classs_error_names_the_users_line(tmp_path, capsys):
    (tmp_path / "broken.py").write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        return x * int(x.sum().item())\n")
    code = main(["trace", f"{tmp_path}/broken.py:M", "--input", "x=B,N"])
    err = capsys.readouterr().err
    assert code == 2 and "line 4 of broken.py (return x * int(x.sum().item()))" in err


LAZY = '''
def attn(q, k, v):
    from flash_attn import flash_attn_func  # imported lazily, as many codebases do

    return flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                           causal=True).transpose(1, 2)
'''


def test_a_flash_attn_imported_inside_the_function_is_the_stand_in_too(tmp_path):
    """The stand-ins hold for the whole trace, not only while the file is imported: the
    same call imported at the top of the file traces to the same figures."""
    import memcalc
    from memcalc.tracing import load_function

    (tmp_path / "lazy.py").write_text(LAZY)
    (tmp_path / "eager.py").write_text("from flash_attn import flash_attn_func\n"
                                       + LAZY.replace("    from flash_attn import", "    # "))
    options = dict(seq_len=1024, batch=2, heads=8, head_dim=64, dtype="bf16")
    lazy, eager = (memcalc.trace(load_function(f"{tmp_path}/{name}.py:attn"), **options)
                   for name in ("lazy", "eager"))
    assert lazy.figures() == eager.figures() and lazy.peak_bytes > 0


def test_a_file_is_imported_once_for_its_target_and_its_apply(tmp_path):
    """The target and ``--fsdp-apply`` named in one file share its classes (an
    ``isinstance`` between them holds, as torchtitan's code checks its model), and its
    module-level code runs once; edited, the file is imported again."""
    from memcalc.tracing import load_function

    step = tmp_path / "step.py"
    step.write_text(
        "import torch\n"
        "IMPORTS = []\n"
        "IMPORTS.append(1)\n"
        "class Step(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        return x\n"
        "def apply(model, mesh):\n"
        "    assert isinstance(model, Step)\n")
    target, apply = load_function(f"{step}:Step"), load_function(f"{step}:apply")
    apply(target, None)
    assert target.__module__ == apply.__module__
    assert len(__import__(target.__module__).IMPORTS) == 1
    step.write_text(step.read_text() + "EDITED = True\n")
    assert __import__(load_function(f"{step}:Step").__module__).EDITED


def test_a_file_is_imported_again_in_another_environment(tmp_path, monkeypatch):
    """Module-level code that reads the environment (``LAYERS`` of the examples) runs again
    when it changed."""
    from memcalc.tracing import load_function

    (tmp_path / "sized.py").write_text(
        "import os\nimport torch\nWIDTH = int(os.environ.get('WIDTH', 8))\n"
        "def attn(x):\n    return x * WIDTH\n")
    monkeypatch.setenv("WIDTH", "8")
    first = load_function(f"{tmp_path}/sized.py:attn")
    monkeypatch.setenv("WIDTH", "16")
    second = load_function(f"{tmp_path}/sized.py:attn")
    assert (first.__globals__["WIDTH"], second.__globals__["WIDTH"]) == (8, 16)
