"""SIGTERM, a pre-emption: every rank stops after the same step, and that step is durable.

A SIGTERM (Kubernetes, a spot VM, the agent passing its own on) is agreed on through the
step's control all-reduce (``STOP_BIT``), so every rank stops after the same step: they
finish it, confirm it with one more all-gather, rank 0 commits it and writes its snapshot
synchronously, and the ranks that got the signal exit with 128 + 15. Ranks that did not go
on: the world answers (in place it re-forms without the leavers; torchrun's ends). Between
worlds no step is in flight, so a SIGTERM there ends the process at once.
:class:`StopsOnSignal` is that part of :class:`~elastic.trainer.ElasticRun` (a mixin, so
the trainer's module keeps to the loop; every attribute it reads is the run's).
"""

from __future__ import annotations

import logging
import signal
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

from . import worker_env
from .distributed import all_gather_ints, node_name
from .collectives import first_line, is_collective_failure
from .snapshots import StaleGroupError

if TYPE_CHECKING:
    from .distributed import DistInfo
    from .formation import TrainingWorld
    from .goodput.recorder import GoodputLog
    from .plan import DataPlan
    from .snapshots import Snapshots
    from .train_state import TrainState

log = logging.getLogger("elastic.trainer")  # the run's lines

# The control all-reduce (MAX) of a step carries the newest ready round, plus this bit when
# the rank got SIGTERM: every rank sees the same value, so all stop after the same step.
STOP_BIT = 1 << 62
# A second SIGTERM this soon after the first is the same request: systemd (KillMode=
# control-group) signals every process of the unit, and the agent passes its own on too.
_REPEATED_SIGNAL_S = 3.0


