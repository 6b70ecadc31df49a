"""The replica consistency check inside ``ElasticRun``: every N steps, vote, and on a
mismatch return every replica to the last state all of them agreed on.

A corrupted replica does not stay alone: its next gradient is all-reduced into every
replica, so healing the outlier alone would leave the others off the true trajectory.
So at each check that passes every rank keeps a CPU copy of its whole state (model,
optimizer, scheduler, sampler position, RNG, registered state) and of the data plan's
recent steps; at a check that fails, every rank loads that copy and retrains the steps
since with the same samples (the sampler goes back with it; the ledger's lines for those
steps are written again and supersede the first ones). The copies were equal when they
were taken; a second vote after loading proves they still are, and a rank whose copy
went bad meanwhile is healed from a majority replica.

Every rank fingerprints its state (:mod:`.fingerprint`) and the ranks all-gather one
digest per group: ``1 + 3`` int64 per rank. Only on a mismatch do they exchange the
per-tensor hashes, to name what differs.

Under HSDP (``shard_ranks`` = L local ranks per node) rank ``r`` holds the shards of local
rank ``r % L``: it fingerprints its own shards, the all-gather is the same, the vote runs
within each shard class (:func:`.vote.vote_by_class`), the kept copy is each rank's own
shards and the rest (``capture(local=True)``), a rollback loads them back, and a rank
whose copy went bad is healed from a replica of the same local rank.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from checkpoints.tree import iter_tensors, map_state

from ..distributed import DistInfo, collective_device
from ..inplace.transfer import recv_state, send_state
from .fingerprint import GROUPS, Fingerprint, fingerprint, nonfinite_entries
from .vote import Verdict, differing_groups, vote, vote_by_class

log = logging.getLogger(__name__)
DEFAULT_EVERY_STEPS = 100
_NAMES_SHOWN = 4


class CheckedRun(Protocol):
    """What the check needs of ``ElasticRun`` (kept small on purpose)."""

    state: Any
    plan: Any
    snapshots: Any

    @property
    def dist(self) -> DistInfo: ...

    def _returned_to(self, step: int) -> None: ...


@dataclass
class Agreed:
    """The last state every replica agreed on, on the CPU."""

    step: int
    state: dict[str, Any]
    recent: list[list[Any]]
    digests: list[int]  # this rank's, when it kept the copy: a copy that changed since is told apart


@dataclass(frozen=True)
class Mismatch:
    """What one failed check found (for the line, the metric and the agent)."""

    step: int
    back_to: int
    verdict: Verdict
    nodes: list[str]  # per rank
    differing: dict[int, list[str]]  # rank -> entries that differ from the reference replica
    nonfinite: dict[int, list[str]] = field(default_factory=dict)  # rank -> entries holding a NaN or an Inf
    shard_ranks: int = 0  # HSDP: local ranks per node (each shard class votes alone); 0: every rank a replica


class ReplicaCheck:
    """Every ``every_steps`` committed steps (0: never), at the step boundary."""

    def __init__(self, every_steps: int, on_mismatch: Callable[[Mismatch, DistInfo], None] | None = None,
                 snapshot_every_steps: int | None = None) -> None:
        self.every_steps = every_steps
        self.snapshot_every_steps = snapshot_every_steps or 0
        self.agreed: Agreed | None = None
        self.on_mismatch = on_mismatch
        self._warned_methods = False
        self._last: tuple[int, list[list[int]]] | None = None  # the last mismatch: (step, every rank's digests)
        self.ignored: set[str] = set()  # entries found to differ by design (the same mismatch after a retrain)
        self._buffers: list[torch.Tensor] = []  # the host tensors of the kept copy, reused by the next one
        self.diverged_at = 0  # the first check that found every replica non-finite (said once)
        self.outcome: tuple[bool, str] | None = None  # the last check's: (agreed, its one line), for `elastic check`
        self.shard_ranks = 0  # HSDP: local ranks per node (rank r holds local rank r % L's shards); 0: all replicas

    def classes(self, world_size: int) -> list[int]:
        """Each rank's shard class: ranks of one class hold the same bits (DDP: one class)."""
        return [r % self.shard_ranks if self.shard_ranks else 0 for r in range(world_size)]

    def due(self, step: int) -> bool:
        """Whether applying ``step`` makes a check due: a function of the step alone, so that
        every rank of a world that applied it decides alike (a check is a collective).

        A step a snapshot is due at (by steps) is checked too, before the snapshot copies it
        (inside the next step): a snapshot never holds state the replicas did not agree on,
        so a restart from disk cannot resume a corrupted replica's state."""
        if self.every_steps <= 0 or step <= 0:
            return False
        return step % self.every_steps == 0 or (self.snapshot_every_steps > 0 and step % self.snapshot_every_steps == 0)

    def forget(self) -> None:
        """A new world: its ranks' histories differ (a joiner has none); each keeps a baseline."""
        self.agreed = None

    def pending(self, step: int) -> bool:
        """Steps were trained since the last agreed state (the run's end checks them)."""
        return self.every_steps > 0 and self.agreed is not None and self.agreed.step != step

    def baseline(self, run: CheckedRun) -> None:
        """A world formed: every replica just restored or healed the same state; keep it."""
        if self.every_steps > 0:
            self._keep(run)

    def run(self, run: CheckedRun) -> bool:
        """Vote; on a mismatch return to the last agreed state. True: the run went back."""
        self.outcome = None
        fp = _fingerprint(run, self.ignored)
        rows = all_gather_vector([*fp.digests(), int(not fp.finite)], run.dist)
        if self.shard_ranks:
            verdict = vote_by_class([r[:-1] for r in rows], [bool(r[-1]) for r in rows], self.classes(len(rows)))
        else:
            verdict = vote([r[:-1] for r in rows], [bool(r[-1]) for r in rows])
        if verdict.diverged:
            self._diverged(run)
            return False
        if verdict.methods_differ:
            if not self._warned_methods and run.dist.is_main:
                log.warning("[%s rank %d] replica check off: ranks fingerprint with different methods "
                            "(torch.hash_tensor on some, not others); run the same torch on every node",
                            run.dist.node, run.dist.rank)
            self._warned_methods = True
        if verdict.agreed:
            self._keep(run, fp)
            self.outcome = (True, f"the {len(rows)} replicas agree at step {run.state.step}"
                            + (" (not compared: ranks fingerprint with different methods)"
                               if verdict.methods_differ else ""))
            return False
        mismatch = self._describe(run, fp, rows, verdict)
        self.outcome = (False, describe(mismatch))
        if self._last == (run.state.step, rows):
            self._by_design(run, mismatch)
            return False
        self._last = (run.state.step, rows)
        if self.on_mismatch is not None:
            self.on_mismatch(mismatch, run.dist)
        self._return(run)
        return True

    # ------------------------------------------------------------------ internals

    def _keep(self, run: CheckedRun, fp: Fingerprint | None = None) -> None:
        digests = (fp or _fingerprint(run, self.ignored)).digests()
        state = host_copy(run.state.capture(local=bool(self.shard_ranks)), self._buffers)
        self._buffers = iter_tensors(state)
        self.agreed = Agreed(run.state.step, state, run.plan.recent_state(), digests)

    def _diverged(self, run: CheckedRun) -> None:
        """Every replica holds a NaN or an Inf: the training diverged (the loop's doing, not a
        fault of one node). Going back would train into it again, so the check says so once,
        keeps this state as the agreed one (the replicas stand alike) and leaves the decision
        to the loop's own policy (its loss is non-finite too)."""
        names = nonfinite_entries(run.state.module, run.state.optimizer,
                                  run.state.user.capture() if len(run.state.user) else None)
        line = (f"training diverged: every replica holds non-finite values at step {run.state.step} ("
                + ", ".join(names[:_NAMES_SHOWN]) + (" ..." if len(names) > _NAMES_SHOWN else "")
                + "); not silent data corruption, so no replica is named and nothing is rolled back: the loop "
                "decides (a lower learning rate, gradient clipping, a restart from an earlier snapshot)")
        self.outcome = (False, line)
        if run.dist.is_main and not self.diverged_at:
            log.error("[%s rank %d] %s", run.dist.node, run.dist.rank, line)
        self.diverged_at = self.diverged_at or run.state.step
        self._last = None
        self._keep(run)

    def _by_design(self, run: CheckedRun, m: Mismatch) -> None:
        """The same steps, retrained from the same agreed state, differ in the very same way:
        that is the loop's doing (a registered value that is rank-local, say), not corruption.
        Say so once and stop comparing those entries, rather than retraining forever."""
        entries = sorted({n for names in m.differing.values() for n in names})
        self.ignored.update(entries)
        self._last = None
        if run.dist.is_main:
            log.warning("[%s rank %d] the replicas differ again at step %d after retraining it from step %d, in the "
                        "same way: not silent data corruption but state that differs between ranks by design (%s); "
                        "the replica check no longer compares it (register only values every rank holds alike: a "
                        "healed rank gets another rank's)", run.dist.node, run.dist.rank, m.step, m.back_to,
                        ", ".join(entries[:_NAMES_SHOWN]) + (" ..." if len(entries) > _NAMES_SHOWN else ""))
        self._keep(run)

    def _describe(self, run: CheckedRun, fp: Fingerprint, rows: list[list[int]], verdict: Verdict) -> Mismatch:
        """Every rank learns every rank's node and per-entry hashes (the rare path)."""
        d = run.dist
        gathered: list[Any] = [None] * d.world_size
        bad = nonfinite_entries(run.state.module, run.state.optimizer,
                                run.state.user.capture() if len(run.state.user) else None) if not fp.finite else []
        dist.all_gather_object(gathered, (d.node, fp.names, fp.groups, fp.hashes, bad))
        prints = [Fingerprint(names, groups, hashes) for _node, names, groups, hashes, _bad in gathered]
        classes = self.classes(d.world_size)
        differing: dict[int, list[str]] = {}
        for c in sorted(set(classes)):  # each shard class against its own reference replica
            ranks = [r for r in range(d.world_size) if classes[r] == c]
            reference = next((r for r in verdict.majority if classes[r] == c), ranks[0])
            differing.update({r: prints[r].differing(prints[reference]) for r in ranks if r != reference})
            if not verdict.has_majority:  # no reference to trust: name what differs between the two sides
                differing[reference] = sorted({n for r in ranks if r != reference for n in differing[r]})
        back_to = self.agreed.step if self.agreed is not None else run.state.step
        return Mismatch(run.state.step, back_to, verdict, [g[0] for g in gathered],
                        {r: differing.get(r, []) for r in verdict.suspects},
                        {r: gathered[r][4] for r in verdict.nonfinite}, self.shard_ranks)

    def _return(self, run: CheckedRun) -> None:
        agreed = self.agreed
        if agreed is None:  # only a check with every_steps > 0 runs, and a world always keeps a baseline
            raise RuntimeError("replicas disagree and no agreed state was kept")
        run.snapshots.wait_capture()  # an asynchronous snapshot copy must not read half-loaded state
        local = bool(self.shard_ranks)
        run.state.load(map_state(agreed.state, lambda t, _w: t.clone()), local=local)  # the copy stays untouched
        run.plan.load_recent(agreed.recent)
        run._returned_to(agreed.step)
        intact = _fingerprint(run, self.ignored).digests() == agreed.digests
        flags = all_gather_vector([int(intact)], run.dist)
        if all(ok for (ok,) in flags):
            return
        d, classes = run.dist, self.classes(len(flags))
        for rank in (r for r, (ok,) in enumerate(flags) if not ok):  # rare: a copy went bad since it was kept
            good = [r for r, (ok,) in enumerate(flags) if ok and classes[r] == classes[rank]]
            if not good:
                raise RuntimeError(f"every replica's copy of step {agreed.step}, their last agreed state, changed "
                                   "since; the job restarts from its newest snapshot")
            src = good[0]  # a replica of the same shard (under HSDP, the same local rank)
            if d.rank == src:
                send_state(run.state.capture(local=local), rank, collective_device(d))
            elif d.rank == rank:
                run.state.load(recv_state(src, collective_device(d)), local=local)
                log.warning("[%s rank %d] healed step %d from rank %d: this rank's copy of it had changed",
                            d.node, d.rank, agreed.step, src)


