"""A frozen peer written off in well under its lease TTL, and a thawed node that knows it was.

A SIGSTOPped node (a VM pause, a kernel stall, ``kill -STOP``) fails no collective: the
survivors' gloo waits for it, and its etcd lease runs out only after the TTL. Its kernel
still completes TCP connects to its listening sockets, so a connect probe says "reachable";
only an application-level answer tells a frozen agent from a live one.

**Survivor side.** An in-place worker whose step waits beyond its own pace says so in its
status (``stalled``, :mod:`elastic.inplace.stall`): "slow" at 0.4 of its limit, "stuck" at
the limit. At "slow" the agent asks every other member's witness
(:mod:`agent.rendezvous.witness`, a signed nonce question) at once, in the background; at
"stuck" it judges: a live agent answers in milliseconds, a frozen one never, and each peer
gets at least ``ANSWER_TIMEOUT_S`` (asked early, the verdict usually waits for nothing).
Those that did not answer are asked once more at once, given :data:`RECHECK_TIMEOUT_S` (late
answers count): one missed question is not a verdict (a live agent on a loaded machine can
miss 0.3 s once; the whole suite wrote off a live node that way twice in one run). Those
silent on both are written off: a :class:`ReachReport` for the current round
names them (``unreachable`` and ``frozen``), and the agent opens a new round at once. Every
closer of that round leaves them out (:func:`agent.rendezvous.keepout.choose_kept_out`),
exactly as for a node its peers cannot reach, so the decision is the same whoever closes.

**A member lost while a join is pending.** A round that adds a node closes before the
survivors switch to it: they train on in their world until the joiner's workers are up. If
a member of that world dies or freezes meanwhile, the survivors' world fails (or is tripped
when stuck), and their join of the new round waits for the lost member's handle, which
never comes; its lease was the only way out. A local worker behind the agent's round whose
world failed although that round removed nobody from it (:func:`waiting_level`) is the
same verdict's trigger: the round's other members are asked at once, and the silent are
written off in it.

**A stall judged alive and then a freeze.** A stuck step whose peers all answered (a slow
peer, a long heal, a join waiting on a joiner still starting) stays stuck; if one of them
freezes then, no new report comes (the worker says "stuck" once per step), and judged once
per stall, such a freeze waited for the lease; so did a verdict skipped because this
node's own keep-alive was not fresh, or refused by etcd (issue 51 item 11: two of four
freezes of a chaos run, 2.95 s and 3.46 s at a 3 s lease). So while the step stays stuck
the agent asks again (:class:`Recheck`, in the background, never blocking its loop), and
writes off a peer only after :data:`RECHECK_MISSES` questions *in a row* went unanswered,
each given :data:`RECHECK_TIMEOUT_S` (late answers count): a live agent busy re-forming
may miss one 0.3 s question (re-asking at every look with one miss enough wrote off such a
live node, dd51539), but not a second of silence; a frozen one misses every question.

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
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

from elastic import contract
from agent.node.channel import AgentChannel
from elastic.inplace.channel import WorkerStatus
from elastic.inplace.stall import STUCK
from agent.rendezvous.keepout import ReachReport, choose_kept_out
from agent.rendezvous.signing import StateSigner
from agent.rendezvous.witness import ask

if TYPE_CHECKING:
    from agent.rendezvous.session import RendezvousSession

log = logging.getLogger("elastic.agent")

ANSWER_TIMEOUT_S = 0.3  # a live agent answers in ms, even on a loaded 2-core machine
OWN_LEASE_FRESH = 0.5  # judge only with a keep-alive confirmed within this fraction of the TTL
RECHECK_TIMEOUT_S = 0.5  # a re-asked question waits this long for a late answer
RECHECK_MISSES = 2  # questions in a row a peer leaves unanswered before a re-judged stall writes it off
RECHECK_EVERY_S = 0.25  # the least time between two re-asks of one stall (a live peer answers in ms)


def probe_enabled(env: Mapping[str, str] | None = None) -> bool:
    return (os.environ if env is None else env).get(contract.FREEZE_PROBE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


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


def missed_in_a_row(before: Mapping[str, int], answered: Mapping[str, bool]) -> dict[str, int]:
    """Each peer's count of questions in a row it left unanswered, after one more question."""
    return {n: 0 if ok else before.get(n, 0) + 1 for n, ok in answered.items()}


