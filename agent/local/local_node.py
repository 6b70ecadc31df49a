"""One local "node": a real torchrun agent and its workers, as one process tree.

The one-machine demo and the tests use it to stand for a machine: it can be killed
(SIGKILL of the whole tree, since torchrun puts workers in their own sessions), frozen
and thawed. Its progress comes from the job's own progress file (``elastic.train
--progress``) when there is one, else from the agent: the heartbeat every worker beats
after each optimizer step and the agent's ``status.json`` (round and ranks), so any script
can be followed without a change. Rows built that way carry ``kind``: ``job`` when the
script reported its own step numbers (``elastic.report_progress(step)``), ``count`` when
they only count this process's optimizer steps; and the loss and samples the script
reported, if it did (``report_progress(step, loss=..., samples=...)``). Their
``samples`` are the rank's own since the previous row, where a progress file's are the
step's global batch.

Its crashes come from its agent's events (:mod:`agent.node.events`: what the agent acted
on, typed) and its log (:class:`NodeLog`), where the workers' tracebacks land.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from elastic import contract

from agent.node.events import (EVENTS_FILE, AgentError, Event, EventReader, GaveUp, HealthyAgain, KeptOut,
                               NotJoining, Restarted, WorkersFailed, WorkersHung)
from agent.node.fault_cause import attribute
from agent.node.proctree import freeze_tree, kill_tree, process_tree, thaw_tree

from agent.local.zygote import ForkedProcess, Zygote, ZygoteGone

if TYPE_CHECKING:
    from agent.local.netns import Namespace

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
AUTO_METRICS_PORT = -1  # --metrics-port auto: no port picked ahead that another process could take first
# Not `-m agent.cli`: that puts the working directory (the user's, under `elastic local`) first
# on sys.path, and a user's own `agent/` or `elastic/` directory would shadow ours. `-c` puts ''
# there, which is dropped (as agent/worker/worker_boot.py does for the workers).
_AGENT_BOOT = "import sys; sys.path[:1] = [p for p in sys.path[:1] if p]; import agent.cli as elastic; " \
              "sys.exit(elastic.main())"
ELASTIC = [sys.executable, "-c", _AGENT_BOOT, "agent"]


@dataclass
class LocalNode:
    """``elastic agent`` (or plain ``torchrun``) running ``module`` as node ``name``.

    ``{progress}`` in ``module_args`` becomes this node's progress file; ``agent_args``
    are extra launcher flags (``--metrics-port``, ``--hang-timeout``...). With ``netns``
    (from :class:`agent.local.netns.NodeNetwork`) the node runs inside that namespace and uses its
    address for ``--local-addr`` and ``--metrics-addr``, as a node on its own host would.
    The agent and its workers run in ``cwd`` (default: ``workdir``, where the log goes).
    """

    name: str
    endpoint: str
    run_id: str
    workdir: Path
    module: str = "elastic.examples.tiny_ddp"
    module_args: Sequence[str] = ()
    script: str | None = None  # run this file instead of ``-m module`` (its args: module_args)
    nnodes: str = "1:3"
    nproc_per_node: int = 1
    max_restarts: int = 20
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    launcher: str = "elastic"  # or "torchrun": torch's own launcher
    rdzv_backend: str = "etcd-v3"  # "c10d" for comparisons (then endpoint is the store host's)
    agent_args: Sequence[str] = ()
    metrics_port: int = 0  # AUTO_METRICS_PORT: the agent binds a free one and says which (bound_metrics_port)
    netns: Namespace | None = None  # run inside this network namespace (agent.local.netns), at its address
    cwd: Path | None = None  # where the agent and its workers run; None: workdir
    zygote: Zygote | None = None  # fork the agent from this pre-imported process (agent.local.zygote)
    process: subprocess.Popen[bytes] | ForkedProcess | None = None
    frozen: list[int] = field(default_factory=list)
    _rows: list[dict[str, Any]] = field(default_factory=list, repr=False)
    _read_to: int = field(default=0, repr=False)  # bytes of the progress file already parsed
    _beats_seen: dict[tuple[int, int], tuple[int, float]] = field(default_factory=dict, repr=False)
    _samples_seen: dict[tuple[int, int], int] = field(default_factory=dict, repr=False)  # running totals
    _log: "NodeLog | None" = field(default=None, repr=False)

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    @property
    def metrics_host(self) -> str:
        """Where this node's /metrics listens: its namespace's address, else loopback."""
        return self.netns.addr if self.netns is not None else "127.0.0.1"

    @property
    def progress_path(self) -> Path:
        return self.workdir / f"{self.name}.progress.jsonl"

    @property
    def agent_dir(self) -> Path:
        return self.workdir / f"{self.name}.agent"

    def command(self) -> list[str]:
        port = "auto" if self.metrics_port == AUTO_METRICS_PORT else str(self.metrics_port)
        cmd = [*ELASTIC, "--node-name", self.name, "--metrics-port", port,
               "--agent-dir", str(self.agent_dir)] if self.launcher == "elastic" else [TORCHRUN]
        if self.netns is not None:  # peers and scrapers reach it at its own address, as on a host
            cmd += ["--local-addr", self.netns.addr]
            cmd += ["--metrics-addr", self.netns.addr] if self.launcher == "elastic" else []
        cmd += [
            "--nnodes", self.nnodes,
            "--nproc-per-node", str(self.nproc_per_node),
            "--rdzv-backend", self.rdzv_backend,
            "--rdzv-endpoint", self.endpoint,
            "--rdzv-id", self.run_id,
            "--max-restarts", str(self.max_restarts),
            "--monitor-interval", "0.1",
        ]
        if self.rdzv_conf:
            cmd += ["--rdzv-conf", ",".join(f"{k}={v}" for k, v in self.rdzv_conf.items())]
        args = [a.replace("{progress}", str(self.progress_path)) for a in self.module_args]
        target = [self.script] if self.script is not None else ["-m", self.module]
        cmd += [*self.agent_args, *target, *args]
        return self.netns.wrap(cmd) if self.netns is not None else cmd  # `ip netns exec` keeps the pid

    def start(self) -> "LocalNode":
        if self._log is not None:
            self._log.started_again()
        env = {**os.environ, contract.NODE_NAME_ENV: self.name, "PYTHONUNBUFFERED": "1", **self.env}
        command = self.command()
        if self.zygote is not None and self.launcher == "elastic" and self.netns is None:
            try:  # the same `elastic agent` command line, run in a fork of a pre-imported process
                self.process = self.zygote.fork("agent.cli", command[len(ELASTIC) - 1:], env, self.cwd or self.workdir, self.log_path)
                return self
            except ZygoteGone:
                pass  # started by exec below, as without a zygote
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, cwd=self.cwd or self.workdir, start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def _gone(self) -> bool:
        """The agent has exited and its exit code is known. Its pid then names nothing of ours: an
        agent forked by the zygote is reaped by the zygote at once, so nothing holds its pid, and
        on a busy machine (pid_max 32768, every thread a pid) the kernel hands it to another
        process within minutes. A signal sent to that pid's tree would kill a stranger."""
        return self.process is None or self.process.poll() is not None

    def kill(self) -> list[int]:
        """Node loss: SIGKILL the agent and all its workers at once (nothing if it already ended)."""
        if self._gone():
            return []
        pids = kill_tree(self.pid, signal.SIGKILL)
        assert self.process is not None
        self.process.wait(timeout=10)
        return pids

    def freeze(self) -> None:
        self.frozen = [] if self._gone() else freeze_tree(self.pid)

    def thaw(self) -> None:
        thaw_tree(self.frozen)
        self.frozen = []

    def cleanup(self) -> None:
        if self.process is None:
            return
        if self.frozen:
            self.thaw()
        if not self._gone() and process_tree(self.pid):
            kill_tree(self.pid, signal.SIGKILL)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def progress(self) -> list[dict[str, Any]]:
        """Every progress row so far: the job's progress file, or else the agent's heartbeats."""
        rows = self._file_progress()
        return rows if rows else self._beat_progress()

    def _file_progress(self) -> list[dict[str, Any]]:
        """Every complete progress line so far; only what was appended since the last call
        is read, since the live view and the tests poll this many times a second."""
        try:
            with open(self.progress_path, "rb") as f:
                f.seek(self._read_to)
                fresh = f.read()
        except FileNotFoundError:
            return [r for r in self._rows if r.get("kind") == "file"]
        complete = fresh[: fresh.rfind(b"\n") + 1]  # a line still being written waits for its end
        self._read_to += len(complete)
        for line in complete.splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by SIGKILL, with the restarted node's next line glued on
            row.setdefault("kind", "file")
            self._rows.append(row)
        return [r for r in self._rows if r.get("kind") == "file"]

    def _beat_progress(self) -> list[dict[str, Any]]:
        """One row per new heartbeat seen (any script): rank and world from the agent's status."""
        from elastic.heartbeat import JOB_STEP, read_beats

        try:
            status = json.loads((self.agent_dir / "status.json").read_text())
        except (OSError, ValueError):
            return [r for r in self._rows if r.get("kind") != "file"]
        for local_rank, beat in sorted(read_beats(self.agent_dir / "heartbeat").items()):
            key = (local_rank, beat.pid)
            if self._beats_seen.get(key) == (beat.step, beat.time) or beat.time < float(status["time"]):
                continue  # seen, or beaten before this round began (not this round's)
            self._beats_seen[key] = (beat.step, beat.time)
            # the record holds the process's running total: the difference counts every sample
            # since the last beat seen here, those of beats overwritten before this poll too
            samples = max(0, beat.samples - self._samples_seen.get(key, 0))
            self._samples_seen[key] = beat.samples
            self._rows.append({
                "node": self.name, "rank": int(status["rank_base"]) + local_rank, "local_rank": local_rank,
                "world_size": int(status["world_size"]), "step": beat.step, "time": beat.time,
                "round": int(status["round"]), "pid": beat.pid, "loss": beat.loss, "samples": samples,
                "kind": "job" if beat.kind == JOB_STEP else "count",
            })
        return [r for r in self._rows if r.get("kind") != "file"]

    def steps_at(self, world_size: int, after: float = 0.0) -> list[dict[str, Any]]:
        """Steps this node completed in a world of ``world_size`` after time ``after``."""
        return [r for r in self.progress() if r["world_size"] == world_size and r["time"] > after]

    def metric(self, name: str, **labels: str) -> float | None:
        """The sum of the agent's ``/metrics`` series ``name`` whose labels include ``labels``;
        None while it serves none (not up yet, or gone)."""
        from prometheus_client.parser import text_string_to_metric_families

        port = self.bound_metrics_port()
        if port is None:
            return None
        try:
            with urllib.request.urlopen(f"http://{self.metrics_host}:{port}/metrics", timeout=5) as reply:
                text = reply.read().decode()
        except OSError:
            return None
        found = [s.value for family in text_string_to_metric_families(text) for s in family.samples
                 if s.name == name and labels.items() <= s.labels.items()]
        return sum(found) if found else None

    def bound_metrics_port(self) -> int | None:
        """Where this node's /metrics listens: the port it was given, or with
        AUTO_METRICS_PORT the one its agent bound (None until it says, or without metrics)."""
        if self.metrics_port != AUTO_METRICS_PORT:
            return self.metrics_port or None
        from agent.node.launch import METRICS_PORT_FILE

        try:
            return int((self.agent_dir / METRICS_PORT_FILE).read_text())
        except (OSError, ValueError):
            return None

    @property
    def log(self) -> "NodeLog":
        """What this node's log says of its workers' crashes (read as it grows)."""
        if self._log is None:
            self._log = NodeLog(self.log_path, self.agent_dir / EVENTS_FILE)
        return self._log

    def crashes(self) -> list["Crash"]:
        """Every worker crash or hang this node's agent acted on so far, oldest first."""
        return self.log.read()

    def kept_out_by_health(self) -> tuple[float, str] | None:
        """Since when and why a failed health check keeps this node out of the job, or None."""
        self.log.read()
        return self.log.health_out

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return f"{self.name}: no log"
        text = self.log_path.read_text(errors="replace").splitlines()
        return f"--- {self.name} log (last {lines} lines) ---\n" + "\n".join(text[-lines:])


