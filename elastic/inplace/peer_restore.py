"""A world standing on one step from peer memory: what each rank reports, and the moves.

Each rank of the new world reports what it holds (:func:`holding`: its position in the world
before, its live step, its own copies' steps, the copies it keeps), every rank gathers every
report (:func:`gather`, one all-gather of a few integers), and :func:`.copy_plan.by_position`
picks the step and, for each old position, the rank that holds it. :func:`regather` then moves
the state: each rank of the new world gathers its new rows of every parameter and of its
optimizer state (and the buffers of the position it takes) from whichever rank holds them,
every send and receive posted at once. Nothing here touches the model: the caller loads what
it gets (after :func:`.fsdp_private.reshard` where the rank's cut changed).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from .copy_plan import LIVE, OWN, CopyPlan, Holding
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


def gather(mine: Holding, world_size: int, device: torch.device | None = None, group: Any = None) -> list[Holding]:
    """Every rank's report, in rank order (a collective)."""
    t = torch.tensor(encode(mine), dtype=torch.int64, device=device)
    rows = [torch.zeros_like(t) for _ in range(world_size)]
    dist.all_gather(rows, t, group=group)
    return [decode(r.tolist()) for r in rows]


def _copy_of(copies: PeerCopies, kind: str, position: int, step: int) -> Copy:
    pool = [copies.own, copies.own_prev] if kind == OWN else [*copies.held.values(), *copies.held_prev.values()]
    for c in pool:
        if c is not None and c.step == step and (kind == OWN or c.rank == position):
            return c
    raise LookupError(f"no {kind} copy of rank {position} at step {step} here")  # the plan said there was: a bug


def _payload(copies: PeerCopies, kind: str, position: int, step: int, capture_live: Callable[[], Any]) -> Any:
    return host_copy(capture_live())[0] if kind == LIVE else _copy_of(copies, kind, position, step).payload


def regather(decided: CopyPlan, copies: PeerCopies, me: int, ranks: Sequence[int], before: int,
             names: Sequence[str], lengths: Mapping[str, int], capture_live: Callable[[], Any],
             group: Any = None) -> dict[str, Any]:
    """A world of another size from memory: each rank gathers its new rows of every parameter
    and of its optimizer state from whichever rank holds the positions that had them.

    ``decided``: :func:`.copy_plan.by_position` (sources keyed by old position, ranks as
    indices into ``ranks``, the new world's global ranks in order); ``me``: this rank's
    index; ``names``: the model's parameter names in the optimizer's order; ``lengths``:
    each parameter's global first dimension. Returns this rank's new state, as a copy's
    ``state`` (model and optimizer local tensors of the new cut; the rest of the run's state
    as the first position had it, with its ``recent`` batches' record when its payload had
    one), for :func:`.hsdp.load_local` after :func:`.fsdp_private.reshard`. The model's
    buffers (every entry of its state that is not a parameter: FSDP2 leaves each rank its
    own, whole) come whole from one position's state: :func:`.copy_plan.buffers_of`."""
    from .copy_plan import buffers_of, pieces, rows

    after = len(ranks)
    whose_buffers = buffers_of(decided, before, after)
    mine = sorted(p for p, src in decided.sources.items() if src.rank == me)
    payloads = {p: _payload(copies, decided.sources[p].kind, p, decided.step, capture_live) for p in mine}
    states = {p: payloads[p]["state"] for p in mine}
    sends: dict[int, Any] = {}
    for target in range(after):
        parts: dict[int, Any] = {}
        for p in mine:
            model, optimizer = states[p]["model"], states[p]["optimizer"]
            cut_model, cut_state = {}, {}
            for index, name in enumerate(names):
                start = rows(lengths[name], before)[p][0]
                wanted = [(a - start, b - start) for q, a, b in pieces(lengths[name], before, after, target) if q == p]
                lo, hi = wanted[0] if wanted else (0, 0)
                cut_model[name] = model[name][lo:hi]
                held = optimizer["state"].get(index, {})
                cut_state[index] = {k: (v[lo:hi] if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                                    for k, v in held.items()}
            parts[p] = {"model": cut_model, "optimizer": cut_state}
            if whose_buffers[target] == p:
                parts[p]["buffers"] = {k: v for k, v in model.items() if k not in lengths}
            if p == 0:
                parts[p]["rest"] = {k: v for k, v in states[p].items() if k not in ("model", "optimizer")}
                if "recent" in payloads[p]:  # the recent batches' record, as of the step (exactly-once)
                    parts[p]["rest"]["recent"] = payloads[p]["recent"]
                parts[p]["param_groups"] = optimizer["param_groups"]
        if parts:
            sends[ranks[target]] = parts
    sources = sorted({src.rank for src in decided.sources.values()})
    local = sends.pop(ranks[me], None)
    received = exchange(sends, [ranks[s] for s in sources if s != me], group)
    if local is not None:
        received[ranks[me]] = local
    by_position = {p: part for parts in received.values() for p, part in parts.items()}
    model_state: dict[str, Any] = {}
    optimizer_state: dict[int, dict[str, Any]] = {}
    for index, name in enumerate(names):
        needed = [q for q, _, _ in pieces(lengths[name], before, after, me)]
        any_part = by_position[needed[0] if needed else 0]
        model_state[name] = torch.cat([by_position[q]["model"][name] for q in needed]) if needed \
            else any_part["model"][name]
        entry: dict[str, Any] = {}
        for k, v in any_part["optimizer"].get(index, {}).items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                entry[k] = torch.cat([by_position[q]["optimizer"][index][k] for q in needed]) if needed else v
            else:
                entry[k] = v
        if entry:
            optimizer_state[index] = entry
    model_state.update(by_position[whose_buffers[me]]["buffers"])
    first = by_position[0]
    return {"model": model_state, "optimizer": {"state": optimizer_state, "param_groups": first["param_groups"]},
            **first["rest"]}


__all__ = ["MAX_HELD", "decode", "encode", "gather", "holding", "regather"]
