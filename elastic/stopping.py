"""SIGTERM, a pre-emption: every rank stops after the same step, and that step is durable.

A SIGTERM (Kubernetes, a spot VM, the agent passing its own on) is agreed on through the
step's control all-reduce (``STOP_BIT``), so every rank stops after the same step: they
finish it, confirm it with one more all-gather, rank 0 commits it and writes its snapshot
synchronously, and the ranks that got the signal exit with 128 + 15. Ranks that did not go
on: the world answers (in place it re-forms without the leavers; torchrun's ends). Between
worlds no step is in flight, so a SIGTERM there ends the process at once.
:class:`SignalStop` is that part of :class:`~elastic.trainer.ElasticRun`: an object the run
holds (``run._stop``), with its own state (the signal, whether the run is between worlds,
whether this rank leaves) and a stated contract with its run (:class:`StopsRun`).
"""

from __future__ import annotations

import logging
import signal
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Protocol

from . import worker_env
from .distributed import all_gather_ints, node_name
from .collectives import first_line, is_collective_failure
from .snapshots import StaleGroupError

if TYPE_CHECKING:
    from .distributed import DistInfo
    from .formation import TrainingWorld
    from .goodput.recorder import GoodputLog
    from .plan import DataPlan
    from .restore import WorldForming
    from .snapshots import Snapshots
    from .train_state import TrainState

log = logging.getLogger("elastic.trainer")  # the run's lines

# The control all-reduce (MAX) of a step carries the newest ready round, plus this bit when
# the rank got SIGTERM: every rank sees the same value, so all stop after the same step.
STOP_BIT = 1 << 62
# A second SIGTERM this soon after the first is the same request: systemd (KillMode=
# control-group) signals every process of the unit, and the agent passes its own on too.
_REPEATED_SIGNAL_S = 3.0


class StopsRun(Protocol):
    """What :class:`SignalStop` reads of its run and calls on it: the run's current world and
    state, its snapshots and goodput log, whether this rank holds state and the last step it
    committed; closing it, committing the previous step, and forming the next world."""

    world: TrainingWorld
    state: TrainState
    plan: DataPlan
    snapshots: Snapshots
    goodput: GoodputLog
    _has_state: bool
    _committed: int
    _worlds: WorldForming

    @property
    def dist(self) -> DistInfo: ...
    @property
    def _where(self) -> str: ...
    def close(self) -> None: ...
    def _commit_previous(self, force_snapshot: bool = False) -> None: ...


