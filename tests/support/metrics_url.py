"""Where a test node's /metrics listens, read back from its agent (never a port picked ahead)."""

from __future__ import annotations

from agent.local.local_node import LocalNode
from tests.support.waiting import wait_until


def metrics_url(node: LocalNode, timeout: float = 60.0) -> str:
    """The node's /metrics URL; with AUTO_METRICS_PORT waits for its agent to say which port it bound
    (a port found free and handed over could be taken before the agent binds it: issue 40)."""
    port = wait_until(node.bound_metrics_port, timeout, f"{node.name}'s agent to bind its metrics port",
                      on_timeout=node.log_tail)
    return f"http://{node.metrics_host}:{port}/metrics"
