"""memcalc.errors: bad input as one line, the field named by the CLI option that sets it."""

import inspect
import os
import signal
import subprocess
import sys
import textwrap
from typing import Annotated

import pytest
from pydantic import AfterValidator, BaseModel, TypeAdapter, ValidationError

from memcalc.cli import build_parser
from memcalc.config import Config, make_config
from memcalc import errors
from memcalc.errors import FLAGS, one_line

GE_1 = "Input should be greater than or equal to 1"


def refusal(make, *args, **kwargs) -> ValueError:
    """The ValueError (pydantic's ValidationError is one) that ``make(*args, **kwargs)``
    raises; ``make_config`` makes it one line already, which ``one_line`` keeps."""
    with pytest.raises(ValueError) as caught:
        make(*args, **kwargs)
    return caught.value


def test_flags_are_the_options_that_set_each_field():
    """Every field a user can get wrong on the command line (make_config's keywords, less
    the --forward-only switch; --causal is, for a traced function without the argument)
    maps to an option the parser really has; so do the limits on the work (memcalc.engine.work,
    --time-limit), which every command that replays has, and oom's --work-limit."""
    (sub,) = build_parser()._subparsers._group_actions
    options = {name: set(parser._option_string_actions) for name, parser in sub.choices.items()}
    fields = set(inspect.signature(make_config).parameters) - {"forward_only"}
    assert set(FLAGS) == fields | {"time_limit", "memory_limit", "work_limit"}
    for field, flag in FLAGS.items():
        assert flag in options["oom" if field == "work_limit" else "breakdown"], (field, flag)
    for command in ("breakdown", "compare", "sweep", "oom", "trace"):
        assert {"--time-limit", "--memory-limit"} <= options[command], command


def test_a_field_is_named_by_its_option_and_the_value_got_is_quoted():
    """``field: message (got value)``: the option when ``flags`` maps the field, else the
    field; the value as ``repr`` (a string quoted, a newline in it escaped: still one line)."""
    zero = refusal(make_config, seq_len=0)
    assert one_line(zero, FLAGS) == f"--seq: {GE_1} (got 0)"
    assert one_line(zero) == one_line(zero, {}) == f"seq_len: {GE_1} (got 0)"
    fp8 = refusal(make_config, dtype="fp8\nrm")
    assert one_line(fp8, FLAGS) == (
        "--dtype: Input should be 'fp32', 'fp16' or 'bf16' (got 'fp8\\nrm')")


def test_a_near_miss_of_a_choice_is_suggested():
    """``--loss gard`` and ``--dtype bf61`` listed the choices without the one meant."""
    assert one_line(refusal(make_config, loss="gard"), FLAGS) == (
        "--loss: Input should be 'grad' or 'sum' (got 'gard'); did you mean 'grad'?")
    assert one_line(refusal(make_config, dtype="bf61"), FLAGS).endswith(
        "(got 'bf61'); did you mean 'bf16'?")
    assert one_line(refusal(make_config, loss="zzz"), FLAGS).endswith("(got 'zzz')")


def test_a_nested_field_is_named_by_its_last_part_or_its_dotted_path():
    """A Config read from a dict fails at ``shape.head_dim``: ``--head-dim`` with the flags,
    the dotted path without; a nested field no option sets keeps its path."""
    head_dim = refusal(Config.model_validate, {"shape": {"head_dim": 0}})
    assert one_line(head_dim, FLAGS) == f"--head-dim: {GE_1} (got 0)"
    assert one_line(head_dim) == f"shape.head_dim: {GE_1} (got 0)"
    memory = refusal(Config.model_validate, {"device": {"memory_bytes": 0}})
    assert one_line(memory, FLAGS) == f"device.memory_bytes: {GE_1} (got 0)"


def test_pydantic_value_error_framing_is_dropped():
    """A validator's ValueError reads as its own message, without "Value error, "."""
    error = refusal(make_config, cublas_workspace_config="4096")
    assert one_line(error, FLAGS) == ('--cublas-workspace-config: must look like ":4096:8" or '
                                      '":4096:2:16:8" (SIZE_KiB:COUNT pairs) (got \'4096\')')


def test_a_check_across_fields_is_its_message_alone():
    """No location: the message names the fields itself; no "(got ...)" of a whole model."""
    assert one_line(refusal(make_config, heads=4, kv_heads=3), FLAGS) == (
        "--kv-heads: 3 must divide heads (4)")
    assert one_line(refusal(make_config, impl="naive", heads=4, kv_heads=2), FLAGS) == (
        "--kv-heads: implementation naive needs kv_heads == heads (2 != 4)")
    assert one_line(refusal(make_config, heads=4, kv_heads=3)) == (  # the API's: no option
        "kv_heads: 3 must divide heads (4)")


def _even(value: int) -> int:
    if value % 2:
        raise ValueError("must be even")
    return value


class _Chunked(BaseModel):
    chunk: Annotated[int, AfterValidator(_even)] | list[int]