# ---------------------------------------------------------------------------- the node's log

_TRACEBACK = "Traceback (most recent call last):"
_LOGGING_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")  # logging's asctime: not a worker's traceback
CRASH, HANG, LEASE_LOST = "crash", "hang", "lease_lost"
_CAUSES = {c.value for c in contract.FaultCause}


@dataclass(frozen=True)
class Crash:
    """A worker crash (or hang) that its agent acted on, as the node's log tells it."""

    at: float  # unix time of the agent's line
    kind: str  # crash | hang
    exit: str  # the exit code(s) the agent logged ("1", "-9", "1, 1"); "" if it logged none
    error: str  # the last line of the worker's traceback; "" if it printed none
    gave_up: str = ""  # the agent's reason when it gave up on the job ("no restarts left")
    gave_up_for: str = ""  # that reason's kind (agent.node.policy.Reason's value: "script_error"...)
    cause: str = ""  # what ended it, by the error's type (elastic.contract.FaultCause's value), if named

    def describe(self) -> str:
        """``worker exit 1: NameError: name 'x' is not defined``."""
        if self.error.startswith("killed by "):  # the agent's own words for a death by a signal (agent.node.oom)
            return f"worker {self.error}"
        if self.kind == LEASE_LOST:  # the agent stopped its workers as stale: its words say why
            return f"workers stopped: {self.error}"
        what = "worker hung" if self.kind == HANG else f"worker {_exit_words(self.exit)}"
        kind = contract.FaultCause(self.cause) if self.cause in _CAUSES else None
        return f"{what}: {attribute(self.error, kind)}" if self.error else what  # its kind first (agent.node.fault_cause)


