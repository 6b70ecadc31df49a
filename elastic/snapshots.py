"""Snapshots and the ledger of one run: what rank 0 writes, and what a world with no replica reads.

Rank 0 owns the writer (:class:`checkpoints.AsyncSnapshotWriter`) and the ledger. In place,
rank 0 can move: when rank 0's node is lost the first survivor becomes rank 0, so every
process can open them, and does so the first time it is rank 0.

Both follow **committed** steps: a step is committed once every rank of the world has
completed it, which rank 0 learns when the next step's all-reduces complete (every rank
finished the previous step before it could contribute), or at a re-formation (the agreed
step). So a snapshot of step k is submitted during step k+1, after its backward and before
its optimizer step, when the parameters are still exactly step k's; and the ledger line
for step k is written then too. A re-run step therefore never has a ledger line twice.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

from checkpoints import (AsyncSnapshotWriter, Fence, FenceToken, SnapshotCorruptError, SnapshotError, SnapshotFencedError,
                         SnapshotStore)
from checkpoints.location import uses_object_store
from checkpoints.reading import DCP_FILES_KEY
from checkpoints.tree import iter_tensors
from checkpoints.stores import open_fence, open_store

from . import contract, worker_env
from .atomic_file import write_atomically
from .consistency.nonfinite import state_finite
from .distributed import DistInfo, ElasticRunError, broadcast_int, check_shared_dir
from .host_shards import HostShards
from .ledger import Ledger, LedgerError
from .metrics.training import MetricsLike
from .plan import StepRecord
from .run_config import SnapshotConfig, WriterMode
from .sharded_snapshots import ShardedWriter

log = logging.getLogger(__name__)


def _tell_agent(root: Path | str, fence: FenceToken | None, token: FenceToken) -> None:
    """The fence that refused this group, for the agent (its heartbeat directory): an agent
    started without --snapshot-dir cannot read it itself, and a fence above the rounds etcd
    holds now means etcd lost the job's state (agent.node.policy)."""
    directory = worker_env.read().node.heartbeat_dir
    if not directory or fence is None:
        return
    path = Path(directory) / contract.STALE_FENCE_FILE
    with contextlib.suppress(OSError):
        write_atomically(path, json.dumps({"snapshot_dir": str(root), "run": fence.run, "round": fence.round,
                                           "group_round": token.round}).encode())


class FinalSnapshotLost(Exception):
    """The final snapshot could not be written (a full or read-only directory); one line."""


class StaleGroupError(RuntimeError):
    """A newer round of this job commits to the snapshot directory: this group must stop.

    Not an :class:`ElasticRunError` (a usage error, which would end the job): the worker
    exits like a crash, and its agent, whose lease is gone, rejoins the job anew."""


class StaleGroupExit(SystemExit, StaleGroupError):
    """A stale group found as its world forms, its agent told the fence that refused it: the
    worker exits 1 as a crash would, with its one line logged and no traceback (uncaught, a
    ``SystemExit`` prints nothing; the agent decides from the fence it was told)."""

    def __init__(self, message: str) -> None:
        SystemExit.__init__(self, 1)
        self.message = message

    def __str__(self) -> str:
        return self.message


