"""The three pictures: each function and each CLI --plot writes a non-empty PNG, with no
warning, and only --plot loads matplotlib."""

import subprocess
import sys
import warnings

import pytest

pytest.importorskip("matplotlib")

import memcalc  # noqa: E402
from memcalc.cli import main  # noqa: E402
from memcalc.plots import plot_components, plot_peaks, plot_timeline  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def no_warnings():
    """Any warning while drawing (tight layout, missing glyph, overlap) fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def is_png(path) -> bool:
    data = path.read_bytes()
    return len(data) > 10_000 and data.startswith(PNG)


def test_timeline(tmp_path):
    out = tmp_path / "timeline.png"
    fig = plot_timeline(memcalc.make_config(seq_len=4096), str(out))
    assert is_png(out)
    assert "naive" in fig.axes[0].get_title()


def test_timeline_of_a_breakdown(tmp_path):
    """``plot_timeline(memcalc.breakdown(...))`` draws that step (its config)."""
    out = tmp_path / "timeline.png"
    fig = plot_timeline(memcalc.breakdown(impl="flash2", seq_len=2048), str(out))
    assert is_png(out) and "flash2" in fig.axes[0].get_title()
    with pytest.raises(TypeError, match="Config or a breakdown"):
        plot_timeline("naive")


def test_components(tmp_path):
    out = tmp_path / "components.png"
    results = [memcalc.breakdown(impl=name, seq_len=2048) for name in ("naive", "flash2")]
    fig = plot_components(results, str(out))
    assert is_png(out)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["naive", "flash2"]


def test_peaks_marks_the_solved_threshold(tmp_path):
    out = tmp_path / "peaks.png"
    table = memcalc.sweep(seq_lens=(1024, 4096), impls=["naive", "flash2"], gpu_gb=80)
    report = memcalc.oom(gpu_gb=80, impls=["naive", "flash2"])
    ax = plot_peaks(table, report, str(out)).axes[0]
    assert is_png(out)
    texts = [t.get_text() for t in ax.texts]
    assert "N=19,511" in texts  # memcalc.oom's answer for naive at 80 GB
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    title = ax.get_title()
    assert "against seq_len: B=8 H=1 d=16 fp32\n" in title  # two impls: none named
    assert "79.50 GiB" in title


def test_peaks_solves_per_series_without_a_report(tmp_path):
    table = memcalc.sweep(seq_lens=(1024, 4096), impls=["naive"], dtypes=["fp16", "fp32"],
                          gpu_gb=80)
    ax = plot_peaks(table, path=str(tmp_path / "p.png")).axes[0]
    labels = ax.get_legend_handles_labels()[1]
    assert any(label.startswith("naive fp32 (fits to N=19,511)") for label in labels)
    assert any(label.startswith("naive fp16") for label in labels)


def test_peaks_rejects_a_report_for_another_budget():
    table = memcalc.sweep(seq_lens=(1024,), impls=["naive"], gpu_gb=80)
    with pytest.raises(ValueError, match="another budget"):
        plot_peaks(table, memcalc.oom(gpu_gb=40, impls=["naive"]))


def test_peaks_skips_implementations_too_slow_to_solve():
    table = memcalc.sweep(seq_lens=(256, 1024), impls=["linear-causal-chunked"], gpu_gb=80)
    labels = plot_peaks(table).axes[0].get_legend_handles_labels()[1]
    assert labels[0] == "linear-causal-chunked (largest N not solved)"


@pytest.mark.parametrize("argv, what", [
    (["breakdown", "--seq", "2048"], "the step's memory timeline"),
    (["compare", "--seq", "2048", "--only", "naive", "--only", "flash2"],
     "what is alive at each implementation's peak"),
    (["sweep", "--seq", "1024,4096", "--impl", "naive,flash2"],
     "the reserved peak against seq_len"),
])
def test_cli_plot(tmp_path, capsys, argv, what):
    out = tmp_path / "out.png"
    assert main([*argv, "--plot", str(out)]) == 0
    assert is_png(out)
    printed = capsys.readouterr()
    assert printed.out  # the table is still printed
    assert printed.err == f"memcalc: wrote {out}: {what}\n"  # on stderr: stdout stays data


def test_cli_plot_says_the_name_matplotlib_gave_it(tmp_path, capsys):
    """``--plot step`` wrote ``step.png`` without a word."""
    assert main(["breakdown", "--seq", "1024", "--plot", str(tmp_path / "step")]) == 0
    assert is_png(tmp_path / "step.png")
    assert capsys.readouterr().err == (f"memcalc: wrote {tmp_path / 'step.png'}: the step's "
                                       f"memory timeline\n")


def test_sweep_without_plot_imports_no_matplotlib():
    code = ("import sys; from memcalc.cli import main; main(['sweep', '--seq', '1024', "
            "'--json']); print('matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.parametrize("name", ["timeline", "components", "peaks"])
def test_example_scripts(tmp_path, monkeypatch, capsys, name):
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "plots" / f"{name}.py"
    out = tmp_path / f"{name}.png"
    monkeypatch.setattr(sys, "argv", [str(script), str(out)])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(script), run_name="__main__")
    assert done.value.code == 0 and is_png(out)


@pytest.mark.parametrize("name", ["timeline", "components", "peaks"])
def test_an_example_script_without_matplotlib_names_the_extra(tmp_path, monkeypatch, capsys,
                                                               name):
    """``python examples/plots/peaks.py`` without matplotlib ended in a traceback and
    ``ValueError: --plot: needs matplotlib``, an option the script has not: one line
    naming the extra, exit status 2."""
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "plots" / f"{name}.py"
    monkeypatch.setattr(sys, "argv", [str(script), str(tmp_path / f"{name}.png")])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(script), run_name="__main__")
    assert done.value.code == 2
    assert capsys.readouterr().err == (f"{name}.py: error: drawing needs matplotlib, which is "
                                       f"not installed: pip install 'memcalc[plot]'\n")


def test_peaks_draws_the_figure_that_decides_fitting(tmp_path):
    """Points under the budget line fit, points over it do not: the plot draws reserved
    memory, which is what fitting is judged on (allocated memory would sit under the line
    for steps that do not fit)."""
    # naive at N = 16384: allocated 48.11 GiB < budget 52 - 0.5 = 51.5 GiB < reserved 56.09
    table = memcalc.sweep(seq_lens=(1024, 4096, 8192, 16384), gpu_gb=52)
    ax = plot_peaks(table, path=str(tmp_path / "p.png")).axes[0]
    budget_y = next(line.get_ydata()[0] for line in ax.lines
                    if line.get_label().startswith("budget"))
    ys = ax.lines[0].get_ydata()
    assert [y <= budget_y for y in ys] == [r.fits for r in table.rows]
    assert [r.fits for r in table.rows] == [True, True, True, False]


def test_components_takes_a_comparison(tmp_path):
    """``plot_components(memcalc.compare(...))`` raised AttributeError ('tuple' object has
    no attribute 'peak_bytes'): a comparison's rows with figures are drawn."""
    import memcalc

    comparison = memcalc.compare(seq_len=1024, impls=["naive", "sdpa-flash", "flash2"])
    fig = plot_components(comparison, str(tmp_path / "bars.png"))
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == ["naive", "flash2"]  # sdpa-flash refuses fp32: no figures, no bar
    with pytest.raises(TypeError, match="plot_components: breakdowns .* not int"):
        plot_components([1, 2])


def test_peaks_of_a_sweep_over_ranks_adds_largest_n_against_p(tmp_path):
    """sweep over cps: a second panel, each P's largest N (oom's answer) against P."""
    options = dict(impls=["sdpa-flash"], causal=True, heads=32, head_dim=128, dtype="bf16",
                   batch=1)
    table = memcalc.sweep(seq_lens=(262144, 1048576), cps=(1, 4), **options)
    fig = plot_peaks(table, path=str(tmp_path / "p.png"))
    assert is_png(tmp_path / "p.png") and len(fig.axes) == 2
    xs, ys = fig.axes[1].lines[0].get_data()
    solved = [memcalc.oom(cp=p, **options).results[0].max_value for p in (1, 4)]
    assert list(xs) == [1, 4] and list(ys) == solved  # 856,192 and 1,005,056 on an H100
