"""Every command shown in README.md and ``docs/`` prints what the page shows under it
(``tools/shown_outputs.py`` rewrites them): a page never shows an output memcalc no longer
gives."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import shown_outputs  # noqa: E402

BLOCKS = [(page.relative_to(shown_outputs.ROOT).as_posix(), command, shown)
          for page in shown_outputs.pages() for command, shown in shown_outputs.blocks(page)]


def test_the_pages_show_commands():
    assert len(BLOCKS) > 50 and {p for p, *_ in BLOCKS} >= {"README.md",
                                                            "docs/guides/trace.md"}


@pytest.mark.parametrize("page, command, shown", BLOCKS,
                         ids=[f"{p}:{i}" for i, (p, *_) in enumerate(BLOCKS)])
def test_a_shown_command_prints_what_is_shown(page, command, shown):
    assert shown_outputs.output(command) == shown, f"{page}: $ {command}"


def test_the_cli_reference_has_every_command_and_option():
    """The generated CLI page: each command's ``--help``, its options among it."""
    sys.path.insert(0, str(shown_outputs.ROOT / "tools"))
    import mkdocs_hooks

    from memcalc.cli import command_names

    text = mkdocs_hooks.cli_reference()
    assert all(f"## memcalc {name}\n" in text for name in command_names())
    assert "--seq" in text.split("## memcalc breakdown")[1].split("## memcalc")[0]
