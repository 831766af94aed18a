"""Rendering of results: rich tables, Markdown, CSV and JSON, from column specifications.

Each table is a list of ``Column`` (a header and a function of the row), so adding a
column never means switching on key names. Results call these from ``__rich__`` and
``_repr_html_``; the library itself never prints.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from rich import box
from rich.console import Group
from rich.table import Table

from memcalc.units import human, mib, share


@dataclass(frozen=True)
class Column:
    header: str
    cell: Callable[[Any], Any]
    justify: str = "left"


def rich_table(title: str | None, columns: list[Column], rows: Iterable[Any]) -> Table:
    table = Table(title=title, title_justify="left", expand=False, box=box.SIMPLE_HEAD)
    for i, c in enumerate(columns):  # names (first column) and numbers are never wrapped
        table.add_column(c.header, justify=c.justify, no_wrap=i == 0 or c.justify == "right")
    for row in rows:
        table.add_row(*(str(c.cell(row)) for c in columns))
    return table


def markdown_table(columns: list[Column], rows: Iterable[Any]) -> str:
    lines = ["| " + " | ".join(c.header for c in columns) + " |",
             "| " + " | ".join("---:" if c.justify == "right" else "---" for c in columns) + " |"]
    lines += ["| " + " | ".join(str(c.cell(r)) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def csv_table(columns: list[Column], rows: Iterable[Any]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(c.header for c in columns)
    writer.writerows([c.cell(r) for c in columns] for r in rows)
    return out.getvalue()


def to_json(model) -> str:
    return json.dumps(model.to_dict(), indent=2) + "\n"


# --- breakdown --------------------------------------------------------------------------

def component_columns(peak: int, with_source: bool = False) -> list[Column]:
    """Columns of the components table; ``peak`` gives the share column, ``with_source``
    adds the code line that allocated each component (traced results have it)."""
    columns = [
        Column("component", lambda c: c.name),
        Column("role", lambda c: c.role.value),
        Column("dtype", lambda c: c.dtype),
        Column("formula (shape x element)", lambda c: c.formula),
        Column("bytes", lambda c: c.nbytes, "right"),
        Column("allocated", lambda c: c.block_bytes, "right"),
        Column("MiB", lambda c: mib(c.block_bytes), "right"),
        Column("share", lambda c: share(c.block_bytes, peak), "right"),
    ]
    return columns + [Column("source", lambda c: c.source)] if with_source else columns


def _columns_for(b) -> list[Column]:
    return component_columns(b.peak_bytes, any(c.source for c in b.components))


FIGURE_LABELS = {
    "saved_bytes": "saved for backward",
    "forward_peak_bytes": "forward peak",
    "backward_peak_bytes": "backward peak",
    "peak_bytes": "peak (max_memory_allocated)",
    "reserved_peak_bytes": "reserved peak (max_memory_reserved)",
    "workspace_bytes": "cuBLAS workspaces",
}

FIGURE_COLUMNS = [
    Column("figure", lambda kv: FIGURE_LABELS[kv[0]]),
    Column("bytes", lambda kv: kv[1], "right"),
    Column("MiB", lambda kv: mib(kv[1]), "right"),
    Column("", lambda kv: human(kv[1]), "right"),
]


def breakdown_title(b) -> str:
    c = b.config
    s = c.shape
    kv = f" M={s.kv_len}" if s.kv_len else ""
    flags = (" causal" if c.causal else "") + (" forward-only" if c.protocol.forward_only else "")
    return (f"{c.impl}{flags}: B={s.batch} H={s.heads} N={s.seq_len}{kv} d={s.head_dim} "
            f"{c.dtype.value} on {c.device.spec.label}; peak in {b.peak_phase}")


def breakdown_rich(b) -> Group:
    components = rich_table(f"{breakdown_title(b)}\nalive at the peak", _columns_for(b),
                            b.components)
    figures = rich_table(None, FIGURE_COLUMNS, _figure_rows(b))
    return Group(components, figures)


def breakdown_markdown(b) -> str:
    return (f"**{breakdown_title(b)}**\n\n"
            + markdown_table(_columns_for(b), b.components) + "\n"
            + markdown_table(FIGURE_COLUMNS, _figure_rows(b)))


def breakdown_csv(b) -> str:
    return csv_table(_columns_for(b), b.components)


def _figure_rows(b) -> list[tuple[str, int]]:
    return [(k, getattr(b, k)) for k in FIGURE_LABELS]


def html(renderable) -> str:
    """Jupyter HTML of anything with ``__rich__``, through rich's own exporter."""
    from rich.console import Console

    # force_jupyter=False: in a notebook rich would also display the table itself
    console = Console(record=True, width=140, file=io.StringIO(), force_jupyter=False)
    console.print(renderable)
    return console.export_html(inline_styles=True, code_format="<pre>{code}</pre>")
