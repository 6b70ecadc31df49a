"""The agent's events (agent.node.events): each kind survives its line, a torn or foreign
line is skipped, and the reader hands out only what was appended since its last read."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from agent.node.events import (AgentError, EventLog, EventReader, GaveUp, HealthyAgain, KeptOut, NotJoining,
                               Restarted, WorkersFailed, WorkersHung, parse, to_line)

EVERY_KIND = [
    WorkersFailed((0, 2), (1, -9), 'killed by the OOM killer "x"', in_place=True, at=1.5, log_offset=120),
    WorkersHung((1,), at=2.0),
    Restarted("lease_lost", "this node lost its own etcd lease", at=3.0, log_offset=0),
    KeptOut("crash_loop", "crashed 3 times right after starting", 20.0, 2, at=4.0),
    GaveUp("script_error", "the workers of every node (2) failed", (0,), (1,), at=5.0),
    NotJoining("snapshot dir: 0.2 GiB free, below the 1 GiB floor", 5.0, 1, at=6.0),
    HealthyAgain(6.0, at=7.0),
    AgentError("the job fails: no restarts left", at=8.0),
]


@pytest.mark.parametrize("event", EVERY_KIND, ids=lambda e: e.KIND)
def test_every_kind_survives_its_line(event) -> None:
    line = to_line(event)
    assert line.endswith("\n") and line.count("\n") == 1
    assert parse(line) == event


def test_a_signal_death_is_named() -> None:
    assert WorkersFailed((0,), (-11,)).signal == "SIGSEGV"
    assert WorkersFailed((0, 1), (1, -9)).signal == "SIGKILL"
    assert WorkersFailed((0,), (1,)).signal == ""


@pytest.mark.parametrize("line", [
    '{"event":"restart","reason":"peer_lo',  # cut short by a SIGKILL
    '{"event":"restart","reason":"peer_lost","at":1}{"event":"hung","at":2}',  # a torn line with the next glued on
    '{"event":"from_a_newer_agent","at":1}',
    '{"event":"worker_failed","ranks":["0"],"exits":[1],"at":1}',  # not what the schema says
    '{"event":"kept_out","reason":"crash_loop","why":"x","backoff":"long"}',
    '["restart"]',
    "",
])
def test_a_line_that_is_no_event_is_skipped(line: str) -> None:
    assert parse(line) is None


def test_an_older_reader_ignores_fields_it_does_not_know() -> None:
    assert parse('{"event":"restart","reason":"hang","at":1,"added_later":true}') == Restarted("hang", at=1)


def test_the_reader_takes_what_was_appended_and_waits_for_a_whole_line(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    reader = EventReader(path)
    assert reader.read() == []  # no file yet
    events = EventLog(path)
    events.emit(WorkersHung(at=1.0))
    events.emit(Restarted("hang", at=2.0))
    first = reader.read()
    assert [type(e) for e in first] == [WorkersHung, Restarted]
    assert all(e.log_offset is None or e.log_offset >= 0 for e in first)  # the agent's output size, when a file
    line = to_line(GaveUp("hang", "hung, and no restarts left", at=3.0))
    with open(path, "a") as f:
        f.write(line[:10])
        f.flush()
        assert reader.read() == []  # half a line waits
        f.write(line[10:])
    assert reader.read() == [GaveUp("hang", "hung, and no restarts left", at=3.0)]
    assert reader.read() == []


def test_an_error_line_becomes_an_event_and_a_failed_write_does_not_raise(tmp_path: Path) -> None:
    events = EventLog(tmp_path / "events.jsonl")
    logger = logging.getLogger("test.agent.events")
    handler = events.error_handler()
    logger.addHandler(handler)
    try:
        logger.warning("not an error")
        logger.error("[%s] %s: the job fails", "node-0", "no restarts left")
    finally:
        logger.removeHandler(handler)
    (error,) = EventReader(tmp_path / "events.jsonl").read()
    assert isinstance(error, AgentError) and error.message == "[node-0] no restarts left: the job fails"
    EventLog(tmp_path / "no-such-dir" / "events.jsonl").emit(HealthyAgain())  # said at debug level, not raised
