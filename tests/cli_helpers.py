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


def csv_as_json(text: str) -> list[dict]:
    """The rows of a CSV, each cell read back as JSON would hold it: empty -> None, an
    integer -> int, a decimal (``0.25``, ``1.5e-05``) -> float, True/False -> bool, else
    the text (to compare a result's CSV with its JSON records cell by cell)."""
    import csv
    import io
    import re

    def value(cell: str):
        if cell == "":
            return None
        if cell in ("True", "False"):
            return cell == "True"
        if re.fullmatch(r"-?\d+", cell):
            return int(cell)
        return float(cell) if re.fullmatch(r"-?\d+\.\d+(e-?\d+)?|-?\d+e-?\d+", cell) else cell

    return [{k: value(v) for k, v in row.items()} for row in csv.DictReader(io.StringIO(text))]
