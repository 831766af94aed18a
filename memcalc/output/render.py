"""Rendering of results: one protocol, every format derived from it.

A result declares its tables once (``Table``: a title, ``Column`` specifications and the
rows) and its notes (``memcalc.output.result.Result.tables``/``footnotes``); the rich rendering,
HTML, Markdown, CSV, JSON and the short ``repr`` all come from that declaration, here.

In a terminal the tables fit the width they get, and no figure is ever cut: a column that
does not fit is dropped (secondary columns first, by their ``drop`` rank), and when even the
essential columns do not fit, each row is printed as a block of ``header value`` pairs.
The library itself never prints.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

# rich is imported where a table is drawn, not here: JSON and CSV, which a script reads,
# need none of it (its console module is a sixth of a command's start-up)

# separators of ``_rich_table``'s layout: one space of padding on each side of a column
# boundary, none at the edges (measured: a two-column table of widths a and b is a + b + 2)
_GAP = 2
# a prose column (``wrap``) may be narrowed to this, wrapping at spaces, never below its
# longest word
_PROSE = 24


@dataclass(frozen=True)
class Column:
    """A header and a function of the row. ``drop``: 0 for a column that is always shown,
    higher for secondary columns, dropped first (highest rank first) when the width is
    short. ``wrap``: prose that may wrap at spaces (never a figure). ``phrase``: a header
    kept on one line where the width allows (a pivot's ``seq_len \\ head_dim`` wrapped into
    three lines put ``head_dim`` over the lengths)."""

    header: str
    cell: Callable[[Any], Any]
    justify: str = "left"
    drop: int = 0
    wrap: bool = False
    phrase: bool = False
    means: str = ""  # what the column means, in the legend under the table when it is shown
    term: str = ""  # the legend's name for it (default: the header)

    def __post_init__(self):
        if not self.header:  # a CSV or Markdown reader needs every column named
            raise ValueError("a column needs a header")


@dataclass(frozen=True)
class Table:
    """One table of a result: ``title`` (may hold several lines), columns and rows."""

    title: str | None
    columns: Sequence[Column]
    rows: Sequence[Any]
    notes: Sequence[str] = field(default_factory=tuple)

    def cells(self, columns: Sequence[Column] | None = None) -> list[list[str]]:
        return [[shown(c.cell(r)) for c in (columns or self.columns)] for r in self.rows]


def shown(value: Any) -> str:
    """A cell as a person reads it: a count with thousands separators (``20,516,864``, as
    the prose writes it); anything else as it is. CSV and JSON keep the bare number."""
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


# --- plain formats ------------------------------------------------------------------------

def escaped(text: str) -> str:
    """Text that Markdown shows as written: ``*`` would start emphasis even inside a word
    (``192*N^2 + 3,168*N``), ``|`` would end a table cell, ``<`` would open an HTML tag
    (``trace:<lambda>`` showed as ``trace:``). (``_`` inside a word, as in ``exp_x``, and a
    backslash before a space, as in ``seq_len \\ head_dim``, are literal in CommonMark.)"""
    return str(text).replace("*", "\\*").replace("|", "\\|").replace("<", "\\<")


def markdown_table(columns: Sequence[Column], rows: Iterable[Any]) -> str:
    lines = ["| " + " | ".join(escaped(c.header) for c in columns) + " |",
             "| " + " | ".join("---:" if c.justify == "right" else "---" for c in columns) + " |"]
    lines += ["| " + " | ".join(escaped(shown(c.cell(r))) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def csv_table(columns: Sequence[Column], rows: Iterable[Any]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(c.header for c in columns)
    writer.writerows([c.cell(r) for c in columns] for r in rows)
    return out.getvalue()


def record_table(keys: Sequence[str], records: Sequence[dict]) -> Table:
    """A machine table (CSV) of ``records``, the dicts the JSON and ``records()`` hold: a
    column per key, named as the key, holding its value (None: an empty cell), so that a
    CSV column and a JSON key of the same name always hold the same figure."""
    return Table(None, [Column(k, (lambda k: lambda r: r[k])(k)) for k in keys], records)


def legend(columns: Sequence[Column]) -> str | None:
    """``peak: max_memory_allocated ...; saved: ...``: what the columns shown mean (a
    column a narrow terminal dropped is not explained); None when none says."""
    said = [f"{c.term or c.header}: {c.means}" for c in columns if c.means]
    return "; ".join(said) + "." if said else None


def _bold_title(title: str) -> str:
    """Markdown: the title's first line in bold, the rest as a paragraph."""
    first, _, rest = title.partition("\n")
    return f"**{escaped(first)}**\n\n" + (f"{escaped(rest)}\n\n" if rest else "")


def markdown(result) -> str:
    """Every table of ``result`` (bold title, table, its notes), then the result's notes."""
    parts = []
    for t in result.tables():
        notes = "".join(f"\n{escaped(n)}\n" for n in [*t.notes, legend(t.columns)] if n)
        parts.append((_bold_title(t.title) if t.title else "")
                     + markdown_table(t.columns, t.rows) + notes)
    notes = "".join(f"\n{escaped(n)}\n" for n in result.footnotes())
    return "\n".join(parts) + notes


def csv_text(result) -> str:
    """The result's CSV table (exact bytes where the rich tables show units)."""
    t = result.csv_table()
    return csv_table(t.columns, t.rows)


