"""The one interface between the node agent and its rendezvous.

The agent acts on the rendezvous only through an :class:`AgentRendezvous`: take part in
the next round (with a cause) and get it back as a frozen :class:`Round`; publish this
node's state; read its peers; report an unreachable peer; ask after its lease; subscribe
to wake-ups. It never reads or writes a handler's fields. This module holds the interface
and the generic implementation only:

* :class:`TorchRendezvous`, over any torch ``RendezvousHandler``: rounds only; what it
  cannot do (keep a node out, publish, watch leases) does nothing;
* the etcd-v3 one (registry, keep-outs, in-place round offers, spares, leases) lives with
  its handler, in :mod:`agent.rendezvous.agent_side`, whose ``agent_rendezvous`` and
  ``handler_side`` are the factories the agent and the launcher call: no module of
  ``agent/node`` names the etcd handler.

Call order: :meth:`~AgentRendezvous.attach` once (what this node advertises, the agent's
hooks), then :meth:`~AgentRendezvous.next_round` whenever the agent needs a round; every
other method at any time after ``attach``. The collaborators that need etcd itself (the
straggler, freeze and command watches, goodput's account) are made here from the
rendezvous' :meth:`~AgentRendezvous.session`, so that a handler without one gets their null
objects.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousHandler

from elastic.inplace.channel import RoundOffer
from agent.rendezvous.ended import JobEnded
from agent.rendezvous.keepout import KeepOut
from agent.rendezvous.registry import NodeRecord
from agent.rendezvous.session import RendezvousSession

from agent.node.policy import JobEnd, Reason
from agent.node.states import RoundCause

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from agent.node.goodput import GoodputAccountant, NoGoodput


class JobFinishedError(RendezvousClosedError):
    """The job trained its last step while this node was out: nothing to join, and exit 0."""


@dataclass(frozen=True)
class Round:
    """One round as this node takes part in it: its members, this node's ranks, and, for
    in-place workers, the offer to hand them (None: the round cannot be handed over)."""

    number: int = -1
    participants: tuple[str, ...] = ()
    group_rank: int = 0
    group_world: int = 0
    rank_base: int = 0
    world_size: int = 0
    master_addr: str = ""
    master_port: int = 0
    offer: RoundOffer | None = None
    # In place: a member's workers ran in place when it closed, so workers started now join
    # it through its offer from a set-up world of their own (agent.rendezvous.rounds)...
    live_world: bool = False
    # ... or none did, so every member starts its workers afresh into it, a node whose
    # workers went in place a moment after the close included.
    fresh_world: bool = False

    def others(self, node: str) -> list[str]:
        return [n for n in self.participants if n != node]

    def count_others(self, node: str) -> int:
        """``len(others(node))`` without building the list (asked on every look of the agent)."""
        return len(self.participants) - (node in self.participants)


@dataclass(frozen=True)
class LeaseHealth:
    """How this node's lease fares (all None/False where the rendezvous has no lease)."""

    age: float | None = None  # seconds since the last confirmed keep-alive
    outage: bool = False  # etcd does not answer (the lease may still hold)
    cut_off: str = ""  # why this node judged itself cut off, for the log line
    due_in: float | None = None  # seconds until the lease is to be judged again


