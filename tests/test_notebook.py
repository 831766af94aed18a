"""examples/tour.ipynb runs top to bottom in a fresh kernel (about 10 s): no error, nothing
on stderr, no warning, and the three plots come out as PNGs."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")
pytest.importorskip("pandas")
pytest.importorskip("torch")

TOUR = Path(__file__).resolve().parents[1] / "examples" / "tour.ipynb"


@pytest.fixture(scope="module")
def executed():
    """The tour's code cells with the outputs of a fresh run (stored outputs dropped)."""
    nb = nbformat.read(TOUR, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(TOUR.parent)}})
    client.execute()
    return [c for c in nb.cells if c.cell_type == "code"]


def test_runs_without_error_stderr_or_warning(executed):
    for cell in executed:
        for out in cell.outputs:
            assert out.output_type != "error", f"{out.get('ename')}: {out.get('evalue')}"
            assert not (out.output_type == "stream" and out.name == "stderr"), out.text
            text = out.get("text", "") + str(out.get("data", {}).get("text/plain", ""))
            assert "Warning" not in text, text


def test_every_cell_shows_something_and_the_plots_are_images(executed):
    assert all(cell.outputs for cell in executed), "a code cell shows nothing"
    plots = [c for c in executed if c.source.startswith("plot_")]
    assert len(plots) == 3
    for cell in plots:
        assert any("image/png" in out.get("data", {}) for out in cell.outputs), cell.source


def test_the_seeds_numbers(executed):
    """The markdown makes no claims; the cells print these (from memcalc, not typed in)."""
    text = "".join(out.get("text", "") for c in executed for out in c.outputs)
    assert "saved_bytes = 17,181,442,048" in text  # exp_x, p, row sum, int64 argmax
    assert "0 mismatches" in text


def test_rich_results_render_once(executed):
    for cell in executed:
        kinds = [out.output_type for out in cell.outputs if "text/html" in out.get("data", {})]
        assert kinds.count("display_data") == 0, cell.source
