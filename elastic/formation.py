"""What a world hands the run when it forms, and the heal the run carries out from it.

A world (:mod:`elastic.world`) knows how its ranks come together and how they agree on a
step; the run knows its state. So a world answers with two frozen records and never
touches the run: :class:`Joined` (the process group this rank is now in) and
:class:`StatePlan` (how every rank comes to stand on one step: restore from disk, heal from
a peer, or start fresh). :class:`~elastic.trainer.ElasticRun` carries the plan out in its
one restore sequence (``elastic.restore.WorldForming._take_state``), whichever world it trains in.

The run calls a world (:class:`TrainingWorld`) in this order:

1. :meth:`TrainingWorld.connect` once, in the constructor: the process group this rank
   starts in (the run builds its metrics, DDP and snapshots on it).
2. Each formation (the first, after those are built; then after a failure or for a
   join): :meth:`~TrainingWorld.join` (the group), :meth:`~TrainingWorld.plan` (how every
   rank stands on one step), :meth:`~TrainingWorld.formed` once the run carried it out;
   :meth:`~TrainingWorld.incomplete` instead when a member died during it.
3. :meth:`~TrainingWorld.enter_loop` at the loop's first batch, for a joiner.
4. Every step: :meth:`~TrainingWorld.replaced_by` and :meth:`~TrainingWorld.control_value`
   before the forward, :meth:`~TrainingWorld.stepped` after the optimizer step, and
   :meth:`~TrainingWorld.offers` with the value the control all-reduce agreed on; at the
   step boundary after it the run forms the world offered (2), from that round on.
5. A collective failed: :meth:`~TrainingWorld.lost_peer`; a peer stopped after SIGTERM:
   :meth:`~TrainingWorld.peers_stopped`. Each returns the round the next formation starts
   from (the run then forms it, 2), or does not return.
6. :meth:`~TrainingWorld.close` once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Mapping

import torch

from .distributed import DistInfo
from .inplace.agreement import Holding  # what one rank holds as a world forms (torch-free, so kept there)

if TYPE_CHECKING:
    from .inplace.heal_link import Wire


class Source(str, Enum):
    """Where a rank's state comes from at a formation (the ``elastic_state_source`` label)."""

    DISK = "disk"  # every rank loads the newest snapshot (none on disk: FRESH)
    REPLICA = "replica"  # healed from a rank that holds the agreed step
    FRESH = "fresh"  # nothing anywhere: the script's freshly built state is the start
    PEER_MEMORY = "peer-memory"  # FSDP across every node: a lost node's shards from its buddies' copies
    MEMORY = "memory"  # restarted workers: each rank its own copy, kept in its node agent's shared memory


@dataclass(frozen=True)
class Joined:
    """The process group this rank is in after a world's ``join``."""

    dist: DistInfo
    round: int = -1  # the agent's round (-1: torchrun's world)
    participants: tuple[str, ...] = ()  # the round's nodes, in rank order (empty: torchrun's world)
    rendezvous: bool = False  # the world re-forms in place: its wait was a round, its formation a re-formation


@dataclass(frozen=True)
class StatePlan:
    """How every rank of a world comes to stand on one step; the run carries it out.

    ``DISK``: every rank loads the newest snapshot; if there is none, every rank starts
    fresh, and ``fresh_from_rank0`` says whether rank 0's fresh state is sent to the
    others (in place) or each keeps its own (torchrun's world: DDP's first broadcast, by
    ``init_sync``, aligns the parameters). ``REPLICA``/``FRESH``: each rank in ``sources``
    receives the whole state from its sender; every other rank stands on ``step`` already.
    """

    source: Source
    step: int = -1  # the step every rank stands on afterwards (-1: decided by the disk)
    sources: Mapping[int, int] = field(default_factory=dict)  # healed rank -> the rank that sends to it
    fresh_from_rank0: bool = False
    check_same_step: bool = False  # DISK: the ranks confirm they all restored the same step
    init_sync: bool = False  # DDP broadcasts rank 0's parameters when it is built
    # HSDP in place: a heal moves each rank's own shards, to the same local rank of another node
    local_shards: bool = False
    fresh_sources: Mapping[int, int] | None = None  # DISK, none there: who sends the fresh state (default: rank 0)
    # PEER_MEMORY: the plan over the world before (elastic.inplace.copy_plan.CopyPlan) and that world's size
    peer: Any = None
    peer_before: int = 0
    # DISK: why an empty disk cannot mean a fresh start (the state was held but is gone), for one line
    no_fresh_start: str = ""

    @property
    def healed(self) -> list[int]:
        return sorted(self.sources)

    def senders(self) -> list[int]:
        return sorted(set(self.sources.values()))

    def from_memory(self) -> "StatePlan":
        """DISK, but every rank loaded its own copy from its node agent's memory instead (one step)."""
        return StatePlan(Source.MEMORY, init_sync=self.init_sync, local_shards=self.local_shards)

    def fresh(self, world_size: int) -> "StatePlan":
        """Nothing on disk either: the plan for a fresh start."""
        if self.fresh_sources is not None:
            sources = dict(self.fresh_sources)
        else:
            sources = {rank: 0 for rank in range(1, world_size)} if self.fresh_from_rank0 else {}
        return StatePlan(Source.FRESH, step=0, sources=sources, init_sync=self.init_sync,
                         local_shards=self.local_shards)


