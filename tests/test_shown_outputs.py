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

SLOW = ("examples/training/llama3_8b.py", "examples/training/torchtitan_llama3.py",
        "memcalc validate", "memcalc.validation.context_parallel", "validation/memtracker.py",
        "--compile eager,default", "--compile-budget 0,1")
"""What makes a shown command slow (a minute or more each on a 2-core machine): Llama-3-8B's
32 layers traced on the meta device, as Hugging Face and torchtitan build it (at six lengths
for a search, ``oom --trace``; 8 ranks' ring attention traced rank by rank), the whole validation grid and context parallelism's
(``memcalc validate``, ``--cases cp``), the recorded ring runs given back rank by rank,
torchtitan's 8B beside PyTorch's FSDPMemTracker, a model compiled and eager side by
side (each compiled by inductor: half a minute or more), and the longest length a compiled
step fits at two budgets (compiled at each length its search tries).
Their checks run with ``-m slow``; what they rest on is checked quickly elsewhere: the
search (``tests/test_solver.py``), traced training steps and FSDP
(``tests/test_tracing_*.py``; FSDPMemTracker on torchtitan's small model in
``test_tracing_memtracker.py``; compiled steps in ``tests/test_compiling_*.py``), the grid
(``tests/test_validate_emulated.py``), the ring
against torch's (``tests/test_impls_ring.py``) and the recorded ranks, every eighth
(``tests/test_validate_context_parallel.py``)."""


LONGEST = ("--cp 8",)
"""What makes a slow command among the longest: Llama-3-8B over 8 ranks with ring attention,
each rank traced in turn. Marked ``first``: it starts before the rest (``tests/conftest.py``).
(``oom --trace`` over those ranks fits each rank's program and traces every rank at its
answer: half an hour of CPU time. The page shows a trace at its answer instead, and the
slow suite stays within CI's time.)"""


def _checked(blocks):
    """``pytest.param`` per block, ``page:index`` its id; the slow ones marked ``slow``, the
    longest ``first`` too."""
    return [pytest.param(page, command, shown, id=f"{page}:{i}", marks=_marks(command))
            for i, (page, command, shown) in enumerate(blocks)]


def _marks(command: str) -> list:
    if not any(s in command for s in SLOW):
        return []
    return [pytest.mark.slow] + ([pytest.mark.first] if any(s in command for s in LONGEST)
                                 else [])


def test_the_pages_show_commands():
    assert len(BLOCKS) > 50 and {p for p, *_ in BLOCKS} >= {"README.md",
                                                            "docs/guides/trace.md"}


def test_the_slow_blocks_are_the_minutes_long_ones():
    """The Llama-3-8B blocks of the training guide, the validation commands of two pages,
    torchtitan's, the compiled-steps page's side-by-side tables, and nothing else."""
    slow = [p for p in _checked(BLOCKS) if p.marks]
    assert len(slow) >= 10 and {p.values[0] for p in slow} == {
        "docs/guides/training.md", "docs/concepts/validation.md", "docs/guides/several-gpus.md",
        "docs/guides/torchtitan.md", "docs/guides/compiled.md"}


def test_the_longest_block_starts_first():
    """The trace over 8 ranks with ring attention is put first among the slow blocks
    (``conftest.pytest_collection_modifyitems``), the others in the pages' order."""
    import conftest

    class Item:
        def __init__(self, param):
            self.param = param

        def get_closest_marker(self, name):
            return next((m for m in self.param.marks if m.name == name), None)

    slow = [Item(p) for p in _checked(BLOCKS) if p.marks]
    ordered = list(slow)
    conftest.pytest_collection_modifyitems(ordered)
    command = ordered[0].param.values[1]
    assert command.startswith("COLUMNS=80 memcalc trace") and "--cp 8" in command
    assert ordered[1:] == [i for i in slow if i is not ordered[0]]


@pytest.mark.parametrize("page, command, shown", _checked(BLOCKS))
def test_a_shown_command_prints_what_is_shown(page, command, shown):
    why = shown_outputs.unlike_the_pages()  # .ci/run pins the releases they show
    if why is not None:
        pytest.skip(why)
    assert shown_outputs.output(command) == shown, f"{page}: $ {command}"


def test_the_cli_reference_has_every_command_and_option():
    """The generated CLI page: each command's ``--help``, its options among it."""
    sys.path.insert(0, str(shown_outputs.ROOT / "tools"))
    import mkdocs_hooks

    from memcalc.cli import command_names

    text = mkdocs_hooks.cli_reference()
    assert all(f"## memcalc {name}\n" in text for name in command_names())
    assert "--seq" in text.split("## memcalc breakdown")[1].split("## memcalc")[0]
