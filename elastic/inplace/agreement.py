"""After a re-formation: which step the new world goes on from, and who heals whom.

Every rank reports whether it holds training state and the last step it completed. DDP
keeps ranks within one step of each other: a rank finishes step k only after every rank
contributed its gradients for k, i.e. finished k-1. So when a failure strikes mid-step,
some ranks may have completed step k and others not, and the ones that did hold a
correct step k: their gradient all-reduce completed, with every rank's contribution.

The rule is therefore **roll forward**: the agreed step is the highest any holder
completed; every rank that stands elsewhere (behind it, or fresh) is healed from a holder
of the agreed step, spread over the holders so no one sender carries every transfer.
Nothing completed by a survivor is thrown away. Only when nobody holds state (every
replica gone, or the job's first round) does the world read the newest snapshot on disk.

HSDP (:func:`pair_shards`): a rank holds only its own shards, so a healed rank's source
must be a rank of the same local index on another node. The node's verdict
(:mod:`.node_verdict`) makes a node apply each step on all of its ranks or on none, so a
node that holds the agreed step holds every shard of it.

Pure: no torch, no I/O; the trainer all-gathers the reports and carries the plan out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass(frozen=True)
class Holding:
    """What one rank holds as a world forms: the one record every world's agreement reads
    (``elastic.formation`` re-exports it for :meth:`TrainingWorld.plan`; it lives here because
    this module stays free of torch)."""

    rank: int
    has_state: bool
    step: int  # completed (optimizer) steps; meaningless without state


@dataclass(frozen=True)
class HealPlan:
    step: int  # the step every rank stands on afterwards (-1: decided by the disk)
    sources: dict[int, int] = field(default_factory=dict)  # healed rank -> the rank that sends to it
    from_disk: bool = False

    @property
    def healed(self) -> list[int]:
        return sorted(self.sources)

    def senders(self) -> list[int]:
        return sorted(set(self.sources.values()))


def plan(reports: Sequence[Holding]) -> HealPlan:
    holders = [r for r in reports if r.has_state]
    if not holders:
        return HealPlan(step=-1, from_disk=True)
    agreed = max(r.step for r in holders)
    sources = sorted(r.rank for r in holders if r.step == agreed)
    needy = sorted(r.rank for r in reports if not (r.has_state and r.step == agreed))
    return HealPlan(step=agreed, sources={rank: sources[i % len(sources)] for i, rank in enumerate(needy)})


def pair_shards(plan: HealPlan, reports: Sequence[Holding], local: int) -> HealPlan:
    """``plan`` for HSDP (``local`` ranks per node, one shard each): each healed rank's source
    a holder of the same local rank on another node, spread over them. From disk when some
    local rank has no holder left."""
    if plan.from_disk or not plan.sources:
        return plan
    holders = [r.rank for r in reports if r.has_state and r.step == plan.step]
    if not holders:  # the job's start: rank 0's node holds the fresh state
        holders = list(range(local))
    sources: dict[int, int] = {}
    used: dict[int, int] = {}
    for rank in sorted(r.rank for r in reports if r.rank not in holders):
        same = sorted(h for h in holders if h % local == rank % local)
        if not same:
            return HealPlan(step=-1, from_disk=True)
        turn = used.get(rank % local, 0)
        used[rank % local] = turn + 1
        sources[rank] = same[turn % len(same)]
    return HealPlan(step=plan.step, sources=sources)


def fresh_plan(world_size: int) -> HealPlan:
    """Nobody holds state and no snapshot exists: rank 0's freshly built state is the start."""
    return HealPlan(step=0, sources={rank: 0 for rank in range(1, world_size)})


def encode(holding: Holding) -> list[int]:
    return [holding.rank, int(holding.has_state), holding.step]


def decode(rows: Sequence[Sequence[int]]) -> list[Holding]:
    return [Holding(rank=int(r[0]), has_state=bool(r[1]), step=int(r[2])) for r in rows]
