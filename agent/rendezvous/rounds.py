"""The round protocol's pure decisions: when to close a round, and who gets which rank.

Kept free of etcd and threads so every rule is a unit test away from being checked.

A round is ``open`` while nodes join it and ``closed`` once its participants are fixed.
Closing a round is a race every joined node may run; a transaction on the round record
lets exactly one win.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Collection, Iterable, Mapping, TypeGuard

from agent.rendezvous.states import NodeState, RoundCause

OPEN, CLOSED = "open", "closed"
JOIN, FAILURE = RoundCause.JOIN.value, RoundCause.FAILURE.value  # why a round was opened: a node arriving, or a broken world
ON_THEIR_WAY = frozenset({NodeState.STOPPING.value, NodeState.RENDEZVOUS.value})  # states of nodes heading to the next round


@dataclass(frozen=True)
class RoundRecord:
    round: int
    state: str
    participants: tuple[str, ...] = ()
    previous: tuple[str, ...] = ()  # the last closed round's participants, for stable ranks
    opened_at: float = field(default_factory=time.time)
    closed_at: float | None = None
    cause: str = JOIN  # in place, survivors interrupt their collectives only for a broken world
    # In place: the participants whose workers ran in place when the round closed (they
    # hold state, or are starting and will take the round's offer). Read once, by the node
    # that closed it, so that every member decides alike whether the round forms in place
    # (workers that go on take its offer, new ones start in set-up worlds of their own and
    # join through it) or afresh (every member starts its workers anew, as torchrun does):
    # two agents reading the registry a moment apart once chose differently, and each
    # waited for the other's kind of start.
    in_place: tuple[str, ...] = ()
    # The members whose lost lease opened this round (a steward saw their leases go,
    # :mod:`.steward`): the other members, who watch only this record and not each peer's
    # key, read from it that a peer was lost rather than that a node arrived.
    lost: tuple[str, ...] = ()
    # Where each participant's witness answers (parallel to ``participants``; "" unknown),
    # written by the closer: a member asks them while its own keep-alives fail, when etcd
    # may no longer answer, so it must hold them before (:mod:`.lease_watch`).
    witnesses: tuple[str, ...] = ()

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "RoundRecord":
        """Raises ValueError on anything that is not a round record :meth:`to_json` wrote
        (callers refuse it: a value that merely parses must not open or close a round)."""
        try:
            data = json.loads(raw)
        except RecursionError:
            raise ValueError("not a round record: nested too deeply") from None
        if not isinstance(data, dict):
            raise ValueError("not a round record: not a JSON object")
        number, state, cause = data.get("round"), data.get("state"), data.get("cause", JOIN)
        if not _is_int(number) or number < 0:
            raise ValueError(f"round {number!r:.40} is not a round number")
        if state not in (OPEN, CLOSED) or cause not in (JOIN, FAILURE):
            raise ValueError(f"unknown round state {state!r:.40} or cause {cause!r:.40}")
        opened_at, closed_at = data.get("opened_at", 0.0), data.get("closed_at")
        if not _is_time(opened_at) or not (closed_at is None or _is_time(closed_at)):
            raise ValueError(f"opened_at {opened_at!r:.40} / closed_at {closed_at!r:.40} are not times")
        participants, in_place = _names(data.get("participants", [])), _names(data.get("in_place", []))
        if not set(in_place) <= set(participants):
            raise ValueError(f"in_place {list(in_place)!r:.60} names nodes outside the round")
        witnesses = _names(data.get("witnesses", []))
        if witnesses and len(witnesses) != len(participants):
            raise ValueError(f"{len(witnesses)} witnesses for {len(participants)} participants")
        return cls(round=number, state=state, participants=participants,
                   previous=_names(data.get("previous", [])), opened_at=float(opened_at),
                   closed_at=None if closed_at is None else float(closed_at), cause=cause, in_place=in_place,
                   lost=_names(data.get("lost", [])), witnesses=witnesses)

    def next_open(self, cause: str = JOIN, lost: Iterable[str] = ()) -> "RoundRecord":
        return RoundRecord(self.round + 1, OPEN, previous=self.participants or self.previous, cause=cause,
                           lost=tuple(lost))

    def closed_with(self, participants: Iterable[str], in_place: Collection[str] = (),
                    witnesses: Mapping[str, str | None] | None = None) -> "RoundRecord":
        """Closed with ``participants``; ``in_place``: those of them whose workers run in place now;
        ``witnesses``: where each one's witness answers, where known."""
        members = tuple(participants)
        addrs = tuple((witnesses or {}).get(n) or "" for n in members) if witnesses is not None else ()
        return RoundRecord(self.round, CLOSED, members, self.previous, self.opened_at, time.time(), self.cause,
                           tuple(n for n in members if n in in_place), self.lost, addrs)

    def witness_of(self) -> dict[str, str | None]:
        """Each participant's witness address (None: unknown)."""
        return {n: (self.witnesses[i] or None) if i < len(self.witnesses) else None
                for i, n in enumerate(self.participants)}

    @property
    def forms_in_place(self) -> bool:
        """Whether workers started now into this round join it in place (a member's workers
        ran in place at its close), rather than forming it afresh with every other member."""
        return bool(self.in_place)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_time(value: object) -> TypeGuard[float]:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and -1e300 < value < 1e300)  # finite, and float() of it cannot overflow


