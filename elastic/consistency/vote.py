"""Who is the outlier: a pure decision over the replicas' digests.

Replicas of one state (every DDP rank; the replicas of one shard under HSDP) must hold
the same bits after every step. When they do not, a strict majority that agrees names the
others as outliers; without one (two replicas, or an even split) every replica is a
suspect, because nothing says which side is right. Either way every replica goes back to the last agreed state, so the vote only
decides whom to *name* and who heals whom, never whether to roll back.

Non-finite values are decided by a flag, not by the digests (a NaN's bits vary with the
op that made it): replicas holding a NaN or an Inf that others do not are outliers, and
the majority is taken among the finite ones (with two replicas, the finite one is right).
When every replica holds one, the training diverged: that is the loop's problem (a
learning rate, a bad batch), not corruption, and going back would only diverge again.
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
    diverged: bool = False  # every replica holds non-finite values: training diverged, not SDC
    nonfinite: tuple[int, ...] = ()  # ranks holding a NaN or an Inf

    @property
    def has_majority(self) -> bool:
        return bool(self.majority)


def vote(digests: Sequence[Sequence[int]], nonfinite: Sequence[bool] = ()) -> Verdict:
    """``digests[rank]`` is ``[method, digest per group]`` (:meth:`Fingerprint.digests`);
    ``nonfinite[rank]``: that rank's state holds a NaN or an Inf (none, if not given)."""
    rows = [tuple(d) for d in digests]
    everyone = tuple(range(len(rows)))
    bad = tuple(r for r, f in enumerate(nonfinite) if f)
    if len(bad) == len(rows) and rows:
        return Verdict(False, (), (), diverged=True, nonfinite=bad)
    finite = tuple(r for r in everyone if r not in bad)
    if len({r[0] for r in rows}) > 1:  # a torch without hash_tensor beside one with it: the flags still count
        return Verdict(not bad, finite, bad, methods_differ=True, nonfinite=bad)
    counts = Counter(rows[r] for r in finite)
    value, n = counts.most_common(1)[0]
    if not bad and n == len(rows):
        return Verdict(True, everyone, ())
    if 2 * n > len(finite):
        majority = tuple(r for r in finite if rows[r] == value)
        return Verdict(False, majority, tuple(r for r in everyone if r not in majority), nonfinite=bad)
    return Verdict(False, (), everyone, nonfinite=bad)


def vote_by_class(digests: Sequence[Sequence[int]], nonfinite: Sequence[bool],
                  classes: Sequence[int]) -> Verdict:
    """One :func:`vote` per shard class, merged into one verdict over global ranks.

    Under HSDP rank ``r`` holds the shards of local rank ``classes[r]`` (``r % L``): only the
    replicas of one shard hold the same bits, so each class votes alone and an outlier is
    named by its own shard's replicas. The merged verdict agrees when every class does;
    its suspects are every class's; it has a majority only when every class that
    disagrees has one (else every replica of such a class is a suspect, and the line says
    no majority decides). Every class diverged or not is decided alike: a NaN spreads
    through the shard all-gathers, so one class all non-finite is the training's doing."""
    flags = list(nonfinite) or [False] * len(digests)
    verdicts: list[tuple[list[int], Verdict]] = []
    for c in sorted(set(classes)):
        ranks = [r for r, k in enumerate(classes) if k == c]
        verdicts.append((ranks, vote([digests[r] for r in ranks], [flags[r] for r in ranks])))

    def back(ranks: list[int], sub: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(ranks[i] for i in sub)

    nonfin = tuple(sorted(r for ranks, v in verdicts for r in back(ranks, v.nonfinite)))
    if any(v.diverged for _, v in verdicts):
        return Verdict(False, (), (), diverged=True, nonfinite=nonfin)
    failed = [(ranks, v) for ranks, v in verdicts if not v.agreed]
    suspects = tuple(sorted(r for ranks, v in failed for r in back(ranks, v.suspects)))
    majority = (tuple(sorted(r for ranks, v in verdicts for r in back(ranks, v.majority)))
                if all(v.has_majority for _, v in failed) else ())
    return Verdict(not failed, majority, suspects, methods_differ=any(v.methods_differ for _, v in verdicts)
                   or len({tuple(d)[0] for d in digests}) > 1, nonfinite=nonfin)


def differing_groups(mine: Sequence[int], reference: Sequence[int], groups: Sequence[str]) -> list[str]:
    """The group names (parameters, optimizer, registered) whose digests differ."""
    return [g for g, a, b in zip(groups, mine[1:], reference[1:]) if a != b]


__all__ = ["Verdict", "differing_groups", "vote", "vote_by_class"]
