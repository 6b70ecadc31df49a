"""Which node is a straggler, and whether to evict it: pure rules over per-node paces.

Data-parallel training steps at the pace of its slowest rank, so one node with a throttled
GPU, a noisy neighbour or a bad NIC slows every node. Each agent publishes its node's
*pace* in its registry record: the slowest local rank's median compute seconds per step
(``elastic_step_compute_seconds``, :mod:`elastic.metrics.step_split`: step time less data
wait and collective wait, so a straggler's peers, who wait for it in the all-reduce, do
not look slow themselves). Every agent reads every member's pace from etcd and runs the
same rules, so all of them name the same node; the straggler's own agent evicts itself.

**Slow**: a node whose pace exceeds :data:`FACTOR` times the median of the *other*
members' paces, and them by at least :data:`MIN_LAG_S` per step. A uniformly slow world
has no node slow against the others. The floor is for jobs of short steps on a busy host:
there a few milliseconds of a process's own scheduling are a large factor (rank 0 of a
job of 3 ms steps measured 2-4x its peers for seconds at a time on a loaded 2-core
machine, and was evicted), while a real straggler, a throttled GPU or a bad NIC, lags by
tens of milliseconds per step or more.
**Persistent**: slow in :data:`WINDOWS` consecutive windows, each of which counts only
once every member's figure has advanced by :data:`MIN_STEPS` job steps since the last
(a stalled or restarting node's stale figure never decides). The figures are medians of
20 steps that leave out each world's first steps, so a slow first step, a snapshot step
or a single GC pause moves none of them.

**Evicted** (:func:`eviction`) when a spare waits to take its place, or when the world
without it trains faster: N nodes at the straggler's pace make N / slow steps' worth of
samples per second, N - 1 at the others' pace (N - 1) / others; so evict when
slow / others > N / (N - 1) (2 for a world of 2, 1.5 for 3) and N - 1 >= ``--nnodes MIN``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Mapping

FACTOR = 1.5  # slower than the others' median by this much
MIN_LAG_S = 0.02  # and by at least this much per step
WINDOWS = 3  # consecutive windows before a node is named
MIN_STEPS = 5  # job steps every member must have made for a window to count


@dataclass(frozen=True)
class Pace:
    """A node's published figure: median compute seconds per step, as of job ``step``."""

    compute: float
    step: int


@dataclass(frozen=True)
class Straggler:
    node: str
    compute: float  # its pace
    others: float  # the median of the other members' paces
    windows: int  # consecutive windows it has been slow in

    @property
    def ratio(self) -> float:
        return self.compute / self.others if self.others > 0 else float("inf")

    def describe(self) -> str:
        return (f"node {self.node} is a straggler: {self.compute * 1000:.0f} ms of compute per step against "
                f"{self.others * 1000:.0f} ms on the other nodes ({self.ratio:.1f}x, {self.windows} windows in a row)")


def slowest(paces: Mapping[str, float], factor: float = FACTOR, min_lag: float = MIN_LAG_S
            ) -> tuple[str, float, float] | None:
    """The node slower than ``factor`` times the median of the others and them by ``min_lag``,
    the slowest if several (one eviction at a time); None in a world of one or with no such node."""
    if len(paces) < 2:
        return None
    node = max(sorted(paces), key=lambda n: paces[n])
    others = statistics.median(v for n, v in paces.items() if n != node)
    if others > 0 and paces[node] > factor * others and paces[node] - others >= min_lag:  # 0: no real figure
        return node, paces[node], others
    return None


class StragglerWatch:
    """Counts consecutive slow windows of one world's members; :meth:`observe` each look."""

    def __init__(self, factor: float = FACTOR, windows: int = WINDOWS, min_steps: int = MIN_STEPS) -> None:
        self.factor, self.windows, self.min_steps = factor, windows, min_steps
        self._members: frozenset[str] = frozenset()
        self._last: dict[str, int] = {}  # node -> step of its figure in the last window counted
        self._suspect: str | None = None
        self._count = 0
        self._verdict: Straggler | None = None  # the last window's, standing until the next window counts

    def observe(self, paces: Mapping[str, Pace | None]) -> Straggler | None:
        """``paces``: every member of the current world (None: no figure yet). Returns the
        straggler once it has been slow :attr:`windows` windows in a row, in every window after."""
        members = frozenset(paces)
        if members != self._members:  # another world: start counting again
            self._members, self._last, self._suspect, self._count, self._verdict = members, {}, None, 0, None
        if any(p is None for p in paces.values()):
            return None
        known = {n: p for n, p in paces.items() if p is not None}
        if self._last and any(p.step < self._last.get(n, -1) + self.min_steps for n, p in known.items()):
            # not a new window for every member yet: the last one's verdict stands (a look
            # between windows once un-named the straggler, and named it again a look later)
            return self._verdict
        self._last = {n: p.step for n, p in known.items()}
        found = slowest({n: p.compute for n, p in known.items()}, self.factor)
        if found is None:
            self._suspect, self._count, self._verdict = None, 0, None
            return None
        node, compute, others = found
        self._count = self._count + 1 if node == self._suspect else 1
        self._suspect = node
        self._verdict = Straggler(node, compute, others, self._count) if self._count >= self.windows else None
        return self._verdict


def eviction(straggler: Straggler, world: int, min_nodes: int, spares: int) -> str | None:
    """Why to evict ``straggler`` from a world of ``world`` nodes, or None to keep it."""
    if world < 2:
        return None
    if spares > 0:
        return "a spare waits to take its place"
    if world - 1 >= min_nodes and straggler.ratio > world / (world - 1):
        return (f"{world - 1} nodes at their pace train faster than {world} at its pace "
                f"({straggler.ratio:.1f}x > {world}/{world - 1})")
    return None
