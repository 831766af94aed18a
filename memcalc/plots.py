"""Pictures of results (matplotlib, an optional extra: ``pip install memcalc[plot]``).

Three pictures: ``plot_timeline`` (one step's allocated and reserved memory, event by
event), ``plot_components`` (what is alive at each implementation's peak, by role) and
``plot_peaks`` (peak against seq_len, log-log, with the budget and each line's largest
fitting seq_len). Every function draws on a new ``matplotlib.figure.Figure`` (not pyplot:
no backend is switched, nothing stays registered), writes it when given a path, and returns
it; in Jupyter the returned figure shows inline. matplotlib is imported inside, so importing
memcalc never loads it. Axes are in MiB or GiB, chosen from the largest value, and say which.
"""

from __future__ import annotations

from memcalc.engine.allocator import MiB
from memcalc.engine.deadline import DEFAULT_WORK_LIMIT
from memcalc.engine.units import GiB, human

ROLE_COLOURS = {
    "input": "#9e9e9e", "saved": "#d62728", "activation": "#ff7f0e", "temporary": "#1f77b4",
    "recomputed": "#ff9896",
    "gradient": "#2ca02c", "output": "#8c564b", "workspace": "#bcbd22",
    "parameter": "#9467bd", "buffer": "#c5b0d5", "optimizer state": "#e377c2",
    "unsharded parameter": "#aec7e8", "collective buffer": "#17becf",
}


def _unit(largest: int) -> tuple[int, str]:
    return (GiB, "GiB") if largest >= GiB else (MiB, "MiB")


def _figure(width: float = 9, height: float = 5, panels: int = 1):
    """A new figure and its axes (a list of ``panels`` side by side when more than one),
    made without pyplot: no backend is chosen or switched (a notebook keeps its own, and
    shows the returned figure inline) and no figure stays registered after the caller
    drops it."""
    from memcalc.errors import require

    require("matplotlib", "drawing")  # missing: one line, naming the extra
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    if panels == 1:
        return fig, fig.subplots()
    return fig, list(fig.subplots(1, panels, width_ratios=[2] + [1] * (panels - 1)))


def _finish(fig, path: str | None):
    if path:
        fig.savefig(path, dpi=120)
    return fig


def plot_timeline(config, path: str | None = None, recorded=None):
    """Allocated and reserved bytes over the allocations of one measured step, with the
    saved-for-backward level and the peak marked and labelled with what is alive there.
    ``config``: a ``Config``, or a result that has one (``memcalc.breakdown(...)``).
    ``recorded``: ``(history, breakdown)`` of a step already run (a trace's), instead of
    ``predict(config)``'s."""
    from memcalc.engine.replay import Ledger
    from memcalc.analysis.predict import predict

    config = _config_of(config)
    if recorded is None:
        ledger = Ledger(config.workspace_bytes, record=True,
                        settings=config.protocol.allocator)
        recorded = ledger.history, predict(config, ledger=ledger)
    history, result = recorded
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
    phases = ", ".join(dict.fromkeys(e.label for e in events if e.kind == "phase"))
    ax.set_xlabel(f"allocation events of the measured step ({phases})")
    ax.set_ylabel(f"memory ({unit})")
    ax.set_ylim(0, max(e.reserved for e in events) / scale * 1.08)
    ax.set_title(_wrapped((f"{config.impl}: one training step, {config.label()}",
                           f"torch.cuda memory on {config.device.spec.label}"), 70),
                 fontsize=11)
    fig.legend(loc="outside lower center", ncols=3, fontsize=9, frameon=False)
    return _finish(fig, path)


def _config_of(obj):
    """The ``Config`` of ``obj``: itself, or its ``.config`` (a ``Breakdown``), or its
    breakdown's (a ``Traced``)."""
    from memcalc.config import Config

    for candidate in (obj, getattr(obj, "config", None),
                      getattr(getattr(obj, "breakdown", None), "config", None)):
        if isinstance(candidate, Config):
            return candidate
    raise TypeError(f"plot_timeline: a Config or a breakdown, not {type(obj).__name__}")


