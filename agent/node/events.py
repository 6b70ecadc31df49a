"""What the node agent did, as typed events: one JSON object a line in ``events.jsonl``.

The agent's log lines are for people; tools that must know what it acted on (``elastic
local``'s crash list, its console, the tests' fault records: :mod:`agent.local.local_node`)
read these instead of parsing that prose. One event per act, appended (``O_APPEND``, one
``write`` a line) to :data:`EVENTS_FILE` in the agent's directory; a new agent on the same
directory appends after its predecessor's. A line cut short by a SIGKILL is skipped by
the reader, and so is an event this build does not know (a newer agent's).

``log_offset`` is the size of the agent's own output file (its stderr) when the event was
written, or None when that is not a file: a reader of that output knows which of its
lines (a worker's traceback) came before the act.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import stat
import time
import dataclasses
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import ClassVar, Mapping

log = logging.getLogger("elastic.agent")

EVENTS_FILE = "events.jsonl"


def _now() -> float:
    return time.time()


@dataclass(frozen=True)
class WorkersFailed:
    """Local workers failed and the agent acts on it: it stops every local worker (and
    ``restarted`` says next whether the failure was this node's), or with ``in_place``
    starts only these ranks again while the others keep running."""

    KIND: ClassVar[str] = "worker_failed"
    ranks: tuple[int, ...]
    exits: tuple[int, ...]  # each rank's exit code, as ``ranks``; negative: killed by a signal
    words: str = ""  # the cause the agent has: the error files' first line, its words for a signal death
    in_place: bool = False
    cause: str = ""  # what ended them, by the error's type (elastic.contract.FaultCause's value); "": none named
    at: float = field(default_factory=_now)
    log_offset: int | None = None

    @property
    def signal(self) -> str:
        """``SIGSEGV`` for the first rank killed by a signal; "" when it exited."""
        for code in self.exits:
            if code < 0:
                try:
                    return signal.Signals(-code).name
                except ValueError:
                    return f"signal {-code}"
        return ""


@dataclass(frozen=True)
class WorkersHung:
    """No local rank made progress for the hang timeout: the agent stops them (or, with
    ``in_place``, starts these ranks again)."""

    KIND: ClassVar[str] = "hung"
    ranks: tuple[int, ...] = ()
    in_place: bool = False
    at: float = field(default_factory=_now)
    log_offset: int | None = None


@dataclass(frozen=True)
class Restarted:
    """Every local worker started anew in a new round, for ``reason`` (a
    :class:`agent.node.policy.Reason` value: ``worker_failed`` and ``hang`` are this node's
    own, ``peer_lost`` another's); ``why``: what the agent said when it stopped them."""

    KIND: ClassVar[str] = "restart"
    reason: str
    why: str = ""
    at: float = field(default_factory=_now)
    log_offset: int | None = None


@dataclass(frozen=True)
class KeptOut:
    """The agent stopped its workers and stays out of the job for ``backoff`` s (a crash
    loop, a straggler, suspect hardware: ``reason``)."""

    KIND: ClassVar[str] = "kept_out"
    reason: str
    why: str
    backoff: float = 0.0
    strikes: int = 0
    at: float = field(default_factory=_now)
    log_offset: int | None = None


@dataclass(frozen=True)
class GaveUp:
    """The agent gives up: the job fails, for ``reason`` (``hang``, ``worker_failed``,
    ``crash_loop``, ``script_error``...); ``why`` says it to a person."""

    KIND: ClassVar[str] = "gave_up"
    reason: str
    why: str
    ranks: tuple[int, ...] = ()
    exits: tuple[int, ...] = ()
    at: float = field(default_factory=_now)
    log_offset: int | None = None


@dataclass(frozen=True)
class NotJoining:
    """A health check fails: the node joins no round for ``kept_out_s`` s, then checks again."""

    KIND: ClassVar[str] = "not_joining"
    reason: str  # the failed checks, with their fix
    kept_out_s: float
    strikes: int = 0
    at: float = field(default_factory=_now)
    log_offset: int | None = None


@dataclass(frozen=True)
class HealthyAgain:
    """Every health check passes again after ``after_s`` s kept out: the node joins."""

    KIND: ClassVar[str] = "healthy_again"
    after_s: float = 0.0
    at: float = field(default_factory=_now)
    log_offset: int | None = None


@dataclass(frozen=True)
class AgentError:
    """The agent logged an error (its ``ERROR`` line's message), for a tool to show why it failed."""

    KIND: ClassVar[str] = "error"
    message: str
    at: float = field(default_factory=_now)
    log_offset: int | None = None


Event = WorkersFailed | WorkersHung | Restarted | KeptOut | GaveUp | NotJoining | HealthyAgain | AgentError
_TYPES: Mapping[str, type] = {t.KIND: t for t in (WorkersFailed, WorkersHung, Restarted, KeptOut, GaveUp,
                                                   NotJoining, HealthyAgain, AgentError)}


def to_line(event: Event) -> str:
    """One JSON object, ``event`` naming its kind, ending in a newline."""
    return json.dumps({"event": event.KIND, **asdict(event)}, separators=(",", ":")) + "\n"


def parse(line: str | bytes) -> Event | None:
    """The event on ``line``; None for a torn line, an unknown kind or a field of the wrong type."""
    try:
        data = json.loads(line)
        kind = _TYPES[data.pop("event")]
        known = {f.name: f for f in fields(kind)}
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in known}
        event = kind(**values)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return event if _typed(event) else None


def _typed(event: Event) -> bool:
    """Its numbers are numbers and its ranks ints: a hand-edited or foreign line is dropped, not trusted."""
    for f in fields(event):
        value = getattr(event, f.name)
        if f.name in ("ranks", "exits") and not all(isinstance(v, int) for v in value):
            return False
        if f.name in ("at", "backoff", "kept_out_s", "after_s") and not isinstance(value, (int, float)):
            return False
        if f.name in ("words", "why", "reason", "message", "cause") and not isinstance(value, str):
            return False
    return True


def _output_size() -> int | None:
    """The size of this process's stderr when it is a file (where its workers' tracebacks land too)."""
    try:
        st = os.fstat(2)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


class EventLog:
    """Appends the agent's events to ``path``; a write that fails is logged, never raised
    (what the agent acts on must not depend on a tool's file)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def emit(self, event: Event) -> None:
        if event.log_offset is None:
            event = dataclasses.replace(event, log_offset=_output_size())
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, to_line(event).encode())
            finally:
                os.close(fd)
        except OSError as exc:
            log.debug("cannot write %s: %s", self.path, exc)

    def error_handler(self) -> logging.Handler:
        """A logging handler that turns each ERROR record into an :class:`AgentError`."""
        return _ErrorEvents(self)


class NoEvents:
    """:class:`EventLog`'s place where nothing reads the events (a unit test's watch)."""

    def emit(self, event: Event) -> None:
        pass


class _ErrorEvents(logging.Handler):
    def __init__(self, events: EventLog) -> None:
        super().__init__(logging.ERROR)
        self.events = events

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.events.emit(AgentError(record.getMessage(), at=record.created))
        except Exception:  # noqa: BLE001 - logging's rule: a handler never raises into the caller
            self.handleError(record)


class EventReader:
    """Reads ``path``'s events as the file grows: each call returns only those appended
    since the last; a line still being written waits for its end."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._read_to = 0
        self._partial = b""

    def read(self) -> list[Event]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._read_to)
                fresh = f.read()
        except FileNotFoundError:
            return []
        self._read_to += len(fresh)
        lines = (self._partial + fresh).split(b"\n")
        self._partial = lines.pop()
        return [e for e in (parse(line) for line in lines if line.strip()) if e is not None]


__all__ = ["EVENTS_FILE", "AgentError", "Event", "EventLog", "EventReader", "GaveUp", "HealthyAgain", "KeptOut",
           "NoEvents", "NotJoining", "Restarted", "WorkersFailed", "WorkersHung", "parse", "to_line"]
