"""Real torchrun agents, each a separate process tree standing for one node."""

from agent.local.local_node import TORCHRUN, LocalNode as TorchrunNode

__all__ = ["TORCHRUN", "TorchrunNode"]
