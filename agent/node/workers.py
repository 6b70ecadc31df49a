"""This node's worker processes: started warm or cold, watched, stopped, one by one.

torch's ``start_processes`` starts and stops a whole group at once. In-place recovery
needs more: survivors keep running while one dead local rank is started again, and a
worker may be forked from the node's pre-imported template (``agent/node/fork_server.py``) or
come from a pre-imported standby (``agent/node/warm_start.py``). So the agent
keeps its own small set of processes, built from torch's public pieces:

* ``LogsSpecs.reify`` decides where each rank's stdout, stderr and error file go
  (``--log-dir``, ``--redirects``, ``--tee``, ``--local-ranks-filter``), and sets
  ``TORCHELASTIC_ERROR_FILE`` as torchrun does;
* ``SubprocessHandler`` starts a cold worker (in its own session, with the NUMA binding
  of ``--numa-binding`` if asked) and ``TailLog`` copies tee'd logs to the console;
* ``ProcessFailure`` reads a failed worker's error file for the final report.

A worker started again in place writes to fresh files beside its predecessor's
(``stdout.1.log``...), so nothing a dead worker wrote is lost.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Protocol

from torch.distributed.elastic.multiprocessing import LogsDest, LogsSpecs, ProcessFailure
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler
from torch.distributed.elastic.multiprocessing.tail_log import TailLog

from elastic import contract, failure_record, worker_env

from agent.node.fork_server import ForkServer
from agent.node.nulls import NoPool
from agent.node.warm_start import WarmPool

log = logging.getLogger("elastic.agent")

WARM, COLD = "warm", "cold"


class _Process(Protocol):
    """A ``subprocess.Popen``, or a worker the node's template forked (``agent.node.fork_server``)."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class _Handle(Protocol):
    proc: _Process

    def close(self, death_sig: signal.Signals | None = None) -> None: ...


@dataclass
class _Warm:
    """A worker forked from the template, or a standby that became one: stopped the way
    ``SubprocessHandler`` stops a cold one."""

    proc: _Process

    def close(self, death_sig: signal.Signals | None = None) -> None:
        sig = death_sig or signal.SIGTERM
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            # Forked a moment ago, it may not have made its session yet: the template says
            # "started" before the child runs setsid(), so a stop that soon (a round that
            # changed at once) finds no such group, and the worker itself is all there is.
            # Once missed, such a worker lived on unseen and joined a later round in place.
            try:
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass


@dataclass
class Worker:
    local_rank: int
    handle: _Handle
    mode: str  # warm | cold
    error_file: str
    started_at: float = field(default_factory=time.time)
    exited_at: float | None = None  # when the agent first saw it exited
    stderr: str = ""  # its stderr file ('' : the agent's own stderr), where its traceback is

    @property
    def pid(self) -> int:
        return int(self.handle.proc.pid)

    def exit_code(self) -> int | None:
        code = self.handle.proc.poll()
        if code is not None and self.exited_at is None:
            self.exited_at = time.time()
        return code

    def ran_for(self) -> float:
        """Seconds from its start to its exit (or to now, while it runs)."""
        return (self.exited_at or time.time()) - self.started_at

    def error_line(self) -> str:
        """The first line of the error torchrun's error file holds (``ValueError: boom``), or ''."""
        return self.error_record()[0]

    def error_record(self) -> tuple[str, contract.FailureKind | None]:
        """(the first line of its error, the error's kind) from torchrun's error file, or ('', None).

        The worker bootstrap writes both for any uncaught exception (``elastic.failure_record``),
        and so does a script decorated with torch's ``@record`` (the bootstrap adds the kind)."""
        line, kind, _ = self.error_details()
        return line, kind

    def error_details(self) -> tuple[str, contract.FailureKind | None, contract.FaultCause | None]:
        """:meth:`error_record`, and the error's cause by its type (a full disk...), if named."""
        if not self.error_file or self.error_file == os.devnull:
            return "", None, None
        return failure_record.read_all(self.error_file)


@dataclass(frozen=True)
class Launch:
    """What to run as one local rank: the command and the variables torchrun would set."""

    args: tuple[str, ...]
    env: dict[str, str]