def test_validator_steps_are_left_out_of_the_location():
    """In a union pydantic puts ``function-after[...]`` into the location: not a field, so
    the field before it names the option, and with nothing left the message stands alone."""
    assert one_line(refusal(_Chunked, chunk=3), FLAGS) == "--chunk: must be even (got 3)"
    adapter = TypeAdapter(Annotated[int, AfterValidator(_even)] | list[int])
    assert one_line(refusal(adapter.validate_python, 3), FLAGS) == "must be even"


def test_only_the_first_of_several_errors():
    """Two bad fields: pydantic's text is a header and two entries; one_line is the first."""
    error = refusal(Config.model_validate, {"shape": {"seq_len": 0}, "dtype": "fp8"})
    assert error.error_count() == 2 and str(error).startswith("2 validation errors for Config\n")
    assert one_line(error, FLAGS) == f"--seq: {GE_1} (got 0)"


class _Listed(Exception):
    errors = ["not a method"]  # an ``errors`` that is no pydantic method: read as text


def test_any_other_error_is_its_first_line_or_its_type():
    assert one_line(ValueError("first line\nsecond line"), FLAGS) == "first line"
    assert one_line(FileNotFoundError(2, "No such file or directory", "/x.json")) == (
        "[Errno 2] No such file or directory: '/x.json'")
    assert one_line(RuntimeError()) == "RuntimeError"
    assert one_line(_Listed("listed\nmore")) == "listed"


class Chunked(BaseModel):
    chunk: Annotated[int, AfterValidator(lambda v: (_ for _ in ()).throw(
        ValueError("line one\nline two")))]


class Outer(BaseModel):
    shape: Config


def test_every_message_is_one_line_and_says_something():
    """A validator's message with a newline keeps its first line; a message that starts
    with one, its first line that says something; a check across a nested model's fields
    is not followed by the whole model as the value it got."""
    assert one_line(refusal(Chunked, chunk=1), FLAGS) == "--chunk: line one (got 1)"
    assert one_line(ValueError("\nsecond")) == "second"
    error = refusal(Outer, shape={"impl": "sdpa-math", "shape": {"heads": 4, "kv_heads": 3}})
    assert one_line(error, FLAGS) == "shape.shape: kv_heads: 3 must divide heads (4)"


def test_a_library_field_prefix_becomes_the_option():
    """``kv_len: ...`` raised by the library (the vectorized grid) names ``--kv-len`` when the
    flags are given; without them, for a prefix that is no field, or with no ``: `` after the
    word, the text is kept."""
    from memcalc.analysis.vectorized import grid_axes

    with pytest.raises(ValueError) as caught:
        grid_axes(Config(), kv_len=0)
    assert one_line(caught.value, FLAGS) == "--kv-len: sizes must be >= 1 (got 0)"
    assert one_line(caught.value) == "kv_len: sizes must be >= 1 (got 0)"
    assert one_line(ValueError("seq: not a configuration field\nknown: ..."), FLAGS) == (
        "seq: not a configuration field")
    assert one_line(ValueError("dtype"), FLAGS) == "dtype"  # a field's name, no "field: "


def test_a_refusal_drops_the_name_the_line_already_shows():
    """A skip line or a row names the implementation: its refusal does not again
    ("sdpa-flash: skipped, sdpa-flash: FlashAttention..."); anything but a ValueError is
    what the model raised."""
    from memcalc.errors import refusal

    assert refusal(ValueError("sdpa-flash: fp16 only\nmore"), "sdpa-flash") == "fp16 only"
    assert refusal(ValueError("--dtype: fp16 only"), "sdpa-flash") == "--dtype: fp16 only"
    assert refusal(ValueError("--dtype: sdpa-flash: fp16 only"), "sdpa-flash") == \
        "--dtype: fp16 only"
    assert refusal(KeyError("x"), "naive") == "the model raised KeyError: 'x'"


def test_a_missing_extra_is_named_with_how_to_install_it(monkeypatch):
    """``require``: the package, or one line naming what needs it and memcalc's extra."""
    from memcalc.errors import MissingExtra, require

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed
    with pytest.raises(MissingExtra, match=r"^drawing needs matplotlib, which is not "
                                           r"installed: pip install 'memcalc\[plot\]'$"):
        require("matplotlib", "drawing")
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ImportError, match=r"^memcalc.trace needs PyTorch, which is not "
                                          r"installed: pip install torch \(the CPU build"):
        require("torch", "memcalc.trace")
    assert require("json", "reading").dumps(1) == "1"


