"""The run's side of forming a world: one restore sequence, whichever world it trains in.

A world (:mod:`elastic.formation`) says which group this rank joined and how every rank of
it comes to stand on one step (restore from disk, heal from a peer, or start fresh).
:class:`WorldForming`, a part of :class:`~elastic.trainer.ElasticRun` (the object it holds
as ``run._worlds``, its contract with the run stated in :class:`FormsRun`), carries that out
the same way for both worlds (:meth:`~WorldForming._take_state`), at the first formation,
after a lost peer (:meth:`~WorldForming.recover`) and for a join.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, ContextManager, Protocol

import torch
import torch.distributed as dist

from .distributed import ElasticRunError, all_gather_ints, collective_device
from .formation import Holding, Source, StatePlan, TrainingWorld, heal
from .collectives import first_line
from .grad_sync import CollectiveFailure, GradSync, is_collective_failure
from .inplace.copy_plan import LIVE, OWN
from .inplace.memory_copies import NONE, UNKNOWN_SNAPSHOT, choose
from .inplace.user_collectives import Guard, UserCollectiveFailure
from .log import how_noticed

if TYPE_CHECKING:
    from .distributed import DistInfo
    from .goodput.recorder import GoodputLog
    from .plan import DataPlan
    from .snapshots import Snapshots
    from .train_state import TrainState

log = logging.getLogger("elastic.trainer")  # the run's lines


class BetweenWorlds(Protocol):
    """The run's stop on SIGTERM, as forming a world sees it (:class:`elastic.stopping.SignalStop`)."""

    def between_worlds(self) -> ContextManager[None]: ...


class FormsRun(Protocol):
    """What :class:`WorldForming` reads of its run and sets on it: the run's world, state,
    data plan, snapshots, DDP builder, metrics, goodput log and peer copies; the current
    world's ``dist`` (set at each formation), and what this rank holds (``_has_state``,
    ``_committed``, ``resumed_from``, set once it stands on the world's step); and the
    run's own steps around a formation (a new world's loader, a usage error, the first
    peer copy)."""

    world: TrainingWorld
    dist: DistInfo
    state: TrainState
    plan: DataPlan
    snapshots: Snapshots
    sync: GradSync
    goodput: GoodputLog
    metrics: Any
    resumed_from: int
    _has_state: bool
    _committed: int
    _guard: Guard
    copies: Any  # elastic.inplace.peer_copies.PeerCopies

    @property
    def _stop(self) -> BetweenWorlds: ...
    @property
    def _where(self) -> str: ...
    def _new_world(self) -> None: ...
    def _usage_error(self, exc: Exception) -> None: ...
    def _seed_copies(self) -> None: ...