def _exit_words(code: str) -> str:
    """``exit 1``; a death by signal by its name (``killed by SIGSEGV``)."""
    first = code.split(",")[0].strip()
    if first.startswith("-") and first[1:].isdigit():
        try:
            return f"killed by {signal.Signals(int(first[1:])).name}"
        except ValueError:
            pass
    return f"exit {code}" if code else "crashed"


class NodeLog:
    """Reads what a node's agent acted on (its events, :mod:`agent.node.events`) and what its
    workers printed (the node's log: their tracebacks and ``error:`` lines), as both grow.

    A worker's traceback is in the log (the agent's workers share its output), then the
    agent's event that its workers failed. That alone is not yet a crash of this node: a
    worker whose peer was killed fails too, and the agent's next event says which it was, a
    restart for ``worker_failed`` (or ``hang``) against one for ``peer_lost``. A ``gave_up``
    event is a crash the agent gave up on, and ``kept_out`` one it stepped out of the job
    for (a crash loop). Each event says how long the log was when it was written, so a
    traceback is matched with the act that followed it, as the log's own order would.
    """

    def __init__(self, path: Path, events: Path | None = None) -> None:
        self.path = path
        self.events = EventReader(events if events is not None else path.with_name(f"{path.stem}.agent") / EVENTS_FILE)
        self.last_error = ""  # the newest traceback's last line, or agent error, or "error: ..." line
        self._read_to = 0
        self._partial = b""
        self._lines: list[tuple[int, str]] = []  # log lines read, not yet taken in (their end's offset)
        self._in_traceback = False
        self._exception = ""  # the last line of the newest traceback no crash has claimed yet
        self._pending: Crash | None = None  # acted on, not yet told apart from a peer's doing
        self._crashes: list[Crash] = []
        self.lease_losses: list[Crash] = []  # the agent lost its etcd lease and stopped its workers (not a crash)
        self.health_out: tuple[float, str] | None = None  # since when and why a health check keeps it out

    def read(self) -> list[Crash]:
        """Every crash confirmed so far; reads only what was appended since the last call."""
        self._read_log()  # first: an event read next was written after every line read here
        for event in self.events.read():
            self._take_lines(event.log_offset)
            self._event(event)
        self._take_lines(None)
        return list(self._crashes)

    def _read_log(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._read_to)
                fresh = f.read()
        except FileNotFoundError:
            return
        offset = self._read_to - len(self._partial)
        self._read_to += len(fresh)
        lines = (self._partial + fresh).split(b"\n")
        self._partial = lines.pop()  # a line still being written waits for its end
        for line in lines:
            offset += len(line) + 1
            self._lines.append((offset, line.decode("utf-8", errors="replace").rstrip("\r")))

    def _take_lines(self, until: int | None) -> None:
        """Take in the log lines that end by ``until`` (None: every one read)."""
        taken = 0
        for end, line in self._lines:
            if until is not None and end > until:
                break
            self._line(line)
            taken += 1
        del self._lines[:taken]

    def settle(self) -> None:
        """The agent exited on its own: a crash it had not yet told apart was its own."""
        self.read()
        if self._pending is not None:
            self._crashes.append(self._pending)
            self._pending = None

    def started_again(self) -> None:
        """The node starts anew (after a kill): what its old agent left undecided is dropped."""
        self.read()
        self._pending, self._exception, self._in_traceback = None, "", False

    def _line(self, line: str) -> None:
        """A line of the workers' (or the agent's own) output: a traceback's last line, an ``error:`` line."""
        if _LOGGING_LINE.match(line):
            self._in_traceback = False  # a logger's line (the agent's, say) between a traceback's frames
        elif line.startswith(_TRACEBACK):
            self._in_traceback = True
        elif self._in_traceback and line.strip() and not line[0].isspace():
            self._in_traceback = False  # frames are indented; the exception's line is not
            self._exception = self.last_error = line.strip()
        elif line.startswith("error: "):  # a worker's one line (a usage error, a diverged training): its crash's why
            self._exception = self.last_error = line.strip()

    def _event(self, event: Event) -> None:
        self._in_traceback = False
        at = event.at
        if isinstance(event, NotJoining):
            self.health_out = (self.health_out[0] if self.health_out else at, event.reason)
        elif isinstance(event, HealthyAgain):
            self.health_out = None
        elif isinstance(event, AgentError):
            self.last_error = event.message
        elif isinstance(event, GaveUp):
            base = self._pending or Crash(at, HANG if event.reason == HANG else CRASH,
                                          ", ".join(map(str, event.exits)), self._take_exception())
            self._crashes.append(Crash(base.at, base.kind, base.exit, base.error, gave_up=event.why,
                                       gave_up_for=event.reason, cause=base.cause))
            self._pending = None
        elif isinstance(event, KeptOut):
            self._crashes.append(self._pending or Crash(at, CRASH, "", self._take_exception()))
            self._pending = None
        elif isinstance(event, (WorkersFailed, WorkersHung)):
            failed = isinstance(event, WorkersFailed)
            crash = Crash(at, CRASH if failed else HANG,
                          ", ".join(map(str, event.exits)) if isinstance(event, WorkersFailed) else "",
                          self._take_exception() or (event.words if isinstance(event, WorkersFailed) else ""),
                          cause=event.cause if isinstance(event, WorkersFailed) else "")
            if event.in_place:  # only this node's ranks start again: no peer's doing
                self._crashes.append(crash)
            else:
                self._pending = crash
        elif isinstance(event, Restarted):
            if event.reason == LEASE_LOST:
                self.lease_losses.append(Crash(at, LEASE_LOST, "", f"etcd lease lost: {event.why}"
                                               if event.why else "etcd lease lost"))
            if self._pending is not None and event.reason in ("worker_failed", HANG):
                self._crashes.append(self._pending)
            self._pending = None  # else a peer's death failed our worker: not this node's crash
            self._exception = ""  # what the stopped workers printed is not their successors'

    def _take_exception(self) -> str:
        exception, self._exception = self._exception, ""
        return exception
