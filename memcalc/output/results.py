"""What a breakdown shows: its tables, headline and caveats, declared once.

``memcalc.analysis.breakdown.Breakdown`` (and ``memcalc.tracing.report.Traced``) return these from
``tables()``, ``headline()`` and ``footnotes()``; ``memcalc.output.render`` derives every format.
"""

from __future__ import annotations

from memcalc.output.legend import legend, made_by
from memcalc.output.render import Column, Table, record_table
from memcalc.output.repeats import collapse
from memcalc.engine.units import human, mib, share

# The caching-allocator model (block rounding, pools, best fit, splitting, segment sizes,
# cuBLAS workspaces) is read from c10/cuda/CUDACachingAllocator.cpp and
# aten/src/ATen/cuda/CublasHandlePool.cpp. `memcalc validate --backend cuda` agreed with it
# on an H200 (torch 2.11): every figure of 675 grid and fused-kernel configurations and of
# the user-code cases (validation/results/nvidia-h200-2.11.0-cu130.json, rechecked by
# memcalc.validation.recorded), so results no longer carry the caveat.
ALLOCATOR_CHECKED_ON_GPU = True


def caveats(impls, kernels=()) -> list[str]:
    """One line on the figures that rest on models not checked against a GPU: kernels read
    from PyTorch's CUDA sources (``Impl.traced`` False, or the fused SDPA ``kernels`` a
    trace ran) and the allocator model."""
    from memcalc.impls import get_impl, registered

    derived: dict[str, list[str]] = {}  # by the sources each model is read from
    for name in dict.fromkeys(impls):
        if not _traced(get_impl, name):
            derived.setdefault(get_impl(name).source, []).append(name)
    for k in kernels:  # a fused SDPA backend, or a package's kernel memcalc models
        if k in registered():  # a package's kernel, or FlexAttention's
            call = "flex_attention" if k == "flex" else "flash_attn_func"
            derived.setdefault(get_impl(k).source, []).append(f"{k}'s {call}")
        else:
            derived.setdefault(PYTORCH, []).append(f"scaled_dot_product_attention's {k} backend")
    parts = [f"{', '.join(names)} modelled from {source}, not traced"
             for source, names in derived.items()]
    if not ALLOCATOR_CHECKED_ON_GPU:
        parts.append("the allocator model follows PyTorch's source and is not yet checked "
                     "on a GPU")
    return [f"caveat: {'; '.join(parts)}."] if parts else []


PYTORCH = "PyTorch's CUDA kernel sources"  # the fused SDPA backends a trace runs


def _traced(get_impl, name: str) -> bool:
    try:
        return get_impl(name).traced
    except ValueError:  # a name the registry no longer has (a traced function)
        return True


def breakdown_title(b) -> str:
    c = b.config
    rank = f", rank {b.rank} of {len(b.rank_peaks)}" if b.rank is not None else ""
    return f"{ran(b)}: {c.label()}{rank} on {c.device.spec.label}; peak in {b.peak_phase}"


def picked_notes(*configs) -> list[str]:
    """How an implementation that picks its kernel picked it (``sdpa``) for each of
    ``configs``, for the notes: one line per distinct answer."""
    from memcalc.impls import get_impl

    said = {}  # each answer, and the first configuration that gave it
    for config in configs:
        impl = get_impl(config.impl)
        if impl.runs and impl.how:
            said.setdefault((config.impl, impl.how(config.dims)), config)
    if len({impl for impl, _ in said}) == len(said):  # one answer each: no need to say where
        return [f"{impl}: {how}" for impl, how in said]
    return [f"{impl} at {config.label()}: {how}" for (impl, how), config in said.items()]


def rank_note(b) -> list[str]:
    """Under context parallelism: which rank is shown, and why."""
    if b.rank is None:
        return []
    c, world = b.config, len(b.rank_peaks)
    key = list(zip(b.rank_reserved, b.rank_peaks))
    rows = (f"each rank holds {c.dims.N:,} of the {c.shape.seq_len:,} rows" if c.cp > 1 else
            "each rank holds its shard of every parameter (FSDP)")
    if len(set(key)) == 1:  # DeepSpeed-Ulysses: every rank's step is the same
        return [f"rank {b.rank} of {world} shown: every rank's step is the same ({rows}; "
                f"reserved {b.rank_reserved[0]:,} B, allocated {b.rank_peaks[0]:,} B)"]
    ties = [r for r, k in enumerate(key) if k == key[b.rank] and r != b.rank]
    tied = f" (as busy: rank{'s' * (len(ties) > 1)} {', '.join(map(str, ties))})" if ties else ""
    return [f"rank {b.rank} of {world} shown, the busiest{tied}: the highest "
            f"max_memory_reserved, then max_memory_allocated; {rows}. By rank, reserved: "
            f"{', '.join(f'{p:,}' for p in b.rank_reserved)} B; allocated: "
            f"{', '.join(f'{p:,}' for p in b.rank_peaks)} B"]

def component_columns(peak: int, with_source: bool = False) -> list[Column]:
    """Columns of the components table; ``peak`` gives the share column, ``with_source``
    adds the code line that allocated each component (traced results have it). ``drop``
    ranks say what goes first on a narrow terminal: the exact bytes and the formula, then
    the role; what made each tensor and its size (the allocated block, in its unit) stay."""
    columns = [
        Column("component", lambda c: c.name),
        Column("made by", made_by, drop=3, wrap=True),
        Column("role", lambda c: c.role.value, drop=4),
        Column("dtype", lambda c: c.dtype, drop=8),
        Column("formula (shape x element)", lambda c: c.formula, drop=6),
        Column("bytes", lambda c: c.bytes, "right", drop=7),
        Column("allocated", lambda c: c.allocated, "right", drop=5),
        Column("size", lambda c: human(c.allocated), "right"),
        Column("share", lambda c: share(c.allocated, peak), "right", drop=2),
    ]
    return columns + [Column("source", lambda c: c.source, drop=9, wrap=True)] if with_source \
        else columns


