"""Is this node's etcd lease still good? Judged by its own clock, and by its peers' word.

etcd expires a lease ``ttl`` seconds after the last keep-alive it received. A node that
cannot reach etcd is never told: its keep-alives just fail. So it must count for itself:
its lease is safe only until ``confirmed + ttl``, where ``confirmed`` is when it *sent* the
last keep-alive etcd confirmed (etcd received it later, so etcd's own deadline is later
still). Past that, its workers must be stopped, or the others (who see the lease expire
and re-form without it) and this node's stale workers could both commit steps.

But etcd can also be down for everyone. Then nobody's lease expires (etcd extends every
lease when it comes back, and nothing can form a new round meanwhile), so stopping would
throw away training for nothing. The two cases look the same from one node, and differ
from its peers': if etcd is merely unreachable from *this* node, the others' keep-alives
still succeed. So a failing node asks members of its round, over a channel that does
not need etcd (:mod:`.witness`), how long ago their last confirmed keep-alive was sent: the
round's stewards and a few members spread around it (:mod:`.vouchers`, every other member
in a round of up to 11; below, "the members" are those), a bounded number at any size.

The rule, :func:`judge`, for a node whose own deadline has passed:

* **outage** (keep training) only if *every* member it asks answered a
  question sent late enough to tell, each says its own keep-alives fail too, and none has
  had one confirmed since this node's began to fail;
* **cut off** (stop the workers) otherwise: a peer that still reaches etcd, a peer that
  cannot be asked (cut off from us too), a round of one, or a keep-alive thread so starved
  that it has not even seen an attempt fail.

"Late enough to tell": a peer that reaches etcd confirms a keep-alive every ``ttl/4``, so
its last confirmation is at most ``ttl/4`` (plus scheduling slack) old. Only an answer to a
question sent more than that after this node's first failure can show that the peer has
confirmed nothing since. The deadline has a margin (``ttl/4``, at most 1 s) so that the
workers are dead before etcd's own deadline even when the agent runs a little late on a
loaded machine, not after.

After an accepted outage, the clock restarts. etcd renews every lease when it returns,
so a lease cannot expire before ``proven + ttl``, where ``proven`` is the last time the
peers proved etcd down for everyone (:func:`outage_proven_at`). When etcd comes back, a
peer may reach it a moment before this node's next keep-alive does; judged from this
node's old deadline, that peer's word alone would cut it off (at a 2 s TTL the next
keep-alive is at most 0.1 s away, but a loaded machine can stretch that). So the deadline
after an accepted outage is the later of the two, and the node has a whole TTL less the
margin from the outage's last proof to reach etcd itself.

Every time is this process's ``time.monotonic()``; a peer's answer carries durations
only, so no two clocks are ever compared.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Collection, Mapping


class Verdict(str, enum.Enum):
    HELD = "held"  # confirmed recently enough: nothing to decide
    OUTAGE = "outage"  # past our deadline, but etcd is down for the whole round: train on
    CUT_OFF = "cut_off"  # past our deadline and not proven an outage: stop the workers


@dataclass(frozen=True)
class LeaseClock:
    """What the keep-alive thread knows: the send time of the last keep-alive etcd confirmed,
    and of the first one that failed after it (None while the last attempt succeeded)."""

    ttl: float
    confirmed_at: float | None
    failing_since: float | None = None

    @property
    def interval(self) -> float:
        return self.ttl / 4

    def age(self, now: float) -> float | None:
        return None if self.confirmed_at is None else now - self.confirmed_at


@dataclass(frozen=True)
class PeerWord:
    """One peer's answer: ``age`` is how long before answering it sent its last confirmed
    keep-alive (None: it has none); ``failing`` whether its latest attempt failed."""

    asked_at: float
    answered_at: float
    age: float | None
    failing: bool


def margin(ttl: float) -> float:
    """How long before etcd could expire the lease this node stops its workers."""
    return min(1.0, ttl / 4)


def deadline(clock: LeaseClock, outage_proven: float | None = None) -> float | None:
    """When, by this node's clock, its workers must be stopped unless an outage is proven;
    ``outage_proven``: the last proof of an outage while this node's keep-alives fail."""
    if clock.confirmed_at is None:
        return None
    due = clock.confirmed_at + clock.ttl - margin(clock.ttl)
    if outage_proven is not None and clock.failing_since is not None:
        due = max(due, outage_proven + clock.ttl - margin(clock.ttl))  # etcd renews every lease on return
    return due


def telling_after(clock: LeaseClock) -> float | None:
    """Answers to questions sent after this time can tell an outage from a cut-off."""
    if clock.failing_since is None:
        return None
    slack = clock.interval / 8  # the peer's keep-alive thread running late, a slow etcd reply
    return clock.failing_since + clock.interval + 2 * slack


def lost_etcd_too(clock: LeaseClock, word: PeerWord) -> bool:
    """The peer's keep-alives fail as well, and none succeeded after ours began to fail."""
    after = telling_after(clock)
    if after is None or word.asked_at < after or not word.failing:
        return False
    if word.age is None:
        return True  # it never had a confirmed keep-alive: it certainly had none since
    assert clock.failing_since is not None
    latest_confirmation = word.answered_at - word.age
    return latest_confirmation <= clock.failing_since + clock.interval / 8


def still_reaches_etcd(word: PeerWord, ttl: float) -> bool:
    """Whether a peer that answered can still reach etcd (and so join a round): its
    keep-alives succeed, or have failed only briefly (an etcd leader election). A peer cut
    off from etcd answers too, with a keep-alive older than half a TTL."""
    return not word.failing or (word.age is not None and word.age < ttl / 2)


def proves_outage(clock: LeaseClock, peers: Collection[str], words: Mapping[str, PeerWord]) -> bool:
    """Every member asked (:mod:`.vouchers`) says it lost etcd too, since before our failure."""
    return clock.failing_since is not None and bool(peers) and all(
        p in words and lost_etcd_too(clock, words[p]) for p in peers)


def outage_proven_at(clock: LeaseClock, peers: Collection[str], words: Mapping[str, PeerWord]) -> float | None:
    """The time up to which the peers' words prove etcd down for everyone (the earliest
    question among the proving answers), or None if they do not prove it."""
    if not proves_outage(clock, peers, words):
        return None
    return min(words[p].asked_at for p in peers)


def judge(clock: LeaseClock, now: float, peers: Collection[str], words: Mapping[str, PeerWord],
          outage_proven: float | None = None) -> Verdict:
    """This node's verdict on its own lease; see the module's docstring for the rule.
    ``outage_proven``: the last proof of an accepted outage (:func:`outage_proven_at`)."""
    due = deadline(clock, outage_proven)
    if due is None or now < due:
        return Verdict.HELD
    if proves_outage(clock, peers, words):
        return Verdict.OUTAGE
    return Verdict.CUT_OFF


def should_ask(clock: LeaseClock, now: float, last_asked: float | None) -> bool:
    """Ask the peers while failing, four times per keep-alive interval, so that several
    answers that can tell arrive between :func:`telling_after` and the deadline."""
    if clock.failing_since is None:
        return False
    every = clock.interval / 4
    return last_asked is None or now - last_asked >= every
