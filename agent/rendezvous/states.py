"""A node's registry states and a round's causes as enums, one spelling each, where the
rendezvous writes them (``agent.node.states`` re-exports them for the agent).

They are ``str`` enums so that what reaches etcd (a node record's ``state``, a round's
``cause``), the ``elastic_agent_state`` metric and the logs stays the very strings the
rest of the project (``elastic top``, the rendezvous, the tests) already reads: a member
compares equal to its value and ``json.dumps`` writes the value. What goes into a record
is the ``.value`` (a plain ``str``): an enum member hashes by its name, so a member put
into a record would miss a set of strings such as :data:`.rounds.ON_THEIR_WAY`.
"""

from __future__ import annotations

import enum


class RoundCause(str, enum.Enum):
    """Why a node takes part in a new round, should it be the one to open it."""

    JOIN = "join"  # a node arrives (or comes back): the others may train on until it is ready
    FAILURE = "failure"  # the world is broken: the others stop for it

    def __str__(self) -> str:
        return self.value


class NodeState(str, enum.Enum):
    """A node's ``state`` in its registry record (what its peers and ``elastic top`` read)."""

    STARTING = "starting"  # a record written before its first round
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


__all__ = ["NodeState", "RoundCause"]
