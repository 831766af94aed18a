"""MkDocs hooks (``mkdocs.yml``): the pages generated from the code when the site is built.

``reference/cli.md`` gets every command's ``--help`` (from the argparse parsers of
``memcalc.cli``), ``accuracy.md`` the recorded GPU runs given back by today's model
(``memcalc.validation.accuracy``).
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cli_reference() -> str:
    """``memcalc --help`` and each command's ``--help``, at 100 columns."""
    os.environ["COLUMNS"] = "100"  # argparse wraps at the terminal's width
    from memcalc.cli import _subparsers, build_parser, command

    parser = build_parser()  # every command's options
    parts = ["```text", parser.format_help().rstrip(), "```"]
    for name, sub in _subparsers(parser):
        summary = command(name).HELP
        parts += ["", f"## memcalc {name}", "", summary[:1].upper() + summary[1:] + ".", "",
                  "```text", sub.format_help().rstrip(), "```"]
    return "\n".join(parts)


def accuracy() -> str:
    from memcalc.validation.accuracy import page

    return page(ROOT / "validation" / "results")


GENERATED = {"<!-- cli-reference -->": cli_reference, "<!-- accuracy -->": accuracy}


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Fill the placeholders of a page with what they stand for."""
    for placeholder, make in GENERATED.items():
        if placeholder in markdown:
            markdown = markdown.replace(placeholder, make())
    return markdown
