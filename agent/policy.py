"""What the node agent does next: a pure decision over what it has observed.

The agent's loop only observes (worker exits, the rendezvous' verdict on membership,
the hang watchdog, requests from workers that run in place) and then carries out the
:class:`Decision` this module returns. Keeping the rules here, free of processes, etcd
and clocks, lets every case be unit-tested in milliseconds, as ``rounds.py`` does for
the rendezvous.

Two kinds of worker group:

* **restart** (any script): a membership change or a failure stops every local worker
  and starts a new group after the next rendezvous round, as torchrun does.
* **in place** (``ElasticRun`` on a torch that can reconfigure a live process group):
  survivors keep their processes. The agent takes part in the new round and hands it to
  its workers; it starts again only the local workers that died or hung.

Restarts caused by this node (a worker failed or hung) spend one of ``--max-restarts``;
restarts caused by other machines (a peer lost, a node joining) or by this node's own
lease loss do not, so a long job does not run out of restarts because others died.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass, field
from typing import Iterable, Mapping

USER_ERROR_EXIT = 2  # a usage error (bad flags, a snapshot from another model): retrying cannot fix it


class Reason(str, enum.Enum):
    WORKER_FAILED = "worker_failed"
    HANG = "hang"
    PEER_LOST = "peer_lost"
    LEASE_LOST = "lease_lost"
    SCALE_UP = "scale_up"  # another node opened a new round (joined or came back)
    REFORM = "reform"  # an in-place worker's collective failed with nobody's lease lost

    @property
    def counted(self) -> bool:
        """Whether a restart for this reason spends one of ``--max-restarts``."""
        return self in (Reason.WORKER_FAILED, Reason.HANG)

    @property
    def abrupt(self) -> bool:
        """The world is broken: there is nothing to flush, so workers get SIGKILL."""
        return self is not Reason.SCALE_UP


class Action(str, enum.Enum):
    CONTINUE = "continue"
    SUCCEED = "succeed"  # every local worker exited 0
    FAIL = "fail"  # give up: a usage error, or no restarts left
    RESTART = "restart"  # stop every local worker, rendezvous, start a new group
    REJOIN = "rejoin"  # in place: keep the workers, rendezvous, hand them the new round
    REPLACE = "replace"  # in place: start again only ``ranks``, then rendezvous as in REJOIN


@dataclass(frozen=True)
class Observation:
    """One look at the node, taken by the agent's loop.

    ``exits`` maps every local rank to its exit code, or None while it runs.
    ``membership`` is the rendezvous' reason to act (peer lost, own lease lost, a new
    round), or None. ``stalled_for`` is the hang watchdog's verdict. ``in_place`` is true
    when every local worker said it runs in place; ``reform_requested`` when one of them
    asked for a new round because a collective failed.
    """

    exits: Mapping[int, int | None]
    membership: Reason | None = None
    stalled_for: float | None = None
    in_place: bool = False
    reform_requested: bool = False
    restarts_left: int = 0


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: Reason | None = None
    ranks: tuple[int, ...] = ()  # REPLACE: the local ranks to start again
    dump_stacks: bool = False  # a hang: SIGUSR1 first, so the log shows where it hung
    detail: str = ""
    failed: Mapping[int, int] = field(default_factory=dict)  # local rank -> exit code, for FAIL's report

    @property
    def counted(self) -> bool:
        return self.reason is not None and self.reason.counted and self.action in (Action.RESTART, Action.REPLACE)

    @property
    def usage_error(self) -> bool:
        """FAIL because of a usage error: the agent exits 2 as well (``podFailurePolicy``, systemd)."""
        return self.action is Action.FAIL and bool(self.failed) and all(
            code == USER_ERROR_EXIT for code in self.failed.values())


CONTINUE = Decision(Action.CONTINUE)


def decide(obs: Observation) -> Decision:
    """The agent's next step; the rules, in order of precedence, are the module's contract."""
    failed = {rank: code for rank, code in obs.exits.items() if code not in (None, 0)}

    # 1. Our own lease is gone: the world moved on without us. Whatever our workers hold
    #    belongs to an old round, in either mode; they must die before they act.
    if obs.membership is Reason.LEASE_LOST:
        return Decision(Action.RESTART, Reason.LEASE_LOST, detail="this node's etcd lease was lost")

    # 2. A usage error: a worker exited with 2, and retrying cannot fix it. Its siblings
    #    may have failed with it (their collective with it broke: an ordinary exit code), and
    #    still nothing a restart would change; a death by a signal beside it is a crash.
    usage = {rank: code for rank, code in failed.items() if code == USER_ERROR_EXIT}
    if usage and all(code > 0 for code in failed.values()):
        return Decision(Action.FAIL, Reason.WORKER_FAILED, failed=usage,
                        detail=f"local worker(s) {sorted(usage)} exited with code 2 (a usage error, which would "
                               "come back at every start); not restarting")

    # 3. Done: every local worker exited cleanly.
    if obs.exits and all(code == 0 for code in obs.exits.values()):
        return Decision(Action.SUCCEED)

    # 4. Local failures: ours to count.
    if failed:
        if obs.restarts_left <= 0:
            return Decision(Action.FAIL, Reason.WORKER_FAILED, failed=failed, detail="no restarts left")
        if obs.in_place:
            return Decision(Action.REPLACE, Reason.WORKER_FAILED, ranks=tuple(sorted(failed)), failed=failed)
        return Decision(Action.RESTART, Reason.WORKER_FAILED, failed=failed)

    # 5. Someone else's doing: a peer lost or a node joining. Never counted.
    if obs.membership in (Reason.PEER_LOST, Reason.SCALE_UP):
        return Decision(Action.REJOIN if obs.in_place else Action.RESTART, obs.membership)

    # 6. An in-place worker's collective failed while every lease held (a frozen worker,
    #    a reset connection): the same members form a new round, which is cheap.
    if obs.reform_requested and obs.in_place:
        return Decision(Action.REJOIN, Reason.REFORM)

    # 7. No local rank made progress for the hang timeout.
    if obs.stalled_for is not None:
        if obs.restarts_left <= 0:
            return Decision(Action.FAIL, Reason.HANG, dump_stacks=True, detail="hung, and no restarts left")
        running = tuple(sorted(rank for rank, code in obs.exits.items() if code is None))
        if obs.in_place:
            return Decision(Action.REPLACE, Reason.HANG, ranks=running, dump_stacks=True)
        return Decision(Action.RESTART, Reason.HANG, dump_stacks=True)

    return CONTINUE


def stop_signal(reason: Reason | None, progressed: bool) -> int:
    """How to stop a worker group: SIGTERM (rank 0 flushes its snapshot) only when the
    world is healthy and the group has made progress; otherwise SIGKILL at once, since a
    worker blocked in process-group set-up would never run a SIGTERM handler."""
    if reason is None or reason.abrupt or not progressed:
        return signal.SIGKILL
    return signal.SIGTERM


def refunded(reason: Reason, previous: Iterable[str], current: Iterable[str]) -> bool:
    """A worker failure that the next round explains as a peer's death is not ours.

    A SIGKILLed peer makes our worker's collective fail at once, usually before its lease
    expires; only the next round shows that the peer is gone.
    """
    previous_set = set(previous)
    return reason is Reason.WORKER_FAILED and bool(previous_set) and not previous_set <= set(current)
