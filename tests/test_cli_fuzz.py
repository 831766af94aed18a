"""The command line under random and malformed input (hypothesis): every subcommand, fed
argument lists built from its real options and hostile values, ends with exit status 0,
1 (``validate`` on a mismatch) or 2; on 2 with exactly one stderr line that names an
option, never a traceback and never an unhandled exception.

Sizes that make long computations (large ``--seq`` with chunked implementations, ``oom``
on them, ``validate`` on the shipped grid) are kept out so that this file runs in seconds.
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memcalc.cli import build_parser
from memcalc.impls import impl_names
from cli_helpers import run

IMPLS = set(impl_names())

SETTINGS = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 50)), deadline=None,
                    database=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])
FAST_IMPLS = ["naive", "naive-softmax", "naive-weights", "sdpa-math", "sdpa-flash",
              "sdpa-efficient", "linear", "checkpoint-naive"]
GPUS = ["h100-80gb", "a100-40gb", "t4", "H100-80GB", "h100", "tpu", ""]
SIZE_OPTIONS = {"--seq", "--kv-len", "--batch", "--heads", "--kv-heads", "--head-dim"}
PATH_OPTIONS = {"--plot", "--out", "--grid"}
BAD_PATHS = ["/nonexistent-dir/x.png", "/", "/proc/self", "/dev/null/x.json", ""]
HUGE = "10" * 30
ODD = ["", " ", "-1", "0", "-0", "1.5", "1e3", "nan", "inf", "-inf", "x", "1,,x", ",", "1,",
       ",2", "1:8:0", "8:1:1", "1:2:3:4", "é", "٣", "½", "\u200b", "0x10", "1_0", HUGE,
       "--seq", "-", "1/0", "512MiB", "1.5GiB", "-1GiB", "1e400", "0.1"]


ARGPARSE = {"unrecognized arguments: ", "the following arguments are required: "}


def subcommands() -> dict:
    """Each subcommand's parser, by name (from the real CLI parser)."""
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return dict(sub.choices)


def options(name: str) -> dict[str, int | None]:
    """``option -> nargs`` for the subcommand's optional arguments (0: a flag)."""
    found = {}
    for action in subcommands()[name]._actions:
        for flag in action.option_strings:
            found[flag] = 0 if action.nargs == 0 else 1
    return found


def option_names(name: str) -> set[str]:
    """Every option string and positional name the subcommand knows."""
    names = set(options(name)) - {"-h", "--help"}
    for action in subcommands()[name]._actions:
        if not action.option_strings:
            names |= {action.dest, str(action.metavar)}
    return names


def safe_int(limit: int) -> st.SearchStrategy[str]:
    return st.integers(1, limit).map(str)


def value(flag: str, command: str) -> st.SearchStrategy[str]:
    """A value for ``flag``: valid (small enough to be fast) or hostile."""
    if flag in PATH_OPTIONS:
        return st.sampled_from(BAD_PATHS)
    odd = [o for o in ODD if not (command == "sweep" and o == HUGE)]  # test_sweep_huge_sizes
    hostile = st.one_of(st.sampled_from(odd), st.text(max_size=6),
                        st.integers(-10**30, 0).map(str),
                        st.floats(allow_nan=True).map(str))
    if flag in SIZE_OPTIONS:
        top = 64 if command in ("oom", "compare") else 512
        valid = (st.lists(safe_int(top), min_size=1, max_size=3).map(",".join)
                 if command == "sweep" else safe_int(top))
        return st.one_of(valid, hostile)
    if flag == "--chunk":
        return st.one_of(st.integers(16, 10**6).map(str), hostile)
    if flag in ("--impl", "--only", "--baseline"):
        names = st.sampled_from(FAST_IMPLS + ["flashy", "all", "NAIVE", "trace:x"])
        return st.one_of(names, st.lists(names, min_size=1, max_size=3).map(",".join), hostile)
    if flag == "--gpu":
        return st.one_of(st.sampled_from(GPUS), hostile)
    if flag == "--dtype":
        return st.one_of(st.sampled_from(["fp32", "fp16", "bf16", "fp8", "fp32,bf16"]), hostile)
    if flag == "--loss":
        return st.one_of(st.sampled_from(["grad", "sum", "mean"]), hostile)
    if flag in ("--gpu-gb", "--reserve", "--time-limit"):
        return st.one_of(st.sampled_from(["80", "0.5", "79.5", "1e-9", "1", "40GiB"]), hostile)
    return st.one_of(st.sampled_from(["peak", "saved", "emulated", "cuda", "seq", "batch",
                                      "head-dim", ":4096:8", ":4096"]), hostile)


