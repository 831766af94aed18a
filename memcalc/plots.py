"""Pictures of results (matplotlib, an optional extra: ``pip install memcalc[plot]``).

Every function draws on a new figure, writes it when given a path, and returns the figure;
matplotlib is imported inside, so importing memcalc never loads it. Axes are in MiB or GiB,
chosen from the largest value, and say which.
"""

from __future__ import annotations

from typing import Iterable

from memcalc.allocator import MiB
from memcalc.units import GiB

ROLE_COLOURS = {
    "input": "#9e9e9e", "saved": "#d62728", "activation": "#ff7f0e", "temporary": "#1f77b4",
    "gradient": "#2ca02c", "output": "#8c564b", "workspace": "#7f7f7f",
}


def _unit(largest: int) -> tuple[int, str]:
    return (GiB, "GiB") if largest >= GiB else (MiB, "MiB")


def _figure(width: float = 9, height: float = 5):
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot: needs matplotlib (pip install 'memcalc[plot]')") from None

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(width, height), layout="constrained")


def _finish(fig, path: str | None):
    if path:
        fig.savefig(path, dpi=120)
    return fig


def plot_timeline(config, path: str | None = None):
    """Allocated and reserved bytes over the allocations of one measured step, with the
    saved-for-backward level and the peak marked and labelled with what is alive there."""
    from memcalc.timeline import Ledger, predict

    ledger = Ledger(config.workspace_bytes, record=True)
    result = predict(config, ledger=ledger)
    history = ledger.history
    start = next(i for i, e in enumerate(history) if e.label == "forward")
    events = [e for e in history[start:] if e.kind != "phase" or e.label != "end"]
    scale, unit = _unit(max(e.reserved for e in events))
    fig, ax = _figure()
    xs = range(len(events))
    ax.step(xs, [e.allocated / scale for e in events], where="post", label="allocated")
    ax.step(xs, [e.reserved / scale for e in events], where="post", color="#bbbbbb",
            label="reserved (cached segments)")
    _mark_phases(ax, events)
    _mark_saved_and_peak(ax, events, result, scale, unit)
    ax.set_xlabel("allocation events of the measured step (forward, then backward)")
    ax.set_ylabel(f"memory ({unit})")
    ax.set_title(f"{config.impl}: one step, N={config.shape.seq_len}, "
                 f"{config.dtype.value}, {config.device.spec.label}")
    ax.legend(loc="upper left")
    return _finish(fig, path)


def _mark_phases(ax, events) -> None:
    for i, e in enumerate(events):
        if e.kind == "phase":
            ax.axvline(i, color="#555555", linestyle=":", linewidth=1)
            ax.annotate(e.label, (i, 0), xytext=(3, 3), textcoords="offset points",
                        fontsize=9, color="#555555")


def _mark_saved_and_peak(ax, events, result, scale: int, unit: str) -> None:
    backward = next((i for i, e in enumerate(events) if e.label == "backward"), None)
    if backward is not None:
        level = events[backward].allocated
        ax.axhline(level / scale, color="#d62728", linestyle="--", linewidth=1,
                   label=f"after forward: saved + inputs + output ({level / scale:,.2f} {unit})")
    peak = max(range(len(events)), key=lambda i: events[i].allocated)
    top = sorted(result.components, key=lambda c: -c.block_bytes)[:4]
    label = "peak {:,.2f} {}\n".format(result.peak_bytes / scale, unit) + "\n".join(
        f"{c.name}: {c.block_bytes / scale:,.2f} {unit}" for c in top)
    ax.plot([peak], [events[peak].allocated / scale], "o", color="#d62728")
    ax.annotate(label, (peak, events[peak].allocated / scale), xytext=(-10, -10),
                textcoords="offset points", ha="right", va="top", fontsize=8,
                bbox={"boxstyle": "round", "fc": "white", "ec": "#cccccc"})


def plot_components(results: Iterable, path: str | None = None):
    """The live set at each result's peak as one stacked bar per implementation, by role."""
    results = list(results)
    scale, unit = _unit(max(r.peak_bytes for r in results))
    fig, ax = _figure()
    names = [r.config.impl for r in results]
    bottoms = [0.0] * len(results)
    for role, colour in ROLE_COLOURS.items():
        heights = [sum(c.block_bytes for c in r.components if c.role.value == role) / scale
                   for r in results]
        if any(heights):
            ax.bar(names, heights, bottom=bottoms, color=colour, label=role)
            bottoms = [b + h for b, h in zip(bottoms, heights)]
    for x, r in enumerate(results):
        ax.annotate(f"{r.peak_bytes / scale:,.2f} {unit}\n({r.peak_phase})",
                    (x, bottoms[x]), ha="center", va="bottom", fontsize=8)
    c = results[0].config
    ax.set_ylim(0, max(bottoms) * 1.15)
    ax.set_ylabel(f"alive at the peak ({unit})")
    ax.set_title(f"What is alive at the peak: N={c.shape.seq_len}, B={c.shape.batch}, "
                 f"H={c.shape.heads}, d={c.shape.head_dim}, {c.dtype.value}")
    ax.legend(title="role", loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.tick_params(axis="x", labelrotation=20)
    return _finish(fig, path)
