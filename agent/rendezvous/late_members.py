"""Which absent members of a round its closer need not wait for, or should wait for a little.

After a failure, the previous round's members are expected back. One that has not joined
is either dead (its agent's port refuses connects: :class:`.probe.DeathProbe`, not waited
for) or alive but late (its witness answers and it still reaches etcd:
:class:`.witness.PeerAsker`, waited for up to the rejoin timeout). Both questions are asked
in the background; each call answers from what came back so far, so the round loop never
blocks on a peer. Call both once per look at an open round, ``proven_dead`` first.
"""

from __future__ import annotations

from typing import Callable

from agent.rendezvous.lease_clock import still_reaches_etcd
from agent.rendezvous.probe import DeathProbe
from agent.rendezvous.registry import NodeLease, NodeRecord
from agent.rendezvous.rounds import JOIN, RoundRecord, missing_members
from agent.rendezvous.signing import StateSigner
from agent.rendezvous.witness import PeerAsker

_VOUCH_TIMEOUT_S = 0.3  # a late member's witness answers well within the rejoin timeout, or not at all


class LateMembers:
    """``records(entries)`` gives every registered node's record (where its port and witness are);
    ``on_death`` is called from the probe's thread when a member is found dead (to wake the loop)."""

    def __init__(self, signer: StateSigner, lease: NodeLease,
                 records: Callable[[dict], dict[str, NodeRecord]],
                 on_death: Callable[[], None]) -> None:
        self.lease, self._records = lease, records
        self._probe = DeathProbe(on_death=on_death)
        self._vouch = PeerAsker(signer, timeout=_VOUCH_TIMEOUT_S)

    def proven_dead(self, record: RoundRecord, joined: dict[str, int], entries: dict) -> set[str]:
        """Previous members that have not joined and whose agent's port refuses connects."""
        records = self._records(entries)
        missing = {n: records[n].store_addr for n in record.previous if n in records and n not in joined}
        return self._probe.dead(missing) if missing else set()

    def vouched(self, record: RoundRecord, joined: dict[str, int], entries: dict,
                live: dict[str, str], dead: set[str], since: float | None) -> set[str]:
        """Previous members still running, not joined, whose witness answered since the round
        opened and who still reach etcd: alive, only late (asked in the background, so an
        answer is in before the rejoin timeout runs out; a frozen or partitioned agent never
        answers)."""
        if record.cause == JOIN or since is None:
            return set()
        missing = missing_members(record, joined, live, dead)
        if not missing:
            return set()
        words = self._vouch.words()
        vouched = {n for n in missing
                   if n in words and words[n].asked_at >= since and still_reaches_etcd(words[n], self.lease.ttl)}
        records = self._records(entries)
        self._vouch.ask_all({n: records[n].witness_addr if n in records else None
                             for n in missing if n not in vouched})
        return vouched
