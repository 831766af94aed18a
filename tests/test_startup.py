"""Ctrl-C while the ``memcalc`` command starts (memcalc/startup.py): held until the
command's ``main`` answers it with its one line, wherever in start-up it came."""

import os
import subprocess
import sys
import textwrap

import pytest

from memcalc import startup

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
    assert startup.the_command() is command
    with pytest.raises(SystemExit if command else KeyboardInterrupt):
        startup.interrupted()


def _run(code: str, *argv: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (this worktree's memcalc first on the path)."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *argv], env=env,
                          capture_output=True, text=True, timeout=120)


needs_sigmask = pytest.mark.skipif(not hasattr(__import__("signal"), "pthread_sigmask"),
                                   reason="SIGINT is held only where it can be blocked")


@needs_sigmask
def test_a_held_ctrl_c_is_raised_when_released():
    """Held, a SIGINT raises nothing; released, it is a KeyboardInterrupt there. (In a
    fresh interpreter: threads started before the hold, pytest's own, would take it.)"""
    done = _run("""
        import os, signal, time
        from memcalc import startup
        startup.hold()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        print("held")
        try:
            startup.release()
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