def host_copy(state: dict[str, Any], buffers: list[torch.Tensor]) -> dict[str, Any]:
    """``state`` with every tensor copied to host memory: into ``buffers`` (the last copy's)
    when they line up, so that a check allocates nothing (fresh pages fault in at a cost
    several times the copy's); pinned for a GPU's tensors, whose copies are queued and
    waited for once."""
    sources = iter_tensors(state)
    if [(b.shape, b.dtype) for b in buffers] != [(t.shape, t.dtype) for t in sources]:
        buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda) for t in sources]
    it = iter(buffers)
    copy = map_state(state, lambda t, _w: next(it).copy_(t.detach(), non_blocking=t.is_cuda))
    if any(t.is_cuda for t in sources):
        torch.cuda.synchronize()
    return copy


def _fingerprint(run: CheckedRun, ignored: set[str]) -> Fingerprint:
    user = run.state.user
    registered = user.capture() if len(user) else None
    fp = fingerprint(run.state.module, run.state.optimizer, registered)
    if not ignored:
        return fp
    fp = fp.without(ignored)
    if not fp.finite:  # rare: is the NaN in an entry no longer compared (rank-local by design)?
        fp.finite = all(n in ignored for n in nonfinite_entries(run.state.module, run.state.optimizer, registered))
    return fp