def _names(value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
        raise ValueError(f"{value!r:.60} is not a list of node names")
    return tuple(value)


@dataclass(frozen=True)
class Timings:
    min_nodes: int
    max_nodes: int
    last_call: float  # first round: after min_nodes joined, wait this long for more
    rejoin: float  # later rounds: wait this long for a previous member that is still "running"
    stop_grace: float = 30.0  # ...and this long for one that says it is stopping its workers
    spare_join: float = 1.0  # ...and this long for a spare (or a newcomer) on its way, below --nnodes MAX


def missing_members(record: RoundRecord, joined: Mapping[str, int], live: Mapping[str, str],
                    dead: Collection[str] = ()) -> list[str]:
    """Previous members that still hold a lease, have not joined, and are not proven dead:
    the ones a later round may wait for."""
    return [n for n in record.previous if n in live and n not in joined and n not in dead]


def should_close(
    record: RoundRecord,
    joined: Mapping[str, int],
    live: Mapping[str, str],
    timings: Timings,
    waited: float,
    dead: Collection[str] = (),
    vouched: Collection[str] = (),
) -> bool:
    """Whether an open round may close now.

    ``joined`` maps node -> join revision; ``live`` maps node -> registry state for every
    node holding a lease; ``waited`` is how long min_nodes have been in (first round) or
    how long this node has watched the round open (later rounds); ``dead`` are nodes proven
    dead although their lease has not expired yet (their agent's port refused a connect).

    Later rounds close as soon as every previous member that is alive has joined (and, below
    ``--nnodes MAX``, a spare or newcomer on its way, :func:`arriving`, for ``spare_join``). A
    previous member still marked ``running`` may be dead with its lease not yet expired
    (SIGKILL), or just slow to notice: after a failure it gets ``rejoin`` seconds. One
    marked ``stopping`` or ``rendezvous`` is alive and on its way, so it is waited for (up
    to ``stop_grace``, in case it is wedged). So is a running one in a round opened for a
    join: nothing broke, so it is training and only late to see the round (its watch
    failing over to another etcd member after the leader died, say); closing without it
    would start a world beside the one it trains in. So is a running one in a round that
    follows a failure once its agent ``vouched`` for itself since the round opened (its
    witness answered: alive, reachable, only late; the etcd leader's death delays every
    member's watch). A dead one is still not waited for: the probe proves a SIGKILL, and a
    frozen or unreachable one cannot answer, and leaves ``live`` when its lease expires.
    """
    if len(joined) >= timings.max_nodes:
        return True
    if len(joined) < timings.min_nodes:
        return False
    if not record.previous:
        return waited >= timings.last_call
    missing = missing_members(record, joined, live, dead)
    if not missing:
        return not (len(joined) < timings.max_nodes and waited < timings.spare_join
                    and arriving(record, joined, live, dead))
    if record.cause == JOIN or any(live[n] in ON_THEIR_WAY or n in vouched for n in missing):
        return waited >= timings.stop_grace
    return waited >= timings.rejoin


def arriving(record: RoundRecord, joined: Mapping[str, int], live: Mapping[str, str],
             dead: Collection[str] = ()) -> list[str]:
    """Live nodes that are no previous member and have not joined, but wait to (a spare, whose
    place this round is, or a newcomer in its rendezvous). A round that lost a member closes
    once every live previous member joined, and the survivors can join faster than a spare
    sees the round open: under load a write-off round closed in 0.03 s without the spare, and
    the world shrank for a round before it grew back. So such a round, below ``--nnodes MAX``,
    waits ``spare_join`` for them."""
    on_their_way = (NodeState.SPARE.value, NodeState.RENDEZVOUS.value)
    return [n for n, state in live.items()
            if state in on_their_way and n not in joined and n not in record.previous and n not in dead]


def lost_members(record: RoundRecord, live: Mapping[str, str]) -> list[str]:
    """Members of a closed round whose lease is gone (dead, frozen past the TTL, cut off)."""
    return [n for n in record.participants if n not in live] if record.state == CLOSED else []


def waits_as_spare(record: RoundRecord | None, node: str, max_nodes: int, live: Mapping[str, str]) -> bool:
    """Whether ``node`` is a spare: the current round closed full (``--nnodes MAX``) without it,
    and every member of it still holds its lease.

    A spare opens no round (that would only re-form a full world to leave it out again): it
    waits, joins the next round a member's loss opens, and :func:`rank_order` admits it in
    the lost member's place, so the world keeps its size. Once a member's lease is gone it
    is a spare no longer: it opens that round itself (as a failure), so that a world whose
    every member died still gets its spares.
    """
    return (record is not None and record.state == CLOSED and node not in record.participants
            and len(record.participants) >= max_nodes and not lost_members(record, live))


def rank_order(joined: Mapping[str, int], previous: Iterable[str], max_nodes: int) -> list[str]:
    """Previous members keep their relative order (rank 0 stays rank 0 if it survives),
    newcomers follow in the order they joined."""
    prior = [n for n in previous if n in joined]
    newcomers = sorted((n for n in joined if n not in prior), key=lambda n: (joined[n], n))
    return (prior + newcomers)[:max_nodes]
