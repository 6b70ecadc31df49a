"""A node's wait as a spare: beside a full world (``--nnodes`` max reached), ready to take
the place of the next member lost.

The round loop asks :meth:`SpareWait.now` at each look at a closed round, says the change
with :meth:`mark` (registry state ``spare``, one log line, ``on_spare`` listeners; only on a
change), and while it waits calls :meth:`tick` (the ``while_spare`` listeners: our agent
starts its workers ahead). :meth:`begin` starts each rendezvous; ``first`` then tells the
handler whether, and since when, this rendezvous found the node a spare.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from agent.rendezvous.registry import NodeLease
from agent.rendezvous.rounds import CLOSED, RoundRecord, waits_as_spare
from agent.rendezvous.states import NodeState

log = logging.getLogger(__name__)


class SpareWait:
    """``live(entries)`` gives every live node's registry state (the handler's mirror view)."""

    def __init__(self, node: str, lease: NodeLease, max_nodes: int,
                 live: Callable[[dict], dict[str, str]]) -> None:
        self.node, self.lease, self.max_nodes, self._live = node, lease, max_nodes, live
        # told True when this node starts waiting as a spare (a full world without it), False when it
        # leaves that wait (admitted, or the round it joined); the agent exports it as a gauge
        self.on_spare: list[Callable[[bool], None]] = []
        # called at each look while this node waits as a spare (on an etcd change, at least once a
        # second): the agent starts its workers ahead once the world it would join trains in place
        self.while_spare: list[Callable[[], None]] = []
        self.since: float | None = None  # monotonic; while this node waits as a spare
        self.first: float | None = None  # when this rendezvous first found this node a spare

    def begin(self) -> None:
        self.first = None

    def now(self, record: RoundRecord | None, entries: dict,
            joined_round: int | None) -> bool:
        """Whether this node waits as a spare now (a round it opened itself may not show yet)."""
        if record is None or record.state != CLOSED or self.node in record.participants \
                or len(record.participants) < self.max_nodes or joined_round == record.round + 1:
            return False  # the cheap checks first: the registry is read only beside a full world
        return waits_as_spare(record, self.node, self.max_nodes, self._live(entries))

    def mark(self, spare: bool, record: RoundRecord | None = None, write: bool = True) -> None:
        """Say (registry state ``spare``, log, ``on_spare``) that this node waits as a spare, or
        no longer does; only on a change."""
        if spare == (self.since is not None):
            return
        self.since = time.monotonic() if spare else None
        if spare and self.first is None:
            self.first = self.since
        if spare and record is not None:
            log.info("[%s] round %d is full (%s; --nnodes max %d): waiting as a spare, to take the place of "
                     "the next member lost", self.node, record.round, ", ".join(record.participants),
                     self.max_nodes)
        if write:
            self.lease.update(state=NodeState.SPARE.value if spare else NodeState.RENDEZVOUS.value)
        for callback in list(self.on_spare):
            callback(spare)

    def tick(self) -> None:
        """One look while waiting beside a full world: run the ``while_spare`` listeners."""
        for callback in list(self.while_spare):
            try:
                callback()
            except Exception:  # a spare's extra must never break its rendezvous
                log.exception("[%s] while waiting as a spare", self.node)
