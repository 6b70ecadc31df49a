"""This node's keep-outs: one strike counter and one way of staying out, whatever the cause.

A crash loop, a straggler or suspect hardware (kept out by :mod:`agent.node.policy`'s decision
while the workers train) and a failed health check (before a round: :meth:`agent.node.
health_watch.HealthWatch.gate`) keep the node out of the job's rounds alike: a keep-out key
naming the cause, the back-off of its strike (:func:`agent.rendezvous.keepout.backoff`), then
back. The strikes are counted here once for all of them, by one rule
(:func:`agent.rendezvous.keepout.next_strikes`): each keep-out is one more, and a node back
in for a while starts again from the base back-off. Two counters used to escalate apart: a
node kept out for a failed check while training came back to a gate that started at strike 1.
"""

from __future__ import annotations

import time
from typing import Callable

from agent.rendezvous.keepout import BACKOFF_BASE_S, KeepOut, backoff, next_strikes

_RECHECK_S = 0.5  # how often a node kept out looks whether the job ended


class KeepOuts:
    def __init__(self, node: str, closed: Callable[[], bool], base_s: float = BACKOFF_BASE_S) -> None:
        self.node, self.closed = node, closed
        self.base_s = base_s  # --keep-out-s: the first strike's back-off, doubled at each strike after
        self.strikes = 0
        self.back_in_at: float | None = None  # when this node last came back from a keep-out

    def strike(self, cause: str, round_number: int) -> KeepOut:
        """The next keep-out of this node, its strike counted."""
        back_for = None if self.back_in_at is None else time.monotonic() - self.back_in_at
        self.strikes = next_strikes(self.strikes, back_for)
        return KeepOut(self.node, self.strikes, backoff(self.strikes, self.base_s), cause=cause, round=round_number)

    def stay_out(self, out: KeepOut) -> bool:
        """Wait out ``out``'s back-off (the caller holds its key meanwhile and drops it after).
        False if the job ended first."""
        deadline = time.monotonic() + out.backoff
        ended = False
        while time.monotonic() < deadline:
            if self.closed():
                ended = True
                break
            time.sleep(min(_RECHECK_S, max(0.0, deadline - time.monotonic())))
        self.back_in_at = time.monotonic()
        return not ended


__all__ = ["KeepOuts"]