def heal(plan: StatePlan, info: DistInfo, wire: Wire, capture: Callable[[], Any],
         load: Callable[[Any], None], recent: Callable[[], Any], load_recent: Callable[[Any], None]) -> int:
    """Send or receive the whole state (and the recent batches' record), as ``plan`` says,
    over ``wire`` (:meth:`TrainingWorld.heal_wire`); returns the tensor bytes this rank moved."""
    from checkpoints.tree import iter_tensors

    from .inplace.transfer import recv_state, send_state

    rank, moved = info.rank, 0
    if rank in plan.sources:
        payload = recv_state(plan.sources[rank], wire.device, wire)
        load(payload["state"])
        load_recent(payload["recent"])
        moved = sum(t.numel() * t.element_size() for t in iter_tensors(payload["state"]))
    else:
        needy = [r for r, src in sorted(plan.sources.items()) if src == rank]
        if needy:
            payload = {"state": capture(), "recent": recent()}
            for target in needy:
                moved += send_state(payload, target, wire.device, wire)
    return moved


class TrainingWorld(ABC):
    """One recovery path's answer to each moment of the run where the two paths differ."""

    #: A peer stopping after SIGTERM ends this world, so the job resumes from disk: rank 0
    #: writes a snapshot of the step every rank finished even when it does not leave.
    restarts_from_disk: bool = False
    #: This rank runs the script's set-up in a world of its own (a joiner, see
    #: :mod:`elastic.worker_env`); what rank 0 would say for the job is not its to say.
    in_setup_world: bool = False
    #: The script's own default process group, replaced by this world's (for the start-up line).
    took_group: str | None = None
    #: :meth:`close` leaves the process group for the script's collectives after the loop; it
    #: is left at exit, so the run's DDP must go before it does.
    keeps_group_until_exit: bool = False

    @property
    @abstractmethod
    def round(self) -> int:
        """The agent's rendezvous round this world belongs to (-1: not under ``elastic agent``)."""

    @abstractmethod
    def connect(self) -> DistInfo:
        """The process group this rank starts in."""

    @abstractmethod
    def join(self, min_round: int) -> Joined:
        """The group of the next world (a round from ``min_round`` on, in place); may wait."""

    @abstractmethod
    def plan(self, mine: Holding, info: DistInfo) -> StatePlan:
        """How every rank of the world just joined comes to stand on one step (may be a
        collective among them: a lost member raises)."""

    def incomplete(self, noticed: str) -> int:
        """A member died while the world formed (``noticed``: how): the round the next try
        starts from. A world that cannot form again does not return."""
        raise NotImplementedError(f"{type(self).__name__} cannot form again ({noticed})")

    def formed(self, joined: Joined, reason: str, where: str, at_step: int, seconds: float, note: str,
               is_main: bool) -> None:
        """The world formed and every rank stands on ``at_step`` (``note``: how, in a few words)."""

    def heal_wire(self, sources: Mapping[int, int], info: DistInfo, device: torch.device) -> Wire:
        """What this rank's part in a heal goes over (``sources``: receiver -> sender): the
        world's own group here; a world that can open a group of the heal's own on the
        operator's interface does (:mod:`elastic.inplace.heal_link`)."""
        from .inplace.heal_link import GroupWire, collectives_link

        return GroupWire(device, collectives_link(info.backend))

    def enter_loop(self, local_rank: int, waiting: Callable[[], ContextManager[None]]) -> bool:
        """At the loop's first batch: a joiner leaves its set-up world for the one that trains
        (``waiting``: around a wait for the agent's offer). True: the run forms that world."""
        return False

    def replaced_by(self) -> int | None:
        """A newer round that replaces this world: the step about to start is abandoned."""
        return None

    @abstractmethod
    def control_value(self, agree_stop: bool, world_size: int) -> int | None:
        """What this rank puts in the step's control all-reduce (MAX), or None when the
        step needs none (``agree_stop``: a SIGTERM must be agreed on across the ranks)."""

    def stepped(self, step: int) -> None:
        """``step`` was applied on this rank."""

    def offers(self, ready: int) -> bool:
        """The control all-reduce agreed on ``ready``: a world to switch to at the boundary."""
        return False

    @abstractmethod
    def lost_peer(self, step: int, noticed: str, user_collective: str, where: str) -> int:
        """Step ``step`` was abandoned because a collective failed (``noticed``: how, in a
        few words; ``user_collective``: the script's own collective that failed, if it was
        one). The round the next world forms from, or do not return."""

    @abstractmethod
    def peers_stopped(self, step: int, said: str, leavers: list[int], broke: str, where: str, is_main: bool,
                      close: Callable[[], None], stop_signal: Callable[[], int | None]) -> int:
        """Ranks ``leavers`` stopped after ``step`` (SIGTERM on their node) and this one goes
        on (``broke``: the collective error, if the world broke as they stopped). The round
        the next world forms from, or do not return (``close``: the run's; ``stop_signal``:
        the signal this rank got meanwhile, if any)."""

    @abstractmethod
    def close(self) -> None:
        """The run is over: leave (or hand back) the process group."""


__all__ = ["Holding", "Joined", "Source", "StatePlan", "TrainingWorld", "heal"]
