"""``memcalc.compiling.session`` and ``device``: what a compiled trace refuses in one line,
and what it leaves behind (nothing: torch's CUDA queries, inductor's module cache and the
tracer's table of generated code are as they were)."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from cli_helpers import assert_refused, run  # noqa: E402
from memcalc.tracing.tracer import torch_release  # noqa: E402

MODEL = ("import torch\nfrom torch import nn\n\n\n"
         "class Model(nn.Module):\n"
         "    def __init__(self):\n"
         "        super().__init__()\n"
         "        self.lin = nn.Linear(64, 64)\n"
         "        self.act = torch.compile(torch.relu{options})\n"
         "\n"
         "    def forward(self, x):\n"
         "        return self.act(self.lin(x))\n")
ARGS = ("--input", "x=B,N,64", "--seq", "128")


def written(tmp_path, options: str = "") -> str:
    path = tmp_path / f"model_{abs(hash(options)) % 1000}.py"
    path.write_text(MODEL.format(options=options))
    return f"{path}:Model"


@pytest.mark.parametrize("options, why", [
    (", mode='reduce-overhead'", "CUDA graphs keep their own memory pool"),
    (", mode='max-autotune'", "autotuning picks kernels by timing them"),
    (", backend='aot_eager'", "memcalc follows inductor"),
    (", options={'triton.cudagraphs': True}", "inductor options are not followed yet")])
def test_what_is_not_followed_is_one_line(tmp_path, capsys, options, why):
    code, out, err = run(capsys, "trace", written(tmp_path, options), *ARGS)
    assert_refused(code, out, err, why)


def test_meta_paths_cannot_compile_for_a_gpu(tmp_path, capsys):
    code, out, err = run(capsys, "trace", written(tmp_path), *ARGS, "--meta-paths")
    assert_refused(code, out, err, "runs inside a trace on the GPU's code paths (not with "
                                   "--meta-paths)")


def test_a_compiled_trace_leaves_torch_as_it_was(tmp_path, capsys):
    from torch._inductor.codecache import PyCodeCache

    from memcalc.tracing import tracer

    before = (torch.cuda.get_device_properties, torch.cuda._DeviceGuard,
              torch.cuda.set_device, dict(PyCodeCache.modules_no_attr))
    code, out, err = run(capsys, "trace", written(tmp_path), *ARGS)
    assert code == 0, err
    assert (torch.cuda.get_device_properties, torch.cuda._DeviceGuard,
            torch.cuda.set_device, dict(PyCodeCache.modules_no_attr)) == before
    assert tracer.GENERATED == {}


def test_a_triton_check_made_before_the_trace_without_a_gpu_does_not_stop_it(tmp_path,
                                                                            capsys):
    """torch caches whether triton can run (``has_triton``): asked before the trace on
    this machine (no GPU), it says no; the trace asks again for its GPU, and leaves the
    machine's answer after it."""
    from torch.utils._triton import has_triton

    assert not has_triton()  # cached: a torch.compile made here would find no triton
    code, out, err = run(capsys, "trace", written(tmp_path), *ARGS)
    assert code == 0, err
    assert not has_triton()


def test_a_preset_without_an_sm_count_is_refused():
    from memcalc.compiling.device import properties
    from memcalc.gpus import gpu_preset
    from memcalc.tracing.errors import NotModelled

    gpu = gpu_preset("h100-80gb").model_copy(update={"sm_count": None})
    with pytest.raises(NotModelled, match="has no SM count"):
        properties(gpu)
    assert properties(gpu_preset("h100-80gb")).multi_processor_count == 132


def test_deepspeeds_availability_check_does_not_reach_the_cuda_runtime(tmp_path, capsys,
                                                                       monkeypatch):
    """deepspeed sets PYTORCH_NVML_BASED_CUDA_CHECK=1 on import; torch.cuda.is_available
    then asks device_count, which the compiled trace answers 1: it must still say False, or
    dynamo calls the CUDA runtime itself (no driver here)."""
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    code, out, err = run(capsys, "trace", written(tmp_path), *ARGS)
    assert code == 0, err


def test_autocast_around_compiled_code_is_refused(tmp_path, capsys):
    code, out, err = run(capsys, "trace", written(tmp_path), *ARGS, "--autocast", "bf16")
    assert_refused(code, out, err, "under autocast: not followed yet")


def _self_compiling(head: str, forward: str) -> str:
    """A file: ``head`` (imports, helpers), then a module on Linear(64, 64) that compiles
    itself in its constructor, its forward's body ``forward``."""
    return (head + "class Model(nn.Module):\n"
            "    def __init__(self):\n"
            "        super().__init__()\n"
            "        self.lin = nn.Linear(64, 64)\n"
            "        self.compile()\n"
            "\n"
            "    def forward(self, x):\n" + forward)