def _mark_phases(ax, events) -> None:
    for i, e in enumerate(events):
        if e.kind == "phase":
            ax.axvline(i, color="#555555", linestyle=":", linewidth=1)
            ax.annotate(e.label, (i, 1), xycoords=("data", "axes fraction"), xytext=(4, -4),
                        textcoords="offset points", va="top", fontsize=9, color="#555555")


def _mark_saved_and_peak(ax, events, result, scale: int, unit: str) -> None:
    backward = next((i for i, e in enumerate(events) if e.label == "backward"), None)
    if backward is not None:
        level = events[backward].allocated
        ax.axhline(level / scale, color="#d62728", linestyle="--", linewidth=1,
                   label=f"after forward: inputs + saved + output ({level / scale:,.2f} {unit})")
    peak = max(range(len(events)), key=lambda i: events[i].allocated)
    top = sorted(result.components, key=lambda c: -c.allocated)[:6]
    rest = result.peak_bytes - sum(c.allocated for c in top)
    label = f"total {human(result.peak_bytes)} ({result.peak_phase})\n" + "\n".join(
        f"{c.name}: {human(c.allocated)}" for c in top)
    if rest:
        label += f"\n{len(result.components) - len(top)} more: {human(rest)}"
    ax.plot([peak], [events[peak].allocated / scale], "o", color="#d62728")
    ax.annotate("peak", (peak, events[peak].allocated / scale), xytext=(6, 2),
                textcoords="offset points", fontsize=8, color="#d62728")
    ax.text(1.02, 1, "alive at the peak (red dot)\n" + label, transform=ax.transAxes,
            ha="left", va="top", fontsize=8, linespacing=1.5,
            bbox={"boxstyle": "round", "fc": "white", "ec": "#cccccc"})


def plot_components(results, path: str | None = None):
    """The live set at each result's peak as one stacked horizontal bar per implementation,
    by role, each labelled with its peak and phase; horizontal so that long names stay
    readable however many implementations there are. ``results``: breakdowns, or a
    ``memcalc.compare`` result (its rows with figures)."""
    results = _breakdowns(results)
    scale, unit = _unit(max(r.peak_bytes for r in results))
    fig, ax = _figure(10, 1.6 + 0.38 * len(results))
    names = [r.config.impl for r in results]
    ys = range(len(results))
    lefts = [0.0] * len(results)
    for role, colour in ROLE_COLOURS.items():
        widths = [sum(c.allocated for c in r.components if c.role.value == role) / scale
                  for r in results]
        if any(widths):
            ax.barh(ys, widths, left=lefts, color=colour, label=role, height=0.7)
            lefts = [a + w for a, w in zip(lefts, widths)]
    for y, r in enumerate(results):
        ax.annotate(f" peak {human(r.peak_bytes)} ({r.peak_phase})", (lefts[y], y),
                    va="center", ha="left", fontsize=8)
    ax.set_yticks(list(ys), names, fontsize=9)
    ax.invert_yaxis()  # first result on top, as in the tables
    ax.set_xlim(0, max(lefts) * 1.3)
    ax.set_xlabel(f"alive at the peak, max_memory_allocated ({unit})")
    ax.set_title(f"What is alive at each implementation's peak: {results[0].config.label()}",
                 fontsize=11)
    ax.legend(title="role", loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=9)
    ax.grid(axis="x", color="#eeeeee")
    ax.set_axisbelow(True)
    return _finish(fig, path)


def _breakdowns(results) -> list:
    """Breakdowns from a list of them or from a comparison's rows (those with figures); a
    TypeError naming what is taken otherwise."""
    rows = getattr(results, "rows", None)
    if rows is not None:
        results = [r.breakdown for r in rows if getattr(r, "breakdown", None) is not None]
    results = list(results) if not isinstance(results, (str, bytes)) else [results]
    if not results or not all(hasattr(r, "peak_bytes") and hasattr(r, "components")
                               for r in results):
        raise TypeError("plot_components: breakdowns (memcalc.breakdown(...)) or a comparison "
                        f"(memcalc.compare(...)), not {type(results[0]).__name__ if results else 'nothing'}")
    return results