class AgentRendezvous(abc.ABC):
    """See the module doc. ``node`` and ``nproc`` are this node's; ``in_place``: it hosts
    in-place workers (rounds come with offers)."""

    def __init__(self, handler: RendezvousHandler, node: str, nproc: int, in_place: bool) -> None:
        self._handler, self.node, self.nproc, self.in_place = handler, node, nproc, in_place

    @property
    def use_agent_store(self) -> bool:
        return bool(self._handler.use_agent_store)

    def is_closed(self) -> bool:
        return bool(self._handler.is_closed())

    @property
    def can_keep_out(self) -> bool:
        """Whether this rendezvous can keep a node out of rounds (crash loops, stragglers, SDC)."""
        return False

    @property
    def min_nodes(self) -> int:
        return 1

    @abc.abstractmethod
    def next_round(self, cause: RoundCause, previous: Round, offered: bool = False) -> Round:
        """Take part in the next round; ``cause`` says why, should this node open it.
        ``offered``: in-place workers go on, so only a round with an offer will do (a few
        tries; the returned round's ``offer`` is None if none came)."""

    def attach(self, *, advertise_host: str | None, metrics_url: str | None, store_addr: str | None,
               on_etcd_error: Callable[[str], None], wake: Callable[[], None],
               on_keep_out: Callable[[KeepOut | None], None], while_spare: Callable[[], None]) -> None:
        """Advertise this node and hook the agent in (wake-ups, keep-out news, a spare's wait)."""

    def membership(self, current: Round) -> tuple[Reason | None, list[str]]:
        """The rendezvous' reason to act on ``current`` (None: none), and its members that went out (kept out)."""
        return None, []

    def job_ended(self) -> JobEnd | None:
        """The job's end as another node closed it, as far as this node has heard without asking
        (None: not ended, or this rendezvous cannot say so cheaply)."""
        return None

    def publish(self, **fields: Any) -> None:
        """Say something in this node's registry record (``state``, or ``extra`` keys such as
        ``crash`` and ``in_place``); each written only on a change."""

    def peers(self) -> Mapping[str, NodeRecord]:
        return {}

    def peer_crashes(self, current: Round) -> dict[str, str] | None:
        """What the round's other members said their workers failed with (None: cannot be heard)."""
        return None

    def report_unreachable(self) -> None:
        """The round failed with every lease held: record the members this node cannot reach."""

    def etcd_settings(self) -> Any:
        """How to reach etcd, for the health check's clock (None: no etcd to compare with)."""
        return None

    def hold_out(self, out: KeepOut | None) -> None:
        """Before any round: hold (or, with None, drop) a keep-out key, the lease it needs
        started first (a node failing a health check at its start)."""
        self.keep_out(out)

    def spares_waiting(self, current: Round) -> int:
        """Live nodes of the run outside ``current``: warm spares, one of which would take the
        place of a node kept out (read on the rare path that needs it)."""
        return 0

    def lease_health(self) -> LeaseHealth:
        return LeaseHealth()

    def etcd_lost(self, fence: Mapping[str, object] | None, run_id: str) -> str:
        """agent.node.policy.etcd_lost against the round the rendezvous holds now."""
        return ""

    def keep_out(self, out: KeepOut | None) -> None:
        """Keep this node out of rounds (``out``) or let it back (None), seen by the rendezvous."""

    def announce_finished(self) -> None:
        """This node's workers trained the job's last step (every one exited 0): say so now, before
        :meth:`exit_barrier`, so that a node whose workers are still joining a round with this
        one (back just after the last step) stops them at once (``agent.node.policy`` rule 3a)
        instead of waiting out the round's store timeout. Nothing here for torch's rendezvous."""

    def exit_barrier(self, current: Round, timeout: float) -> None:
        """Wait until every other member finished too (or ``timeout``)."""

    def live_world_ahead(self) -> bool:
        """A spare's question: does the running world train in place (start workers ahead)?"""
        return False

    # the collaborators that need the rendezvous' own store (null objects without one)

    def session(self) -> RendezvousSession | None:
        """The narrow session the watches and goodput's shared account work on (None: this
        rendezvous has no store of its own; the watches are null objects, goodput keeps no
        account)."""
        return None

    def pace_monitor(self, metrics: Any, metrics_dir: Any, heartbeat_dir: Any) -> Any:
        session = self.session()
        if session is None:
            from agent.node.nulls import NoPace
            return NoPace()
        from agent.node.pace import PaceMonitor
        return PaceMonitor(self.node, session, metrics, metrics_dir, heartbeat_dir)

    def freeze_watch(self, channel: Any) -> Any:
        session = self.session()
        if session is None or not self.in_place:
            from agent.node.nulls import NoFreeze
            return NoFreeze()
        from agent.node.freeze import FreezeWatch
        return FreezeWatch(self.node, session, channel)

    def goodput(self, directory: Path, heartbeat_dir: Path, registry: CollectorRegistry) -> GoodputAccountant | NoGoodput:
        """Goodput's shared account in the session, or its null without one (the same gauges, no account)."""
        from agent.node.goodput import GoodputAccountant, NoGoodput

        session = self.session()
        if session is None:
            return NoGoodput(registry)
        return GoodputAccountant(self.node, directory, heartbeat_dir, registry, session)

    def command_watch(self, heartbeat_dir: str) -> Any:
        session = self.session()
        if session is None:
            from agent.node.nulls import NoCommands
            return NoCommands()
        from agent.node.commands import CommandWatch
        watch = CommandWatch(session, self.node)
        watch.heartbeat_dir = heartbeat_dir  # `elastic inject-sdc`: the request goes there
        return watch


class TorchRendezvous(AgentRendezvous):
    """Any torch ``RendezvousHandler``: rounds, and a node waiting as a scale-up."""

    def next_round(self, cause: RoundCause, previous: Round, offered: bool = False) -> Round:
        info = self._handler.next_rendezvous()
        bootstrap = info.bootstrap_store_info
        return Round(number=previous.number + 1, participants=(), group_rank=info.rank, group_world=info.world_size,
                     rank_base=info.rank * self.nproc, world_size=info.world_size * self.nproc,
                     master_addr=bootstrap.master_addr if bootstrap is not None else previous.master_addr,
                     master_port=bootstrap.master_port if bootstrap is not None else previous.master_port)

    def membership(self, current: Round) -> tuple[Reason | None, list[str]]:
        return (Reason.SCALE_UP if self._handler.num_nodes_waiting() > 0 else None), []


class HandlerSide:
    """What the launcher asks of the handler torchrun's registry built, before and after the
    agent runs: any torch handler answers with nothing (no outcome, no spares, no round numbers
    of its own) and is shut down as torch's contract says."""

    fences_rounds = False  # whether its round numbers are the snapshot directory's fence tokens

    def __init__(self, handler: RendezvousHandler) -> None:
        self._handler = handler

    def closed_outcome(self) -> JobEnded | None:
        """How the job ended, as another node closed it (None: not closed, or cannot say)."""
        return None

    def close_job(self, outcome: str, cause: str) -> None:
        """Close the job's rendezvous (``outcome``/``cause``: how it ended, for the other agents)."""
        self._handler.shutdown()

    def leave(self) -> None:
        """Leave without closing the job (peers notice now, not at a lease's end), where the
        handler can (torch's ABC has no such call: those without a ``close`` do nothing)."""
        close = getattr(self._handler, "close", None)
        if callable(close):
            close()

    def on_spare(self, callback: Callable[[bool], None]) -> None:
        """Call ``callback(True/False)`` as this node starts and stops waiting as a spare."""

    def start_rounds_above(self, fence_round: int) -> int | None:
        """Start the job's rounds above ``fence_round`` if etcd holds none; returns the newest round
        etcd holds when that is below the fence (no group of this job raised it), else None."""
        return None


__all__ = ["AgentRendezvous", "HandlerSide", "JobFinishedError", "LeaseHealth", "Round", "TorchRendezvous"]
