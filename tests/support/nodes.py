"""Real torchrun agents, each a separate process tree standing for one node.

A test's agents are forks of one pre-imported process per pytest worker
(:mod:`agent.local.zygote`, as ``elastic local``'s are): the same ``elastic agent`` command
line, arguments, environment, working directory and log, in a session of its own, without an
import of torch per agent start (the largest part of a multi-node test's CPU). Nodes in a
network namespace and plain ``torchrun`` still start by exec, and so does every agent with
``ELASTIC_TEST_EXEC_AGENTS=1`` set (to compare, or to rule the zygote out).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from agent.local.local_node import TORCHRUN, LocalNode
from agent.local.zygote import Zygote

EXEC_AGENTS_ENV = "ELASTIC_TEST_EXEC_AGENTS"
_ZYGOTE = Zygote()  # one per pytest worker; its process starts with the first node


def shared_zygote() -> Zygote | None:
    return None if os.environ.get(EXEC_AGENTS_ENV) == "1" else _ZYGOTE


@dataclass
class TorchrunNode(LocalNode):
    zygote: Zygote | None = field(default_factory=shared_zygote)


__all__ = ["TORCHRUN", "TorchrunNode", "shared_zygote"]
