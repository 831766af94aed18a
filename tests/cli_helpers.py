"""Running the command line inside a test, and the contract for bad input."""

from memcalc.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of ``memcalc *argv`` (``--help`` exits through
    ``SystemExit``, status 0)."""
    try:
        code = main(list(argv))
    except SystemExit as stop:
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_refused(code: int, out: str, err: str, option: str) -> None:
    """Bad input: exit status 2, nothing on stdout, one line on stderr that names the
    option, no traceback."""
    assert code == 2 and out == "", (code, out)
    assert err.count("\n") == 1 and option in err and "Traceback" not in err, err
