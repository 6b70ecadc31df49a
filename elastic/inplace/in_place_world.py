"""The rounds ``elastic agent`` offers: a world that re-forms in the same processes.

Each formation joins the agent's newest round (:mod:`.membership`), agrees on the step to
go on from (:mod:`.agreement`: the highest step any rank holding state completed) and heals
every rank that stands elsewhere from one that holds it (:mod:`.transfer`). Only when no
rank holds state (the job's start, or every replica lost) is the newest snapshot read from
disk. A lost peer fails a step, which is abandoned; the next round leaves the peer out. A
joiner is admitted at a step boundary every rank agreed on.

A *joiner* runs the script's set-up in a world of its own (:mod:`elastic.worker_env`) and
joins the world that trains at its loop's first batch (:meth:`InPlaceWorld.enter_loop`), so
its set-up collectives never meet the survivors' steps.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import time
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..distributed import DistInfo, collective_device, init_distributed, node_name, pick_backend
from ..grad_sync import CollectiveFailure, is_collective_failure
from ..log import how_noticed, reformed_line
from ..own_group import own_backend, release_default_group
from ..worker_env import in_setup_world
from ..world import TrainingWorld
from . import agreement
from .channel import RESTART, WorkerChannel, WorkerStatus
from .membership import Membership, World

if TYPE_CHECKING:
    from ..trainer import ElasticRun

log = logging.getLogger("elastic.trainer")  # the run's lines, whichever world says them


def in_place_off_reason(channel: WorkerChannel, backend: str) -> tuple[str | None, str]:
    """Why this torch cannot reconfigure the backend the run would use (None: it can), and
    that backend. When it cannot, rank 0 says so in one line and the agent is told, so that
    a lost or joining node restarts the workers."""
    from .reconfigure import unsupported_reason

    chosen = pick_backend(own_backend(backend))
    why_not = unsupported_reason(chosen)
    if why_not is not None:
        if int(os.environ.get("RANK", "0")) == 0:
            log.warning("in-place recovery off: %s; a lost or joining node restarts the workers", why_not)
        channel.report(WorkerStatus(pid=os.getpid(), mode=RESTART, reason=why_not))
    return why_not, chosen


def restart_instead(channel: WorkerChannel, why: str) -> None:
    """This run takes the restart path for a reason of its own (a sharded model): rank 0 says
    so once, and the agent is told, so that a lost or joining node restarts the workers."""
    if int(os.environ.get("RANK", "0")) == 0:
        log.warning("in-place recovery off: %s", why)
    channel.report(WorkerStatus(pid=os.getpid(), mode=RESTART, reason=why))


class InPlaceWorld(TrainingWorld):
    def __init__(self, run: "ElasticRun", channel: WorkerChannel, backend: str, timeout: float,
                 owns_group: bool) -> None:
        super().__init__(run)
        self.channel, self.backend, self.owns_group = channel, backend, owns_group
        self.timeout = timedelta(seconds=timeout)
        self.device = torch.device("cpu")
        self.membership = Membership(channel, backend, self.timeout, node=node_name())
        self.took_group: str | None = None  # the script's own default group, made again reconfigurable
        self._broken: tuple[int, str] | None = None  # (step abandoned, how it was noticed), for rank 0's line
        self._user_broke = ""  # the script's own collective that broke the world being re-formed
        self._node_ranks: dict[str, list[int]] = {}  # the current world's ranks by node
        self._said_misaligned = False

    @property
    def round(self) -> int:
        return self.membership.round

    # ------------------------------------------------------------------ forming

    def connect(self) -> DistInfo:
        if torch.cuda.is_available():
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)
        if in_setup_world():  # a joiner: set-up code runs in its own world; it joins at the first batch
            self.in_setup_world = True
            self.membership.announce()
            return init_distributed(self.backend, self.timeout.total_seconds())
        if dist.is_initialized():  # the script's own init_process_group: make it again, reconfigurable
            self.took_group = release_default_group(self.timeout.total_seconds())
        self.membership.start(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), self.device)
        return self.info()

    def info(self) -> DistInfo:
        world = self.membership.world
        rank = world.rank if world else int(os.environ.get("RANK", "0"))
        size = world.world_size if world else int(os.environ.get("WORLD_SIZE", "1"))
        return DistInfo(rank, size, int(os.environ.get("LOCAL_RANK", "0")), self.device, self.backend, node_name())

    def start(self) -> None:
        if self.in_setup_world:
            self.run.sync.build(self.run.dist)  # run.model for set-up code; built again for the real world
        else:
            self.form("start")

    def enter_loop(self) -> None:
        """A joiner at its loop's first batch: leave the set-up world, join the one that
        trains (the survivors switch to it at their next step boundary) and be healed there.

        Its stable rank is its rank in the agent's offer: its ``RANK`` was the set-up world's.
        A spare's worker, started before its node had a place, waits here for that offer."""
        if not self.in_setup_world:
            return
        self.in_setup_world = False
        if dist.is_initialized():
            group = release_default_group(self.timeout.total_seconds())
            if not self.owns_group:
                self.took_group = group
        offer = self.channel.offer()
        if offer is None:  # a spare's worker, started ahead: its place comes with the round that admits it
            with self.run._between_worlds():
                offer = self.membership.wait_for_offer()
        self.membership.start(offer.rank_base + self.run.dist.local_rank, offer.world_size, self.device)
        self.run._guard.take()  # a failure in the set-up world was that world's
        self.form("join")

    def form(self, reason: str, min_round: int = 0, since: float | None = None) -> None:
        """Join the agent's newest round, agree on a step, heal who needs it, build DDP."""
        run = self.run
        started = since if since is not None else time.perf_counter()
        before, before_ranks = self.membership.world, self._node_ranks
        broken, self._broken = self._broken, None
        run.goodput.forming(reason)
        while True:
            with run._between_worlds():
                world = self.membership.join(min_round)
            run.dist = self.info()
            run.goodput.joined()
            try:
                moved, healed = self._agree_and_heal()
                run.sync.build(run.dist)
            except CollectiveFailure as exc:  # a member died meanwhile: the next round leaves it out
                log.debug("%s round %d could not be completed (%s); waiting for the next", run._where,
                          world.round, exc)
                self.membership.failed(how_noticed(str(exc)))
                min_round = world.round + 1
                continue
            break
        run._new_world()
        self._node_ranks = self._ranks_by_node(world)
        user_broke, self._user_broke = self._user_broke, ""
        if user_broke and before is not None and set(before.participants) <= set(world.participants):
            self._say_misaligned(user_broke, broken[0] if broken else run.state.step)
        run.metrics.world_changed(run.dist.rank, run.dist.world_size)
        run.metrics.healed(time.perf_counter() - started, moved)
        run.goodput.formed(world.participants, run.dist.rank)
        if not run.dist.is_main:
            return
        seconds = time.perf_counter() - started
        if before is None:
            log.info("%s round %d (%s): world of %d, at step %d%s in %.3f s", run._where, world.round, reason,
                     run.dist.world_size, run.state.step, healed, seconds)
            return
        log.info("%s %s", run._where, reformed_line(
            lost=[n for n in before.participants if n not in world.participants],
            joined=[n for n in world.participants if n not in before.participants], lost_ranks=before_ranks,
            failed_step=broken[0] if broken else None, noticed=broken[1] if broken else "", seconds=seconds,
            old_world=before.world_size, new_world=run.dist.world_size, at_step=run.state.step,
            round_number=world.round, note=healed))

    def _agree_and_heal(self) -> tuple[int, str]:
        """Returns (bytes moved, a few words on what happened) for the log."""
        run = self.run
        try:
            hsdp = getattr(run, "hsdp", None)
            if hsdp is not None:  # HSDP: the script's mesh over this world, before any of its collectives
                hsdp.rebuild(run.dist, run._has_state)
            run.snapshots.attach(run.dist)  # rank 0 may be new: it opens the writer and ledger
            mine = agreement.Report(run.dist.rank, run._has_state, run.state.step)
            reports = agreement.decode(self._all_gather_rows(agreement.encode(mine)))
            plan = self._paired(agreement.plan(reports), reports)
            note = ""
            if plan.from_disk:
                t0 = time.perf_counter()
                step, written_at = run._restore_newest()
                run.metrics.restored(time.perf_counter() - t0, written_at)
                if step < 0:
                    plan = self._paired(agreement.fresh_plan(run.dist.world_size), reports)
                    note = ", from rank 0's fresh state" if hsdp is None else ", from node 0's fresh shards"
                    run.metrics.state_from("fresh")
                else:
                    note = f", from snapshot step {step} (no replica held state)"
                    run.metrics.state_from("disk")
            elif plan.sources and run.dist.is_main:  # says why the world stands still during a long transfer
                log.info("%s round %d: healing rank(s) %s from %s at step %d", run._where,
                         self.membership.round, plan.healed, plan.senders(), plan.step)
            t_heal = time.perf_counter()
            moved = self._heal(plan) if plan.sources else 0
            t_heal = time.perf_counter() - t_heal
            if run.dist.rank in plan.sources and not plan.from_disk:
                run.metrics.state_from("replica")
                run.goodput.healed_from_replica()
            if plan.sources and not note:
                note = f", ranks {plan.healed} healed from {plan.senders()} ({moved / 1e6:.1f} MB in {t_heal:.2f} s)"
        except RuntimeError as exc:
            if is_collective_failure(exc):
                raise CollectiveFailure(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc
            raise
        run._holds_state()
        return moved, note

    def _paired(self, plan: agreement.HealPlan, reports: list[agreement.Report]) -> agreement.HealPlan:
        """HSDP: each healed rank's source holds the same shards (:meth:`.hsdp.HsdpInPlace.pair`)."""
        hsdp = getattr(self.run, "hsdp", None)
        return plan if hsdp is None else hsdp.pair(plan, reports)

    def _all_gather_rows(self, row: list[int]) -> list[list[int]]:
        info = self.run.dist
        mine = torch.tensor(row, dtype=torch.int64, device=collective_device(info))
        out = [torch.zeros_like(mine) for _ in range(info.world_size)]
        dist.all_gather(out, mine)
        return [t.tolist() for t in out]

    def _heal(self, plan: agreement.HealPlan) -> int:
        """Send or receive the whole state, as the plan says; returns the bytes this rank moved."""
        from checkpoints.tree import iter_tensors

        from .transfer import recv_state, send_state

        run = self.run
        device, rank = collective_device(run.dist), run.dist.rank
        moved = 0
        if rank in plan.sources:
            payload = recv_state(plan.sources[rank], device)
            run.state.load(payload["state"], local=True)  # a sharded model: the peer's shards of this local rank
            run.plan.load_recent(payload["recent"])
            moved = sum(t.numel() * t.element_size() for t in iter_tensors(payload["state"]))
        else:
            needy = [r for r, src in sorted(plan.sources.items()) if src == rank]
            if needy:
                payload = {"state": run.state.capture(local=True), "recent": run.plan.recent_state()}
                for target in needy:
                    moved += send_state(payload, target, device)
        return moved

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

    def _say_misaligned(self, name: str, step: int) -> None:
        """A collective of the script's own failed and no node was lost: most likely the ranks
        did not issue it at the same point. Not fixable from here; said once, with the fix."""
        if self._said_misaligned:
            return
        self._said_misaligned = True
        log.warning("%s step %d failed in your dist.%s with every node still in the world: your collectives were "
                    "probably not issued at the same step on every rank (a counter of your own that a heal does "
                    "not restore, or rank-dependent code); key them on run.step_count or registered state, and do "
                    "per-world set-up in run.on_new_world", self.run._where, step, name)

    # ------------------------------------------------------------------ every step

    def replaced_by(self) -> int | None:
        return self.membership.replaced_by()

    def control_value(self, agree_stop: bool) -> int | None:
        # The newest round every rank could switch to: all switch at the same step boundary.
        return max(self.membership.ready_round(), 0)

    def stepped(self, step: int) -> None:
        self.membership.stepped(step)

    def offers(self, ready: int) -> bool:
        return ready > self.membership.round

    def switch(self, ready: int) -> None:
        self.form("join", min_round=ready)  # every rank saw the same value

    # ------------------------------------------------------------------ failures

    def lost_peer(self, step: int, noticed: str, user_collective: str) -> None:
        started = time.perf_counter()
        self.run.goodput.failed()
        self._broken, self._user_broke = (step, noticed), user_collective
        self.membership.failed(noticed)
        self.form("failure", min_round=self.membership.round + 1, since=started)

    def peers_stopped(self, step: int, said: str, leavers: list[int], broke: str) -> None:
        run = self.run
        started = time.perf_counter()
        run.goodput.failed()
        if run.dist.is_main and not broke:
            log.info("%s %s; re-forming in place without them", run._where, said)
        self._broken = (step, how_noticed(broke) if broke else "they stopped after SIGTERM")
        self.membership.failed(broke or f"rank(s) {leavers} stopped after step {step} (SIGTERM)")
        self.form("failure", min_round=self.membership.round + 1, since=started)

    def close(self) -> None:
        self.membership.close()  # the group stays, for the script's collectives after the loop; left at exit
        atexit.register(_release_ddp_at_exit, weakref.ref(self.run))  # runs before the group is left


def _release_ddp_at_exit(ref: "weakref.ref[ElasticRun]") -> None:
    """Drop the run's DDP before the process group is left at exit: a DDP that outlives its
    destroyed group frees it in C++ teardown, where gloo aborts the process (SIGABRT,
    "terminate called without an active exception"; 2 to 3 exits in 12 of a 2-process
    script, 0 in 14 with this), and the agent would take a finished worker for a failed one."""
    run = ref()
    if run is not None and getattr(run, "sync", None) is not None:
        run.sync.model = None
    gc.collect()


__all__ = ["InPlaceWorld", "in_place_off_reason", "restart_instead"]