@st.composite
def argvs(draw, command: str) -> list[str]:
    """``command`` and a random list of its options, some without their value, some
    unknown, in random order."""
    known = options(command)
    flags = sorted(f for f in known if f not in ("-h", "--help")
                   and not (command == "sweep" and f == "--plot"))  # see test_sweep_plot
    argv = [command]
    for _ in range(draw(st.integers(0, 6))):
        flag = draw(st.one_of(st.sampled_from(flags), st.sampled_from(["--bogus", "-x", "--se"]))
                    if flags else st.sampled_from(["--bogus", "x"]))
        argv.append(flag)
        if known.get(flag) == 1 and draw(st.integers(0, 9)):  # 1 in 10: value missing
            argv.append(draw(value(flag, command)))
    return argv


def fast(argv: list[str]) -> list[str]:
    """``argv`` made quick to compute: ``oom`` and ``compare`` only on fast implementations,
    at small lengths."""
    command = argv[0]
    if command == "oom" and "--impl" not in argv:
        argv += ["--impl", "naive"]
    if command == "compare" and "--only" not in argv:
        argv += ["--only", "naive"]
    if command in ("breakdown", "compare", "oom", "trace") and "--seq" not in argv:
        argv += ["--seq", "64"]
    if command == "sweep" and "--seq" not in argv:
        argv += ["--seq", "64,128"]
    return argv


def check(code: int, out: str, err: str, argv: list[str]) -> None:
    """The contract: 0, 1 (validate only) or 2 with one line naming an option."""
    assert code in (0, 1, 2), (argv, code, err)
    assert "Traceback" not in err and "Traceback" not in out, argv
    if code == 1:
        assert argv[0] == "validate", (argv, err)
    if code == 2:
        assert err.startswith("memcalc: error: ") and err.count("\n") == 1, (argv, err)
        names = option_names(argv[0]) if argv[0] in subcommands() else {"command", "-h"}
        impl = err.removeprefix("memcalc: error: ").split(":")[0]  # an implementation's limit
        assert any(n in err for n in names | ARGPARSE) or impl in IMPLS, (argv, err)
        assert out == "", (argv, out)


@pytest.mark.parametrize("command", ["breakdown", "compare", "oom", "sweep", "gpus", "impls"])
def test_random_arguments(capsys, command):
    @SETTINGS
    @given(argvs(command))
    def fuzz(argv):
        argv = fast(argv)
        check(*run(capsys, *argv), argv)

    fuzz()


@pytest.mark.parametrize("command", ["breakdown", "compare", "oom", "sweep", "trace"])
def test_every_option_with_every_odd_value(capsys, user_files, command):
    """Systematically: each option alone with each odd value (and with none); every
    failure is listed."""
    failures = []
    shared = set(options("breakdown")) - {"--seq", "--kv-heads", "--gpu-gb"}
    for flag, nargs in options(command).items():
        if flag in ("-h", "--help") or flag in PATH_OPTIONS:
            continue
        if command in ("compare", "trace") and flag in shared:
            continue  # parsed as by breakdown (slow here: compare solves, trace traces)
        for odd in ODD if nargs else [None]:
            argv = [command, f"{user_files['file']}:f"] if command == "trace" else [command]
            argv = fast(argv + [flag] + ([] if odd is None else [odd]))
            if command == "sweep" and odd == HUGE:
                continue  # see test_sweep_huge_sizes
            try:
                check(*run(capsys, *argv), argv)
            except Exception as error:  # noqa: BLE001 - collected, reported below
                failures.append(f"{argv}: {type(error).__name__}: {str(error)[:300]}")
    assert not failures, "\n".join(failures)


@SETTINGS
@given(st.lists(st.one_of(st.text(max_size=8), st.sampled_from(["--seq", "-", "--", "-h9"])),
                max_size=4))
