"""Who to keep out of the next round when a round failed because members cannot reach each other.

A node cut from its peers but not from etcd keeps its lease: etcd lists it, so every new
round would include it and fail again, forever. So when a round fails while every lease
holds, each member probes the others (a TCP connect to each one's round store) and
writes what it could not reach (:class:`ReachReport`, one etcd key per node). The next
round leaves out the fewest nodes that make the rest fully connected
(:func:`choose_kept_out`), so after at most two failed rounds the job trains again without
the unreachable node. The node itself stays out for a back-off that doubles each time it
is kept out again (:func:`backoff`), and comes back only once it can reach its peers.

Pure: every function here is a unit test away from being checked.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

BACKOFF_BASE_S = 5.0
BACKOFF_CAP_S = 300.0
STRIKES_FORGOTTEN_AFTER_S = 600.0  # a node back in for this long starts again from the base back-off


@dataclass(frozen=True)
class ReachReport:
    """After ``round`` failed, ``node`` could not reach ``unreachable`` (a connect timed out
    or the route failed; a refused connect is a dead agent, which its lease deals with).

    ``frozen``: those of ``unreachable`` whose agent did not answer its witness while a
    collective waited on them (a SIGSTOPped node's kernel accepts the connect and nothing
    answers: ``agent/node/freeze.py``); such a node, thawed, knows its workers are stale at once,
    whatever its lease says.

    ``lease``: the lease its writer holds the key under, signed with the rest, so the same
    bytes put back later (without a lease, or under another) are stale (:mod:`.freshness`)."""

    node: str
    round: int
    unreachable: tuple[str, ...] = ()
    frozen: tuple[str, ...] = ()
    lease: int = 0

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "ReachReport":
        """Raises ValueError on anything that is not a report :meth:`to_json` wrote."""
        data = _object(raw)
        node, number = data.get("node"), data.get("round")
        if not isinstance(node, str) or not isinstance(number, int) or isinstance(number, bool):
            raise ValueError(f"not a reach report: node {node!r:.40}, round {number!r:.40}")
        return cls(node, number, _names(data.get("unreachable", [])), _names(data.get("frozen", [])),
                   _lease(data.get("lease", 0)))


@dataclass(frozen=True)
class KeepOut:
    """What a kept-out node says about itself (its ``keepout`` key, under its own lease).

    ``unreachable``: the peers it cannot reach; ``cause``: why else it stays out (its
    workers fail right after every start, ``agent.node.policy``'s crash loop); ``round``: the round
    it went out of (the one it was left out of, or, in a crash loop, the one it was in), so a
    member does not stop for a keep-out of an earlier round put back; ``lease``: the lease it
    holds the key under, signed, so a replay of these bytes is stale (:mod:`.freshness`)."""

    node: str
    strikes: int
    backoff: float
    unreachable: tuple[str, ...] = ()
    cause: str = ""
    lease: int = 0
    round: int = -1

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "KeepOut":
        """Raises ValueError on anything that is not a keep-out :meth:`to_json` wrote."""
        data = _object(raw)
        node, strikes, back = data.get("node"), data.get("strikes"), data.get("backoff")
        if (not isinstance(node, str) or not isinstance(strikes, int) or isinstance(strikes, bool)
                or not isinstance(back, (int, float)) or isinstance(back, bool) or not 0 <= back < 1e300):
            raise ValueError(f"not a keep-out: node {node!r:.40}, strikes {strikes!r:.40}, backoff {back!r:.40}")
        cause = data.get("cause", "")
        if not isinstance(cause, str):
            raise ValueError(f"not a keep-out: cause {cause!r:.40}")
        number = data.get("round", -1)
        if not isinstance(number, int) or isinstance(number, bool) or number < -1:
            raise ValueError(f"not a keep-out: round {number!r:.40}")
        return cls(node, strikes, float(back), _names(data.get("unreachable", [])), cause,
                   _lease(data.get("lease", 0)), number)

    def describe(self) -> str:
        cut = f"; cannot reach {', '.join(self.unreachable)}" if self.unreachable else ""
        why = f"; {self.cause}" if self.cause else ""
        return f"kept out: back-off {self.backoff:.0f} s (strike {self.strikes}){cut}{why}"


def _object(raw: bytes) -> dict:
    try:
        data = json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    return data


def _lease(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**64:
        raise ValueError(f"{value!r:.40} is not a lease id")
    return value


def _names(value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
        raise ValueError(f"{value!r:.60} is not a list of node names")
    return tuple(value)


def broken_pairs(participants: Sequence[str], reports: Iterable[ReachReport]) -> set[frozenset[str]]:
    """Pairs of participants of which at least one could not reach the other."""
    members = set(participants)
    pairs: set[frozenset[str]] = set()
    for report in reports:
        if report.node not in members:
            continue
        for other in report.unreachable:
            if other in members and other != report.node:
                pairs.add(frozenset((report.node, other)))
    return pairs


def choose_kept_out(participants: Sequence[str], reports: Iterable[ReachReport]) -> set[str]:
    """The nodes to leave out so that every remaining pair reached each other.

    Greedy, and the same on every node: repeatedly remove the node in the most broken
    pairs; on a tie, the one more members reported unreachable (a reporter is less
    suspect than the node it could not reach); then the later one in round order (rank
    0 stays). Never removes the last node.
    """
    reports = list(reports)
    if not reports:  # the usual case, asked by every member at every look of a join: no work per member
        return set()
    pairs = broken_pairs(participants, reports)
    if not pairs:
        return set()
    reported = {n: sum(1 for r in reports if r.node in participants and n in r.unreachable) for n in participants}
    order = {n: i for i, n in enumerate(participants)}
    kept = set(participants)
    removed: set[str] = set()
    while len(kept) > 1:
        live = [p for p in pairs if p <= kept]
        if not live:
            break
        degree = {n: sum(1 for p in live if n in p) for n in kept}
        worst = max(kept, key=lambda n: (degree[n], reported[n], order[n]))
        kept.discard(worst)
        removed.add(worst)
    return removed


def backoff(strikes: int, base: float = BACKOFF_BASE_S, cap: float = BACKOFF_CAP_S) -> float:
    """How long a node stays out after its ``strikes``-th keep-out: base, 2 x base, ... cap."""
    return min(cap, base * 2 ** max(0, strikes - 1))


def next_strikes(strikes: int, back_for: float | None) -> int:
    """The strike count for a new keep-out, given how long the node has been back since the last."""
    if back_for is not None and back_for >= STRIKES_FORGOTTEN_AFTER_S:
        return 1
    return strikes + 1