def recheck_verdict(missed: Mapping[str, int], answered: Mapping[str, bool], need: int = RECHECK_MISSES) -> list[str]:
    """The peers to write off when a stall judged before is judged again: those silent on the
    latest question (``answered``) that also missed ``need`` questions in a row (``missed``),
    under :func:`frozen_verdict`'s guard (a node that hears none of two or more peers evicts
    nobody). One missed question is not enough here: a live agent busy for a moment (re-forming
    after a kill, on a loaded machine) can miss one, and re-asking gives it that chance again
    and again."""
    return [n for n in frozen_verdict(answered) if missed.get(n, 0) >= need]


def waiting_level(status: WorkerStatus, round_number: int, participants: Sequence[str],
                  worlds: Mapping[int, Sequence[str]]) -> int:
    """How far a local worker waits on a member of the agent's round: 0 not at all, 1 (slow)
    ask the members, 2 (:data:`STUCK`) judge them.

    In the agent's round: its step's own stall level. Behind it, in a world that round only
    adds to (``worlds``: each recent round's members): its world stuck, or failed (a
    request for a new round) although the pending round removed nobody, so a member that
    is also in the pending round is dead or frozen, and the worker's join of that round
    would wait for the member's handle until its lease expires. A failure is judged at
    once: a failed collective is the evidence a stalled step only builds up to. Joining the
    agent's round: how far that join is stalled (a member, the round's store host among
    them, frozen before or during the exchange; :func:`elastic.inplace.stall.join_level`).
    """
    joins = status.state == contract.WorkerState.JOINING and isinstance(status.extra, dict) and status.extra.get("joining") == round_number
    return max(status.stalled if joins else 0, _behind_level(status, round_number, participants, worlds))


def _behind_level(status: WorkerStatus, round_number: int, participants: Sequence[str],
                  worlds: Mapping[int, Sequence[str]]) -> int:
    if status.round == round_number:
        return status.stalled
    world = worlds.get(status.round)
    if not 0 <= status.round < round_number or world is None or not set(world) <= set(participants):
        return 0
    return STUCK if status.want_round_after is not None else status.stalled


class Questions:
    """One question to each peer's witness, all asked at once in the background.

    A peer with no witness address counts as answering: what is not known is never a
    reason to evict."""

    def __init__(self, witnesses: Mapping[str, str | None], signer: StateSigner, timeout: float) -> None:
        self.asked_at, self.timeout = time.monotonic(), timeout
        self._answered: dict[str, bool] = {n: True for n, addr in witnesses.items() if not addr}
        self.peers = dict(witnesses)
        self._nodes = list(witnesses)
        self._done = threading.Condition()
        for node, addr in witnesses.items():
            if addr:
                threading.Thread(target=self._ask, args=(node, addr, signer), name="elastic-freeze-ask",
                                 daemon=True).start()

    def _ask(self, node: str, addr: str, signer: StateSigner) -> None:
        ok = ask(addr, node, signer, self.timeout) is not None
        with self._done:
            self._answered[node] = ok
            self._done.notify_all()

    def done(self) -> bool:
        """Every peer answered, or had ``timeout`` to (never blocks)."""
        with self._done:
            return len(self._answered) >= len(self._nodes) or time.monotonic() >= self.asked_at + self.timeout

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


def written_off_later(node: str, round_number: int,
                      reports: Mapping[int, Iterable[ReachReport]]) -> tuple[int, list[str]] | None:
    """The first round after ``round_number`` (this node's own) in which other nodes wrote
    ``node`` off as frozen, and who: frozen as that round closed, before its agent saw it,
    this node's workers were left behind in the older world while its peers formed a round
    with it and went on without it. Its agent never saw that round, so no report of its own
    round says so; its workers must be stopped all the same (a worker of the old world must
    not rejoin in place, healed or not)."""
    for later in sorted(r for r in reports if r > round_number):
        by = sorted(r.node for r in reports[later] if node in r.frozen and r.node != node)
        if by:
            return later, by
    return None


@dataclass(frozen=True)
class Frozen:
    """Peers found frozen (to write off: :meth:`FreezeWatch.write_off`), and what the log says about it."""

    nodes: tuple[str, ...]
    detail: str
    round: int = -1  # the round they are written off in
    said: str = ""  # the log line once they are


@dataclass
class Recheck:
    """One stall judged before (its peers answered, or the verdict was skipped or refused),
    still stuck: the question in flight and each peer's misses in a row (:func:`recheck_verdict`)."""

    stall: tuple[int, int, int]  # (round, its round, step): FreezeWatch._stall
    questions: Questions | None = None
    missed: dict[str, int] | None = None
    asked_at: float = 0.0  # when the latest question went out (RECHECK_EVERY_S)


