"""This worker's place in the job's world, kept current without restarting the process.

One object, used by the trainer in a fixed order:

1. :meth:`Membership.start` creates a reconfigurable default process group (no members
   yet) and a watcher thread that follows the agent's offers (:mod:`.channel`).
2. :meth:`join` blocks until the agent offers a round newer than the current one, gathers
   every member's handle through that round's store (:mod:`.round_store`) and reconfigures
   the group to exactly those members (:mod:`.reconfigure`). It returns the new
   :class:`World`, and rewrites torchrun's rank variables (``RANK``, ``WORLD_SIZE``...)
   in this process's environment to match it (:mod:`elastic.worker_env`). A round that
   cannot be completed (a member died in the meantime) is given up for a newer one; the
   worker asks its agent for one.
3. Every step, :meth:`replaced_by` says whether a newer round replaces this world (it
   leaves a member out, or follows a failure); the trainer then abandons the step and joins
   it. A world whose collectives cannot fail (a world of one has no peer to fail with)
   would otherwise train on alone while the others wait for it in the new round.
   :meth:`ready_round` is the newest round the watcher has seen every member's
   handle for. The trainer all-reduces it (MAX), so that all ranks switch to a round that
   adds members at the same step boundary, and survivors only stand still for the switch,
   never for a joiner's start-up.
4. After a collective failed, :meth:`failed` asks the agent for a new round; then
   :meth:`join` again.

The watcher also gets the main thread out of a collective that cannot finish: when a newer
round leaves out a current member (lost, or written off as frozen), or when a newer round
exists and no step has completed for a while, it trips the :class:`SocketFence`, and gloo
raises at once instead of waiting for its timeout. It also tells the agent when a step waits
beyond this rank's own pace (:mod:`.stall`), so that a frozen peer, which fails no collective,
is written off by the agents (``agent/node/freeze.py``) instead of at its lease's expiry; and when
a join of a round waits beyond the stall floor (:func:`.stall.join_level`), which is how a
member frozen while a round forms (its store host among them) shows when no step runs. A
newer round that leaves out members of the round whose pairs are connecting right now
(they were written off, frozen mid-connect) releases this rank's pairs that wait for them
(:func:`.gloo_private.release_pending_connect`): the connect fails at once rather than after
gloo's connect timeout, and the frozen member, thawed, cannot abort this process.

The watcher never waits on a peer: it reads the offer file, trips the fence and writes its
status. Posting this worker's handle ahead for a round that only adds members, through that
round's store (whose host may be frozen, and torch's TCPStore client then blocks in every
call), runs on a thread of its own that a newer round abandons (:mod:`.round_store`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import statistics
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import contract, failure_record, heartbeat
from ..collectives import first_line
from .. import worker_env
from ..contract import WorkerMode, WorkerState
from ..worker_env import Place, update_env
from .channel import RoundOffer, WorkerChannel, WorkerStatus
from . import gloo_private
from .fence import SocketFence, listening
from .left_behind import LeftBehindWatch
from .reconfigure import ReconfigureError, abort_backend, handle, init_group, reconfigure, reconfigure_timeout
from .round_store import RoundAbandoned, RoundStore
from .stall import STUCK, StallRule, join_level

log = logging.getLogger(__name__)

_POLL_S = 0.005
_POST_AGAIN_S = 0.1  # a post ahead that failed (its store not up yet) is tried again after this
_STALL_FLOOR_S = 0.5  # a newer round exists and no step for this long: the collective is stuck
_STALL_FACTOR = 4.0


@dataclass(frozen=True)
class World:
    round: int
    rank: int
    world_size: int
    participants: tuple[str, ...]


def waited_for(connecting: RoundOffer, newer: RoundOffer, rank: int) -> list[int]:
    """The ranks of ``connecting`` (a round whose pairs connect) that ``newer`` leaves out and
    that rank ``rank`` waits for to connect (gloo: the higher rank of a pair connects); none
    if the members' process counts are unknown."""
    if len(connecting.nprocs) != len(connecting.participants):
        return []
    kept, found, base = set(newer.participants), [], 0
    for node, count in zip(connecting.participants, connecting.nprocs):
        if node not in kept:
            found += [r for r in range(base, base + count) if r > rank]
        base += count
    return found