class StopsOnSignal:
    """Stopping after an agreed step (6. of the run's state machine)."""

    _stop_signal: int | None  # SIGTERM (or the like) this rank got, if any
    _stop_since: float
    _forming: bool  # no step in flight and nothing new to save: SIGTERM exits at once
    _leaving: bool  # agreed: this rank stops at the end of the current loop iteration

    if TYPE_CHECKING:  # the run's, for type checkers
        world: TrainingWorld
        dist: DistInfo
        state: TrainState
        plan: DataPlan
        snapshots: Snapshots
        goodput: GoodputLog
        _has_state: bool
        _committed: int

        @property
        def _where(self) -> str: ...

        def close(self) -> None: ...
        def _commit_previous(self, force_snapshot: bool = False) -> None: ...
        def _form(self, reason: str, min_round: int = 0, since: float | None = None) -> None: ...

    @contextmanager
    def _between_worlds(self) -> Iterator[None]:
        """Waiting for a world: no step is in flight, so a SIGTERM ends the process at once.
        Rank 0 of the world that just ended first makes its last committed step durable, if
        no snapshot holds it yet (peers left at a step boundary, and now this node is
        pre-empted too)."""
        was, self._forming = self._forming, True
        try:
            if self._stop_signal is not None:  # it came while the world broke: nothing to wait for
                self._exit_on_signal_now()
            yield
        except SystemExit:
            self._forming = was
            self._save_committed_on_the_way_out()
            raise
        finally:
            self._forming = was

    def _save_committed_on_the_way_out(self) -> None:
        snapshots = self.snapshots
        if snapshots is None or snapshots.writer is None or not self._has_state or self.state.sharded:
            return  # a sharded capture needs every rank, and they are not here: the newest durable one stays
        step = self.state.step
        if self._committed != step or step <= 0 or snapshots.newest_durable == step:
            return  # not known to be committed by every rank, or already durable
        try:
            self._snapshot_before_stopping(step, f"got signal {self._stop_signal}: stopping at step {step}")
        except Exception as exc:  # noqa: BLE001 - exiting anyway; the newest durable snapshot stays
            log.warning("%s snapshot step %d not written on the way out: %s", self._where, step, exc)

    def _on_sigterm(self, signum: int, _frame: Any) -> None:
        now = time.monotonic()
        if self._stop_signal is not None:
            if now - self._stop_since < _REPEATED_SIGNAL_S:
                return  # the same request again (systemd signals the whole unit, the agent passes its own on)
            raise SystemExit(128 + signum)  # asked again, later: stop waiting for the step boundary
        self._stop_signal, self._stop_since = signum, now
        if self._forming:
            self._exit_on_signal_now()

    def _exit_on_signal_now(self) -> None:
        """Between worlds (starting, or waiting for a round): no step is in flight and there is
        nothing new to save (snapshots already submitted are flushed on the way out)."""
        signum = self._stop_signal or signal.SIGTERM
        where = self._where if hasattr(self, "dist") else f"[{node_name()}]"
        step = self.state.step if hasattr(self, "state") else 0
        log.info("%s got signal %d: stopping at step %d while joining a world (no step in flight)", where, signum,
                 step)
        raise SystemExit(128 + signum)

    def _stop_after_step(self) -> None:
        """Some rank got SIGTERM, and every rank knows it from this step's control all-reduce.

        Every rank has finished this step. One more collective (an all-gather of who
        leaves) confirms it, so the step is committed: rank 0 writes its ledger line and,
        unless the world goes on in place without needing it, a snapshot of it,
        synchronously. The ranks that got the signal leave at the end of this loop
        iteration. The others (another node was pre-empted) go on: in place they form the
        next round without the leavers; otherwise their agent restarts the world from that
        snapshot.
        """
        step, leaving = self.state.step, self._stop_signal is not None
        try:
            leavers = [r for r, flag in enumerate(all_gather_ints(int(leaving), self.dist)) if flag]
            broke = ""
        except RuntimeError as exc:
            if not is_collective_failure(exc):
                raise
            leavers, broke = [], first_line(exc)
        said = f"got signal {self._stop_signal}: stopping at step {step}" if leaving else \
            f"rank(s) {leavers or '?'} stop after step {step} (SIGTERM on their node)"
        if broke:  # a peer died as well: ``step`` is not known to be committed, the last one is
            if self.dist.is_main or not leaving:
                log.warning("%s %s, but the world broke as the ranks stopped (%s); the newest snapshot stays the "
                            "last one written", self._where, said, broke)
        else:
            self._commit_previous()
            # In place the ranks that stay hold this step in memory: rank 0 staying writes
            # no snapshot for them (it would only make them stand still); one leaving does,
            # and so does rank 0 of torchrun's world, which restarts from disk.
            if self.state.sharded:
                self._sharded_snapshot_before_stopping(step, said, leaving, len(leavers) == self.dist.world_size)
            elif self.dist.is_main and (leaving or self.world.restarts_from_disk):
                self._snapshot_before_stopping(step, said)
        if leaving:
            self._leaving = True
            return
        started = time.perf_counter()
        min_round = self.world.peers_stopped(step, said, leavers, broke, self._where, self.dist.is_main, self.close,
                                             lambda: self._stop_signal)  # torchrun's world: exits
        self.goodput.failed()
        self._form("failure", min_round=min_round, since=started)

    def _sharded_snapshot_before_stopping(self, step: int, said: str, leaving: bool, everyone: bool) -> None:
        """A sharded snapshot takes every rank: written when every rank stops (or all restart
        from disk); when only some leave in place, those that stay hold the step in memory."""
        if not (everyone or self.world.restarts_from_disk):
            if self.dist.is_main and leaving:
                log.info("%s %s; no snapshot: a sharded one takes every rank, and the ranks that stay hold step %d "
                         "in memory", self._where, said, step)
            return
        if self.dist.is_main:
            self._snapshot_before_stopping(step, said)
        elif self.snapshots.sharded is not None:  # each rank writes its own shards
            self.snapshots.final(step, self.state.capture(), self.dist.world_size,
                                 {"epoch": self.plan.sampler.epoch, "cursor": self.plan.sampler.cursor,
                                  "samples": self.state.samples})
        else:
            self.state.capture()  # rank 0 gathers the full state: this rank's part of that collective

    def _snapshot_before_stopping(self, step: int, said: str) -> None:
        """Rank 0: a snapshot of the committed ``step``, durable before this call returns."""
        if self.snapshots.writer is None:
            log.info("%s %s", self._where, said)
            return
        newest = self.snapshots.newest_durable
        if newest == step:
            log.info("%s %s; snapshot step %d is already durable", self._where, said, step)
        else:
            self._say_snapshot_fits(said, step, newest)
        t0 = time.perf_counter()
        try:
            self.snapshots.final(step, self.state.capture(), self.dist.world_size,
                                 {"epoch": self.plan.sampler.epoch, "cursor": self.plan.sampler.cursor,
                                  "samples": self.state.samples})
        except StaleGroupError as exc:  # a newer round already commits: its members hold the state
            log.warning("%s snapshot step %d not written: %s", self._where, step, exc)
            return
        if newest != step:
            log.info("%s snapshot step %d durable in %.2f s; a resume goes on from it", self._where, step,
                     time.perf_counter() - t0)

    def _say_snapshot_fits(self, said: str, step: int, newest: int | None) -> None:
        """One line: the snapshot about to be written, and whether it fits in the grace left
        before the agent's SIGKILL (``ELASTIC_TERM_GRACE``), judged by the last write's time."""
        estimate = self.snapshots.last_write_seconds
        took = f"the last one took {estimate:.2f} s" if estimate is not None else "no earlier snapshot to time it by"
        grace = _term_grace()
        if grace is None or self._stop_signal is None:
            log.info("%s %s; writing snapshot step %d now (%s)", self._where, said, step, took)
            return
        left = grace - (time.monotonic() - self._stop_since)
        if estimate is not None and estimate > left:
            lost = f"snapshot step {newest}, {step - newest} step(s) lost" if newest is not None else \
                "the newest snapshot already on disk (this process wrote none)"
            log.warning("%s %s; snapshot step %d would take about %.1f s (as long as the last one), more than the "
                        "%.1f s left of the %g s grace: writing it anyway, but if the agent's SIGKILL comes first "
                        "the job resumes from %s; give the job a longer grace (elastic agent --term-grace, and "
                        "Kubernetes' terminationGracePeriodSeconds above it)", self._where, said, step, estimate,
                        left, grace, lost)
        else:
            log.info("%s %s; writing snapshot step %d now (%s; %.1f s of the %g s grace left)", self._where,
                     said, step, took, left, grace)

    def _stop_on_signal(self) -> None:
        """The end of the loop iteration after an agreed stop: leave with exit code 128 + signal."""
        signum = self._stop_signal or signal.SIGTERM
        try:
            self.close()  # the snapshot of the last step is durable already; this only flushes and leaves
        except StaleGroupError as exc:
            log.warning("%s %s", self._where, exc)
        raise SystemExit(128 + signum)


def _term_grace() -> float | None:
    """Seconds the agent waits after SIGTERM before its SIGKILL (None: not under elastic agent)."""
    grace = worker_env.read().node.term_grace
    return grace if grace is not None and grace > 0 else None


__all__ = ["STOP_BIT", "StopsOnSignal"]