class FreezeWatch:
    def __init__(self, node: str, session: "RendezvousSession", channel: AgentChannel,
                 timeout: float = ANSWER_TIMEOUT_S, enabled: bool | None = None) -> None:
        self.node, self.session, self.channel, self.timeout = node, session, channel, timeout
        self.enabled = probe_enabled() if enabled is None else enabled
        self._seen: set[tuple[int, int, int, int, int]] = set()  # (pid, round, its round, step, level) acted on
        self._questions: tuple[tuple[int, int, int], Questions] | None = None  # (round, its round, step): questions
        self._worlds: dict[int, tuple[str, ...]] = {}  # recent rounds' members (waiting_level)
        self._recheck: Recheck | None = None  # a stuck stall judged before, asked about again
        self.recheck_timeout, self.recheck_misses = RECHECK_TIMEOUT_S, RECHECK_MISSES

    # ------------------------------------------------------------------ survivor side

    def look(self, pids: Mapping[int, int], round_number: int, participants: tuple[str, ...]) -> Frozen | None:
        """On a local worker's new report that it waits on the round's members (:func:`waiting_level`):
        "slow", ask the round's other members; "stuck" (or its world failed), write off those
        that did not answer. None if nothing was written off."""
        if not self.enabled or len(participants) < 2 or self.node not in participants:
            return None
        self._worlds[round_number] = tuple(participants)
        for old in [r for r in self._worlds if r < round_number - 8]:
            del self._worlds[old]
        fresh = []
        for rank, pid in pids.items():
            status = self.channel.status(rank)
            if status is None or status.pid != pid:
                continue
            level = waiting_level(status, round_number, participants, self._worlds)
            if not level:
                continue
            key = (pid, round_number, status.round, status.step, level)
            if key not in self._seen:
                self._seen = {k for k in self._seen if k[1] == round_number} | {key}  # older rounds: done with
                fresh.append((rank, status, level))
        if not fresh:
            return self._judge_again(pids, round_number, participants)
        rank, status, level = max(fresh, key=lambda found: found[2])
        step = (round_number, status.round, status.step)
        if self._questions is None or self._questions[0] != step:
            self._questions = (step, Questions(self._peers(participants), self.session.signer, self.timeout))
        if level < STUCK or not self._holds_lease():
            return None
        questions = self._questions[1]
        frozen = frozen_verdict(questions.answers())
        if not frozen and questions.asked_at < time.monotonic() - self.timeout:  # all answered, a while ago:
            questions = Questions(questions.peers, self.session.signer, self.timeout)  # one may have frozen since
            frozen = frozen_verdict(questions.answers())
        if not frozen:
            log.debug("[%s] %s, but every peer's agent answered", self.node, self._while(rank, status, round_number, 1))
            return None
        # One unanswered question is not a verdict: a live agent on a loaded machine can miss
        # 0.3 s once (the suite saw a live keeper and a live FSDP node written off that way).
        # Ask again at once, the late answer counting (RECHECK_TIMEOUT_S); a peer silent on that
        # one too is written off by _judge_again: 2 in a row, as a re-judged stall needs.
        stall = self._stall(status, round_number)
        if self._recheck is None or self._recheck.stall != stall:
            self._recheck = Recheck(stall, missed={n: 1 for n in frozen})
            self._ask_again(self._recheck, participants)
        return None

    def _ask_again(self, again: Recheck, participants: Sequence[str]) -> None:
        """Put the stall's next question to the round's other members (late answers count)."""
        again.questions = Questions(self._peers(participants), self.session.signer, self.recheck_timeout)
        again.asked_at = again.questions.asked_at

    @staticmethod
    def _stall(status: WorkerStatus, round_number: int) -> tuple[int, int, int]:
        """Which stall a judgment is of: the round and the step its workers wait in (any local
        rank's: they wait together)."""
        return round_number, status.round, status.step

    def _judge_again(self, pids: Mapping[int, int], round_number: int, participants: tuple[str, ...]) -> Frozen | None:
        """A stall judged before and still stuck: ask again in the background (at most every
        :data:`RECHECK_EVERY_S`, one question at a time), write off the peers silent on
        :attr:`recheck_misses` questions in a row (:func:`recheck_verdict`)."""
        stuck = []
        for rank, pid in sorted(pids.items()):
            status = self.channel.status(rank)
            if status is not None and status.pid == pid and \
                    waiting_level(status, round_number, participants, self._worlds) >= STUCK:
                stuck.append((rank, status))
        if not stuck:
            self._recheck = None
            return None
        rank, status = stuck[0]
        stall = self._stall(status, round_number)
        if self._recheck is None or self._recheck.stall != stall:
            self._recheck = Recheck(stall, asked_at=time.monotonic())  # the first judgment just asked
        again, now = self._recheck, time.monotonic()
        if again.questions is not None:
            if not again.questions.done():
                return None
            answered = again.questions.answers()
            again.questions, again.missed = None, missed_in_a_row(again.missed or {}, answered)
            frozen = recheck_verdict(again.missed, answered, self.recheck_misses)
            if frozen and self._holds_lease():
                return self._found(frozen, rank, status, round_number,
                                   f"did not answer {self.recheck_misses} questions in a row "
                                   f"({self.recheck_timeout:g} s each)", again.asked_at)
        if now - again.asked_at >= RECHECK_EVERY_S:
            self._ask_again(again, participants)
        return None

    def _peers(self, participants: Sequence[str]) -> dict[str, str | None]:
        records = self.session.node_records()
        return {n: (records[n].witness_addr if n in records else None) for n in participants if n != self.node}

    def _while(self, rank: int, status: WorkerStatus, round_number: int, silent: int) -> str:
        """What the local worker was waiting for, for the log line."""
        extra = status.extra if isinstance(status.extra, dict) else {}
        its = "its" if silent == 1 else "their"
        if extra.get("joining") == round_number:
            began = extra.get("join_started_at")
            since = f"{time.time() - began:.2f} s" if isinstance(began, (int, float)) else "?"
            return f"local rank {rank}'s join of round {round_number} waited {since} for the exchange"
        if status.round != round_number:
            return (f"local rank {rank}'s world of round {status.round} failed before it could switch to round "
                    f"{round_number}, which waits for {its} workers")
        last = extra.get("last_step_at")
        waited = f"{time.time() - last:.2f} s" if isinstance(last, (int, float)) else "?"
        return f"local rank {rank}'s step {status.step + 1} waited; detected {waited} after the last step"

    def _found(self, frozen: list[str], rank: int, status: WorkerStatus, round_number: int, how: str,
               asked: float) -> Frozen:
        extra = status.extra if isinstance(status.extra, dict) else {}
        joining = extra.get("joining") == round_number
        what = "lost or frozen" if joining or status.round != round_number else "frozen"
        its = "its" if len(frozen) == 1 else "their"
        said = (f"{', '.join(frozen)} {what}: {its} agent {how} while {self._while(rank, status, round_number, len(frozen))} "
                f"(asked {time.monotonic() - asked:.2f} s before); written off in round {round_number}, not waiting "
                f"for {its} etcd lease")
        return Frozen(tuple(frozen), f"{', '.join(frozen)} {what} ({its} agent did not answer)", round_number, said)

    def write_off(self, frozen: Frozen) -> bool:
        """Write off the peers :meth:`look` found frozen: a report for its round names them, so
        that every closer of the next round leaves them out. False if etcd refused it (nothing
        written off: the next look judges again)."""
        if not self.session.record_reach(ReachReport(self.node, frozen.round, frozen.nodes, frozen.nodes)):
            return False
        log.info("[%s] %s", self.node, frozen.said)
        return True

    def _holds_lease(self) -> bool:
        return self.session.lease_fresh(OWN_LEASE_FRESH)

    # ------------------------------------------------------------------ thawed side

    def written_off(self, round_number: int, participants: tuple[str, ...], fresh: bool = False) -> str | None:
        """Why this node's workers are stale (its peers wrote it off as frozen in its current
        round, and the reports leave it out as every closer reads them), or None. ``fresh``:
        read etcd rather than the mirror, which may still lag just after a thaw, when a stale
        worker's failed collective already asks for a new round."""
        if round_number < 0 or self.node not in participants:
            return None
        entries = self.session.reach_entries(fresh)
        by = written_off_by(self.node, participants, self.session.reach_reports(entries, round_number))
        if not by:
            later = written_off_later(self.node, round_number, {r: self.session.reach_reports(entries, r)
                                                                for r in range(round_number + 1, round_number + 9)})
            if later is None:
                return None
            round_number, by = later
        return (f"its peers ({', '.join(by)}) wrote it off in round {round_number}: its agent did not answer them "
                "while a step or a join waited (it was frozen, or cut off from them); its workers are stale")