def all_gather_vector(values: list[int], info: DistInfo) -> list[list[int]]:
    """One small all-gather of an int64 vector per rank."""
    t = torch.tensor(values, dtype=torch.int64, device=collective_device(info))
    out = [torch.empty_like(t) for _ in range(info.world_size)]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def describe(m: Mismatch) -> str:
    """The one line: the step, the node(s), the tensors that differ, what happens now."""
    v = m.verdict

    def who(r: int) -> str:
        entries = m.differing.get(r, [])
        shown = ", ".join(entries[:_NAMES_SHOWN]) + (f" and {len(entries) - _NAMES_SHOWN} more"
                                                     if len(entries) > _NAMES_SHOWN else "")
        if r in m.nonfinite:
            bad = m.nonfinite[r]
            values = ", ".join(bad[:_NAMES_SHOWN]) + (f" and {len(bad) - _NAMES_SHOWN} more"
                                                      if len(bad) > _NAMES_SHOWN else "")
            return f"node {m.nodes[r]} (rank {r}; non-finite values in {values or '?'})"
        return f"node {m.nodes[r]} (rank {r}; differs in {shown or '?'})"

    if v.has_majority:
        named = "; ".join(who(r) for r in v.suspects)
        what = ("non-finite values in one replica" if v.suspects and all(r in m.nonfinite for r in v.suspects)
                else "silent data corruption")
        if m.shard_ranks:  # HSDP: the replicas of the outlier's own shard decided
            first, L = v.suspects[0], m.shard_ranks
            agree = sum(1 for r in v.majority if r % L == first % L)
            total = sum(1 for r in range(len(m.nodes)) if r % L == first % L)
            of = f"{agree} of {total} replicas of its shard (local rank {first % L})"
        else:
            of = f"{len(v.majority)} of {len(m.nodes)} replicas"
        head = f"{what} at step {m.step}: {named} disagrees with the majority of {of}"
    else:
        named = " and ".join(f"node {m.nodes[r]} (rank {r})" for r in v.suspects)
        entries = m.differing.get(v.suspects[0], []) if v.suspects else []
        head = (f"silent data corruption at step {m.step}: replicas disagree and no majority decides; {named} are "
                f"all suspects (differing: {', '.join(entries[:_NAMES_SHOWN]) or '?'}"
                f"{f' and {len(entries) - _NAMES_SHOWN} more' if len(entries) > _NAMES_SHOWN else ''})")
    return (f"{head}; every replica returns to step {m.back_to}, the last state all agreed on, and retrains "
            f"{m.step - m.back_to} step(s)")


__all__ = ["Agreed", "DEFAULT_EVERY_STEPS", "Mismatch", "ReplicaCheck", "all_gather_vector", "describe",
           "differing_groups", "GROUPS"]
