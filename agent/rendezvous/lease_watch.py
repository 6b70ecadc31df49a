"""This node's verdict on its own lease, kept current: the I/O around :mod:`.lease_clock`.

It runs this node's witness (peers ask it how our keep-alives fare) and, while our own
keep-alives fail, asks a bounded set of the current round's members in the background (the
stewards and a few spread around the round: :mod:`.vouchers`, O(1) whatever the round's size). The
rendezvous calls :meth:`LeaseWatch.verdict` on every ``restart_reason`` (every monitor
tick): a pure judgement over what is already in memory, logged once per change.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Mapping

from agent.rendezvous import ticker
from agent.rendezvous.lease_clock import Verdict, deadline, judge, outage_proven_at, should_ask
from agent.rendezvous.registry import NodeLease
from agent.rendezvous.signing import StateSigner
from agent.rendezvous.witness import PeerAsker, WitnessServer

log = logging.getLogger(__name__)


class LeaseWatch:
    def __init__(self, node: str, lease: NodeLease, signer: StateSigner) -> None:
        self.node, self.lease, self.signer = node, lease, signer
        self.asker = PeerAsker(signer, timeout=min(0.5, lease.ttl / 8))
        self.server: WitnessServer | None = None
        self.verdict_now = Verdict.HELD
        self.outage_proven: float | None = None  # the last proof of the outage this node trains through
        self.detail = ""  # why the node was judged cut off, for the agent's log line
        self._duty: ticker.Duty | None = None

    def start(self, advertise_host: str | None, peers: Callable[[], Mapping[str, str | None] | None]) -> str:
        """Serve our witness; ask ``peers()`` (the round's members this node weighs, from
        :func:`.vouchers.vouchers` -> witness address, None outside a round) while our
        keep-alives fail. Returns the witness address."""
        self.server = WitnessServer(self.node, self.signer, self.lease.clock).start()
        self._duty = ticker.shared().every(max(0.05, self.lease.ttl / 16), lambda: self._ask_while_failing(peers))
        return f"{advertise_host or '127.0.0.1'}:{self.server.port}"

    def _ask_while_failing(self, peers: Callable[[], Mapping[str, str | None] | None]) -> None:
        """On the process's ticker (:mod:`.ticker`); never blocks: the questions go in the background."""
        if should_ask(self.lease.clock(), time.monotonic(), self.asker.last_asked):
            addrs = peers()
            if addrs:
                self.asker.ask_all(addrs)

    def seconds_to_deadline(self) -> float | None:
        """While keep-alives fail: how long until the lease must have been judged."""
        clock = self.lease.clock()
        due = deadline(clock, self.outage_proven)
        if clock.failing_since is None or due is None:
            return None
        return max(0.0, due - time.monotonic())

    def past_deadline(self) -> bool:
        due = deadline(self.lease.clock(), self.outage_proven)
        return due is not None and time.monotonic() >= due

    def verdict(self, peers: list[str]) -> Verdict:
        """:func:`.lease_clock.judge` over what is known now; each change is logged once."""
        clock, words, now = self.lease.clock(), self.asker.words(), time.monotonic()
        if clock.failing_since is None:
            self.outage_proven = None  # a keep-alive got through: the own clock counts again
        verdict = judge(clock, now, peers, words, self.outage_proven)
        if verdict is Verdict.OUTAGE:
            proven = outage_proven_at(clock, peers, words)
            self.outage_proven = max(self.outage_proven or proven or 0.0, proven or 0.0)
        if verdict is self.verdict_now:
            return verdict
        age = clock.age(now) or 0.0
        if verdict is Verdict.OUTAGE:
            log.warning("[%s] no etcd keep-alive confirmed for %.1f s, and none of the %d round member(s) it "
                        "asked reaches etcd either: etcd is down for everyone; training goes on (etcd extends every "
                        "lease when it returns)", self.node, age, len(peers))
        elif verdict is Verdict.CUT_OFF:
            said = ", ".join(f"{p}: " + ("no answer" if p not in words else
                                        "fails too" if words[p].failing else "reaches etcd") for p in peers)
            self.detail = (f"no etcd keep-alive confirmed for {age:.1f} s (lease TTL {self.lease.ttl} s) and the "
                           f"round's members do not confirm an etcd outage ({said or 'no other member'}): this node "
                           "is cut off from etcd; its workers stop before etcd can expire its lease")
            log.warning("[%s] %s", self.node, self.detail)
        elif self.verdict_now is Verdict.OUTAGE:
            log.info("[%s] etcd confirms keep-alives again; the outage is over", self.node)
        self.verdict_now = verdict
        return verdict

    def close(self) -> None:
        if self._duty is not None:
            self._duty.cancel()
        if self.server is not None:
            self.server.close()