COMPONENT_KEYS = ("name", "made_by", "role", "op", "dtype", "formula", "bytes", "allocated",
                  "share")
"""The CSV's columns of what is alive at a peak: keys of ``Breakdown.records()`` (the
JSON's ``components``), plus ``source`` when a component has one (a traced step)."""


def components_csv(b) -> Table:
    """One row per tensor alive at the peak, every figure a number (``share``: a fraction
    of the peak), named as in the JSON."""
    records = b.records()
    sourced = any(r["source"] for r in records)
    return record_table(COMPONENT_KEYS + (("source",) if sourced else ()), records)


FIGURE_LABELS = {
    "saved_bytes": "saved for backward",
    "recomputed_bytes": "recomputed in backward (compiled)",
    "forward_peak_bytes": "forward peak",
    "backward_peak_bytes": "backward peak",
    "optimizer_peak_bytes": "optimizer peak (step, zero_grad)",
    "peak_bytes": "peak (max_memory_allocated)",
    "reserved_peak_bytes": "reserved peak (max_memory_reserved)",
    "workspace_bytes": "cuBLAS workspaces",
}
# a step that fits its budget only by the allocator's release-and-retry: on the device
# max_memory_reserved stays within the budget; unbounded, the step would reserve more
RETRIED_LABELS = {
    "reserved_peak_bytes": "reserved peak, unbounded device",
    "capped_reserved_peak_bytes": "reserved peak (max_memory_reserved) in the budget",
}

FIGURE_COLUMNS = [
    Column("figure", lambda kv: kv[2] if len(kv) > 2 else FIGURE_LABELS[kv[0]]),
    Column("bytes", lambda kv: kv[1], "right"),
    Column("MiB", lambda kv: mib(kv[1]), "right", drop=2),
    Column("size", lambda kv: human(kv[1]), "right", drop=1),
]


def components_table(b, rows, live) -> Table:
    """What is alive at the peak, one row each of ``rows``, with the legend of the short
    names; ``live`` is ``b.components``, sorted once by the caller (a chunked loop's live
    set has 100,000 tensors)."""
    columns = component_columns(b.peak_bytes, any(c.source for c in live))
    return Table(f"{breakdown_title(b)}\nalive at the peak", columns, rows, legend(live))


def breakdown_tables(b) -> list[Table]:
    """What is alive at the peak (a loop's tensors by kind), what by role where a model's
    state is among it, then the figures."""
    live = b.components
    components = components_table(b, collapse(live), live)
    return [components, *role_tables(b.peak_bytes, live),
            Table(None, FIGURE_COLUMNS, figure_rows(b))]


# roles of what a model keeps from step to step: where any is alive at the peak, the peak is
# also shown by role (what dominates: the weights, their grads, the optimizer's state, or
# the step's activations)
RESIDENT_ROLES = ("parameter", "buffer", "optimizer state", "unsharded parameter")


def role_tables(peak: int, live) -> list[Table]:
    """What is alive at the peak by role, largest first, when a model's state is in it."""
    totals: dict[str, list[int]] = {}
    for c in live:
        count_and_bytes = totals.setdefault(c.role.value, [0, 0])
        count_and_bytes[0] += 1
        count_and_bytes[1] += c.allocated
    if not set(totals) & set(RESIDENT_ROLES):
        return []
    rows = sorted(totals.items(), key=lambda kv: -kv[1][1])
    columns = [Column("role", lambda r: r[0]), Column("tensors", lambda r: r[1][0], "right"),
               Column("allocated", lambda r: r[1][1], "right", drop=1),
               Column("size", lambda r: human(r[1][1]), "right"),
               Column("share", lambda r: share(r[1][1], peak), "right")]
    return [Table("by role", columns, rows)]


def figure_rows(b) -> list[tuple]:
    """``(key, bytes)`` of each figure; in a budget the step fits only by release-and-
    retry, the reserved peak twice: unbounded and in the budget, ``(key, bytes, label)``
    (an 80 GiB step showed 86.05 GiB reserved beside "fits")."""
    rows = [(k, getattr(b, k)) for k in FIGURE_LABELS if getattr(b, k) is not None]
    fit = b.fit() if b.has_budget else None
    if fit is None or not fit.retried:
        return rows
    at = [k for k, _ in rows].index("reserved_peak_bytes")
    return rows[:at] + [
        ("reserved_peak_bytes", b.reserved_peak_bytes, RETRIED_LABELS["reserved_peak_bytes"]),
        ("capped_reserved_peak_bytes", fit.capped_reserved_peak_bytes,
         RETRIED_LABELS["capped_reserved_peak_bytes"])] + rows[at + 1:]


def ran(b) -> str:
    """The implementation's name, with the kernel it ran as where it picks one:
    ``sdpa (sdpa-cudnn)``."""
    return f"{b.config.impl} ({b.kernel})" if b.kernel else b.config.impl


def breakdown_headline(b) -> str:
    """``naive N=16384 ...: peak 48.11 GiB (backward), saved ..., fits ...``."""
    c = b.config
    f = b.fit()
    verdict = "fits" if f.fits else "does not fit"
    return (f"{ran(b)} {c.label()}: "
            f"peak {b.peak_bytes:,} B ({human(b.peak_bytes)}, {b.peak_phase}), saved "
            f"{human(b.saved_bytes)}, reserved {human(b.reserved_peak_bytes)}; {verdict} in "
            f"{human(f.budget_bytes)} (the budget of {b.budget.device})")
