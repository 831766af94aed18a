"""The rendering protocol of every result (a breakdown, a comparison, a sweep, an OOM
report, a validation report): one declaration of its tables, every format derived.
"""

from __future__ import annotations

from memcalc.engine.component import Record
from memcalc.output.render import csv_text, fitted, html, markdown, to_json


class Result(Record):
    """A result that renders itself: it declares ``tables()`` and ``footnotes()`` once, and
    rich, HTML, Markdown, CSV, JSON and pandas are derived (``memcalc.output.render``)."""

    def tables(self) -> list:
        """The result's tables (``memcalc.output.render.Table``), as every format shows them."""
        return []

    def footnotes(self) -> list[str]:
        """Lines printed after the tables: caveats, skipped rows, the budget."""
        return []

    def csv_table(self):
        """The table ``to_csv`` writes (exact bytes); the first table by default."""
        return self.tables()[0]

    def __rich__(self):
        return fitted(self)

    def _repr_html_(self) -> str:
        """Jupyter: the same tables as in a terminal, as HTML."""
        return html(self)

    def to_markdown(self) -> str:
        return markdown(self)

    def to_csv(self) -> str:
        return csv_text(self)

    def to_json(self) -> str:
        return to_json(self)

    def to_dataframe(self):
        """``records()`` as a pandas DataFrame; pandas is optional (``memcalc[pandas]``).
        Built from Python objects, then typed (``convert_dtypes``): a byte column with an
        absent value is pandas' nullable ``Int64``, exact, not float64 with NaN."""
        from memcalc.errors import require

        pandas = require("pandas", "to_dataframe")
        return pandas.DataFrame(self.records(), dtype=object).convert_dtypes()