def test_random_words(capsys, argv):
    """No subcommand, an unknown one, or anything at all."""
    if argv and argv[0] in subcommands():
        argv = fast(argv)
        if argv[0] == "validate":
            return  # the full grid: validate has its own tests below
    check(*run(capsys, *argv), argv or ["(none)"])


@pytest.mark.parametrize("argv, option", [
    (["breakdown", "--seq", "1,,x"], "--seq"),
    (["breakdown", "--seq"], "--seq"),
    (["breakdown", "--gpu", "h100 90gb"], "--gpu"),  # "h100 80gb" is accepted
    (["breakdown", "--gpu-gb", "0"], "--gpu-gb"),
    (["breakdown", "--gpu-gb", "1/3"], "--gpu-gb"),  # no decimal: not a GB figure
    (["breakdown", "--gpu-gb", "0.1"], "--reserve"),  # 107,374,182 B, under the 512 MiB
    (["breakdown", "--gpu-gb", "0.5"], "--reserve"),  # 512 MiB, all of it reserved
    (["breakdown", "--seq", "64", "--plot", "/"], "--plot"),
    (["compare", "--seq", "64", "--plot", "/nonexistent-dir/x.png"], "--plot"),
    (["breakdown", "--reserve", "1,,x"], "--reserve"),
    (["breakdown", "--seq", "64", "--plot", "/nonexistent-dir/x.png"], "--plot"),
    (["compare", "--seq", "64", "--only", "flashy"], "--impl"),  # --only: the old --impl
    (["compare", "--seq", "64", "--impl", "bogus"], "--impl"),
    (["compare", "--seq", "64", "--baseline", "flashy"], "--baseline"),
    (["compare", "--seq", "64", "--only", "naive", "--baseline", "flash2"], "--baseline"),
    (["sweep", "--seq", "1,,x"], "--seq"),
    (["sweep", "--impl", "naive,,flash2"], "--impl"),
    (["oom", "--impl", "naive,"], "--impl"),
    (["validate", "--grid", "/nonexistent-dir/grid.json"], "--grid"),
    (["validate", "--grid", "/"], "--grid"),
    (["validate", "--backend", "tpu"], "--backend"),
    (["validate", "--impl", "flashy"], "--impl"),
    (["validate", "--out", "/nonexistent-dir/r.json"], "--out"),
    (["trace"], "FILE.py:FUNCTION"),
    (["gpus", "extra"], "extra"),
])
def test_malformed_examples(capsys, argv, option):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert option in err and "Traceback" not in err