def test_a_graph_break_is_refused_naming_its_line(tmp_path, capsys):
    """The code dynamo runs between two graphs would run without the GPU's rules: refused,
    at the line that breaks."""
    path = tmp_path / "broken.py"
    path.write_text(_self_compiling("import torch\nfrom torch import nn\n\n\n",
                                    "        y = self.lin(x)\n"
                                    "        torch._dynamo.graph_break()\n"  # line 13
                                    "        return torch.relu(y)\n"))
    code, out, err = run(capsys, "trace", f"{path}:Model", *ARGS)
    assert_refused(code, out, err, "the graph breaks at broken.py:13")


def test_a_graph_break_deeper_down_is_named_where_it_is_and_why(tmp_path, capsys):
    """Dynamo logs a break at each frame it was inlining, the caller's first; the line
    named is the innermost (the helper's), with the exception's reason, not the
    caller's "a function call" (Hugging Face's GPT-2 loss: its logger's warning_once)."""
    path = tmp_path / "deeper.py"
    path.write_text(_self_compiling("import logging\n\nimport torch\nfrom torch import nn\n\n\n"
                                    "def helper(y):\n"
                                    "    logging.getLogger('deeper').warning('%s', y.shape)\n"
                                    "    return torch.relu(y)\n\n\n",  # the warning: line 8
                                    "        return helper(self.lin(x))\n"))
    code, out, err = run(capsys, "trace", f"{path}:Model", *ARGS)
    assert_refused(code, out, err, "the graph breaks at deeper.py:8, in helper (")
    assert "a function call" not in err
    if torch_release() >= (2, 15):  # its hint, where dynamo gives one (2.13's: none)
        assert "; dynamo's hint: " in err


def test_validate_checks_a_compiled_target_against_its_own_trace(capsys):
    """``validate --trace --compile``: the program oom --trace solves equals the direct
    trace, figure by figure (a compiled step's kernels change with the length: traced
    directly at each)."""
    code, out, err = run(capsys, "validate", "--trace", "examples/attention/gpt_block.py:Block",
                         "--input", "x=B,N,768", "--seq", "128", "--batch", "1", "--compile")
    assert code == 0, err
    assert "emulated: 1 configurations, 5 figures, 0 mismatches" in out


def test_torch_nns_own_encoder_layer_compiles_with_the_fused_kernel(tmp_path, capsys):
    """nn.TransformerEncoderLayer, with its dropout: the compile-time CUDA rules track
    nothing (its dropout used to reach for the trace's tracer, which is not running while
    the compiler traces), and reach the SDPA call inside F.multi_head_attention_forward,
    which dynamo keeps whole in its graph (it ran the math path, saving more than eager)."""
    import json

    path = tmp_path / "layer.py"
    path.write_text("from torch import nn\n\n\n"
                    "class Layer(nn.TransformerEncoderLayer):\n"
                    "    def __init__(self):\n"
                    "        super().__init__(d_model=64, nhead=4, dim_feedforward=128,\n"
                    "                         batch_first=True)\n")
    args = ("trace", f"{path}:Layer", "--input", "src=B,N,64", "--seq", "64", "--batch", "2",
            "--json")
    code, out, err = run(capsys, *args, "--compile")
    assert code == 0, err
    compiled = json.loads(out)
    eager = json.loads(run(capsys, *args)[1])
    assert any(c["name"].startswith("efficient out") for c in compiled["components"])
    assert compiled["saved_bytes"] < eager["saved_bytes"]


def test_blocks_compiled_in_a_constructor_are_compiled_in_each_ranks_copy(capsys):
    """``--fsdp`` shards a deep copy of the model per rank: the blocks its constructor
    compiled (torchtitan's apply_compile: ``torch.compile(block)`` put in place) are the
    trace's compiled blocks in the copy too, not dynamo's, which would trace the trace's
    own torch-function modes into its graph and stop."""
    code, out, err = run(capsys, "trace", "memcalc/validation/compiled.py:BlockCompiledLM",
                         "--input", "ids=B,N:int64", "--input", "labels=B,N:int64",
                         "--seq", "256", "--batch", "2", "--optimizer", "adamw", "--fsdp", "2")
    assert code == 0, err
    assert "fully_shard on each of the 2 OptimizedModule blocks" in out
    assert "torch.compile followed as inductor compiles it for the GPU" in out