class WorldForming:
    """Forming a world (1. of the run's state machine) and losing one (3.).

    The run calls :meth:`form` (the first world, a join, after an agreed stop of other
    ranks) and :meth:`recover` (a collective failed). Its own state: how long the last
    restore from the node agents' memory took (``memory_seconds``, for the log)."""

    def __init__(self, run: FormsRun) -> None:
        self.run = run
        self.memory_seconds = 0.0

    def form(self, reason: str, min_round: int = 0, since: float | None = None) -> None:
        """Form a world (:mod:`elastic.formation`): join its group, stand every rank on one
        step (:meth:`_take_state`), build DDP. A member lost meanwhile: the world forms
        again from a newer round (in place) or the worker ends (torchrun's world)."""
        started = since if since is not None else time.perf_counter()
        self.run.goodput.forming(reason)
        while True:
            with self.run._stop.between_worlds():
                joined = self.run.world.join(min_round)
            self.run.dist = joined.dist
            if joined.rendezvous:
                self.run.goodput.joined()
            try:
                moved, note, init_sync = self._take_state()
                self.run.sync.build(self.run.dist, init_sync=init_sync)
                self.run._seed_copies()  # FSDP in place: the new world's first peer copy, before its first step
            except CollectiveFailure as exc:
                log.debug("%s round %d could not be completed (%s); waiting for the next", self.run._where,
                          joined.round, exc)
                min_round = self.run.world.incomplete(how_noticed(exc))
                continue
            break
        self.run._new_world()
        if joined.rendezvous:  # a world of the agent's rounds: its rank and its heal, in the metrics
            self.run.metrics.world_changed(self.run.dist.rank, self.run.dist.world_size)
            self.run.metrics.healed(time.perf_counter() - started, moved)
        self.run.goodput.formed(joined.participants, self.run.dist.rank)
        self.run.world.formed(joined, reason, self.run._where, self.run.state.step, time.perf_counter() - started, note,
                          self.run.dist.is_main)

    def _take_state(self) -> tuple[int, str, bool]:
        """The one restore sequence, whichever world: the world's plan says whether this rank
        restores from disk, is healed from a peer, or starts fresh; this carries it out.
        Returns (bytes moved, a few words on how for the log, whether DDP aligns the ranks)."""
        try:
            self.run.snapshots.attach(self.run.dist)  # rank 0 may be new: it opens the writer and ledger
            plan = self.run.world.plan(Holding(self.run.dist.rank, self.run._has_state, self.run.state.step), self.run.dist)
            note, from_peers = "", 0
            if plan.source is Source.PEER_MEMORY:  # FSDP across every node: a lost node's shards from its buddies
                from_peers, note = self._from_peer_memory(plan)
            if plan.source is Source.DISK and self._from_node_memory():  # restarted workers: their agent's memory
                plan = plan.from_memory()
                note = f", from memory at step {self.run.state.step} (the node agents' copies, {self.memory_seconds:.2f} s)"
            if plan.source is Source.DISK:
                t0 = time.perf_counter()
                step, written_at = self._restore_newest()
                self.run.metrics.restored(time.perf_counter() - t0, written_at)
                if plan.check_same_step:
                    self._check_same_step()
                if step < 0 and plan.no_fresh_start:  # the shards were cut anew: nothing left to start from
                    self.run._usage_error(ElasticRunError(  # one line, exit 2 (mid-loop too: never a traceback)
                        f"{plan.no_fresh_start.replace('; resuming from the newest snapshot', '')}, and "
                        f"{self.run.snapshots.root} holds no snapshot to resume from; start the job again (or give it a "
                        "snapshot directory)"))
                if step < 0:
                    plan = plan.fresh(self.run.dist.world_size)
                    note = ", from node 0's fresh shards" if plan.local_shards else \
                        ", from each rank's own fresh shards" if plan.fresh_sources == {} else ", from rank 0's fresh state"
                    self.run.metrics.state_from(Source.FRESH.value)
                else:
                    note = f", from snapshot step {step} (no replica held state)"
                    self.run.metrics.state_from(Source.DISK.value)
            t_heal = time.perf_counter()
            wire = self.run.world.heal_wire(plan.sources, self.run.dist, collective_device(self.run.dist)) if plan.sources \
                else None
            if wire is not None and plan.source is not Source.DISK and self.run.dist.is_main:
                # says why the world stands still during a long transfer, and over which network
                log.info("%s round %d: healing rank(s) %s from %s at step %d %s", self.run._where, self.run.world.round,
                         plan.healed, plan.senders(), plan.step, wire.over)
            local = plan.local_shards  # HSDP: this rank's own shards, for the same local rank elsewhere
            try:
                moved = heal(plan, self.run.dist, wire, lambda: self.run.state.capture(local=local),
                             lambda state: self.run.state.load(state, local=local), self.run.plan.recent_state,
                             self.run.plan.load_recent) if wire is not None else from_peers
            finally:
                if wire is not None:
                    wire.close()
            t_heal = time.perf_counter() - t_heal
            if self.run.dist.rank in plan.sources:
                self.run.metrics.state_from(Source.REPLICA.value)
                self.run.goodput.healed_from_replica()
            if plan.sources and plan.source is Source.REPLICA:
                note = (f", ranks {plan.healed} healed from {plan.senders()} ({moved / 1e6:.1f} MB in {t_heal:.2f} s "
                        f"{wire.over if wire is not None else ''})")
        except RuntimeError as exc:
            if is_collective_failure(exc):
                raise CollectiveFailure(first_line(exc)) from exc
            raise
        self._holds_state()
        return moved, note, plan.init_sync

    def _from_peer_memory(self, plan: StatePlan) -> tuple[int, str]:
        """Carry out a plan from peer memory (:mod:`elastic.inplace.fsdp_in_place`): the bytes
        received, and a few words for the log."""
        fsdp = getattr(self.run.world, "fsdp", None)
        assert fsdp is not None, "a plan from peer memory in a world without FSDP in place"
        t0 = time.perf_counter()
        moved = fsdp.restore(plan.peer, plan.peer_before, self.run.dist,
                             lambda: {"state": self.run.state.capture(local=True), "recent": self.run.plan.recent_state()},
                             lambda state: self.run.state.load(state, local=True), self.run.plan.load_recent)
        self.run.metrics.state_from(Source.PEER_MEMORY.value)
        kinds = {src.kind for src in plan.peer.sources.values()} - {LIVE}
        how = (f"world of {plan.peer_before} kept, the restarted ranks filled from their own copies in their node "
               "agent's memory" if plan.peer_before == self.run.dist.world_size and kinds == {OWN} else
               f"world of {plan.peer_before} kept, the lost ranks filled from their buddies' copies"
               if plan.peer_before == self.run.dist.world_size else
               f"world of {plan.peer_before} re-sharded over {self.run.dist.world_size}")
        return moved, f", from peer memory at step {plan.step} ({how}, {time.perf_counter() - t0:.2f} s)"

    def _from_node_memory(self) -> bool:
        """A (re)started world whose every rank holds its own copy in its node agent's memory
        (:mod:`elastic.inplace.memory_copies`) of one step no older than the newest snapshot,
        of the same run and world: each rank loads it, and True. All ranks agree in one small
        all-gather (never a mix of sources); otherwise rank 0 says in one line why not, and
        the snapshot is loaded. Copies off, or no agent's memory on any rank: False, silently."""
        memory = self.run.copies.memory
        code, held = memory.held(self.run.copies.world_of()) if memory is not None and self.run.copies.world_of else (-1, [])
        snapshot = self._newest_snapshot_step() if self.run.dist.is_main else -1
        row = torch.tensor([code, *(held + [-1, -1])[:2], snapshot], dtype=torch.int64,
                           device=collective_device(self.run.dist))
        rows = [torch.zeros_like(row) for _ in range(self.run.dist.world_size)]
        dist.all_gather(rows, row)
        table = [[int(x) for x in r.tolist()] for r in rows]
        if all(r[0] < 0 or r[0] == NONE for r in table):  # copies off, or none made yet (the job's start)
            return False
        step, why = choose([r[:3] for r in table], table[0][3])
        if step is None:
            if self.run.dist.is_main:
                log.info("%s not restoring from the node agents' memory: %s; loading the newest snapshot",
                         self.run._where, why)
            return False
        assert memory is not None
        t0 = time.perf_counter()
        payload = memory.read(step)
        self.run.state.load(payload["state"], local=True)
        self.run.plan.load_recent(payload["recent"])
        self.memory_seconds = time.perf_counter() - t0
        self.run.metrics.restored(self.memory_seconds, None)
        self.run.metrics.state_from(Source.MEMORY.value)
        if self.run.dist.is_main:
            log.info("%s world %d (%s, %s): resumed from memory at step %d (each rank its own copy in its node "
                     "agent's memory; the newest snapshot is step %d)", self.run._where, self.run.dist.world_size,
                     self.run.dist.backend, self.run.dist.device.type, step, table[0][3])
        return True

    def _newest_snapshot_step(self) -> int:
        """The newest snapshot's step by its manifest (-1: none; :data:`UNKNOWN_SNAPSHOT`: the
        store could not be listed), rank 0's view."""
        store = self.run.snapshots.store
        try:
            found = store.list() if store is not None else []
        except Exception:  # noqa: BLE001 - a store that cannot list is no reason to prefer memory
            return UNKNOWN_SNAPSHOT
        return found[-1].step if found else -1

    def _check_same_step(self) -> None:
        steps = all_gather_ints(self.run.state.step, self.run.dist)
        if len(set(steps)) != 1:
            raise ElasticRunError(
                f"ranks restored different steps {steps}; the snapshot directory changed under the job - "
                "make sure only this job writes to it"
            )

    def _restore_newest(self) -> tuple[int, float | None]:
        """Every rank loads the newest snapshot, if any: (its step or -1, when it was written)."""
        step, written_at = self.run.snapshots.load_newest(self.run.dist, self.run.state.load)
        self._describe_restore(step)
        return step, written_at

    def _holds_state(self) -> None:
        """This rank holds the world's state at ``state.step`` (restored, healed or agreed on)."""
        self.run._has_state = True
        self.run._committed = self.run.resumed_from = self.run.state.step
        self.run.snapshots.catch_up(list(self.run.plan.recent), self.run.state.step, self.run.resumed_from)

    def _describe_restore(self, step: int) -> None:
        d = self.run.dist
        if step >= 0:
            if d.is_main:
                log.info("%s world %d (%s, %s): resumed from snapshot step %d (epoch %d, %d samples into it)",
                         self.run._where, d.world_size, d.backend, d.device.type, step, self.run.plan.sampler.epoch,
                         self.run.plan.sampler.cursor)
        elif d.is_main:
            log.info("%s world %d (%s, %s): no snapshot in %s, starting from scratch",
                     self.run._where, d.world_size, d.backend, d.device.type, self.run.snapshots.root)

    def recover(self, exc: CollectiveFailure, failed_step: int | None = None) -> None:
        """Abandon the step (nothing of it was applied); the world forms again or ends.

        A peer's loss is not this rank's bug: no traceback and no raw gloo message (DEBUG
        keeps it). In place, rank 0 says what happened once the world formed again; on the
        restart path each rank says in one line that its agent restarts it, and exits 1."""
        self.run.state.optimizer.zero_grad(set_to_none=True)
        step = self.run.state.step + 1 if failed_step is None else failed_step  # given: applied, not committed
        log.debug("%s step %d: a collective failed: %s", self.run._where, step, exc.__cause__ or exc)
        noticed = how_noticed(exc, self.run.world.replaced_by() is not None)
        user_collective = self.run._guard.where if isinstance(exc, UserCollectiveFailure) else ""
        started = time.perf_counter()
        min_round = self.run.world.lost_peer(step, noticed, user_collective, self.run._where)  # torchrun's: exits
        self.run.goodput.failed()
        self.form("failure", min_round=min_round, since=started)


__all__ = ["BetweenWorlds", "FormsRun", "WorldForming"]