class SignalStop:
    """Stopping after an agreed step (6. of the run's state machine).

    Its own state: ``signal`` (SIGTERM or the like this rank got, None until then) and when
    (``since``), ``forming`` (no step in flight and nothing new to save: SIGTERM exits at
    once) and ``leaving`` (agreed: this rank stops at the end of the loop iteration). The
    run sets ``forming`` around its own set-up, asks ``signal`` at each step's control
    all-reduce, and calls :meth:`after_step` once every rank knows of a stop and
    :meth:`leave` when ``leaving``; :meth:`on_sigterm` is the signal handler.
    """

    def __init__(self, run: StopsRun) -> None:
        self.run = run
        self.signal: int | None = None  # SIGTERM (or the like) this rank got, if any
        self.since = 0.0
        self.forming = True  # no step in flight and nothing new to save: SIGTERM exits at once
        self.leaving = False  # agreed: this rank stops at the end of the current loop iteration

    @contextmanager
    def between_worlds(self) -> Iterator[None]:
        """Waiting for a world: no step is in flight, so a SIGTERM ends the process at once.
        Rank 0 of the world that just ended first makes its last committed step durable, if
        no snapshot holds it yet (peers left at a step boundary, and now this node is
        pre-empted too)."""
        was, self.forming = self.forming, True
        try:
            if self.signal is not None:  # it came while the world broke: nothing to wait for
                self._exit_now()
            yield
        except SystemExit:
            self.forming = was
            self._save_committed_on_the_way_out()
            raise
        finally:
            self.forming = was

    def _save_committed_on_the_way_out(self) -> None:
        snapshots = self.run.snapshots
        if snapshots is None or snapshots.writer is None or not self.run._has_state or self.run.state.sharded:
            return  # a sharded capture needs every rank, and they are not here: the newest durable one stays
        step = self.run.state.step
        if self.run._committed != step or step <= 0 or snapshots.newest_durable == step:
            return  # not known to be committed by every rank, or already durable
        try:
            self._snapshot_before_stopping(step, f"got signal {self.signal}: stopping at step {step}")
        except Exception as exc:  # noqa: BLE001 - exiting anyway; the newest durable snapshot stays
            log.warning("%s snapshot step %d not written on the way out: %s", self.run._where, step, exc)

    def on_sigterm(self, signum: int, _frame: Any) -> None:
        now = time.monotonic()
        if self.signal is not None:
            if now - self.since < _REPEATED_SIGNAL_S:
                return  # the same request again (systemd signals the whole unit, the agent passes its own on)
            raise SystemExit(128 + signum)  # asked again, later: stop waiting for the step boundary
        self.signal, self.since = signum, now
        if self.forming:
            self._exit_now()

    def _exit_now(self) -> None:
        """Between worlds (starting, or waiting for a round): no step is in flight and there is
        nothing new to save (snapshots already submitted are flushed on the way out)."""
        signum = self.signal or signal.SIGTERM
        where = self.run._where if hasattr(self.run, "dist") else f"[{node_name()}]"
        step = self.run.state.step if hasattr(self.run, "state") else 0
        log.info("%s got signal %d: stopping at step %d while joining a world (no step in flight)", where, signum,
                 step)
        raise SystemExit(128 + signum)

    def after_step(self) -> None:
        """Some rank got SIGTERM, and every rank knows it from this step's control all-reduce.

        Every rank has finished this step. One more collective (an all-gather of who
        leaves) confirms it, so the step is committed: rank 0 writes its ledger line and,
        unless the world goes on in place without needing it, a snapshot of it,
        synchronously. The ranks that got the signal leave at the end of this loop
        iteration. The others (another node was pre-empted) go on: in place they form the
        next round without the leavers; otherwise their agent restarts the world from that
        snapshot.
        """
        step, leaving = self.run.state.step, self.signal is not None
        try:
            leavers = [r for r, flag in enumerate(all_gather_ints(int(leaving), self.run.dist)) if flag]
            broke = ""
        except RuntimeError as exc:
            if not is_collective_failure(exc):
                raise
            leavers, broke = [], first_line(exc)
        said = f"got signal {self.signal}: stopping at step {step}" if leaving else \
            f"rank(s) {leavers or '?'} stop after step {step} (SIGTERM on their node)"
        if broke:  # a peer died as well: ``step`` is not known to be committed, the last one is
            if self.run.dist.is_main or not leaving:
                log.warning("%s %s, but the world broke as the ranks stopped (%s); the newest snapshot stays the "
                            "last one written", self.run._where, said, broke)
        else:
            self.run._commit_previous()
            # In place the ranks that stay hold this step in memory: rank 0 staying writes
            # no snapshot for them (it would only make them stand still); one leaving does,
            # and so does rank 0 of torchrun's world, which restarts from disk.
            if self.run.state.sharded:
                self._sharded_snapshot_before_stopping(step, said, leaving, len(leavers) == self.run.dist.world_size)
            elif self.run.dist.is_main and (leaving or self.run.world.restarts_from_disk):
                self._snapshot_before_stopping(step, said)
        if leaving:
            self.leaving = True
            return
        started = time.perf_counter()
        min_round = self.run.world.peers_stopped(step, said, leavers, broke, self.run._where, self.run.dist.is_main, self.run.close,
                                             lambda: self.signal)  # torchrun's world: exits
        self.run.goodput.failed()
        self.run._worlds.form("failure", min_round=min_round, since=started)

    def _sharded_snapshot_before_stopping(self, step: int, said: str, leaving: bool, everyone: bool) -> None:
        """A sharded snapshot takes every rank: written when every rank stops (or all restart
        from disk); when only some leave in place, those that stay hold the step in memory."""
        if not (everyone or self.run.world.restarts_from_disk):
            if self.run.dist.is_main and leaving:
                log.info("%s %s; no snapshot: a sharded one takes every rank, and the ranks that stay hold step %d "
                         "in memory", self.run._where, said, step)
            return
        if self.run.dist.is_main:
            self._snapshot_before_stopping(step, said)
        elif self.run.snapshots.sharded is not None:  # each rank writes its own shards
            self.run.snapshots.final(step, self.run.state.capture(), self.run.dist.world_size,
                                 {"epoch": self.run.plan.sampler.epoch, "cursor": self.run.plan.sampler.cursor,
                                  "samples": self.run.state.samples})
        else:
            self.run.state.capture()  # rank 0 gathers the full state: this rank's part of that collective

    def _snapshot_before_stopping(self, step: int, said: str) -> None:
        """Rank 0: a snapshot of the committed ``step``, durable before this call returns."""
        if self.run.snapshots.writer is None:
            log.info("%s %s", self.run._where, said)
            return
        newest = self.run.snapshots.newest_durable
        if newest == step:
            log.info("%s %s; snapshot step %d is already durable", self.run._where, said, step)
        else:
            self._say_snapshot_fits(said, step, newest)
        t0 = time.perf_counter()
        try:
            self.run.snapshots.final(step, self.run.state.capture(), self.run.dist.world_size,
                                 {"epoch": self.run.plan.sampler.epoch, "cursor": self.run.plan.sampler.cursor,
                                  "samples": self.run.state.samples})
        except StaleGroupError as exc:  # a newer round already commits: its members hold the state
            log.warning("%s snapshot step %d not written: %s", self.run._where, step, exc)
            return
        if newest != step:
            log.info("%s snapshot step %d durable in %.2f s; a resume goes on from it", self.run._where, step,
                     time.perf_counter() - t0)

    def _say_snapshot_fits(self, said: str, step: int, newest: int | None) -> None:
        """One line: the snapshot about to be written, and whether it fits in the grace left
        before the agent's SIGKILL (``ELASTIC_TERM_GRACE``), judged by the last write's time."""
        estimate = self.run.snapshots.last_write_seconds
        took = f"the last one took {estimate:.2f} s" if estimate is not None else "no earlier snapshot to time it by"
        grace = _term_grace()
        if grace is None or self.signal is None:
            log.info("%s %s; writing snapshot step %d now (%s)", self.run._where, said, step, took)
            return
        left = grace - (time.monotonic() - self.since)
        if estimate is not None and estimate > left:
            lost = f"snapshot step {newest}, {step - newest} step(s) lost" if newest is not None else \
                "the newest snapshot already on disk (this process wrote none)"
            log.warning("%s %s; snapshot step %d would take about %.1f s (as long as the last one), more than the "
                        "%.1f s left of the %g s grace: writing it anyway, but if the agent's SIGKILL comes first "
                        "the job resumes from %s; give the job a longer grace (elastic agent --term-grace, and "
                        "Kubernetes' terminationGracePeriodSeconds above it)", self.run._where, said, step, estimate,
                        left, grace, lost)
        else:
            log.info("%s %s; writing snapshot step %d now (%s; %.1f s of the %g s grace left)", self.run._where,
                     said, step, took, left, grace)

    def leave(self) -> None:
        """The end of the loop iteration after an agreed stop: leave with exit code 128 + signal."""
        signum = self.signal or signal.SIGTERM
        try:
            self.run.close()  # the snapshot of the last step is durable already; this only flushes and leaves
        except StaleGroupError as exc:
            log.warning("%s %s", self.run._where, exc)
        raise SystemExit(128 + signum)


def _term_grace() -> float | None:
    """Seconds the agent waits after SIGTERM before its SIGKILL (None: not under elastic agent)."""
    grace = worker_env.read().node.term_grace
    return grace if grace is not None and grace > 0 else None


__all__ = ["STOP_BIT", "SignalStop", "StopsRun"]
