"""How a rank learnt that its world broke, as a type: set where the failure is raised
(``elastic.collectives.CollectiveFailure.noticed``) and said in rank 0's one line
(:func:`elastic.log.how_noticed`). A module of its own, importing nothing, so that
:mod:`elastic.torch_untyped` can answer in it without importing the log's module.
"""

from __future__ import annotations

from enum import Enum

BY_THE_AGENTS = "the agents' new round"  # a lease expired, an agent stopped answering, a node kept out


class Noticed(str, Enum):
    """How a rank learnt that its world broke: set where the failure is raised
    (``elastic.collectives.CollectiveFailure.noticed``), in the words rank 0's line uses."""

    CLOSED = "its connection closed"
    TIMED_OUT = "a collective timed out"
    NODE_ABANDONED = "a rank of its node abandoned the step"  # elastic.inplace.node_verdict
    BY_THE_AGENTS = BY_THE_AGENTS  # a newer round replaced the world
    FAILED = "a collective failed"


__all__ = ["BY_THE_AGENTS", "Noticed"]
