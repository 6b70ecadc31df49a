"""The node agent's absent parts, as objects that do nothing.

Without the etcd-v3 rendezvous there is no straggler, freeze or command watch (nor goodput's
shared account: :class:`agent.node.goodput.NoGoodput`, beside the real one for its gauges); without
in-place workers no control channel; without ``--warm-start`` no standby pool. The agent
holds one of these instead and calls it as it would the real part, so that no step of its
loop asks whether a part is there.
"""

from __future__ import annotations

import os
from typing import Any, Mapping


class NoPace:
    """agent.node.pace.PaceMonitor's place: never a straggler."""

    def look(self, participants: Any) -> None:
        return None

    def forget(self) -> None:
        pass


class NoFreeze:
    """agent.node.freeze.FreezeWatch's place: never a frozen peer, never written off."""

    def look(self, pids: Mapping[int, int], round_number: int, participants: Any) -> None:
        return None

    def written_off(self, round_number: int, participants: Any, fresh: bool = False) -> str | None:
        return None

    def write_off(self, frozen: Any) -> bool:
        return False


class NoCommands:
    """agent.node.commands.CommandWatch's place: no ``elastic kill`` reaches this node."""

    def poll(self) -> None:
        pass


class NoChannel:
    """agent.node.channel.AgentChannel's place: no worker runs in place. Its wake fd is
    a pipe nobody writes, so the agent's wait selects on it as on the real one."""

    def __init__(self) -> None:
        self.wake_fd, self._unused = os.pipe()

    def offer(self, offer: Any) -> None:
        pass

    def withdraw(self) -> None:
        pass

    def status(self, local_rank: int) -> None:
        return None

    def forget(self, local_rank: int) -> None:
        pass

    def close(self) -> None:
        for fd in (self.wake_fd, self._unused):
            os.close(fd)


class NoPool:
    """agent.node.fork_server.ForkServer's place: every worker starts cold."""

    size = 0
    full = True

    def fill(self) -> None:
        pass

    def ready_count(self) -> int:
        return 0

    def take(self, command: Any, env: Any, stdout: str | None, stderr: str | None) -> None:
        return None  # no standby: the worker starts cold

    def close(self) -> None:
        pass


class NoGauge:
    """A Prometheus gauge's place (a labelled one too) where nothing exports it: a unit test's watch."""

    def labels(self, *values: Any, **labels: Any) -> "NoGauge":
        return self

    def set(self, value: float) -> None:
        pass


__all__ = ["NoChannel", "NoCommands", "NoFreeze", "NoGauge", "NoPace", "NoPool"]
