"""The hang watchdog: has any local rank made progress lately?

One frozen rank (a deadlock, a stuck data loader, a wedged GPU) blocks every other rank
in the next collective, so "no local rank progressed for T seconds" is the signal, read
from the heartbeat files the workers overwrite (:mod:`elastic.heartbeat`). Every Python
worker of ``elastic agent`` beats after each optimizer step, without a code change
(:mod:`agent.worker.worker_boot`); ``ElasticRun`` beats its committed steps.

``auto`` derives T from the observed step time (20 x the median interval between beats,
at least 60 s), so a job of 30-second steps is not killed for being slow.

A worker group that has never produced a progress signal is never declared hung: it may
be a script with no torch optimizer that never calls ``elastic.report_progress``, and
restarting it every so often would burn ``--max-restarts`` for nothing. The watchdog says
so once in the log. Once this node has seen the job make progress, a later group gets
``startup_timeout`` (imports, restore, compilation) to make its first.

A rank whose script has returned (its record says ``finished``) is done, not hung: the
interpreter's teardown and the script's exit hooks (a ``wandb.finish()``, a last upload)
may take longer than the timeout on a loaded machine, and restarting a script that has
finished would train it all again. Its return counts as its last progress for the ranks
still running; once every rank that beat has finished, nothing is judged (the agent
says once if they linger past ``LINGER_WARNING_S``).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from pathlib import Path

from elastic import contract
from elastic.heartbeat import Beat, read_beats

log = logging.getLogger("elastic.agent")

AUTO_FLOOR_S = 60.0
AUTO_FACTOR = 20.0
STARTUP_TIMEOUT_S = 600.0
LINGER_WARNING_S = 120.0


class HangWatch:
    def __init__(self, directory: Path, timeout: float | None, startup_timeout: float = STARTUP_TIMEOUT_S,
                 node: str = "") -> None:
        self.directory, self.timeout, self.node = directory, timeout, node  # timeout None: auto
        self.startup_timeout = max(startup_timeout, timeout or 0.0)
        self.ever_progressed = False  # some group of this job made progress on this node
        self._intervals: deque[float] = deque(maxlen=200)
        self._last: dict[int, tuple[int, float]] = {}
        self._said_off = self._said_linger = False
        self.reset()

    def reset(self, keep_files: bool = False) -> None:
        """A new worker group: forget old beats (a new group's first beat must be its own).
        ``keep_files``: the group's workers are running already (a spare's, started ahead
        after a reset of their own) and write to the files they opened; unlinking those would
        leave them beating into files no one reads, and the node without a hang watch or a pace."""
        self._group_started = self._quiet_from = time.time()
        self._last.clear()
        self._said_off = self._said_linger = False
        if keep_files:
            return
        for path in self.directory.glob(contract.HEARTBEAT_PREFIX + "*"):
            path.unlink(missing_ok=True)

    def rejoined(self) -> None:
        """In place, the workers stood still for a rendezvous and a reconfigure: not a hang."""
        self._quiet_from = time.time()

    def forget(self, local_rank: int) -> None:
        """One local rank was started again in place: its predecessor's beat is not its own."""
        self._last.pop(local_rank, None)
        (self.directory / contract.heartbeat_file(local_rank)).unlink(missing_ok=True)
        self._quiet_from = time.time()

    def current_timeout(self) -> float:
        if self.timeout is not None:
            return self.timeout
        if len(self._intervals) < 5:
            return AUTO_FLOOR_S
        return max(AUTO_FLOOR_S, AUTO_FACTOR * statistics.median(self._intervals))

    def describe_timeout(self) -> str:
        return f"{self.timeout:g} s" if self.timeout is not None else f"auto, {self.current_timeout():.0f} s"

    def progressed(self) -> bool:
        """Has a rank of the current group made progress (as last seen by ``stalled``)?"""
        return bool(self._last)

    def progressed_since_start(self, local_rank: int) -> bool | None:
        """Whether ``local_rank`` beat since it (or its group) started, as last seen by
        ``stalled``; None while this node never saw progress (a script that never beats
        says nothing either way). The crash-loop rule reads it (:mod:`agent.node.policy`)."""
        if not self.ever_progressed:
            return None
        return local_rank in self._last

    def scripts_returned(self, ranks: int) -> bool:
        """Whether all ``ranks`` local workers of this group have beaten and their scripts returned
        (they are exiting: nothing a round asks of them can change their end)."""
        beats = self._group_beats().values()
        return ranks > 0 and len(beats) >= ranks and all(b.finished is not None for b in beats)

    def _group_beats(self) -> dict[int, Beat]:
        """The current group's beats by local rank (an earlier group's left-over files are not)."""
        return {r: b for r, b in read_beats(self.directory).items() if b.time >= self._group_started}

    def last_progress(self) -> float | None:
        return max((t for _, t in self._last.values()), default=None)

    def stalled(self) -> float | None:
        """Seconds since the last progress on this node if that exceeds the budget, else None."""
        now = time.time()
        beats = self._group_beats()
        for rank, beat in beats.items():
            seen = self._last.get(rank)
            if seen is not None and beat.step > seen[0] and beat.time > seen[1]:
                self._intervals.append((beat.time - seen[1]) / (beat.step - seen[0]))
            self._last[rank] = (beat.step, beat.time)
        if not beats:
            quiet = now - self._quiet_from
            if not self.ever_progressed:
                if quiet > self.current_timeout() and not self._said_off:
                    self._said_off = True
                    log.warning("[%s] hang detection is off for this worker group: it has not reported progress "
                                "(no torch optimizer step, no elastic.report_progress call); it turns on at the "
                                "first one", self.node)
                return None
            return quiet if quiet > self.startup_timeout else None
        self.ever_progressed = True
        if all(b.finished is not None for b in beats.values()):
            self._say_lingering(now - min(b.finished or now for b in beats.values()))
            return None
        last = max(b.finished or b.time for b in beats.values())
        quiet = now - max(last, self._quiet_from)
        return quiet if quiet > self.current_timeout() else None

    def _say_lingering(self, since: float) -> None:
        if since > LINGER_WARNING_S and not self._said_linger:
            self._said_linger = True
            log.warning("[%s] the workers' script returned %.0f s ago and they have not exited: their exit hooks or "
                        "the interpreter's teardown are slow or stuck (send them SIGUSR1 for their stacks)",
                        self.node, since)
