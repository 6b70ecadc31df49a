"""A world standing on one step from peer memory: what each rank reports, and the moves.

Each rank of the new world reports what it holds (:func:`holding`: its position in the world
before, its live step, its own copies' steps, the copies it keeps), every rank gathers every
report (:func:`gather`, one all-gather of a few integers), and :func:`.copy_plan.plan` picks
the step and each rank's source. :func:`carry_out` then moves the state: a rank that is
a source sends what the plan names (its live state, its own copy, or a copy it keeps for a
lost rank) to each rank that takes it, every send and receive posted at once
(:func:`.peer_copies.exchange`), and returns what the rank must load (None: its live state
stands already). Nothing here touches the model: the caller loads what it gets (after
:func:`.fsdp_private.reshard` where the rank's cut changed).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from .copy_plan import HELD, LIVE, OWN, CopyPlan, Holding
from .peer_copies import Copy, PeerCopies, exchange, host_copy

MAX_HELD = 8  # (position, step) pairs one rank reports: its copies and the ones before them


def holding(copies: PeerCopies, rank: int, position: int | None, live_step: int | None) -> Holding:
    """What this rank holds, for the plan (``position`` None: a newcomer, holding nothing of its own)."""
    own = tuple(c.step for c in (copies.own, copies.own_prev) if c is not None) if position is not None else ()
    held = tuple((c.rank, c.step) for c in (*copies.held.values(), *copies.held_prev.values()))
    return Holding(rank, position, live_step if position is not None else None, own, held)


def encode(h: Holding) -> list[int]:
    if len(h.own) > 2 or len(h.held) > MAX_HELD:
        raise ValueError(f"rank {h.rank} reports {len(h.own)} own and {len(h.held)} kept copies: more than fit")
    none = -1
    row = [h.rank, none if h.position is None else h.position, none if h.live is None else h.live]
    row += list(h.own) + [none] * (2 - len(h.own))
    for position, step in h.held:
        row += [position, step]
    return row + [none, none] * (MAX_HELD - len(h.held))


def decode(row: Sequence[int]) -> Holding:
    rank, position, live = int(row[0]), int(row[1]), int(row[2])
    own = tuple(int(s) for s in row[3:5] if s >= 0)
    pairs = [(int(row[i]), int(row[i + 1])) for i in range(5, len(row), 2) if row[i] >= 0]
    return Holding(rank, None if position < 0 else position, None if live < 0 else live, own, tuple(pairs))


def gather(mine: Holding, world_size: int, device: torch.device | None = None) -> list[Holding]:
    """Every rank's report, in rank order (a collective)."""
    t = torch.tensor(encode(mine), dtype=torch.int64, device=device)
    rows = [torch.zeros_like(t) for _ in range(world_size)]
    dist.all_gather(rows, t)
    return [decode(r.tolist()) for r in rows]


def _copy_of(copies: PeerCopies, kind: str, position: int, step: int) -> Copy:
    pool = [copies.own, copies.own_prev] if kind == OWN else [*copies.held.values(), *copies.held_prev.values()]
    for c in pool:
        if c is not None and c.step == step and (kind == OWN or c.rank == position):
            return c
    raise LookupError(f"no {kind} copy of rank {position} at step {step} here")  # the plan said there was: a bug


def carry_out(plan: CopyPlan, seated: Mapping[int, int], copies: PeerCopies, rank: int,
              capture_live: Callable[[], Any]) -> Any | None:
    """Send what the plan has this rank send; the payload it must load (None: its live state
    is the plan's already). ``seated``: new rank -> the position it takes."""
    assert plan.from_memory
    sends: dict[int, Any] = {}
    for target, source in sorted(plan.sources.items()):
        if source.rank != rank or target == rank:
            continue
        if source.kind == LIVE:
            sends[target] = host_copy(capture_live())[0]
        else:
            sends[target] = _copy_of(copies, source.kind, seated[target], plan.step).payload
    mine = plan.sources[rank]
    srcs = [mine.rank] if mine.rank != rank else []
    received = exchange(sends, srcs)
    if srcs:
        return received[mine.rank]
    if mine.kind == LIVE:
        return None
    if mine.kind == HELD:  # a rank taking the position whose copy it keeps itself
        return _copy_of(copies, HELD, seated[rank], plan.step).payload
    return _copy_of(copies, OWN, seated[rank], plan.step).payload


__all__ = ["MAX_HELD", "carry_out", "decode", "encode", "gather", "holding"]