class LocalWorkers:
    """The local ranks of the current worker group."""

    def __init__(self, logs_specs: LogsSpecs, name: str = "default",
                 pool: ForkServer | WarmPool | NoPool | None = None,
                 numa_options: object | None = None, log_line_prefixes: Mapping[int, str] | None = None,
                 on_start: Callable[[str], None] = lambda mode: None) -> None:
        self.logs_specs, self.name = logs_specs, name
        self.pool: ForkServer | WarmPool | NoPool = pool if pool is not None else NoPool()  # NoPool: cold starts
        self.numa_options, self.log_line_prefixes = numa_options, dict(log_line_prefixes or {})
        self.on_start = on_start
        self.workers: dict[int, Worker] = {}
        self._dest: LogsDest | None = None
        self._launches: dict[int, Launch] = {}
        self._generation: dict[int, int] = {}
        self._tails: list[TailLog] = []

    # ------------------------------------------------------------------ starting

    def start_all(self, launches: Mapping[int, Launch]) -> dict[int, int]:
        """Start local ranks 0..n-1 as a new group; returns local rank -> pid."""
        envs = {rank: dict(launch.env) for rank, launch in launches.items()}
        self._dest = self.logs_specs.reify(envs)  # sets TORCHELASTIC_ERROR_FILE in envs
        self._launches = {rank: Launch(launch.args, envs[rank]) for rank, launch in launches.items()}
        self._generation = {rank: 0 for rank in launches}
        for rank in sorted(launches):
            self._spawn(rank)
        self._retail()
        return self.pids()

    def start_again(self, local_rank: int, launch: Launch) -> int:
        """Start one local rank again (in place) while the others run; returns its pid."""
        if self._dest is None:
            raise RuntimeError("start_again before start_all")
        self._generation[local_rank] = self._generation.get(local_rank, 0) + 1
        env = dict(launch.env)
        error_file = self._dest.error_files.get(local_rank)
        if error_file and error_file != os.devnull:
            env[contract.ERROR_FILE_ENV] = self._fresh_path(error_file, local_rank)
        self._launches[local_rank] = Launch(launch.args, env)
        self._spawn(local_rank)
        self._retail()
        return self.workers[local_rank].pid

    def _fresh_path(self, path: str, local_rank: int) -> str:
        generation = self._generation.get(local_rank, 0)
        if not path or path == os.devnull or generation == 0:
            return path
        p = Path(path)
        return str(p.with_name(f"{p.stem}.{generation}{p.suffix}"))

    def _paths(self, local_rank: int) -> tuple[str, str]:
        assert self._dest is not None
        return (self._fresh_path(self._dest.stdouts.get(local_rank, ""), local_rank),
                self._fresh_path(self._dest.stderrs.get(local_rank, ""), local_rank))

    def _spawn(self, local_rank: int) -> None:
        launch = self._launches[local_rank]
        stdout, stderr = self._paths(local_rank)
        env = {**os.environ, **launch.env}
        error_file = worker_env.read(env).error_file or ""
        handle: _Handle | None = None
        if self.numa_options is None:  # a NUMA binding needs the launcher's own start
            proc = self.pool.take(launch.args, env, stdout or None, stderr or None)
            if proc is not None:
                handle, mode = _Warm(proc), WARM
        if handle is None:
            handle = SubprocessHandler(entrypoint=launch.args[0], args=launch.args[1:], env=launch.env,
                                       stdout=stdout or None, stderr=stderr or None, local_rank_id=local_rank,
                                       numa_options=self.numa_options)
            mode = COLD
        self.workers[local_rank] = Worker(local_rank, handle, mode, error_file, stderr=stderr or "")
        self.on_start(mode)

    def _retail(self) -> None:
        """(Re)start the console copies of tee'd logs for the current files."""
        for tail in self._tails:
            tail.stop()
        self._tails = []
        if self._dest is None:
            return
        for tees, stream in ((self._dest.tee_stdouts, sys.stdout), (self._dest.tee_stderrs, sys.stderr)):
            files = {rank: self._fresh_path(path, rank) for rank, path in tees.items()}
            if files:
                self._tails.append(TailLog(self.name, files, stream, self.log_line_prefixes or None).start())

    # ------------------------------------------------------------------ watching

    def pids(self) -> dict[int, int]:
        return {rank: w.pid for rank, w in self.workers.items()}

    def exits(self) -> dict[int, int | None]:
        return {rank: w.exit_code() for rank, w in self.workers.items()}

    def failures(self) -> dict[int, ProcessFailure]:
        """torch's view of every failed worker (error file included) for the final report."""
        out: dict[int, ProcessFailure] = {}
        for rank, worker in self.workers.items():
            code = worker.exit_code()
            if code not in (None, 0):
                out[rank] = _failure(rank, worker.pid, int(code), worker.error_file or os.devnull)
        return out

    def send(self, sig: int, ranks: list[int] | None = None) -> None:
        """To the worker only (not its group): faulthandler's stack dump on SIGUSR1."""
        for rank in (ranks if ranks is not None else list(self.workers)):
            worker = self.workers.get(rank)
            if worker is not None and worker.exit_code() is None:
                try:
                    os.kill(worker.pid, sig)
                except ProcessLookupError:
                    pass

    def running(self) -> list[int]:
        return sorted(rank for rank, w in self.workers.items() if w.exit_code() is None)

    # ------------------------------------------------------------------ stopping

    def terminate(self, sig: int = signal.SIGTERM) -> None:
        """Ask every running worker to stop, without waiting. A Python worker started through
        the agent's bootstrap gets the signal alone: its DataLoader workers and snapshot
        writer share its session, and a DataLoader worker killed by SIGTERM would fail the
        very step the worker is finishing. Anything else (``--no-python``: perhaps a shell
        that would not pass it on) gets it in its whole session, as torchrun does."""
        for worker in self.workers.values():
            if worker.exit_code() is not None:
                continue
            if _bootstrapped(self._launches.get(worker.local_rank)):
                try:
                    os.kill(worker.pid, sig)
                except ProcessLookupError:
                    pass
            else:
                try:
                    os.killpg(worker.pid, sig)
                except ProcessLookupError:
                    pass

    def stop(self, sig: int = signal.SIGTERM, grace: float = 5.0, ranks: list[int] | None = None) -> None:
        """Signal each worker's whole session, wait up to ``grace``, then SIGKILL what is left."""
        chosen = [self.workers[r] for r in (ranks if ranks is not None else list(self.workers)) if r in self.workers]
        for worker in chosen:
            if worker.exit_code() is None:
                worker.handle.close(signal.Signals(sig))
        deadline = time.monotonic() + (grace if sig != signal.SIGKILL else 0.0)
        for worker in chosen:
            while worker.exit_code() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            if worker.exit_code() is None:
                worker.handle.close(signal.SIGKILL)
        for worker in chosen:
            try:
                worker.handle.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.warning("worker pid %d did not exit after SIGKILL", worker.pid)
        if ranks is None:
            for tail in self._tails:
                tail.stop()
            self._tails = []

    def forget(self, ranks: list[int] | None = None) -> None:
        for rank in (ranks if ranks is not None else list(self.workers)):
            self.workers.pop(rank, None)


def _failure(rank: int, pid: int, code: int, error_file: str) -> ProcessFailure:
    """torch's ``ProcessFailure``, which parses the error file and raises on a torn one (a
    script's own ``@record`` writes it in place, and a SIGKILL may end that write): the
    agent must go on, without the message, rather than crash on a dead worker's file."""
    try:
        return ProcessFailure(local_rank=rank, pid=pid, exitcode=code, error_file=error_file)
    except (ValueError, KeyError, TypeError):
        log.warning("worker pid %d left a torn error file %s; reporting its exit code only", pid, error_file)
        return ProcessFailure(local_rank=rank, pid=pid, exitcode=code, error_file=os.devnull)


def _bootstrapped(launch: Launch | None) -> bool:
    """Whether a worker runs a Python target through :mod:`agent.worker.worker_boot`."""
    from agent.worker.worker_boot import BOOT_CODE

    return launch is not None and BOOT_CODE in launch.args
