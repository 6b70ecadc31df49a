"""The rounds ``elastic agent`` offers: a world that re-forms in the same processes.

Each formation joins the agent's newest round (:mod:`.membership`) and agrees on the step to
go on from (:mod:`.agreement`: the highest step any rank holding state completed); the plan
it hands the run (:mod:`elastic.formation`) heals every rank that stands elsewhere from one
that holds it (:mod:`.transfer`). Only when no rank holds state (the job's start, or every
replica lost) is the newest snapshot read from disk. A lost peer fails a step, which is abandoned; the next round leaves the peer out. A
joiner is admitted at a step boundary every rank agreed on.

A *joiner* runs the script's set-up in a world of its own (:mod:`elastic.worker_env`) and
joins the world that trains at its loop's first batch (:meth:`InPlaceWorld.enter_loop`), so
its set-up collectives never meet the survivors' steps.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any, Callable, ContextManager, Mapping

import torch
import torch.distributed as dist

from ..distributed import DistInfo, collective_device, init_distributed, node_name, pick_backend
from ..log import how_noticed, reformed_line
from ..own_group import own_backend, release_default_group
from ..formation import Holding, Joined, Source, StatePlan, TrainingWorld
from .. import worker_env
from ..contract import WorkerMode
from . import agreement, heal_link
from .channel import WorkerChannel, WorkerStatus
from .heal_link import Wire
from .membership import Membership, World

log = logging.getLogger("elastic.trainer")  # the run's lines, whichever world says them


def in_place_off_reason(channel: WorkerChannel, backend: str) -> tuple[str | None, str]:
    """Why this torch cannot reconfigure the backend the run would use (None: it can), and
    that backend. When it cannot, rank 0 says so in one line and the agent is told, so that
    a lost or joining node restarts the workers."""
    from .reconfigure import unsupported_reason

    chosen = pick_backend(own_backend(backend))
    why_not = unsupported_reason(chosen)
    if why_not is not None:
        if worker_env.read().me.place.rank == 0:
            log.warning("in-place recovery off: %s; a lost or joining node restarts the workers", why_not)
        channel.report(WorkerStatus(pid=os.getpid(), mode=WorkerMode.RESTART, reason=why_not))
    return why_not, chosen


def restart_instead(channel: WorkerChannel, why: str) -> None:
    """This run takes the restart path for a reason of its own (a sharded model): rank 0 says
    so once, and the agent is told, so that a lost or joining node restarts the workers."""
    if worker_env.read().me.place.rank == 0:
        log.warning("in-place recovery off: %s", why)
    channel.report(WorkerStatus(pid=os.getpid(), mode=WorkerMode.RESTART, reason=why))


class InPlaceWorld(TrainingWorld):
    keeps_group_until_exit = True  # the script's collectives after the loop still have it

    def __init__(self, channel: WorkerChannel, backend: str, timeout: float, owns_group: bool) -> None:
        self.channel, self.backend, self.owns_group = channel, backend, owns_group
        self.timeout = timedelta(seconds=timeout)
        self.device = torch.device("cpu")
        self.membership = Membership(channel, backend, self.timeout, node=node_name())
        self.took_group: str | None = None  # the script's own default group, made again reconfigurable
        self._broken: tuple[int, str] | None = None  # (step abandoned, how it was noticed), for rank 0's line
        self._user_broke = ""  # the script's own collective that broke the world being re-formed
        self._before: World | None = None  # the world formed last (None: none yet)
        self._node_ranks: dict[str, list[int]] = {}  # the current world's ranks by node
        self._said_misaligned = False
        self.hsdp: Any = None  # HSDP in place: the takeover of the script's mesh (elastic.sharded.take_over)
        self.fsdp: Any = None  # FSDP across every node, from peer memory (elastic.sharded.take_over_fsdp)

    @property
    def round(self) -> int:
        return self.membership.round

    # ------------------------------------------------------------------ forming

    def connect(self) -> DistInfo:
        if torch.cuda.is_available():
            self.device = torch.device("cuda", worker_env.read().me.local_rank)
            torch.cuda.set_device(self.device)
        if worker_env.in_setup_world():  # a joiner: set-up code runs in its own world; it joins at the first batch
            self.in_setup_world = True
            self.membership.announce()
            return init_distributed(self.backend, self.timeout.total_seconds())
        if dist.is_initialized():  # the script's own init_process_group: make it again, reconfigurable
            self.took_group = release_default_group(self.timeout.total_seconds())
        started = worker_env.read().me.place
        self.membership.start(started.rank, started.world_size, self.device)
        return self.info()

    def info(self) -> DistInfo:
        world = self.membership.world
        me = worker_env.read().me
        rank = world.rank if world else me.place.rank
        size = world.world_size if world else me.place.world_size
        return DistInfo(rank, size, me.local_rank, self.device, self.backend, node_name())

    def enter_loop(self, local_rank: int, waiting: Callable[[], ContextManager[None]]) -> bool:
        """A joiner at its loop's first batch: leave the set-up world, join the one that
        trains (the survivors switch to it at their next step boundary), where the run
        forms it and has this rank healed.

        Its stable rank is its rank in the agent's offer: its ``RANK`` was the set-up world's.
        A spare's worker, started before its node had a place, waits here for that offer."""
        if not self.in_setup_world:
            return False
        self.in_setup_world = False
        if dist.is_initialized():
            group = release_default_group(self.timeout.total_seconds())
            if not self.owns_group:
                self.took_group = group
        offer = self.channel.offer()
        if offer is None:  # a spare's worker, started ahead: its place comes with the round that admits it
            with waiting():
                offer = self.membership.wait_for_offer()
        self.membership.start(offer.rank_base + local_rank, offer.world_size, self.device)
        return True

    def join(self, min_round: int) -> Joined:
        """The agent's newest round from ``min_round`` on (waits for it)."""
        world = self.membership.join(min_round)
        return Joined(self.info(), round=world.round, participants=tuple(world.participants), rendezvous=True)

    def plan(self, mine: Holding, info: DistInfo) -> StatePlan:
        """Every rank reports what it holds; the plan of :mod:`.agreement` (roll forward)."""
        if self.fsdp is not None:
            return self._fsdp_plan(mine, info)
        hsdp = self.hsdp
        if hsdp is not None:  # HSDP: the script's mesh over this world, before any of its collectives
            hsdp.rebuild(info, mine.has_state)
        rows = self._all_gather_rows(agreement.encode(mine), info)
        reports = agreement.decode(rows)
        agreed = self._paired(agreement.plan(reports), reports)
        local = hsdp is not None
        if agreed.from_disk:
            fresh = self._paired(agreement.fresh_plan(info.world_size), reports).sources if local else None
            return StatePlan(Source.DISK, fresh_from_rank0=True, local_shards=local, fresh_sources=fresh)
        return StatePlan(Source.REPLICA, step=agreed.step, sources=agreed.sources, local_shards=local)

    def _fsdp_plan(self, mine: Holding, info: DistInfo) -> StatePlan:
        """FSDP across every node: the step every position of the world before can stand on,
        from the survivors' live state and the buddies' copies (the run carries it out:
        :meth:`.fsdp_in_place.FsdpInPlace.restore`); else the disk, with one line saying why
        when state was held (a lost node's copies went with its buddy)."""
        decided, before = self.fsdp.decide(info, mine.has_state, mine.step)
        if decided is not None and decided.from_memory:
            return StatePlan(Source.PEER_MEMORY, step=decided.step, peer=decided, peer_before=before)
        why = ""
        if decided is not None:
            why = self.fsdp.lost_line(decided, self._node_ranks)
            if info.rank == 0:
                log.warning("%s", why)
        self.fsdp.rebuild(info)  # the shards cut for this world; the disk (or a fresh start) fills them
        return StatePlan(Source.DISK, check_same_step=decided is not None, fresh_sources={}, no_fresh_start=why)

    def _paired(self, plan: agreement.HealPlan, reports: list[Holding]) -> agreement.HealPlan:
        """HSDP: each healed rank's source holds the same shards (:meth:`.hsdp.HsdpInPlace.pair`)."""
        return plan if self.hsdp is None else self.hsdp.pair(plan, reports)

    def heal_wire(self, sources: Mapping[int, int], info: DistInfo, device: torch.device) -> Wire:
        """A group of the heal's own on ``ELASTIC_HEAL_IFNAME`` when set (through the round's
        store); its sockets join the fence's, so a peer frozen mid-heal trips them too."""
        if not heal_link.heal_interface():
            return super().heal_wire(sources, info, device)
        with self.membership.fence.adding():
            return heal_link.open_wire(sources, info.rank, device, info.backend, self.membership.store,
                                       f"{self.membership.round}", self.timeout)

    def incomplete(self, noticed: str) -> int:
        """A member died meanwhile: the next round leaves it out."""
        self.membership.failed(noticed)
        return self.membership.round + 1

    def formed(self, joined: Joined, reason: str, where: str, at_step: int, seconds: float, note: str,
               is_main: bool) -> None:
        before, before_ranks = self._before, self._node_ranks
        broken, self._broken = self._broken, None
        world = self.membership.world
        assert world is not None
        self._before = world
        self._node_ranks = self._ranks_by_node(world)
        user_broke, self._user_broke = self._user_broke, ""
        if user_broke and before is not None and set(before.participants) <= set(world.participants):
            self._say_misaligned(user_broke, broken[0] if broken else at_step, where)
        if not is_main:
            return
        if before is None:
            log.info("%s round %d (%s): world of %d, at step %d%s in %.3f s", where, world.round, reason,
                     joined.dist.world_size, at_step, note, seconds)
            return
        log.info("%s %s", where, reformed_line(
            lost=[n for n in before.participants if n not in world.participants],
            joined=[n for n in world.participants if n not in before.participants], lost_ranks=before_ranks,
            failed_step=broken[0] if broken else None, noticed=broken[1] if broken else "", seconds=seconds,
            old_world=before.world_size, new_world=joined.dist.world_size, at_step=at_step,
            round_number=world.round, note=note))

    def _all_gather_rows(self, row: list[int], info: DistInfo) -> list[list[int]]:
        mine = torch.tensor(row, dtype=torch.int64, device=collective_device(info))
        out = [torch.zeros_like(mine) for _ in range(info.world_size)]
        dist.all_gather(out, mine)
        return [t.tolist() for t in out]

    def _ranks_by_node(self, world: World) -> dict[str, list[int]]:
        """Global ranks of each node of ``world``, from the agent's offer (for naming the lost)."""
        offer = self.channel.offer()
        if offer is None or offer.round != world.round or len(offer.nprocs) != len(offer.participants):
            return {}
        out, base = {}, 0
        for node, count in zip(offer.participants, offer.nprocs):
            out[node] = list(range(base, base + count))
            base += count
        return out

    def _say_misaligned(self, name: str, step: int, where: str) -> None:
        """A collective of the script's own failed and no node was lost: most likely the ranks
        did not issue it at the same point. Not fixable from here; said once, with the fix."""
        if self._said_misaligned:
            return
        self._said_misaligned = True
        log.warning("%s step %d failed in your dist.%s with every node still in the world: your collectives were "
                    "probably not issued at the same step on every rank (a counter of your own that a heal does "
                    "not restore, or rank-dependent code); key them on run.step_count or registered state, and do "
                    "per-world set-up in run.on_new_world", where, step, name)

    # ------------------------------------------------------------------ every step

    def replaced_by(self) -> int | None:
        return self.membership.replaced_by()

    def control_value(self, agree_stop: bool, world_size: int) -> int | None:
        # The newest round every rank could switch to: all switch at the same step boundary.
        return max(self.membership.ready_round(), 0)

    def stepped(self, step: int) -> None:
        self.membership.stepped(step)

    def offers(self, ready: int) -> bool:
        return ready > self.membership.round

    # ------------------------------------------------------------------ failures

    def lost_peer(self, step: int, noticed: str, user_collective: str, where: str) -> int:
        self._broken, self._user_broke = (step, noticed), user_collective
        self.membership.failed(noticed)
        return self.membership.round + 1

    def peers_stopped(self, step: int, said: str, leavers: list[int], broke: str, where: str, is_main: bool,
                      close: Callable[[], None], stop_signal: Callable[[], int | None]) -> int:
        if is_main and not broke:
            log.info("%s %s; re-forming in place without them", where, said)
        self._broken = (step, how_noticed(broke) if broke else "they stopped after SIGTERM")
        self.membership.failed(broke or f"rank(s) {leavers} stopped after step {step} (SIGTERM)",
                               peers_stopped=not broke)
        return self.membership.round + 1

    def close(self) -> None:
        self.membership.close()  # the group stays, for the script's collectives after the loop; left at exit


__all__ = ["InPlaceWorld", "in_place_off_reason", "restart_instead"]
