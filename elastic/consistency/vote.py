"""Who is the outlier: a pure decision over the replicas' digests.

Replicas of one state (every DDP rank; the replicas of one shard under HSDP) must hold
the same bits after every step. When they do not, a strict majority that agrees names the
others as outliers; without one (two replicas, or an even split) every replica is a
suspect, because nothing says which side is right. Either way every replica goes back to the last agreed state, so the vote only
decides whom to *name* and who heals whom, never whether to roll back.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Verdict:
    agreed: bool
    majority: tuple[int, ...]  # ranks holding the majority's digests (empty: no strict majority)
    suspects: tuple[int, ...]  # ranks named: the outliers, or everyone when no majority exists
    methods_differ: bool = False  # ranks fingerprint with different methods: not comparable

    @property
    def has_majority(self) -> bool:
        return bool(self.majority)


def vote(digests: Sequence[Sequence[int]]) -> Verdict:
    """``digests[rank]`` is ``[method, digest per group]`` (:meth:`Fingerprint.digests`)."""
    rows = [tuple(d) for d in digests]
    if len({r[0] for r in rows}) > 1:  # a torch without hash_tensor beside one with it
        return Verdict(True, tuple(range(len(rows))), (), methods_differ=True)
    counts = Counter(rows)
    if len(counts) == 1:
        return Verdict(True, tuple(range(len(rows))), ())
    value, n = counts.most_common(1)[0]
    if 2 * n > len(rows):
        majority = tuple(r for r, row in enumerate(rows) if row == value)
        return Verdict(False, majority, tuple(r for r, row in enumerate(rows) if row != value))
    return Verdict(False, (), tuple(range(len(rows))))


def differing_groups(mine: Sequence[int], reference: Sequence[int], groups: Sequence[str]) -> list[str]:
    """The group names (parameters, optimizer, registered) whose digests differ."""
    return [g for g, a, b in zip(groups, mine[1:], reference[1:]) if a != b]


__all__ = ["Verdict", "differing_groups", "vote"]
