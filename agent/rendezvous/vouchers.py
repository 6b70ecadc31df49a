"""Which members of its round a node with failing keep-alives asks (and whose word it weighs).

:mod:`.lease_clock`'s rule lets a node train through an etcd outage only if *every* peer it
weighs says etcd is gone for it too; any peer that reaches etcd, or does not answer, makes
it cut off. It used to weigh every other member of the round: at N nodes each failing node
opened N-1 connections four times per keep-alive interval, and a late keep-alive on a loaded
machine (1,024 simulated nodes, issue 53) cost ~1,000 connections per node.

:func:`vouchers` bounds that to the round's stewards plus ``spread`` members spread evenly
around the round (at most ``3 + spread``, 11 by default), whatever N. In a round no larger
than that bound it is every other member, exactly the old rule.

What the bound keeps, and what it weakens. The rule exists so that a node cut off from etcd
(whose lease etcd will expire, so that the others re-form without it) stops its workers
before that happens. A bounded set still proves "cut off" in every case the old rule did
*unless* the node and every member it weighs are cut off together while some member it
does not weigh still reaches etcd: then it reads an outage where the old rule read a cut-off.
The set is chosen to make that partition unlikely:

* the **stewards** are in it: they are the ones who open the round without a lost node, so
  while any of them reaches etcd every failing node hears so and stops in time;
* the others are **spread evenly** over the round's ring (offsets about N/spread apart, not
  neighbours), so a rack or switch that drops out together (neighbouring names) does not
  hold them all; each node's set differs, so no single member is asked by everyone but the
  stewards.

The stewards are the exception to O(1): while many keep-alives fail each of the three answers
every failing node (an accept and an HMAC each, on its process's one witness thread), as they
already hear O(N) events a round. The set is fixed when the round is taken (the stewards as
the narrow mirror shows them then): a failing node cannot read etcd for a newer one.

If it does happen (the stewards and ``spread`` members a ring-fraction apart all cut off
with this node, while others reach etcd), the others re-form only after new stewards take
the slots the cut-off ones held (a TTL later), and this node's stale workers cannot go on
with them: their collectives lose the peers that re-formed, and the snapshot fence refuses a
stale round's writes. The old rule had the opposite weakness at scale: with N-1 peers to
hear from, one slow or dead witness among a thousand made a real etcd outage read as
"cut off" on every node.
"""

from __future__ import annotations

from typing import Iterable, Sequence

DEFAULT_SPREAD = 8


def vouchers(members: Sequence[str], node: str, stewards: Iterable[str] = (),
             spread: int = DEFAULT_SPREAD) -> list[str]:
    """The members ``node`` asks while its keep-alives fail: the round's stewards (those in
    ``members``) and ``spread`` others evenly spaced around the ring of ``members`` (in the
    round's order) starting after ``node``; every other member if that is no fewer.
    Deterministic, in ring order after the stewards, without ``node`` or repeats."""
    others = [m for m in members if m != node]
    chosen = [s for s in dict.fromkeys(stewards) if s in set(others)]
    if len(others) <= spread + len(chosen):
        return others
    ring = list(members)
    start = ring.index(node) if node in ring else -1
    n = len(ring)
    taken = set(chosen)
    for j in range(spread):
        # offsets 1, 1 + (n-1)/spread, ...: the next member, then evenly up to the one before us
        offset = 1 + (j * (n - 1)) // spread
        for step in range(n):  # skip ourselves and the stewards already taken: the next free one
            peer = ring[(start + offset + step) % n]
            if peer != node and peer not in taken:
                taken.add(peer)
                chosen.append(peer)
                break
    return chosen
