"""What the node agent's loop steps share: the run's mutable state, and the group it drives.

:class:`agent.node.node_agent.NodeAgent` owns one :class:`NodeRun` and hands it, with only the
parts each needs, to its collaborators (:class:`agent.node.observer.Observer`,
:class:`agent.node.acts.Acts`, :class:`agent.node.reporting.Reporting`,
:class:`agent.node.spare_ahead.SpareAhead`, :func:`agent.node.preemption.terminate`). They change the
run through these fields and the agent's group through :class:`Group`, never through the
agent itself: so none of them imports the agent, and what each may touch is spelled here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from agent.node.policy import Reason, Streak
from agent.node.rendezvous_api import Round
from agent.node.states import RoundCause
from agent.node.workers import Launch


@dataclass
class NodeRun:
    """The node's state across loop turns. Who writes each field, and why:

    - ``round``: the agent's :meth:`~agent.node.node_agent.NodeAgent.rendezvous`, after each round
      (everyone else reads it: ranks, members, the offer for in-place workers).
    - ``remaining_restarts``: :class:`~agent.node.acts.Acts` spends one per counted restart or
      replace, and refunds one when a peer's loss caused the failure (the policy reads it).
    - ``restart_count``: :class:`~agent.node.acts.Acts`, once per new group (the workers' attempt
      number, their log and error-file directory).
    - ``streak``: the agent's loop counts a failure being acted on
      (:func:`agent.node.policy.streak_acted_on`); :class:`~agent.node.acts.Acts` settles it once
      the workers train, or refunds it (:func:`agent.node.policy.after_round`).
    - ``joiner_pids``: the agent's group starts and :class:`~agent.node.spare_ahead.SpareAhead`
      (workers started into a live in-place world, which the observer waits for).
    - ``recovering``: :class:`~agent.node.acts.Acts`, before a start (the workers' start-up is the
      job's recovery, for goodput).
    - ``unusable_round``: :class:`~agent.node.acts.Acts` when a rejoin or replace got no round to
      hand over; :class:`~agent.node.observer.Observer` takes it into the next observation.
    - ``failure_line``: :class:`~agent.node.acts.Acts` when the job fails and this agent can say
      why in one line (``agent.node.launch`` prints it).
    """

    round: Round
    remaining_restarts: int
    restart_count: int = 0
    streak: Streak = Streak()  # own failures in a row right after a start (agent.node.policy)
    joiner_pids: set[int] = field(default_factory=set)
    recovering: bool = False
    unusable_round: Reason | None = None
    failure_line: str = ""

    @property
    def crash_streak(self) -> int:
        return self.streak.current


class Group(Protocol):
    """The agent's own operations on its rounds and workers, as its collaborators use them."""

    def rendezvous(self, cause: RoundCause = ..., offered: bool = False) -> None:
        """Take part in the next round (:attr:`NodeRun.round` holds it after)."""

    def start_group(self) -> None:
        """Start every local worker into the current round."""

    def start_again(self, ranks: list[int]) -> dict[int, int]:
        """In place: start ``ranks`` again; returns rank -> pid."""

    def stop(self, sig: int, grace: float) -> dict[int, Any]:
        """Stop every local worker; returns torch's failure records of the stopped group."""

    def launches(self, joining: list[int] | None) -> dict[int, Launch]:
        """Every local rank's launch (``joining``: into a set-up world of their own)."""

    def while_healthy(self) -> None:
        """Between looks while the workers train."""

    def wake(self) -> None:
        """Look again at once."""


__all__ = ["Group", "NodeRun"]