def test_plot_unsupported_format(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    argv = ["breakdown", "--seq", "64", "--plot", str(tmp_path / "x.unknownext")]
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1 and "--plot" in err, err


def test_sweep_plot(capsys):
    code, out, err = run(capsys, "sweep", "--seq", "64", "--plot", "/nonexistent-dir/x.png")
    assert code == 2 and out == "" and "--plot" in err


@pytest.mark.parametrize("option", ["--seq", "--head-dim", "--batch", "--heads"])
def test_sweep_huge_sizes(capsys, option):
    argv = fast(["sweep", option, HUGE])
    check(*run(capsys, *argv), argv)


GRIDS = {
    "bad JSON": '{"name": "g", "products": [',
    "not an object": "[1, 2]",
    "empty file": "",
    "wrong type": '{"name": "g", "products": [{"impl": "naive"}]}',
    "wrong list type": '{"name": "g", "products": [{"impl": ["naive"], "seq_len": ["x"]}]}',
    "unknown impl": '{"name": "g", "products": [{"impl": ["flashy"]}]}',
    "negative size": '{"name": "g", "products": [{"impl": ["naive"], "batch": [-2]}]}',
    "empty list": '{"name": "g", "products": [{"impl": ["naive"], "seq_len": []}]}',
    "unknown field": '{"name": "g", "products": [{"impl": ["naive"], "sequence": [8]}]}',
    "unknown gpu": '{"name": "g", "products": [{"impl": ["naive"], "gpu": ["tpu"]}]}',
    "bad dtype": '{"name": "g", "products": [{"impl": ["naive"], "dtype": ["fp8"]}]}',
    "bad config": '{"name": "g", "configs": [{"impl": "naive", "shape": {"seq_len": 0}}]}',
    "no name": '{"products": []}',
    "not UTF-8": b"\xff\xfe{",
}


@pytest.mark.parametrize("kind", sorted(GRIDS))
def test_malformed_grid_files(capsys, tmp_path, kind):
    grid = tmp_path / "grid.json"
    text = GRIDS[kind]
    grid.write_bytes(text if isinstance(text, bytes) else text.encode())
    code, out, err = run(capsys, "validate", "--grid", str(grid))
    assert code == 2 and out == "" and err.count("\n") == 1, (kind, err)
    assert "--grid" in err and "Traceback" not in err


def tiny_grid(path, **product) -> str:
    """A one- or few-configuration grid file at ``path``."""
    path.write_text(json.dumps({"name": "tiny", "products": [
        {"impl": ["naive-weights"], "seq_len": [8], "batch": [1], **product}]}))
    return str(path)


def test_tiny_grid_validates(capsys, tmp_path):
    code, out, err = run(capsys, "validate", "--grid", tiny_grid(tmp_path / "g.json"), "--json")
    assert (code, err) == (0, "") and json.loads(out)["mismatches"] == 0


@SETTINGS
@given(argv=argvs("validate"))
def test_validate_random_arguments(capsys, tmp_path, argv):
    """``validate`` options at random, always on a tiny grid (the last --grid wins)."""
    argv = [a for a in argv if a not in ("--backend", "cuda")]
    argv += ["--grid", tiny_grid(tmp_path / "g.json")]
    check(*run(capsys, *argv), argv)


TARGETS = ["", ":", "x", "x:", ":f", "nope.py:f", "os:nope", "os:getcwd", "os.path:sep",
           "memcalc.cli:main", "nonexistent_module_xyz:f", "{file}:missing", "{file}:CONSTANT",
           "{file}:two_args", "{broken}:f", "{exits}:f", "{file}:raises", "{file}:returns_int",
           "{dir}:f", "é.py:f", "a:b:c"]


@pytest.fixture
def user_files(tmp_path):
    """User modules: a good one with bad functions, one that fails to import, one that exits."""
    good = tmp_path / "user_attn.py"
    good.write_text("CONSTANT = 3\n"
                    "def f(q, k, v):\n    return (q @ k.transpose(-2, -1)).softmax(-1) @ v\n"
                    "def two_args(q, k):\n    return q\n"
                    "def raises(q, k, v):\n    raise RuntimeError('boom')\n"
                    "def returns_int(q, k, v):\n    return 3\n")
    (tmp_path / "broken.py").write_text("import nonexistent_module_xyz\n")
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(3)\n")
    return {"file": str(good), "broken": str(tmp_path / "broken.py"),
            "exits": str(tmp_path / "exits.py"), "dir": str(tmp_path)}


@pytest.mark.parametrize("target", TARGETS)
def test_trace_bad_targets(capsys, user_files, target):
    argv = ["trace", target.format(**user_files), "--seq", "16", "--batch", "1"]
    code, out, err = run(capsys, *argv)
    assert code == 2, (target, code, err)
    check(code, out, err, argv)


def test_trace_good_target(capsys, user_files):
    code, out, err = run(capsys, "trace", f"{user_files['file']}:f", "--seq", "16", "--json")
    assert (code, err) == (0, "") and json.loads(out)["saved_bytes"] > 0


@SETTINGS
@given(argv=argvs("trace"))
def test_trace_random_options(capsys, user_files, argv):
    argv = fast(["trace", f"{user_files['file']}:f", *argv[1:]])
    check(*run(capsys, *argv), argv)


def test_compare_gqa_options_are_not_rejected_by_naive(capsys):
    """--kv-heads is fine for compare: implementations without GQA get a row note."""
    code, out, err = run(capsys, "compare", "--seq", "64", "--heads", "4", "--kv-heads", "2",
                                 "--only", "sdpa-math,naive", "--baseline", "sdpa-math", "--json")
    rows = {r["impl"]: r for r in json.loads(out)["rows"]}
    assert (code, err) == (0, "") and rows["sdpa-math"]["peak_bytes"] > 0
    assert rows["naive"]["peak_bytes"] is None
