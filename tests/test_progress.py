"""Progress on stderr: a bar or a status line on a terminal, nothing elsewhere."""

import io

from memcalc.engine import status
from memcalc.impls import registry
from memcalc.output import progress
from memcalc.config import Config
from memcalc.impls.registry import IMPLS
from memcalc.analysis.predict import predict


class Terminal(io.StringIO):
    """A stream that says it is a terminal (rich then draws, with control codes)."""

    def isatty(self) -> bool:
        return True


def test_say_is_silent_without_a_status():
    assert not status.listening()
    status.say("nobody hears this")  # no error, no output


def test_status_draws_nothing_off_a_terminal():
    stream = io.StringIO()
    with progress.status("working", stream):
        assert not status.listening()
        status.say("step 2")
    assert stream.getvalue() == ""


def test_status_shows_the_latest_say_on_a_terminal():
    stream = Terminal()
    with progress.status("working", stream):
        assert status.listening()
        status.say("trying seq_len=4,096")
        status.detail("measured backward")
    assert not status.listening()  # closed with the block
    assert "trying seq_len=4,096 - measured backward" in stream.getvalue()


def test_say_starts_afresh_and_detail_follows_it():
    heard: list[str] = []
    with status.listen(heard.append):
        status.say("a")
        status.detail("step 1")
        status.detail("step 2")
        status.say("b")
    assert heard == ["a", "a - step 1", "a - step 2", "b"]


def test_a_replay_says_its_phases_and_its_program_build(monkeypatch):
    config = Config(impl="linear-causal-chunked", shape={"seq_len": 6400})  # 100 chunks
    monkeypatch.setattr(registry, "_PROGRAMS", {})  # so that the program is built here
    heard: list[str] = []
    with status.listen(heard.append):
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
        status.say("x" * 100)
    drawn = stream.getvalue()
    assert "x" * 37 + "…" in drawn and "x" * 39 not in drawn  # 40 less the spinner and a space
