"""A frozen peer written off in well under its lease TTL, and a thawed node that knows it was.

A SIGSTOPped node (a VM pause, a kernel stall, ``kill -STOP``) fails no collective: the
survivors' gloo waits for it, and its etcd lease runs out only after the TTL. Its kernel
still completes TCP connects to its listening sockets, so a connect probe says "reachable";
only an application-level answer tells a frozen agent from a live one.

**Survivor side.** An in-place worker whose step waits beyond its own pace says so in its
status (``stalled``, :mod:`elastic.inplace.stall`): "slow" at 0.4 of its limit, "stuck" at
the limit. At "slow" the agent asks every other member's witness
(:mod:`elastic.rendezvous.witness`, a signed nonce question) at once, in the background; at
"stuck" it judges: a live agent answers in milliseconds, a frozen one never, and each peer
gets at least ``ANSWER_TIMEOUT_S`` (asked early, the verdict usually waits for nothing).
Those that did not answer are written off: a :class:`ReachReport` for the current round
names them (``unreachable`` and ``frozen``), and the agent opens a new round at once. Every
closer of that round leaves them out (:func:`elastic.rendezvous.keepout.choose_kept_out`),
exactly as for a node its peers cannot reach, so the decision is the same whoever closes.

Guard: only a node that holds its own lease (a recent confirmed keep-alive) judges, and in
a round of three or more only if some other peer answered it: a node that is itself cut
off hears nobody, and must not evict the others (its own-clock fence stops it instead).

**Thawed side.** Each look, the agent checks whether a report names its node frozen in its
current round: then its workers belong to a world that went on without them, whatever its
lease says (a freeze shorter than the TTL leaves it alive). The agent stops them at once
and joins again after the keep-out back-off, healed from a live replica. A stale rank 0
cannot commit meanwhile: the new world raised the snapshot directory's fence.

``ELASTIC_FREEZE_PROBE=0`` turns the survivor side off (a freeze then costs the lease TTL,
which is the benchmark's anchor).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from elastic import contract
from elastic.etcd import EtcdError
from elastic.etcd.mirror import Entry
from elastic.inplace.channel import AgentChannel
from elastic.inplace.stall import STUCK
from elastic.rendezvous.handler import EtcdV3RendezvousHandler
from elastic.rendezvous.keepout import ReachReport, choose_kept_out
from elastic.rendezvous.witness import ask

log = logging.getLogger("elastic.agent")

PROBE_ENV = contract.FREEZE_PROBE_ENV
ANSWER_TIMEOUT_S = 0.3  # a live agent answers in ms, even on a loaded 2-core machine
OWN_LEASE_FRESH = 0.5  # judge only with a keep-alive confirmed within this fraction of the TTL


def probe_enabled(env: Mapping[str, str] | None = None) -> bool:
    return (os.environ if env is None else env).get(PROBE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def frozen_verdict(answered: Mapping[str, bool]) -> list[str]:
    """The peers to write off, given which of a round's other members answered.

    Nobody if all answered; nobody if none did in a round with two or more other members
    (then this node is the likelier one cut off); in a round of two the lone peer's silence
    is enough (the caller holds its own lease, so it is not the one frozen).
    """
    silent = sorted(n for n, ok in answered.items() if not ok)
    if len(answered) >= 2 and len(silent) == len(answered):
        return []
    return silent


class Questions:
    """One question to each peer's witness, all asked at once in the background.

    A peer with no witness address counts as answering: what is not known is never a
    reason to evict."""

    def __init__(self, witnesses: Mapping[str, str | None], signer: object, timeout: float) -> None:
        self.asked_at, self.timeout = time.monotonic(), timeout
        self._answered: dict[str, bool] = {n: True for n, addr in witnesses.items() if not addr}
        self.peers = dict(witnesses)
        self._nodes = list(witnesses)
        self._done = threading.Condition()
        for node, addr in witnesses.items():
            if addr:
                threading.Thread(target=self._ask, args=(node, addr, signer), name="elastic-freeze-ask",
                                 daemon=True).start()

    def _ask(self, node: str, addr: str, signer: object) -> None:
        ok = ask(addr, node, signer, self.timeout) is not None  # type: ignore[arg-type]
        with self._done:
            self._answered[node] = ok
            self._done.notify_all()

    def answers(self) -> dict[str, bool]:
        """node -> answered; waits until every peer answered or had ``timeout`` to."""
        with self._done:
            while len(self._answered) < len(self._nodes):
                left = self.asked_at + self.timeout - time.monotonic()
                if left <= 0:
                    break
                self._done.wait(left)
            return {n: self._answered.get(n, False) for n in self._nodes}


def written_off_by(node: str, participants: Sequence[str], reports: Iterable[ReachReport]) -> list[str]:
    """The peers that wrote ``node`` off as frozen, if the reports leave it out of the next
    round; else none. Not "some report names it": cut apart from a live peer, both sides name
    each other, and only the one :func:`choose_kept_out` picks (the same on every node) is out."""
    reports = list(reports)
    by = sorted(r.node for r in reports if node in r.frozen and r.node != node)
    return by if by and node in choose_kept_out(participants, reports) else []


@dataclass(frozen=True)
class Frozen:
    """Peers written off as frozen, and what the log line says about it."""

    nodes: tuple[str, ...]
    detail: str


class FreezeWatch:
    def __init__(self, node: str, handler: EtcdV3RendezvousHandler, channel: AgentChannel,
                 timeout: float = ANSWER_TIMEOUT_S, enabled: bool | None = None) -> None:
        self.node, self.handler, self.channel, self.timeout = node, handler, channel, timeout
        self.enabled = probe_enabled() if enabled is None else enabled
        self._seen: set[tuple[int, int, int, int]] = set()  # (pid, round, step, level) already acted on
        self._questions: tuple[tuple[int, int], Questions] | None = None  # (round, step) and its questions

    # ------------------------------------------------------------------ survivor side

    def look(self, pids: Mapping[int, int], round_number: int, participants: tuple[str, ...]) -> Frozen | None:
        """On a local worker's new report: "slow", ask the round's other members; "stuck",
        write off those that did not answer. None if nothing was written off."""
        if not self.enabled or len(participants) < 2 or self.node not in participants:
            return None
        fresh = []
        for rank, pid in pids.items():
            status = self.channel.status(rank)
            if status is None or status.pid != pid or not status.stalled or status.round != round_number:
                continue
            key = (pid, status.round, status.step, status.stalled)
            if key not in self._seen:
                self._seen = {k for k in self._seen if k[1] == round_number} | {key}  # older rounds: done with
                fresh.append((rank, status))
        if not fresh:
            return None
        rank, status = max(fresh, key=lambda found: found[1].stalled)
        step = (status.round, status.step)
        if self._questions is None or self._questions[0] != step:
            records = self.handler.node_records()
            peers = {n: (records[n].witness_addr if n in records else None) for n in participants if n != self.node}
            self._questions = (step, Questions(peers, self.handler.signer, self.timeout))
        if status.stalled < STUCK or not self._holds_lease():
            return None
        questions = self._questions[1]
        frozen = frozen_verdict(questions.answers())
        if not frozen and questions.asked_at < time.monotonic() - self.timeout:  # all answered, a while ago:
            questions = Questions(questions.peers, self.handler.signer, self.timeout)  # one may have frozen since
            frozen = frozen_verdict(questions.answers())
        asked = questions.asked_at
        last = status.extra.get("last_step_at") if isinstance(status.extra, dict) else None
        waited = f"{time.time() - last:.2f} s" if isinstance(last, (int, float)) else "?"
        if not frozen:
            log.debug("[%s] local rank %d's step %d is slow (%s), but every peer's agent answered", self.node, rank,
                      status.step + 1, waited)
            return None
        if not self.handler.reachability.record(ReachReport(self.node, round_number, tuple(frozen), tuple(frozen))):
            return None
        its = "its" if len(frozen) == 1 else "their"
        log.info("[%s] %s frozen: %s agent did not answer within %g s while local rank %d's step %d waited; "
                 "detected %s after the last step (asked %.2f s before); written off in round %d, not waiting for "
                 "%s etcd lease", self.node, ", ".join(frozen), its, self.timeout, rank, status.step + 1, waited,
                 time.monotonic() - asked, round_number, its)
        return Frozen(tuple(frozen), f"{', '.join(frozen)} frozen ({its} agent did not answer)")

    def _holds_lease(self) -> bool:
        lease = self.handler.lease
        if lease.suspect_lost():
            return False
        age = lease.clock().age(time.monotonic())
        return age is not None and age < OWN_LEASE_FRESH * lease.ttl

    # ------------------------------------------------------------------ thawed side

    def written_off(self, round_number: int, participants: tuple[str, ...], fresh: bool = False) -> str | None:
        """Why this node's workers are stale (its peers wrote it off as frozen in its current
        round, and the reports leave it out as every closer reads them), or None. ``fresh``:
        read etcd rather than the mirror, which may still lag just after a thaw, when a stale
        worker's failed collective already asks for a new round."""
        if round_number < 0 or self.node not in participants:
            return None
        entries: Mapping[str, object] = self.handler.mirror.entries()[0]
        if fresh and self.handler.mirror.healthy:  # etcd answers: no request may wait on an outage
            prefix = self.handler.reachability.reach_prefix
            try:
                reply = self.handler.client.call(lambda c: c.get_prefix_response(prefix), deadline=1.0)
                entries = {kv.key.decode(): Entry(kv.value, kv.mod_revision, kv.create_revision, kv.lease)
                           for kv in reply.kvs}
            except EtcdError as exc:
                log.debug("[%s] cannot read the reach reports: %s", self.node, exc)
        by = written_off_by(self.node, participants, self.handler.reachability.reports(entries, round_number))
        if not by:
            return None
        return (f"its peers ({', '.join(by)}) wrote it off in round {round_number}: its agent did not answer them "
                "while a step waited (it was frozen, or cut off from them); its workers are stale")
