"""The command line: thin, exact, one line and exit 2 on bad input, no heavy imports."""

import json
import subprocess
import sys

import pytest

from cli_helpers import assert_refused, run


def test_breakdown_json_has_figures_and_components(capsys):
    code, out, _ = run(capsys, "breakdown", "--seq", "16384", "--impl", "naive-softmax", "--json")
    data = json.loads(out)
    assert code == 0
    assert data["saved_bytes"] == 8 * 16384 * 16384 * 4  # p, fp32
    assert {"name", "shape", "dtype", "bytes"} <= set(data["components"][0])
    assert data["peak_bytes"] == max(data["forward_peak_bytes"], data["backward_peak_bytes"])


def test_breakdown_csv_and_markdown(capsys):
    _, csv_out, _ = run(capsys, "breakdown", "--seq", "1024", "--csv")
    lines = csv_out.splitlines()
    assert lines[0] == "name,made_by,role,op,dtype,formula,bytes,allocated,share"  # JSON's keys
    # exp_x: 8 x 1 x 1024 x 1024 x 4 B = 33,554,432 B asked for, and its block, a number;
    # its share of the peak 33,554,432 / 271,679,488 = 0.1235074..., not "12.4%"
    assert lines[3] == ('exp_x,"exp: e = exp(s - m), kept by ExpBackward0 and DivBackward0",'
                        'saved,exp,float32,8 x 1 x 1024 x 1024 x 4 B,33554432,33554432,0.123507')
    _, md, _ = run(capsys, "breakdown", "--seq", "1024", "--markdown")
    assert "| saved for backward | " in md


@pytest.mark.parametrize("command", ["breakdown", "compare", "oom", "sweep"])
def test_help_says_what_each_output_format_prints(capsys, command):
    from memcalc.options import FORMATS

    code, out, _ = run(capsys, command, "--help")
    said = " ".join(out.split())  # argparse wraps the lines
    assert code == 0 and all(f"--{f} {text}" in said for f, text in FORMATS.items())


def test_every_option_of_every_command_has_help():
    from memcalc.cli import build_parser

    (commands,) = build_parser()._subparsers._group_actions
    silent = [f"{name} {action.option_strings or action.dest}"
              for name, parser in commands.choices.items() for action in parser._actions
              if not action.help]
    assert silent == []


def test_huge_sizes_stay_exact(capsys):
    _, out, _ = run(capsys, "breakdown", "--seq", str(2**22), "--batch", "4096",
                    "--impl", "naive-softmax", "--json")
    # p: 4096 x 1 x 2^22 x 2^22 x 4 B = 2^12 x 2^44 x 2^2 = 2^58
    assert json.loads(out)["saved_bytes"] == 2**58


def test_sizes_may_be_written_in_exponent_notation(capsys):
    """``--seq 1e3`` is 1,000 rows exactly (flash2 at N = 1000 holds no N x N tensor, so
    the peak is small); ``2.5e1`` is 25; so are the lists and ranges of ``sweep``."""
    _, out, _ = run(capsys, "breakdown", "--seq", "1e3", "--batch", "2.5e1", "--impl", "flash2",
                    "--json")
    assert (json.loads(out)["config"]["shape"]["seq_len"],
            json.loads(out)["config"]["shape"]["batch"]) == (1000, 25)
    _, out, _ = run(capsys, "sweep", "--seq", "1e3:3e3:1e3,4_096", "--impl", "flash2", "--csv")
    assert [row.split(",")[5] for row in out.splitlines()[1:]] == ["1000", "2000", "3000", "4096"]