class Snapshots:
    def __init__(self, root: Path | str, config: SnapshotConfig, *, metrics: MetricsLike,
                 round_of: Callable[[], int] | None = None) -> None:
        self.root, self.keep = root, config.keep
        self.every_steps, self.every_seconds = config.every_steps, config.every_seconds
        self.round_of = round_of or _round_from_env  # the rendezvous round this world was formed in
        self.fence: Fence | None = None
        self.writer_mode: WriterMode = config.writer
        self.ledger_path, self.meta, self.metrics = config.ledger, dict(config.meta), metrics
        self.store: SnapshotStore | None = None
        self.writer: AsyncSnapshotWriter | None = None
        self.ledger: Ledger | None = None
        self._last_time = time.monotonic()
        self._checked_members: tuple[int, int] | None = None
        self._stalled = 0.0  # seconds training waited on snapshots since the last take_stall()
        self.collective = False  # a sharded model: every rank takes part in every snapshot (elastic.sharded)
        self.sharded: ShardedWriter | None = None  # every rank's, when each writes its own shards
        self._info: DistInfo | None = None  # this rank in the world the sharded writer last attached to
        self.socket_fence: Any = None  # in place: the world's socket fence, for the sharded snapshots' group
        self.fed_from_host = 0  # snapshots submitted from a host copy (commit's ``host``)

    @property
    def per_rank(self) -> bool:
        """Whether every rank writes its own shards (:mod:`checkpoints.sharded`): a sharded
        model, on the restart path and in place (HSDP), into a directory or an object store
        (:mod:`checkpoints.s3parts`). Two tiers still take the full state gathered to rank
        0: their first tier is each node's own disk, which no other rank can write to."""
        from checkpoints import dcp_private
        from checkpoints.location import split_tiers

        return self.collective and split_tiers(str(self.root)) is None and dcp_private.PROBLEM is None

    # ------------------------------------------------------------------ opening, per world

    def attach(self, info: DistInfo, check_dir: bool = True) -> None:
        """After every formation of a world: rank 0 opens what only it writes, every rank
        checks it sees rank 0's files. A failure on rank 0 is broadcast so every rank stops
        with the same one line."""
        problem = ""
        if info.is_main and self.writer is None:
            try:
                # A sharded snapshot's temp dir is made by whichever rank writes first, never a
                # recycled spare: no spare is kept for it.
                self.store = open_store(self.root, keep=self.keep, **self._store_options())
                if self.ledger_path is not None and self.ledger is None:
                    self.ledger = Ledger(self.ledger_path)
            except (SnapshotError, LedgerError) as e:
                problem = str(e)
        stale = self._raise_fence() if info.is_main and not problem else ""
        verdict = broadcast_int(1 if problem else 2 if stale else 0, info)
        if verdict == 1:
            raise ElasticRunError(problem or f"rank 0 cannot open its snapshot directory {self.root} or ledger; "
                                             "see rank 0's log")
        if verdict == 2:
            token = self.token()
            if token is not None:  # every rank: each node's agent judges for itself (agent.node.policy.etcd_lost)
                _tell_agent(self.root, Fence(self.root).current(), token)
            message = stale or "a newer round of this job commits to the snapshot directory; this group is stale"
            log.error("this group is stale (StaleGroupError), its agent told: %s", message)
            raise StaleGroupExit(message)
        if check_dir and not uses_object_store(self.root):  # an object store is one namespace for every node
            check_shared_dir(Path(self.root), info)  # a local root: a Path (checkpoints.stores.location_of)
        if self.store is None:
            self.store = open_store(self.root, keep=self.keep, create=False, **self._store_options())
        if self.per_rank:
            self._attach_sharded(info)
            return
        if info.is_main and self.writer is None:
            # The writer process imports torch when a worker starts; until it is ready a thread
            # writes, so the first snapshot after a start never waits for that import.
            self.writer = AsyncSnapshotWriter(self.store, overlap_policy="skip",
                                              on_durable=getattr(self.metrics, "snapshot_durable", None),
                                              mode=self.writer_mode)

    def _store_options(self) -> dict[str, Any]:
        return {"recycle": False} if self.per_rank else {}

    def _attach_sharded(self, info: DistInfo) -> None:
        """Every rank's writer of its own shards; rank 0's is also :attr:`writer` (it seals)."""
        assert self.store is not None  # attach opened it before it came here
        if self.sharded is None:
            self.sharded = ShardedWriter(self.store, on_durable=getattr(self.metrics, "snapshot_durable", None),
                                         fence=self.socket_fence)
        self.sharded.formed()  # a lost rank's shards will not come: that snapshot is given up
        if info.is_main:
            self.writer = self.sharded  # type: ignore[assignment]  # what rank 0 flushes, closes and reports
        self._info = info

    def token(self) -> FenceToken | None:
        """This world's fence token: the job's run id and its rendezvous round (None outside
        ``elastic agent``/torchrun with our rendezvous: nothing to fence against)."""
        run, round_number = worker_env.read().me.run_id, self.round_of()
        return FenceToken(run, round_number) if run and round_number >= 0 else None

    def _raise_fence(self) -> str:
        """Rank 0 of a new world stands the fence at its round; why not, if this group is stale.

        A fence that cannot be written (a read-only directory would have failed before)
        is logged and skipped: it guards against a rare split brain, and must not stop a
        job the snapshots themselves do not stop."""
        token = self.token()
        if token is None:
            return ""
        try:
            self.fence = self.fence or open_fence(self.root, self.store)
            self.fence.raise_to(token)
            if self.writer is not None:  # its snapshot of an older round in flight is then ours to drop
                self.writer.own_round = max(self.writer.own_round, token.round)
        except SnapshotFencedError as e:
            return str(e)
        except OSError as e:
            log.warning("cannot write the fence of snapshot dir %s (%s); commits are not fenced", self.root,
                        e.strerror or e)
            self.fence = None
        return ""

    # ------------------------------------------------------------------ reading (no replica left)

    def load_newest(self, info: DistInfo, take: Callable[[dict[str, Any]], None]) -> tuple[int, float | None]:
        """Rank 0 picks the newest valid snapshot; every rank loads exactly that one and gives
        it to ``take``. Returns (step or -1, when it became durable).

        A sharded snapshot's shards are read inside ``take`` (``dcp.load``), each checked
        against the version rank 0's load verified: one replaced since is refused on every
        rank alike (DCP gathers each rank's failure), and every rank falls back to the next
        older snapshot, as a restart would. With none older, the refusal is raised: ``take``
        may have loaded part of the refused one, so this process cannot start from scratch."""
        assert self.store is not None
        below: int | None = None
        refused: SnapshotCorruptError | None = None
        while True:
            found = self.store.load_latest(before=below) if info.is_main else None
            step = broadcast_int(found[0].step if found else -1, info)
            if step < 0:
                if refused is not None:
                    raise refused
                return -1, None
            # Rank 0 hashed every shard file just now; the others read only what DCP reads for them,
            # each range asked for the very version rank 0 hashed (its ETags), never the one a later
            # listing of their own finds: a shard replaced in between is then refused, not read.
            state = found[1] if found else self.store.load(step, verify_shards=False)
            bound = _from_rank0(found[1].get(DCP_FILES_KEY) if found else None, info)
            if bound is not None:
                state[DCP_FILES_KEY] = bound
            try:
                take(state)
            except SnapshotCorruptError as e:
                refused = e
                if info.is_main:
                    log.warning("skipping snapshot step %d, changed since it was verified (%s); falling back to an "
                                "older one", step, e)
                below = step
                continue
            return step, (found[0].written_at if found else None)

    # ------------------------------------------------------------------ committing

    @property
    def takes_host_copies(self) -> bool:
        """Whether this rank writes whole-state snapshots with its own writer (rank 0, a model
        that is not sharded), which a host copy of the state's step can feed (:meth:`commit`)."""
        return self.writer is not None and self.sharded is None and not self.collective

    @property
    def takes_sharded_host_copies(self) -> bool:
        """Whether this rank writes its own shards of sharded snapshots (every rank, a sharded
        model), which its host copy of the step can feed (:meth:`commit`, :mod:`elastic.host_shards`)."""
        return self.sharded is not None

    def host_copy_wanted(self, step: int) -> tuple[bool, bool]:
        """Whether a host copy of ``step`` made now is to be kept for its snapshot (one would
        be due), and whether in shared memory (the writer process reads only that; a sharded
        snapshot is written by this process's own thread, and is due by steps only)."""
        if step == 0:
            return False, False
        every = self.every_steps
        by_steps = step % every == 0 if every else False
        if self.takes_sharded_host_copies:
            return by_steps, False
        if not self.takes_host_copies:
            return False, False
        by_time = self.every_seconds is not None and time.monotonic() - self._last_time >= self.every_seconds
        due = by_steps or by_time
        return due, due and getattr(self.writer, "mode", None) == "process"

    def commit(self, step: int, record: StepRecord | None, state: Callable[[], dict[str, Any]], world_size: int,
               epoch: int, cursor: int, samples: int, force: bool = False, finite: bool = False,
               host: Any = None) -> None:
        """Step ``step`` is committed: its ledger line, and its snapshot if one is due (rank 0).
        A state holding a NaN or an Inf is never snapshotted (said in one line): a snapshot of
        it would be the newest, and prune would delete the finite ones behind it. ``finite``:
        the replica check just found this very state finite, so it is not looked at again.

        ``host``: a complete host copy of this very step's state (a peer copy's,
        :class:`elastic.inplace.peer_copies.Copy`, the caller's to vouch for): its model and
        optimizer are written as they are, with no capture of their own (no second copy of
        their bytes, nothing for the optimizer step to wait for); the rest (progress,
        sampler, RNG, registered state) is captured now, as without it. The files are the same.
        A sharded model's: this rank's shards of it (:class:`elastic.host_shards.HostShards`),
        written as they are under the plan ``dcp.save`` makes of the live state."""
        if self.ledger is not None and record is not None:
            self._write_line(record)
        every = self.every_steps
        by_steps = step % every == 0 if every else False
        if self.sharded is not None:
            if (force or by_steps) and step != 0:
                self._submit_sharded(step, state(), world_size, {"epoch": epoch, "cursor": cursor, "samples": samples},
                                     host=host if isinstance(host, HostShards) else None)
            return
        if self.writer is None:
            if self.collective and (force or by_steps) and step != 0:
                state()  # this rank's part of rank 0's sharded capture (snapshots are due by steps only)
            return
        by_time = self.every_seconds is not None and time.monotonic() - self._last_time >= self.every_seconds
        if not (force or by_steps or by_time) or step == 0:
            return
        t_sync = time.perf_counter()
        if self.ledger is not None:
            self.ledger.sync()  # ledger lines up to this step outlive a machine crash
        t0 = time.perf_counter()
        captured = state()
        frozen: list[Any] = []
        if host is not None and self.takes_host_copies:
            own = host.payload["state"]
            captured["model"], captured["optimizer"] = own["model"], own["optimizer"]
            frozen = iter_tensors({"model": own["model"], "optimizer": own["optimizer"]})
        if not (finite or _finite(step, captured)):
            self.metrics.snapshot_skipped()
            self._stalled += time.perf_counter() - t_sync
            return
        meta = {**self.meta, "epoch": epoch, "cursor": cursor, "samples": samples}
        token = self.token()
        if token is not None:
            meta["fence"] = token.to_meta()  # the store renames it into place only under this fence
        if self.writer.submit(step, captured, world_size=world_size, extra_meta=meta, frozen=frozen,
                              donor=host.arena if frozen else None):
            if frozen and not self.fed_from_host:
                log.info("snapshot step %d written from the peer copy's host copy of that step (no capture of its "
                         "own); so are later ones whose step has a host copy", step)
            self.fed_from_host += bool(frozen)
            self._last_time = time.monotonic()
            self.metrics.snapshot_submitted(time.perf_counter() - t0)
        else:
            self.metrics.snapshot_skipped()
        self._stalled += time.perf_counter() - t_sync

    def _submit_sharded(self, step: int, state: dict[str, Any], world_size: int, meta: dict[str, Any],
                        host: HostShards | None = None) -> bool:
        """Every rank: its part of snapshot ``step`` (a collective); rank 0 counts it."""
        assert self.sharded is not None
        t0 = time.perf_counter()
        if self.ledger is not None:
            self.ledger.sync()
        meta = {**self.meta, **meta}
        token = self.token()
        if token is not None:
            meta["fence"] = token.to_meta()
        assert self._info is not None
        done = self.sharded.submit(step, state, world_size=world_size, info=self._info, extra_meta=meta, host=host)
        if done and host is not None and host.taken_bytes:
            if not self.fed_from_host and self._info.is_main:
                log.info("snapshot step %d: this rank's shards written from its peer copy's host copy of that step "
                         "(%d bytes taken as they are, %d copied); so are later ones whose step has a host copy", step,
                         host.taken_bytes, host.copied_bytes)
            self.fed_from_host += 1
        if self._info.is_main:
            if done:
                self.metrics.snapshot_submitted(time.perf_counter() - t0)
            else:
                self.metrics.snapshot_skipped()
        self._stalled += time.perf_counter() - t0
        return done

    def wait_capture(self) -> None:
        """Before the optimizer step: the snapshot's copy of the parameters must predate it."""
        if self.writer is not None:
            t0 = time.perf_counter()
            self.writer.wait_capture()
            waited = time.perf_counter() - t0
            self.metrics.capture_waited(waited)
            self._stalled += waited

    def take_stall(self) -> float:
        """Seconds training stood still for snapshots since the last call (goodput's ``snapshot``)."""
        stalled, self._stalled = self._stalled, 0.0
        return stalled

    def final(self, step: int, state: dict[str, Any], world_size: int, meta: dict[str, Any]) -> None:
        """A snapshot of ``step`` (the last one, or the one before a stop), durable on return;
        not written again if the periodic one of that very step already is. Sharded: every
        rank calls it (each writes its own shards)."""
        if self.sharded is not None:
            return self._final_sharded(step, state, world_size, meta)
        if self.writer is None:
            return
        try:
            self._settle(self.writer.flush)  # so the overlap policy cannot skip the last one
        except SnapshotError as e:  # an earlier one failed, and said so; the last one may still fit
            log.debug("an earlier snapshot failed (%s); writing step %d's anyway", e, step)
        if self.ledger is not None:
            self.ledger.sync()
        if self.newest_durable == step or not _finite(step, state):
            return
        token = self.token()
        fence = {"fence": token.to_meta()} if token is not None else {}
        try:
            self.writer.submit(step, state, world_size=world_size, extra_meta={**self.meta, **meta, **fence})
            self._settle(self.writer.flush)
        except SnapshotError as e:  # a full or read-only directory: the steps are trained, their snapshot is not
            raise FinalSnapshotLost(self._lost_line(step, e)) from e

    def _final_sharded(self, step: int, state: dict[str, Any], world_size: int, meta: dict[str, Any]) -> None:
        """:meth:`final` for per-rank shards: whether to write is decided alike on every rank
        (by what was submitted, never by what one rank saw become durable)."""
        assert self.sharded is not None
        error: SnapshotError | None = None
        try:
            self._settle(self.sharded.flush)
        except SnapshotError as e:
            error = e
        if self.sharded.last_submitted != step:
            if self.ledger is not None:
                self.ledger.sync()
            self._submit_sharded(step, state, world_size, meta)
            error = None
            try:
                self._settle(self.sharded.flush)
            except SnapshotError as e:
                error = e
        if self._info is not None and self._info.is_main and self.newest_durable != step:
            raise FinalSnapshotLost(self._lost_line(step, error or SnapshotError("a rank's shards were not written")))

    def _lost_line(self, step: int, error: SnapshotError) -> str:
        """One line: the directory, what went wrong, and the newest snapshot that is intact."""
        newest = None
        with contextlib.suppress(SnapshotError, OSError):
            newest = self.store.newest_valid(full=False) if self.store is not None else None
        intact = (f"the newest intact snapshot is step {newest.step} ({newest.path})" if newest is not None
                  else "no intact snapshot is there")
        return (f"step {step} is trained, but its snapshot (the last of this run) could not be written to "
                f"{self.root}: {error}; {intact}; exit {contract.FINAL_SNAPSHOT_LOST_EXIT} (not restarted: "
                "free space or make the directory writable; a new run resumes from that snapshot)")

    def _settle(self, wait: Callable[[], None]) -> None:
        """Wait for the writer; a fenced-off write is a stale group only if the fence has moved
        past this world's own round.

        The writer is asynchronous, so a snapshot submitted in round r can reach its rename
        after this very world (or a new rank 0 of it) stood the fence at r+1 in place: that
        snapshot is dropped (the next one covers it), and the group that wrote it is the
        newest, not stale."""
        try:
            wait()
        except SnapshotFencedError as e:
            token = self.token()
            current = self.fence.current() if self.fence is not None else open_fence(self.root, self.store).current()
            if token is None or current != token:
                raise StaleGroupError(str(e)) from None
            log.warning("a snapshot submitted in an earlier round of this world was not committed (round %d "
                        "formed before it was durable); the next snapshot takes its place", token.round)

    # ------------------------------------------------------------------ the ledger after a re-formation

    def catch_up(self, recent: list[StepRecord], agreed: int, resumed_from: int) -> None:
        """A (possibly new) rank 0 writes the committed steps no line exists for yet."""
        if self.ledger is None:
            return
        self.ledger.resumed_from = resumed_from
        last = last_ledger_step(self.ledger.path)
        for record in recent:
            if last < record.step <= agreed:
                self._write_line(record)
        if recent and last < agreed and last < recent[0].step - 1:
            log.warning("ledger: steps %d..%d were committed but their lines are lost (no replica remembers "
                        "them)", last + 1, recent[0].step - 1)

    def _write_line(self, record: StepRecord) -> None:
        """One committed step's line, appended under the fence: a stale group's rank 0 is
        refused (and stops) instead of interleaving its steps with the new group's."""
        assert self.ledger is not None
        token = self.token()
        fence = self.fence.holding(token) if self.fence is not None and token is not None else contextlib.nullcontext()
        try:
            with fence:
                self.ledger.record(epoch=record.epoch, step=record.step, world_size=record.world_size,
                                   samples=list(record.samples), resumed_from=self.ledger.resumed_from,
                                   round_number=token.round if token is not None else -1)
        except SnapshotFencedError as e:
            raise StaleGroupError(str(e)) from None

    # ------------------------------------------------------------------ closing

    @property
    def pending_step(self) -> int | None:
        return self.writer.pending_step if self.writer is not None else None

    @property
    def newest_durable(self) -> int | None:
        """The step of the newest snapshot this process made durable (None: none yet)."""
        return self.writer.stats.last_durable_step if self.writer is not None else None

    @property
    def last_write_seconds(self) -> float | None:
        """How long this process's last snapshot took from capture to durable (None: none yet)."""
        if self.writer is None:
            return None
        stats = self.writer.stats
        return stats.last_capture_s + stats.last_write_s if stats.snapshots_written else None

    def close(self) -> None:
        try:
            if self.sharded is not None:
                self._settle(self.sharded.close)
            elif self.writer is not None:
                self._settle(self.writer.close)
        finally:
            if self.ledger is not None:
                self.ledger.close()


def _from_rank0(value: Any, info: DistInfo) -> Any:
    """Rank 0's ``value`` on every rank (one small broadcast; a world of one keeps its own)."""
    if info.world_size == 1:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _finite(step: int, state: dict[str, Any]) -> bool:
    """Whether ``state`` holds only finite values; if not, one line says its snapshot is not written."""
    if state_finite(iter_tensors(state)):
        return True
    log.error("not snapshotting step %d: its state holds non-finite values (a NaN or an Inf); the newest "
              "snapshot stays the last finite one", step)
    return False


def _round_from_env() -> int:
    """The round ``elastic agent`` started this worker in (restart path: it never changes)."""
    return worker_env.read().me.place.round


def last_ledger_step(path: str | os.PathLike[str]) -> int:
    """The step of the last complete line of a ledger file (0 if none), reading only its tail."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - (1 << 20)))
            tail = f.read()
    except FileNotFoundError:
        return 0
    for line in reversed(tail.splitlines()):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0
