"""Whether a signed value is current, or an older one put back (a replay).

A signature proves who wrote a value, not when: anyone who can read the prefix can
capture a signed value and put the same bytes back later, without the key. So every
signed value that drives a decision is also bound to what makes it current, and a value
that is signed but stale is ignored with a line, never acted on:

* a key that lives under its writer's lease (``keepout/``, ``reach/``, ``rdzv/join/``,
  ``nodes/``) is current only while it is held by a lease (etcd drops it with the lease);
  a value that names its lease in its signed payload (keep-out, reach report) must also be
  held by that very lease, so bytes put back without one, or under the replayer's own, are
  stale;
* the round record only moves forward: ``(round, open < closed)`` never goes back while a
  node remembers a later one;
* a reach report speaks of one round (its signed ``round``); a chaos command was issued
  after the agent it is meant for started (its signed ``issued_at``).

Pure: each rule is a millisecond unit test (``tests/agent/rendezvous/test_freshness.py``).
"""

from __future__ import annotations

NO_LEASE = 0  # what etcd reports for a key put without a lease


def lease_stale(entry_lease: int, signed_lease: int | None = None) -> str | None:
    """Why a value that must live under its writer's lease is stale, or None if it is current.

    ``entry_lease``: the lease etcd holds the key under (0: none); ``signed_lease``: the lease
    the writer named inside the signed payload (None: the value names none)."""
    if entry_lease == NO_LEASE:
        return "held by no lease (its writer puts it under its lease: an older value put back, a replay)"
    if signed_lease is not None and signed_lease != entry_lease:
        return (f"held by lease {entry_lease:x}, not by {signed_lease:x} that its writer signed "
                "(an older value put back, a replay)")
    return None


def round_order(round_number: int, closed: bool) -> tuple[int, int]:
    """Where a round record stands in the protocol's order: open r < closed r < open r+1."""
    return (round_number, 1 if closed else 0)


def round_stale(seen: tuple[int, int] | None, candidate: tuple[int, int]) -> bool:
    """True if a round record at ``candidate`` is older than one this node already saw."""
    return seen is not None and candidate < seen