@pytest.mark.parametrize("argv, field", [
    (["--seq", "0"], "--seq"),
    (["--batch", "-2"], "--batch"),
    (["--seq", "1.5"], "--seq"),
    (["--seq", "1.5e0"], "--seq"),
    (["--seq", "inf"], "--seq"),
    (["--chunk", "1e-3"], "--chunk"),
    (["--head-dim", "x"], "--head-dim"),
    (["--impl", "flashy"], "--impl"),
    (["--dtype", "fp8"], "--dtype"),
    (["--gpu", "tpu"], "--gpu"),
    (["--cublas-workspace-config", "4096"], "--cublas-workspace-config"),
    (["--loss", "mean"], "--loss"),
    (["--bogus"], "--bogus"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, field):
    code, out, err = run(capsys, "breakdown", *argv)
    assert_refused(code, out, err, field)


@pytest.mark.parametrize("command", ["breakdown", "compare", "oom", "sweep", "trace"])
def test_a_loss_under_forward_only_is_refused(capsys, tmp_path, command):
    """--forward-only runs no backward: a --loss given with it was silently ignored."""
    (tmp_path / "user.py").write_text("def attn(q, k, v):\n    return q * v\n")
    target = [f"{tmp_path}/user.py:attn"] if command == "trace" else []
    code, out, err = run(capsys, command, *target, "--forward-only", "--loss", "sum")
    assert_refused(code, out, err, "--loss sum: --forward-only runs no backward")


@pytest.mark.parametrize("impl", ["naive,flash2", "all"])
def test_breakdown_takes_one_implementation_and_says_where_several_go(capsys, impl):
    code, out, err = run(capsys, "breakdown", "--impl", impl)
    assert_refused(code, out, err, "--impl")
    assert f"memcalc compare --impl {impl}" in err


def test_validate_of_implementations_the_grid_has_not_is_one_line(capsys):
    """The fused kernels are modelled from CUDA sources: the emulated grid has none of them,
    and "0 configurations, 0 mismatches" with exit 0 said nothing was wrong."""
    code, out, err = run(capsys, "validate", "--impl", "sdpa-flash,sdpa-efficient")
    assert_refused(code, out, err, "--impl")
    assert "--backend cuda" in err


def test_validate_of_a_traced_implementation_a_grid_has_not_blames_no_kernel(capsys, tmp_path):
    """flash2 is traced: a grid of naive only simply has none of it (the message said that
    kernels modelled from CUDA sources have no meta-device trace)."""
    grid = tmp_path / "grid.json"
    grid.write_text('{"name": "g", "configs": [{"impl": "naive", "shape": {"seq_len": 64}}]}')
    code, out, err = run(capsys, "validate", "--grid", str(grid), "--impl", "flash2")
    assert_refused(code, out, err, "--impl")
    assert err.rstrip().endswith("the grid has no configuration of flash2")


def test_malformed_grid_file(capsys, tmp_path):
    grid = tmp_path / "grid.json"
    grid.write_text('{"name": "g", "products": [{"impl": ["naive"], "seq_len": [0]}]}')
    code, _, err = run(capsys, "validate", "--grid", str(grid))
    assert code == 2 and err.count("\n") == 1 and "seq_len" in err


def test_cli_path_imports_no_torch_matplotlib_pandas():
    code = ("import sys; from memcalc.cli import main; main(['breakdown', '--seq', '1024', "
            "'--json']); print(sorted(m for m in ('torch', 'matplotlib', 'pandas') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_lists(capsys):
    assert run(capsys, "impls")[0] == 0
    code, out, _ = run(capsys, "gpus")
    assert code == 0 and "h100-80gb" in out


def without_torch(monkeypatch) -> None:
    import sys

    for name in [m for m in sys.modules if m.startswith(("memcalc.validation.", "memcalc.tracing",
                                                         "torch"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError


@pytest.mark.parametrize("argv, needing", [
    (["validate", "--impl", "naive"], "validate"),
    (["trace", "examples/custom_softmax/variants.py:reciprocal"], "trace"),
    # oom itself needs no torch: the option that asked for a trace is named
    (["oom", "--trace", "examples/custom_softmax/variants.py:reciprocal"], "oom --trace"),
])
def test_without_torch_one_line_and_exit_2(capsys, monkeypatch, argv, needing):
    """``pip install .`` has no torch: the commands that need it say how to get it."""
    without_torch(monkeypatch)
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err == (f"memcalc: error: {needing} needs PyTorch, which is not installed: pip "
                   f"install torch (the CPU build is enough)\n")


def test_without_torch_the_api_says_what_needs_it(monkeypatch):
    """``memcalc.trace`` raised a bare ``No module named 'torch'`` from inside the tracer."""
    import memcalc

    without_torch(monkeypatch)
    with pytest.raises(ImportError, match=r"^memcalc.trace needs PyTorch, which is not "
                                          r"installed: pip install torch"):
        memcalc.trace(lambda q, k, v: q, seq_len=8)


@pytest.mark.parametrize("argv, option, says", [
    (["--impl", "sdpa-flash"], "--dtype", "FlashAttention supports fp16 and bf16 only"),
    (["--impl", "sdpa-flash", "--dtype", "fp16", "--head-dim", "300"], "--head-dim",
     "head_dim 300 > 256"),
    (["--impl", "sdpa-efficient", "--head-dim", "7"], "--head-dim", "not a multiple of 4"),
    (["--impl", "sdpa-efficient", "--gpu", "t4"], "--gpu", "8.0 and 9.0, not 7.5"),
    (["--impl", "sdpa-flash", "--dtype", "fp16", "--gpu", "t4"], "--gpu", "not 7.5"),
    (["--impl", "sdpa-flash", "--dtype", "fp16", "--causal", "--kv-len", "100"], "--kv-len",
     "kv_len != seq_len"),
], ids=["dtype", "head dim over", "head dim step", "efficient gpu", "flash gpu", "kv-len"])
def test_a_kernels_refusal_names_the_option(capsys, argv, option, says):
    """The fused kernels' refusals named no option (``sdpa-flash: FlashAttention supports
    fp16 and bf16 only``; the compute capability without --gpu nor the GPU's own)."""
    code, out, err = run(capsys, "breakdown", "--seq", "256", *argv)
    assert_refused(code, out, err, option)
    assert err.startswith(f"memcalc: error: {option}: ") and says in err


@pytest.mark.parametrize("argv", [
    ["breakdown", "--chunk", "128"],
    ["compare", "--chunk", "128", "--impl", "naive,flash2"],
    ["oom", "--chunk", "128", "--impl", "naive"],
    ["sweep", "--chunk", "128", "--impl", "naive"],
], ids=["breakdown", "compare", "oom", "sweep"])
def test_a_chunk_no_implementation_reads_is_refused(capsys, argv):
    """--chunk with naive ran, and even showed chunk=128 in the title: nothing reads it."""
    code, out, err = run(capsys, *argv, "--seq", "256")
    assert_refused(code, out, err, "--chunk")
    assert "only linear-causal-chunked, checkpoint-linear-causal-chunked read it" in err


def test_a_chunk_applies_to_the_chunked_implementations_among_several(capsys):
    code, out, _ = run(capsys, "compare", "--chunk", "128", "--impl",
                       "naive,linear-causal-chunked", "--seq", "256", "--json")
    assert code == 0 and json.loads(out)["rows"][1]["impl"] == "linear-causal-chunked"


def test_trace_refuses_what_it_cannot_pass_on(capsys, tmp_path):
    """trace took --impl and ignored it; --causal reaches a function only as an argument,
    --chunk never."""
    (tmp_path / "user.py").write_text("def attn(q, k, v):\n    return q * v\n")
    target = f"{tmp_path}/user.py:attn"
    code, out, err = run(capsys, "trace", target, "--seq", "8", "--causal")
    assert_refused(code, out, err, "--causal")
    code, out, err = run(capsys, "trace", target, "--seq", "8", "--chunk", "4")
    assert_refused(code, out, err, "--chunk")
    code, out, err = run(capsys, "trace", target, "--seq", "8", "--impl", "naive")
    assert code == 2 and "unrecognized arguments: --impl naive" in err
    assert "--impl is an option of breakdown, compare, oom, sweep and validate, not of trace" \
        in err  # it suggested --plot, the closest spelling


@pytest.mark.parametrize("argv, said", [
    (["gpus", "--seq", "5"], "--seq is an option of breakdown, compare, oom, sweep, trace and "
                             "validate, not of gpus"),
    (["breakdown", "--solve", "batch"], "--solve is an option of oom, not of breakdown"),
    (["--seq=5", "breakdown"], "--seq goes after the command (memcalc breakdown --seq ...)"),
    (["--seq", "5"], "--seq: options follow a command (memcalc COMMAND --seq ...); --seq is an "
                     "option of breakdown, compare, oom, sweep, trace and validate"),
    (["breakdown", "--sq", "5"], "--sq (did you mean '--seq'?)"),
])
def test_an_option_in_the_wrong_place_says_where_it_belongs(capsys, argv, said):
    """An option another command takes, or that came before its command, is named with
    the commands that take it, not answered with the closest spelling ('invalid choice:
    5' for ``memcalc --seq 5``)."""
    code, out, err = run(capsys, *argv)
    assert_refused(code, out, err, argv[0] if argv[0].startswith("-") else argv[1])
    assert said in err


def test_breakdown_takes_one_impl_repeated_or_not(capsys):
    """compare takes --impl repeated; breakdown kept the last of two, silently."""
    code, out, err = run(capsys, "breakdown", "--impl", "naive", "--impl", "flash2")
    assert_refused(code, out, err, "--impl")
    assert "given twice (naive, then flash2)" in err


def test_memcalc_alone_lists_the_commands(capsys):
    """``memcalc`` alone said ``the following arguments are required: command`` and no
    more: its one line lists the commands, and where to read what each does."""
    assert run(capsys) == (2, "", "memcalc: error: give a command: breakdown, compare, gpus, "
                                  "impls, oom, sweep, trace or validate (memcalc --help says "
                                  "what each does)\n")


def test_version_prints_it(capsys):
    """``memcalc --version`` said a command was required."""
    import memcalc

    assert run(capsys, "--version") == (0, f"memcalc {memcalc.__version__}\n", "")


@pytest.mark.parametrize("argv, line", [
    # argparse's own refusals read as the configuration's: "--seq: ...", not "argument --seq:"
    (["breakdown", "--seq", "abc"], "--seq: 'abc' is not a whole number (1024, 1_000_000 or 1e6)"),
    (["breakdown", "--seq", "0"], "--seq: Input should be greater than or equal to 1 (got 0)"),
    (["breakdown", "--block-mask", "x"], "--block-mask: invalid choice: 'x' (choose from "
                                         "'given', 'dense')"),
    (["breakdown", "--impl", "naive", "--impl", "flash2"], "--impl: given twice (naive, then "
                                                           "flash2); it takes one value"),
])
def test_every_refusal_names_its_option_in_one_format(capsys, argv, line):
    code, out, err = run(capsys, *argv)
    assert (code, out, err) == (2, "", f"memcalc: error: {line}\n")


RAISES = '''def attn(q, k, v):
    raise RuntimeError("kaput")
'''


@pytest.mark.parametrize("argv, named", [
    (["trace", "{target}", "--seq", "64"], "target"),
    (["oom", "--trace", "{target}", "--gpu-gb", "80"], "--trace"),
    (["sweep", "--trace", "{target}", "--seq", "64"], "--trace"),
])
def test_a_traced_target_that_fails_is_named_by_every_command(capsys, tmp_path, argv, named):
    """``oom --trace`` and ``sweep --trace`` gave the target's failure with neither the
    target nor the option: each names the argument that named the target, and the target,
    as ``trace`` does (``target F:N: ...``; ``--trace F:N: ...``)."""
    pytest.importorskip("torch")
    path = tmp_path / "raises.py"
    path.write_text(RAISES)
    target = f"{path}:attn"
    code, out, err = run(capsys, *(a.format(target=target) for a in argv))
    assert (code, out) == (2, "")
    assert err == (f"memcalc: error: {named} {target}: line 2 of raises.py (raise "
                   f"RuntimeError(\"kaput\")) raised RuntimeError: kaput\n")


def test_plot_without_matplotlib_names_the_option_and_the_extra(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed
    code, _, err = run(capsys, "breakdown", "--seq", "1024", "--plot", str(tmp_path / "t.png"))
    assert (code, err) == (2, "memcalc: error: --plot: drawing needs matplotlib, which is not "
                              "installed: pip install 'memcalc[plot]'\n")


def test_a_target_importing_a_missing_extra_says_how_to_install_it(capsys, monkeypatch,
                                                                   tmp_path):
    """The DeepSpeed examples without DeepSpeed ended in ``No module named 'deepspeed'``
    and nothing on how to get it."""
    pytest.importorskip("torch")
    path = tmp_path / "uses_deepspeed.py"
    path.write_text("from deepspeed.sequence.layer import DistributedAttention\n\n\n"
                    "def attn(q, k, v):\n    return q\n")
    for name in [m for m in sys.modules if m == "deepspeed" or m.startswith("deepspeed.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # not installed
    code, _, err = run(capsys, "trace", f"{path}:attn", "--seq", "64")
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"memcalc: error: target {path}:attn: importing {path} failed: "
                          f"ModuleNotFoundError: ")
    assert err.endswith("; pip install 'memcalc[deepspeed]'\n")


@pytest.mark.parametrize("variable", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
def test_the_allocators_settings_come_from_the_option_or_the_environment(
        capsys, monkeypatch, variable):
    """``--alloc-conf``, else PYTORCH_ALLOC_CONF or its older name, as a launch script sets
    them; named in the title; a setting the model cannot follow is one line."""
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    code, plain, err = run(capsys, "breakdown", "--seq", "1024", "--json")
    monkeypatch.setenv(variable, "expandable_segments:True")
    code, out, err = run(capsys, "breakdown", "--seq", "1024", "--json")
    assert code == 0, err
    data, default = json.loads(out), json.loads(plain)
    assert data["config"]["protocol"]["alloc_conf"] == "expandable_segments:True"
    assert default["config"]["protocol"]["alloc_conf"] is None
    assert data["peak_bytes"] == default["peak_bytes"]  # the blocks alike here
    code, out, err = run(capsys, "breakdown", "--seq", "1024", "--alloc-conf",
                         "expandable_segments:False")
    assert code == 0 and "ALLOC_CONF" not in out.splitlines()[0]
    assert_refused(*run(capsys, "breakdown", "--alloc-conf", "garbage_collection_threshold:0.6"),
                   "--alloc-conf")