def test_error_line_says_what_a_user_can_act_on_and_nothing_else():
    """Bad input and a missing extra are one line; a bug (a RuntimeError, an ImportError of
    nothing an extra installs) is None: its traceback stands."""
    from memcalc.errors import error_line

    assert error_line(ValueError("--seq: too long\nmore")) == "--seq: too long"
    assert error_line(ModuleNotFoundError("No module named 'deepspeed'", name="deepspeed")) \
        == "No module named 'deepspeed'; pip install 'memcalc[deepspeed]'"
    assert error_line(ModuleNotFoundError("No module named 'transformers.x'",
                                          name="transformers.x")).endswith("'memcalc[hf]'")
    assert error_line(ModuleNotFoundError("No module named 'nosuch'", name="nosuch")) is None
    assert error_line(RuntimeError("a bug")) is None


@pytest.mark.parametrize("raised, code, err", [
    (ValueError("--x: bad"), 2, "prog.py: error: --x: bad\n"),
    (KeyboardInterrupt(), 130, "prog.py: interrupted\n"),
    (None, 0, ""),
])
def test_run_main_ends_a_script_as_the_command_ends(capsys, raised, code, err):
    """A script's bad input: one line and status 2; Ctrl-C: one line and 130; else 0."""
    from memcalc.errors import run_main

    def main():
        if raised is not None:
            raise raised

    with pytest.raises(SystemExit) as done:
        run_main(main, prog="prog.py")
    assert (done.value.code, capsys.readouterr().err) == (code, err)


def test_run_main_leaves_a_bugs_traceback():
    from memcalc.errors import run_main

    def main():
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        run_main(main, prog="prog.py")


# --- Ctrl-C while the command starts ----------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("argv, orig, command", [
    (["/venv/bin/memcalc", "breakdown"], ["python", "/venv/bin/memcalc", "breakdown"], True),
    (["-m", "breakdown"], ["python", "-m", "memcalc.cli", "breakdown"], True),
    (["notebook.py"], ["python", "notebook.py"], False),
    (["-m"], ["python", "-m", "pytest"], False),
])
def test_a_ctrl_c_while_the_package_loads_is_the_commands_only_there(monkeypatch, argv,
                                                                      orig, command):
    """``import memcalc`` takes ~0.1 s (the configuration models, for the signatures): a
    Ctrl-C there is the command's one line and status 130 when the process is the
    ``memcalc`` command, and stays a KeyboardInterrupt for any other code."""
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(sys, "orig_argv", orig, raising=False)
    assert errors.the_command() is command
    with pytest.raises(SystemExit if command else KeyboardInterrupt):
        errors.interrupted()


def _run(code: str, *argv: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (this worktree's memcalc first on the path), started
    as a shell starts a command: SIGINT unblocked and at its default (a child inherits
    both from this process, whatever the tests before left in it)."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *argv], env=env,
                          capture_output=True, text=True, timeout=120,
                          preexec_fn=_as_a_shell_starts_it)


def _as_a_shell_starts_it() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


needs_sigmask = pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"),
                                   reason="SIGINT is held only where it can be blocked")


@needs_sigmask
def test_a_held_ctrl_c_is_raised_when_released():
    """Held, a SIGINT raises nothing; released, it is a KeyboardInterrupt there. (In a
    fresh interpreter: threads started before the hold, pytest's own, would take it.)"""
    done = _run("""
        import os, signal, time
        from memcalc import errors
        errors.hold()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        print("held")
        try:
            errors.release()
        except KeyboardInterrupt:
            print("raised at release")
    """)
    assert done.stdout == "held\nraised at release\n", done.stderr


@needs_sigmask
@pytest.mark.parametrize("module", ["datetime", "pydantic", "argparse"])
def test_a_ctrl_c_at_any_import_of_the_command_is_its_one_line(module):
    """The command, SIGINT sent to itself the moment start-up imports ``module``: while
    pydantic_core (Rust, PyO3) imports the datetime C API that was ``pyo3_runtime.
    PanicException: failed to import datetime C API`` and a traceback; while the entry
    point imports ``memcalc.cli`` (argparse), a bare KeyboardInterrupt. Now both are
    ``memcalc: interrupted`` and status 130."""
    done = _run(f"""
        import os, signal, sys
        sys.argv[0] = "memcalc"

        class Interrupt:  # Ctrl-C as the import of {module!r} begins
            def find_spec(self, name, path=None, target=None):
                if name == {module!r}:
                    sys.meta_path.remove(self)
                    os.kill(os.getpid(), signal.SIGINT)
                return None

        sys.meta_path.insert(0, Interrupt())
        from memcalc.cli import main
        sys.exit(main(["gpus"]))
    """)
    assert (done.returncode, done.stderr) == (130, "memcalc: interrupted\n")
    assert done.stdout == ""


def test_the_package_imported_by_other_code_leaves_ctrl_c_as_it_was():
    """``import memcalc`` from other code: SIGINT is not left blocked (a Ctrl-C after it is
    the usual KeyboardInterrupt, at once)."""
    done = _run("""
        import os, signal, time
        import memcalc
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
            print("not interrupted")
        except KeyboardInterrupt:
            print("interrupted")
    """)
    assert done.stdout == "interrupted\n", done.stderr
