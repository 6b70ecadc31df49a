"""The node agent's states and round causes as enums, one spelling each.

A node's registry states and a round's causes live where the rendezvous writes them
(:mod:`agent.rendezvous.states`) and are re-exported here; the agent's own state (the
``elastic_agent_state`` metric) is this module's. All are ``str`` enums: a member compares
equal to its value and ``json.dumps`` writes the value.
"""

from __future__ import annotations

import enum

from agent.rendezvous.states import NodeState, RoundCause

# SIGTERM -> SIGKILL of the workers when the agent itself is stopped (a pre-emption): inside
# Kubernetes' default terminationGracePeriodSeconds (30 s), with time left to leave the job.
# Here, not in agent.node.launch, so that the agent's modules need nothing from the command line's.
DEFAULT_TERM_GRACE_S = 25.0


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
