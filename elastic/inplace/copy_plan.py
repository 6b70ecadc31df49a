"""After a lost node, a world sharded across every node stands on one step from memory: which
step, and where each rank's state comes from.

A rank of a model sharded over a 1-D mesh holds the shards of one *position* (its rank in the
world it trained in). When a node is lost, its positions' state exists only in the host
memory of their buddies (:mod:`.peer_copies`). Each rank of the new world reports what it
holds (:class:`Holding`): the position it trained at and the step its live state stands on,
the steps of its own copies, and the (position, step) of the copies it keeps for others.

:func:`plan` then picks the **highest step every position can stand on** (a survivor's live
state or own copy, or a buddy's copy: both steps of an exchange not known complete are kept,
so a loss during one leaves a step everyone has) and, for each rank of the new world, the
source of the state of the position it takes (:func:`seats`): its own, if it has it, else
whoever holds it. A position whose state is nowhere at any such step (a node lost together
with the node that kept its copies) means no step can be formed from memory: the newest
snapshot, with :func:`lost_together_line` saying why.

:func:`seats` keeps a survivor at its position when the world keeps its size (a spare takes
the lost node's place): its shards stay where they are and only the lost positions are
filled, from their buddies.

Pure: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

LIVE, OWN, HELD = "live", "own", "held"


@dataclass(frozen=True)
class Holding:
    """What one rank of the new world holds as it forms, under FSDP across every node. Not
    :class:`elastic.inplace.agreement.Holding`: no rank holds a replica there, so the plan needs
    the rank it trained at before and the copies it keeps (its own and others'), not one step."""

    rank: int  # in the new world
    position: int | None = None  # the rank it trained at in the world before (None: a newcomer)
    live: int | None = None  # the step its live state stands on (None: it holds none)
    own: tuple[int, ...] = ()  # the steps of its own copies (of ``position``)
    held: tuple[tuple[int, int], ...] = ()  # (position, step) of each copy it keeps for another rank


@dataclass(frozen=True)
class Source:
    kind: str  # LIVE, OWN or HELD
    rank: int  # the rank of the new world that has it


@dataclass(frozen=True)
class CopyPlan:
    step: int  # the step every rank stands on afterwards (-1: none from memory)
    sources: dict[int, Source] = field(default_factory=dict)  # new rank -> where its position's state is
    missing: tuple[int, ...] = ()  # positions held nowhere at any step the others have (step -1)
    trained: dict[int, int] = field(default_factory=dict)  # new rank -> the position it trained at (survivors)

    @property
    def from_memory(self) -> bool:
        return self.step >= 0

    def moves(self) -> dict[int, int]:
        """new rank -> the other rank that sends it its state (a rank that has its own is left out)."""
        return {rank: src.rank for rank, src in self.sources.items() if src.rank != rank}


def seats(positions: Sequence[int | None], world_size: int) -> list[int]:
    """The position each rank of the new world takes (``positions[r]``: the one rank ``r``
    trained at, None for a newcomer). At the same world size, survivors keep theirs and
    newcomers take the free ones in rank order; otherwise (the world shrank or grew, so the
    shards are cut anew) every rank takes its own rank."""
    if len(positions) != world_size:
        return list(range(world_size))
    kept = [p for p in positions if p is not None]
    if len(set(kept)) != len(kept) or any(not 0 <= p < world_size for p in kept):
        return list(range(world_size))
    free = iter(sorted(set(range(world_size)) - set(kept)))
    return [p if p is not None else next(free) for p in positions]


def _candidates(holdings: Sequence[Holding]) -> dict[int, dict[int, list[Source]]]:
    """position -> step -> who has its state at that step, best first (live, own, held)."""
    out: dict[int, dict[int, list[Source]]] = {}
    for h in holdings:
        if h.position is not None and h.live is not None:
            out.setdefault(h.position, {}).setdefault(h.live, []).append(Source(LIVE, h.rank))
        if h.position is not None:
            for step in h.own:
                out.setdefault(h.position, {}).setdefault(step, []).append(Source(OWN, h.rank))
        for position, step in h.held:
            out.setdefault(position, {}).setdefault(step, []).append(Source(HELD, h.rank))
    order = {LIVE: 0, OWN: 1, HELD: 2}
    for by_step in out.values():
        for sources in by_step.values():
            sources.sort(key=lambda s: (order[s.kind], s.rank))
    return out


def plan(holdings: Sequence[Holding], positions: int, seated: Mapping[int, int], by_rank: bool = True) -> CopyPlan:
    """The step and each new rank's source (``positions``: the old world's size; ``seated``:
    new rank -> the position it takes, every position of the old world once)."""
    found = _candidates(holdings)
    missing = tuple(p for p in range(positions) if not found.get(p))
    if missing:
        return CopyPlan(-1, missing=missing)
    common = set.intersection(*(set(found[p]) for p in range(positions)))
    if not common:  # every position has some state, but no one step has them all
        best = max(max(found[p]) for p in range(positions))
        return CopyPlan(-1, missing=tuple(p for p in range(positions) if best not in found[p]))
    step = max(common)
    sources: dict[int, Source] = {}
    trained_at = {h.position: h.rank for h in holdings if h.position is not None}
    for rank, position in sorted(seated.items()):
        here = found[position][step]
        me = rank if by_rank else trained_at.get(position, -1)
        mine = [s for s in here if s.rank == me and s.kind in (LIVE, OWN)]
        sources[rank] = mine[0] if mine else here[0]
    return CopyPlan(step, sources)


def by_position(holdings: Sequence[Holding], positions: int) -> CopyPlan:
    """:func:`plan` for a world of another size, whose ranks each gather a new cut from several
    positions: ``sources`` keyed by **position** of the world before (the rank that trained at
    it first, if it has the state, else whoever holds it)."""
    decided = plan(holdings, positions, {p: p for p in range(positions)}, by_rank=False)
    trained = {h.rank: h.position for h in holdings if h.position is not None}
    return CopyPlan(decided.step, decided.sources, decided.missing, trained)


def buffers_of(decided: CopyPlan, positions: int, world_size: int) -> list[int]:
    """The position whose buffers (BatchNorm's running stats: FSDP2 leaves every rank its own,
    whole) each rank of the new world takes: a survivor keeps its own (as of the plan's step);
    a rank that trained nowhere (a spare, a newcomer) takes, in rank order, those of the
    positions no survivor keeps (the lost ranks'), and position 0's once none is left (a
    world that grew)."""
    kept = set(decided.trained.values())
    free = iter(sorted(set(range(positions)) - kept))
    return [decided.trained[r] if r in decided.trained else next(free, 0) for r in range(world_size)]


def rows(n: int, world: int) -> list[tuple[int, int]]:
    """The rows ``[start, end)`` of a dimension of ``n`` that each of ``world`` ranks holds, as
    FSDP2 cuts it (``torch.chunk``: ``ceil(n / world)`` each, the last ones short or empty)."""
    size = -(-n // world) if n else 0
    return [(min(n, i * size), min(n, (i + 1) * size)) for i in range(world)]


def pieces(n: int, before: int, after: int, rank: int) -> list[tuple[int, int, int]]:
    """What rank ``rank`` of a world of ``after`` needs of a dimension of ``n`` cut over
    ``before``: (position, start, end) in global rows, in row order."""
    lo, hi = rows(n, after)[rank]
    out = []
    for position, (start, end) in enumerate(rows(n, before)):
        a, b = max(lo, start), min(hi, end)
        if a < b:
            out.append((position, a, b))
    return out


def lost_together_line(missing: Sequence[int], node_of: Mapping[int, str], keeper_of: Mapping[int, int]) -> str:
    """Why a world cannot stand on a step from memory, in one line: whose state is gone and
    which node kept its copies (``node_of``: old position -> its node; ``keeper_of``: old
    position -> the position that kept its copy)."""
    lost = sorted({node_of.get(p, "?") for p in missing})
    keepers = sorted({node_of.get(keeper_of[p], "?") for p in missing if p in keeper_of})
    return (f"rank(s) {list(missing)} (node {', '.join(lost)}) exist in no live memory: lost together with node "
            f"{', '.join(keepers) or '?'}, which kept their copies; resuming from the newest snapshot")


__all__ = ["CopyPlan", "HELD", "Holding", "LIVE", "OWN", "Source", "buffers_of", "by_position", "lost_together_line", "pieces",
           "plan", "rows", "seats"]
