"""The node agent's states and round causes as enums, one spelling each.

They are ``str`` enums so that what reaches etcd (a node record's ``state``, a round's
``cause``), the ``elastic_agent_state`` metric and the logs stays the very strings the
rest of the project (``elastic top``, the rendezvous, the tests) already reads: a member
compares equal to its value and ``json.dumps`` writes the value.
"""

from __future__ import annotations

import enum

from agent.rendezvous.rounds import FAILURE, JOIN

# SIGTERM -> SIGKILL of the workers when the agent itself is stopped (a pre-emption): inside
# Kubernetes' default terminationGracePeriodSeconds (30 s), with time left to leave the job.
# Here, not in agent.node.launch, so that the agent's modules need nothing from the command line's.
DEFAULT_TERM_GRACE_S = 25.0


class RoundCause(str, enum.Enum):
    """Why this node takes part in a new round, should it be the one to open it."""

    JOIN = JOIN  # a node arrives (or comes back): the others may train on until it is ready
    FAILURE = FAILURE  # the world is broken: the others stop for it

    def __str__(self) -> str:
        return self.value


class NodeState(str, enum.Enum):
    """A node's ``state`` in its registry record (what its peers and ``elastic top`` read)."""

    RENDEZVOUS = "rendezvous"
    RUNNING = "running"
    SPARE = "spare"
    REJOINING = "rejoining"
    STOPPING = "stopping"
    KEPT_OUT = "kept_out"
    SUCCEEDED = "succeeded"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


class AgentState(str, enum.Enum):
    """The agent's own state, as the ``elastic_agent_state`` metric names it (agent.node.metrics)."""

    INIT = "init"
    HEALTHY = "healthy"
    STOPPED = "stopped"
    SUCCEEDED = "succeeded"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


__all__ = ["AgentState", "DEFAULT_TERM_GRACE_S", "NodeState", "RoundCause"]