def plot_peaks(sweep, report=None, path: str | None = None, time_limit: float | None = None,
               work_limit: int | None = DEFAULT_WORK_LIMIT // 10):
    """Reserved memory (max_memory_reserved, the figure that decides fitting) against
    seq_len, log-log, one line per series of
    ``sweep`` (a ``memcalc.analysis.scaling.Sweep``), with the budget as a horizontal line and each
    series' largest fitting seq_len (``report``, an ``OomReport``, or solved here with
    ``memcalc.analysis.thresholds.solve``, at most ``work_limit`` events and ``time_limit``
    seconds per series) marked and
    labelled with N: where each one runs out. A sweep over context-parallel ranks (``cp``)
    adds a panel: each series' largest N against the number of ranks."""
    series = _series(sweep)
    solved = _solved_by_series(sweep, series, report, time_limit, work_limit)
    budget = sweep.budget.budget_bytes
    tops = [budget] + [r.reserved_peak_bytes for rows in series.values() for r in rows]
    scale, unit = _unit(max(tops))
    ranks = "cp" in sweep.axes
    fig, ax = _figure(15 if ranks else 10.5, 5.8, 2 if ranks else 1)
    if ranks:
        ax, by_ranks = ax
        _draw_max_n(by_ranks, series, solved)
    names = _series_names(sweep, series)
    marks = []
    for i, (key, rows) in enumerate(series.items()):
        _draw_series(ax, _style(i, len(series)), names[key], rows, solved.get(key), scale)
        s = solved.get(key)
        if s is not None and s.at_max is not None:
            marks.append((s.max_value, s.at_max.reserved_bytes / scale, ax.lines[-1].get_color()))
    _label_thresholds(ax, marks)
    if any(not r.fits for r in sweep.rows):
        ax.plot([], [], "o", markerfacecolor="white", color="#555555",
                label="sweep point that does not fit")
    ax.axhline(budget / scale, color="black", linewidth=1.2, linestyle="--",
               label=f"budget {human(budget)}")
    xs = [r.seq_len for r in sweep.rows] + [m[0] for m in marks]
    _log_axes(ax, unit, min(xs), max(xs))
    ax.set_title(_peaks_title(sweep), fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8,
              title="x: largest N that fits", title_fontsize=8)
    return _finish(fig, path)


def _series(sweep) -> dict[tuple, list]:
    """The sweep's rows by series (impl, dtype, batch, heads, head_dim, cp), in seq_len
    order."""
    out: dict[tuple, list] = {}
    for r in sweep.rows:
        out.setdefault(r.series, []).append(r)
    return {k: sorted(v, key=lambda r: r.seq_len) for k, v in out.items()}


def _series_names(sweep, series) -> dict[tuple, str]:
    """Each series named by the implementation and whatever else varies in the sweep."""
    fields = ("impl", "dtype", "batch", "heads", "head_dim", "cp")
    prefix = {"impl": "", "dtype": "", "batch": "B=", "heads": "H=", "head_dim": "d=",
              "cp": "cp="}
    varying = [0] + [i for i in range(1, 6) if len({k[i] for k in series}) > 1]
    return {k: " ".join(f"{prefix[fields[i]]}{k[i]}" for i in varying) for k in series}


def _solved_by_series(sweep, series, report, time_limit, work_limit) -> dict[tuple, object]:
    """The ``Solved`` threshold of each series: from ``report`` when it has the
    implementation and the sweep has one shape and dtype, else solved per series. Series
    that ``memcalc oom`` would skip as too slow (events that grow with seq_len) get none:
    the solver's time limit is only checked between replays, and one replay near their
    threshold can take minutes."""
    from memcalc.analysis.thresholds import _too_big, solve

    given = {r.impl: r for r in report.results} if report is not None else {}
    if report is not None:
        _check_report(sweep, report)
    one_shape = all(len(sweep.axes.get(k, (1,))) == 1
                    for k in ("dtype", "batch", "heads", "head_dim", "cp"))
    out = {}
    for key in series:
        if one_shape and key[0] in given:
            out[key] = given[key[0]]
            continue
        config = _series_config(sweep.base, key)
        try:
            if _too_big(config, "seq_len") is not None:
                continue
            result = solve(config, sweep.budget, "seq_len", [key[0]], time_limit,
                           work_limit=work_limit).results
        except ValueError:  # a threshold the solver cannot reach: the line has no x
            continue
        if result:
            out[key] = result[0]
    return out


def _check_report(sweep, report) -> None:
    """A ``report`` must be for the sweep's budget and options, or its N would be wrong."""
    def options(config):
        dump = config.model_dump(mode="json")
        dump.pop("impl")
        dump["shape"] = {k: v for k, v in dump["shape"].items() if k not in ("seq_len", "kv_len")}
        return dump

    if report.field != "seq_len":
        raise ValueError(f"plot_peaks: the report solves {report.field}, not seq_len")
    if report.budget != sweep.budget or options(report.base) != options(sweep.base):
        raise ValueError("plot_peaks: the report is for another budget or other options than "
                         "the sweep (pass the same gpu, gpu_gb, reserve and shape to both)")


def _series_config(base, key):
    """``base`` with one series' implementation, dtype, shape and ranks."""
    impl, dtype, batch, heads, head_dim, cp = key
    return base.replace(impl=impl, dtype=dtype, batch=batch, heads=heads, head_dim=head_dim,
                        cp=cp)


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h")


def _style(i: int, count: int) -> tuple:
    """The colour, line style and marker of series ``i`` of ``count``: tab10, or tab20 for
    more than ten lines, then the same colours dashed; a marker of its own, so that lines
    that coincide (one number of ranks under another, two kernels of the same sizes) still
    show both."""
    import matplotlib

    colours = 10 if count <= 10 else 20
    return (matplotlib.colormaps[f"tab{colours}"](i % colours),
            ("-", "--", "-.", ":")[(i // colours) % 4], MARKERS[i % len(MARKERS)])


def _draw_max_n(ax, series: dict, solved: dict) -> None:
    """The largest N that fits against the number of context-parallel ranks: a line per
    series less its ranks (the last field of a series' key), log-log."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullLocator

    lines: dict[tuple, list] = {}
    for key in series:
        if solved.get(key) is not None:
            lines.setdefault(key[:-1], []).append((key[-1], solved[key].max_value))
    for i, (key, points) in enumerate(lines.items()):
        colour, style, marker = _style(i, len(lines))
        ranks, ns = zip(*sorted(points))
        ax.plot(ranks, ns, style, color=colour, marker=marker, markersize=7,
                markerfacecolor="none", label=key[0])
        for p, n in zip(ranks, ns):  # every other series' labels above its points, and
            # each pair a line further: Ns close together stay apart
            below = i % 2 == 0
            ax.annotate(f"{n:,}", (p, n), textcoords="offset points",
                        xytext=(6, (-12 if below else 6) - 10 * (i // 2)), fontsize=7,
                        color=colour)
    every = sorted({p for points in lines.values() for p, _ in points})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(every or [1]))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    # powers of two and halfway between (768K, 1.5M): a range inside one octave has ticks
    ax.yaxis.set_major_locator(LogLocator(base=2, subs=(1.0, 1.5)))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: _seq_text(y)))
    ax.margins(x=0.12, y=0.15)  # room for the labels beside the first and last points
    ax.set_xlabel("context-parallel ranks P (GPUs the sequence is split over)")
    ax.set_ylabel("largest seq_len N that fits (the busiest rank)")
    ax.set_title("Largest N against P", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    if len(lines) > 1:
        ax.legend(fontsize=8)


def _draw_series(ax, style: tuple, name: str, rows, solved, scale: int) -> None:
    """One series' peaks as a line (open markers where the sweep says OOM) and its largest
    fitting N as an x, joined to the line by a dotted extension."""
    colour, style, marker = style
    xs, ys = [r.seq_len for r in rows], [r.reserved_peak_bytes / scale for r in rows]
    label = f"{name} (largest N not solved)"
    if solved is not None:
        label = f"{name} (fits to N={solved.max_value:,})"
    ax.plot(xs, ys, style, color=colour, marker=marker, markersize=5, markerfacecolor="none",
            label=label)
    over = [(r.seq_len, r.reserved_peak_bytes / scale) for r in rows if not r.fits]
    if over:
        ax.plot(*zip(*over), "o", markersize=7, markerfacecolor="white", color=colour)
    if solved is None or solved.at_max is None:
        return
    n, peak = solved.max_value, solved.at_max.reserved_bytes / scale
    if n > xs[-1]:
        ax.plot([xs[-1], n], [ys[-1], peak], ":", color=colour, linewidth=1)
    ax.plot([n], [peak], "x", color=colour, markersize=9, markeredgewidth=2)


def _label_thresholds(ax, points: list[tuple[int, float, object]]) -> None:
    """``N=...`` under each x marker; labels closer than two octaves to the previous one
    drop a line, so that neighbouring thresholds stay readable."""
    import math

    level, last = 0, None
    for n, peak, colour in sorted(points, key=lambda p: p[0]):
        if n == last:  # the same threshold (checkpoint-x and x): one label
            continue
        level = level + 1 if last is not None and math.log2(n / last) < 2 else 0
        last = n
        ax.annotate(f"N={n:,}", (n, peak), xytext=(-6, -8 - 10 * level),
                    textcoords="offset points", fontsize=7.5, color=colour, va="top", ha="left",
                    bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.8})


def _log_axes(ax, unit: str, lo: int, hi: int) -> None:
    """Log-log axes with plain tick labels: seq_len from ``lo`` to ``hi`` as 256, 4K, 1M
    (every octave, or every second or third when the range is wide); memory as 0.5, 20.
    Room is left right of ``hi`` for the threshold labels."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    first, last = lo.bit_length() - 1, hi.bit_length()
    step = -(-(last - first) // 12)
    ax.xaxis.set_major_locator(FixedLocator([2.0 ** e for e in range(first, last + 1, step)]))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: _seq_text(x)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: _fmt(y)))
    ax.set_xlim(lo / 1.4, hi * 3.5)
    ax.set_xlabel("seq_len N (log scale; K = 1,024, M = 1,024 K)")
    ax.set_ylabel(f"reserved peak, max_memory_reserved ({unit}, log scale)")
    ax.grid(which="major", color="#e5e5e5")


def _seq_text(x: float) -> str:
    n = int(round(x))
    for size, suffix in ((1 << 20, "M"), (1 << 10, "K")):
        if n >= size and n % size == 0:
            return f"{n // size:,}{suffix}"
    return f"{n:,}"


def _fmt(value: float) -> str:
    """A tick or budget figure: at most three significant digits, no exponent."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _peaks_title(sweep) -> str:
    """What is fixed in the sweep (``Sweep.fixed``) and the budget, each line wrapped to
    the axes' width."""
    b = sweep.budget
    lines = (f"Reserved memory of one training step (what must fit) against seq_len: "
             f"{sweep.fixed()}",
             f"budget {human(b.budget_bytes)} = {human(b.memory_bytes)} device "
             f"({sweep.base.device.spec.name}) less {human(b.reserve_bytes)} reserve")
    return _wrapped(lines, 95)


def _wrapped(lines, width: int) -> str:
    """Each of a title's ``lines`` wrapped to ``width`` characters: a long one (a traced
    file's path, a sweep's fixed sizes) ran off the figure's left edge."""
    import textwrap

    return "\n".join(textwrap.fill(line, width) for line in lines)