def _key(rank: int) -> str:
    return f"elastic/handle/{rank}"


def _place(offer: RoundOffer, world: World) -> Place:
    """This worker's place in the world it just joined, as torchrun's variables describe it."""
    here = offer.nprocs[offer.node_rank] if offer.node_rank < len(offer.nprocs) else \
        (worker_env.read().me.place.local_world_size or 1)
    return Place(rank=world.rank, world_size=world.world_size, group_rank=offer.node_rank,
                 group_world_size=len(offer.participants), local_world_size=here, round=offer.round)


class Membership:
    def __init__(self, channel: WorkerChannel, backend: str, timeout: timedelta, node: str = "") -> None:
        self.channel, self.backend, self.timeout, self.node = channel, backend, timeout, node
        self.local_rank = channel.local_rank
        self.store = RoundStore(timeout)
        self.fence = SocketFence()
        self.world: World | None = None
        self._handle = ""
        self._lock = threading.Lock()
        self._ready = -1
        self._posting: tuple[int, RoundStore] | None = None  # the round whose handles are gathered ahead
        self._post_again_at = 0.0  # a post that failed is tried again from then
        self._tripped_for = -1
        self._replaced_by = -1  # the newest round that replaces this world rather than growing it
        self._left_behind = LeftBehindWatch()  # since the trip for that round, while the main thread stays (.left_behind)
        self._last_step = time.monotonic()
        self._intervals: deque[float] = deque(maxlen=50)
        self._pace = StallRule()  # steady step intervals: when a step counts as stuck (.stall)
        self._steady = False  # False until the first step after a join: that interval is not steady
        self._stalled = 0  # how far the step in flight was reported stalled (.stall: 1 slow, 2 stuck)
        self.whole_node = False  # HSDP: this node's ranks are one unit of state (set when the run takes the mesh over)
        self._stop = threading.Event()
        self._joining = False
        self._joining_round = -1
        self._join_clock: tuple[int, float] | None = None  # (round, when its join began), while joining it
        self._connecting: RoundOffer | None = None  # the round whose pairs gloo connects right now
        self._released_for = -1  # the newest round whose left-out members' pairs were released
        self._gloo_listeners: list[tuple[str, int]] = []  # the default group's device listener(s)
        self._want_after: int | None = None  # a request for a round newer than this, until one is joined
        self._why = ""
        self._peers_stopped = False  # that request: ranks stopped after an agreed SIGTERM (WorkerStatus)
        self.step = 0
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ 1. start

    def announce(self) -> None:
        """A joiner in its set-up world: tell the agent now that this worker runs in place (so a
        new round rejoins it rather than restarting it); its group comes at :meth:`start`."""
        self._report(WorkerState.JOINING)

    def start(self, stable_rank: int, stable_ranks: int, device: torch.device | None = None) -> None:
        before = listening() if self.backend == "gloo" else {}
        init_group(self.backend, self.store, stable_rank, stable_ranks, self.timeout,
                   device if self.backend == "nccl" else None)
        if self.backend == "gloo":
            self._gloo_listeners = [addr for inode, addr in listening().items() if inode not in before]
        self._handle = handle()
        self._report(WorkerState.JOINING)
        self._thread = threading.Thread(target=self._watch, name="elastic-membership", daemon=True)
        self._thread.start()

    @property
    def round(self) -> int:
        return self.world.round if self.world is not None else -1

    # ------------------------------------------------------------------ 2. join

    def join(self, min_round: int = 0) -> World:
        """Reconfigure into the agent's newest round at or after ``min_round``."""
        self._joining = True
        self._left_behind.left()
        self._report(WorkerState.JOINING)
        try:
            while True:
                offer = self._await_offer(max(min_round, self.round + 1))
                world = self._try(offer)
                if world is not None:
                    return world
                self.failed(f"round {offer.round} could not be completed", after_round=offer.round)
                min_round = offer.round + 1
        finally:
            self._joining = False

    def wait_for_offer(self) -> RoundOffer:
        """The agent's first offer (a spare's worker waits here until its node is admitted)."""
        return self._await_offer(0)

    def _await_offer(self, at_least: int) -> RoundOffer:
        while True:
            offer = self.channel.offer()
            if offer is not None and offer.round >= at_least:
                return offer
            time.sleep(_POLL_S)

    def _try(self, offer: RoundOffer) -> World | None:
        self._joining_round = offer.round
        self._stalled = 0
        self._join_clock = (offer.round, time.monotonic()) if len(offer.participants) > 1 else None
        rank = offer.rank_base + self.local_rank
        started = time.monotonic()
        try:
            self.store.point_at(offer.store, f"round/{offer.round}/")
            self.store.set(_key(rank), self._handle)
            handles = [self.store.get(_key(r)).decode() for r in range(offer.world_size)]
            if handles.count(self._handle) > 1:
                if self.world is None:
                    log.error("[%s local rank %d] my process-group handle collides with another new worker's "
                              "in round %d; exiting so that the agent starts me anew", self.node, self.local_rank,
                              offer.round)
                    os._exit(contract.DUPLICATE_HANDLE_EXIT)
                return None
            self.fence.before_connect()
            self._connecting = offer
            try:
                reconfigure(offer.round, handles, reconfigure_timeout(self.backend, self.timeout))
            finally:
                self._connecting = None
            self.fence.after_connect()
        except (RoundAbandoned, ReconfigureError, dist.DistStoreError, RuntimeError, ValueError, OSError) as exc:
            # Part of forming a world, not news: a newer round came, or a member died as this
            # one formed; the next round leaves it out, and rank 0's line says what happened.
            log.debug("[%s local rank %d] round %d could not be joined (%s); joining the next", self.node,
                      self.local_rank, offer.round, first_line(exc))
            self._join_clock = None
            return None
        self._join_clock = None
        self._handle = handle()
        with self._lock:
            self.world = World(offer.round, dist.get_rank(), dist.get_world_size(), offer.participants)
            self._ready = offer.round
            if self._posting is not None and self._posting[0] <= offer.round:
                self._posting[1].abandon()
                self._posting = None
        self._last_step = time.monotonic()
        self._steady, self._stalled = False, 0
        update_env(_place(offer, self.world))  # for code that reads RANK and the like late
        self._report(WorkerState.TRAINING)
        log.debug("[%s rank %d] reconfigured into round %d in %.3f s", self.node, self.world.rank, offer.round,
                  time.monotonic() - started)
        return self.world

    # ------------------------------------------------------------------ 3. every step

    def replaced_by(self) -> int | None:
        """A newer round this world must give way to (not one that only adds members), or None."""
        with self._lock:
            return self._replaced_by if self._replaced_by > self.round else None

    def ready_round(self) -> int:
        with self._lock:
            return max(self._ready, self.round)

    def stepped(self, step: int) -> None:
        now = time.monotonic()
        self._intervals.append(now - self._last_step)
        if self._steady:
            self._pace.record(now - self._last_step)
        self._last_step, self.step, self._steady = now, step, True
        if self._stalled:  # it was only slow: say so (rare, so the write costs nothing per step)
            self._stalled = 0
            self._report(WorkerState.TRAINING)

    # ------------------------------------------------------------------ 4. after a failure

    def failed(self, reason: str, after_round: int | None = None, peers_stopped: bool = False) -> None:
        """Ask the agent for a round newer than ``after_round`` (default: the current one);
        the request stands in every report until such a round is joined. ``peers_stopped``:
        asked because ranks stopped after an agreed SIGTERM, not for a failed collective."""
        after = self.round if after_round is None else after_round
        self._want_after = max(after, self._want_after if self._want_after is not None else -1)
        self._why, self._peers_stopped = reason, peers_stopped
        self._report(WorkerState.REFORMING, wake=True)

    def _report(self, state: WorkerState, wake: bool = False) -> None:
        if self._want_after is not None and self.round > self._want_after:
            self._want_after, self._why, self._peers_stopped = None, "", False
        try:
            self.channel.report(WorkerStatus(pid=os.getpid(), mode=WorkerMode.IN_PLACE, round=self.round, state=state,
                                             step=self.step, want_round_after=self._want_after, reason=self._why,
                                             peers_stopped=self._peers_stopped,
                                             stalled=self._stalled, extra=self._extra()),
                                wake=wake)
        except OSError as exc:
            log.warning("cannot report to the agent: %s", exc)

    def _extra(self) -> dict[str, float]:
        """``whole_node`` when its node's ranks hold one unit of state (HSDP: a node's shards),
        so its agent starts them again together (agent.node.policy); and :meth:`_stall_extra`."""
        extra = self._stall_extra()
        if self.whole_node:
            extra[contract.WHOLE_NODE_KEY] = 1
        return extra

    def _stall_extra(self) -> dict[str, float]:
        """When the step before the stalled one ended (wall clock), for the agent's log line;
        for a stalled join, the round it waits to join and since when."""
        if not self._stalled:
            return {}
        clock = self._join_clock
        if self._joining and clock is not None:
            return {"joining": clock[0], "join_started_at": time.time() - (time.monotonic() - clock[1])}
        return {"last_step_at": time.time() - (time.monotonic() - self._last_step)}

    def close(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------------ the watcher

    def _stall_limit(self) -> float:
        if len(self._intervals) < 3:
            return _STALL_FLOOR_S * 4
        return max(_STALL_FLOOR_S, _STALL_FACTOR * statistics.median(self._intervals))

    def _watch(self) -> None:
        while not self._stop.wait(_POLL_S):
            try:
                self._look()
                self._check_stuck()
            except Exception:  # the watcher must outlive any one bad poll
                log.exception("membership watcher")

    def _look(self) -> None:
        offer = self.channel.offer()
        if offer is None:
            return
        if self._joining:
            if offer.round > self._joining_round >= 0:
                self.store.abandon()  # the main thread waits on an older round: let it move on
                self._release_left_out(offer)
            return
        world = self.world
        if world is None or offer.round <= world.round:
            return
        current, offered = set(world.participants), set(offer.participants)
        grows_only = offered >= current and offer.cause != "failure"
        stuck = time.monotonic() - self._last_step > self._stall_limit()
        if not grows_only:
            with self._lock:
                self._replaced_by = max(self._replaced_by, offer.round)
            self._left_behind.tripped(time.monotonic())
        if (not grows_only or stuck) and self._tripped_for < offer.round:
            self._tripped_for = offer.round
            shut = self.fence.trip()
            aborted = abort_backend(self.backend)
            why = ("leaves members out" if not offered >= current else "follows a failure" if not grows_only
                   else "waits on a stuck step")
            log.debug("[%s rank %d] round %d %s: interrupting the current collectives (%d sockets%s)", self.node,
                      world.rank, offer.round, why, shut, ", NCCL abort" if aborted else "")
        if grows_only:
            self._post_and_check(offer)

    def _release_left_out(self, offer: RoundOffer) -> None:
        """The pairs connecting for an older round wait for members ``offer`` leaves out
        (written off, frozen mid-connect): release them (:func:`.gloo_private.release_pending_connect`)."""
        connecting = self._connecting
        if connecting is None or offer.round <= self._released_for or not self._gloo_listeners:
            return
        self._released_for = offer.round
        ranks = waited_for(connecting, offer, connecting.rank_base + self.local_rank)
        if ranks:
            made = gloo_private.release_pending_connect(self._gloo_listeners, ranks)
            log.debug("[%s local rank %d] round %d leaves out members of round %d, whose pairs connect: released "
                      "the wait for ranks %s (%d connections)", self.node, self.local_rank, offer.round,
                      connecting.round, ranks, made)

    def _check_stuck(self) -> None:
        """At most twice per step: tell the agent when the step in flight waits beyond this
        rank's pace (:mod:`.stall`: slow, then stuck); the agent asks the peers' agents whether
        they are alive (``agent/node/freeze.py``). A question, not a verdict: nothing here leaves the world.
        A join that waits beyond :func:`.stall.join_level`'s floor is reported the same way."""
        if self._joining:
            self._check_join_stuck()
            return
        world = self.world
        if world is not None and self.replaced_by() is not None:
            self._check_left_behind(world)
        if world is None or self._stalled >= STUCK or len(world.participants) < 2:
            return
        waited = time.monotonic() - self._last_step
        level = self._pace.level(waited)
        if level <= self._stalled:
            return
        with self._lock:
            if self._replaced_by > world.round:
                return  # a newer round already replaces this world
        self._stalled = level
        log.debug("[%s rank %d] step %d has waited %.2f s (limit %.2f s): %s", self.node, world.rank, self.step + 1,
                  waited, self._pace.limit(), "stuck" if level >= STUCK else "slow")
        self._report(WorkerState.TRAINING, wake=True)

    def _check_left_behind(self, world: World) -> None:
        """A main thread that has not left a world its round replaced, long after the trip and
        idle meanwhile, waits on something no fence covers (:mod:`.left_behind`): its stacks and
        one line go to the log, and the worker exits for its agent to restart it in place,
        rather than holding its peers' join of the new round for ever."""
        waited = self._left_behind.check(time.monotonic(), self._pace.limit())
        if waited is None or self._joining or heartbeat.script_returned():
            return  # (a script that returned is on its way out: what it waits on is no peer's)
        why = (f"rank {world.rank} did not leave round {world.round} in {waited:.0f} s after round "
               f"{self.replaced_by()} replaced it (its main thread waits on something the fence cannot "
               f"interrupt; its stacks are above): exiting for the agent to restart it in place")
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        log.error("[%s] %s", self.node, why)
        with contextlib.suppress(Exception):
            failure_record.record(TimeoutError(why), message=f"TimeoutError: {why}", kind=contract.FailureKind.TIMEOUT)
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(contract.LEFT_BEHIND_EXIT)

    def _check_join_stuck(self) -> None:
        """The join of a round with peers waits (a member's handle that does not come, a store
        host that does not answer, a pair that does not connect): tell the agent, which asks
        the round's members and writes off the silent (``agent/node/freeze.py``)."""
        clock = self._join_clock
        if clock is None or self._stalled >= STUCK:
            return
        level = join_level(time.monotonic() - clock[1])
        if level <= self._stalled or self._join_clock is not clock:
            return
        self._stalled = level
        log.debug("[%s local rank %d] the join of round %d has waited %.2f s: %s", self.node, self.local_rank,
                  clock[0], time.monotonic() - clock[1], "stuck" if level >= STUCK else "slow")
        self._report(WorkerState.JOINING, wake=True)

    def _post_and_check(self, offer: RoundOffer) -> None:
        """For a round that only adds members: post our handle, and mark the round ready
        once every member's handle is there (the joiners' processes are up).

        On a thread of its own (:meth:`_post_ahead`): the round's store host may be frozen,
        and this watcher must never wait on a peer (it trips the fence and reports stalls).
        A newer offer abandons the older one's post; a failed post is tried again."""
        with self._lock:
            posting = self._posting
            if posting is not None and posting[0] >= offer.round:
                return
            if time.monotonic() < self._post_again_at:
                return
            if posting is not None:
                posting[1].abandon()  # an older round's post: the newer one replaces it
            store = RoundStore(self.timeout)
            self._posting = (offer.round, store)
        threading.Thread(target=self._post_ahead, args=(offer, store, self._handle), name="elastic-membership-post",
                         daemon=True).start()

    def _post_ahead(self, offer: RoundOffer, store: RoundStore, handle_now: str) -> None:
        try:
            store.point_at(offer.store, f"round/{offer.round}/")
            store.set(_key(offer.rank_base + self.local_rank), handle_now)
            store.wait([_key(r) for r in range(offer.world_size)])
        except (RoundAbandoned, dist.DistStoreError, RuntimeError, ValueError, OSError) as exc:
            log.debug("cannot post to round %d's store yet: %s", offer.round, exc)
            with self._lock:
                if self._posting is not None and self._posting[1] is store and not store.abandoned:
                    self._posting, self._post_again_at = None, time.monotonic() + _POST_AGAIN_S
            return
        finally:
            store.close()  # one post per round: its client and thread go with it
        with self._lock:
            self._ready = max(self._ready, offer.round)