def to_json(model) -> str:
    return json.dumps(model.to_dict(), indent=2) + "\n"


# --- rich: tables that fit the width ------------------------------------------------------

def _width(column: Column, cells: list[str]) -> int:
    """The width ``column`` needs: its longest cell (a prose column: at most ``_PROSE``,
    never below its longest word) and its header's longest word (headers wrap at spaces)."""
    words = [len(w) for text in cells + [column.header] for w in text.split()] or [1]
    longest = max([len(text) for text in cells] or [1])
    if column.wrap:
        longest = max(min(longest, _PROSE), max(words))
    return max(longest, max(len(w) for w in column.header.split() or [""]), 1)


def _fit_columns(table: Table, width: int) -> list[Column] | None:
    """The most columns of ``table`` that fit ``width``: secondary columns dropped, highest
    ``drop`` rank first; None when even the essential ones do not fit."""
    columns = list(table.columns)
    cells = table.cells()
    widths = {id(c): _width(c, [row[i] for row in cells]) for i, c in enumerate(columns)}
    ranks = sorted({c.drop for c in columns}, reverse=True)
    for rank in ranks + [None]:
        if sum(widths[id(c)] for c in columns) + _GAP * (len(columns) - 1) <= width:
            return columns
        if rank is None or rank == 0:
            return None
        columns = [c for c in columns if c.drop < rank]
    return None


def _rich_table(columns: list[Column], cells: list[list[str]], width: int):
    """A rich table whose columns have the widths they need: numbers never wrap or
    shorten; headers and prose wrap at spaces, prose over the width the others leave."""
    from rich import box
    from rich.table import Table as RichTable

    table = RichTable(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, show_edge=False,
                      collapse_padding=True, expand=False)
    for c, w in zip(columns, _widened(columns, cells, width)):
        table.add_column(c.header, justify=c.justify, width=w,
                         overflow="fold")  # every cell fits its width: only headers and prose wrap
    for row in cells:
        table.add_row(*row)
    return table


def _widened(columns: list[Column], cells: list[list[str]], width: int) -> list[int]:
    """Each column's width (``_width``), the prose columns given what the table leaves of
    ``width``, in order, up to their longest cell (a summary wrapped at 31 characters on
    an 80-column terminal with 15 to spare)."""
    widths = [_width(c, [r[i] for r in cells]) for i, c in enumerate(columns)]
    spare = width - sum(widths) - _GAP * (len(columns) - 1)
    for i, c in enumerate(columns):
        if (c.wrap or c.phrase) and spare > 0:
            wanted = len(c.header) if c.phrase else max([len(r[i]) for r in cells] or [0])
            extra = min(spare, wanted - widths[i])
            widths[i], spare = widths[i] + max(0, extra), spare - max(0, extra)
    return widths


def _vertical(table: Table, width: int):
    """Each row as a block: its first cell, then ``header value`` pairs packed into lines
    of ``width`` (for widths where even the essential columns do not fit side by side)."""
    from rich.console import Group
    from rich.text import Text

    first, *rest = table.columns
    lines: list = []
    for row in table.rows:
        lines.append(Text(shown(first.cell(row)), style="bold"))
        line = " "
        for c in rest:
            pair = f"{c.header} {shown(c.cell(row))}"
            if len(line) > 1 and len(line) + 3 + len(pair) > width:
                lines.append(Text(line))
                line = " "
            line += (" · " if len(line) > 1 else " ") + pair
        lines.append(Text(line))
    return Group(*lines)


class Fitted:
    """A result's tables and notes as a rich renderable that fits the console's width."""

    def __init__(self, tables: list[Table], notes: list[str]):
        self.tables, self.notes = tables, notes

    def __rich_console__(self, console, options):
        from rich.text import Text

        width = options.max_width
        for i, t in enumerate(self.tables):
            if i:
                yield Text("")
            if t.title:
                yield Text(t.title)
            columns = _fit_columns(t, width)
            if columns is None:
                yield _vertical(t, width)
            else:
                yield _rich_table(columns, t.cells(columns), width)
            for note in [*t.notes, legend(columns or t.columns)]:
                if note:
                    yield Text(note)
        for note in self.notes:
            yield Text(note)


def fitted(result) -> Fitted:
    return Fitted(list(result.tables()), list(result.footnotes()))


def text(result, width: int = 100) -> str:
    """``result`` rendered as plain text at ``width`` columns (``print(result)``, a pipe),
    without the spaces rich pads each table line with."""
    from rich.console import Console

    console = Console(width=width, file=io.StringIO(), color_system=None, force_jupyter=False,
                      force_terminal=False)
    console.print(result)
    return "".join(line.rstrip() + "\n" for line in console.file.getvalue().splitlines())


def html(renderable) -> str:
    """Jupyter HTML of anything with ``__rich__``, through rich's own exporter."""
    from rich.console import Console

    # force_jupyter=False: in a notebook rich would also display the table itself
    console = Console(record=True, width=140, file=io.StringIO(), force_jupyter=False)
    console.print(renderable)
    return console.export_html(inline_styles=True, code_format="<pre>{code}</pre>")


def rich_table(title: str | None, columns: list[Column], rows: Iterable[Any],
               notes: Sequence[str] = ()) -> Fitted:
    """One table with a title (and notes under it), fitted to the width (for results of a
    single table)."""
    return Fitted([Table(title, columns, list(rows))], list(notes))

