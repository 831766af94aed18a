"""Progress on stderr: a bar or a status line on a terminal, nothing elsewhere."""

import io

from memcalc import progress, registry
from memcalc.config import Config
from memcalc.registry import IMPLS
from memcalc.timeline import predict


class Terminal(io.StringIO):
    """A stream that says it is a terminal (rich then draws, with control codes)."""

    def isatty(self) -> bool:
        return True


def test_say_is_silent_without_a_status():
    assert not progress.listening()
    progress.say("nobody hears this")  # no error, no output


def test_status_draws_nothing_off_a_terminal():
    stream = io.StringIO()
    with progress.status("working", stream):
        assert not progress.listening()
        progress.say("step 2")
    assert stream.getvalue() == ""


def test_status_shows_the_latest_say_on_a_terminal():
    stream = Terminal()
    with progress.status("working", stream):
        assert progress.listening()
        progress.say("trying seq_len=4,096")
        progress.detail("measured backward")
    assert not progress.listening()  # closed with the block
    assert "trying seq_len=4,096 - measured backward" in stream.getvalue()


def test_say_starts_afresh_and_detail_follows_it():
    heard: list[str] = []
    with progress.listen(heard.append):
        progress.say("a")
        progress.detail("step 1")
        progress.detail("step 2")
        progress.say("b")
    assert heard == ["a", "a - step 1", "a - step 2", "b"]


def test_a_replay_says_its_phases_and_its_program_build(monkeypatch):
    config = Config(impl="linear-causal-chunked", shape={"seq_len": 6400})  # 100 chunks
    monkeypatch.setattr(registry, "_PROGRAMS", {})  # so that the program is built here
    heard: list[str] = []
    with progress.listen(heard.append):
        predict(config)
    program = IMPLS["linear-causal-chunked"].program(config.dims)
    forward, backward = len(program.forward), len(program.backward)  # 2,105 and 4,692
    assert heard == ["building the program",
                     f"warm-up step ({forward + backward:,} events)",
                     f"measured forward ({forward:,} events)",
                     f"measured backward ({backward:,} events)"]


def test_the_status_line_is_cut_to_the_terminal_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    stream = Terminal()
    with progress.status("working", stream):
        progress.say("x" * 100)
    drawn = stream.getvalue()
    assert "x" * 37 + "…" in drawn and "x" * 39 not in drawn  # 40 less the spinner and a space
