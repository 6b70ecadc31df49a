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

A NaN or an Inf is caught earlier, by the step itself (:mod:`.nonfinite`): a step whose
all-reduced gradients are non-finite is not applied, and the replicas vote at once
(:meth:`ReplicaCheck.vote_step`). No non-finite gradient is ever applied, so a replica
holding a NaN beside a finite majority cannot have spread it: it is healed from the
majority where it stands (0 steps lost), at that vote and at a periodic check alike; a
return to the last agreed state is kept for replicas that differ otherwise. Every replica
non-finite is a diverged training: every replica returns to the last agreed state (kept
only when finite) and the run stops (:attr:`ReplicaCheck.stop_line`).

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
from .. import contract
from .nonfinite import Do, decide, heals_in_place
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

    def returned_to(self, step: int) -> None: ...


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
    healed: bool = False  # non-finite outliers healed from the majority where they stand: nothing rolled back


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
        self.guarded = False  # every applied step's gradients were finite (.nonfinite): a NaN outlier never spread
        self.stop_line: str | None = None  # the training diverged: the run stops with this line (non-zero exit)
        self.finite_at = -1  # the last step whose state a vote found finite on every replica (a snapshot's shortcut)

    @property
    def kept_bytes(self) -> int:
        """The size of the host copy of the last agreed state this rank keeps (0: none yet):
        what a passing check costs in host memory, for ``bench/replica_check.py`` to report."""
        return sum(t.numel() * t.element_size() for t in self._buffers)

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
            return self._diverged(run)
        if verdict.methods_differ:
            if not self._warned_methods and run.dist.is_main:
                log.warning("[%s rank %d] replica check off: ranks fingerprint with different methods "
                            "(torch.hash_tensor on some, not others); run the same torch on every node",
                            run.dist.node, run.dist.rank)
            self._warned_methods = True
        if verdict.agreed:
            self._keep(run, fp)
            self.finite_at = run.state.step
            self.outcome = (True, f"the {len(rows)} replicas agree at step {run.state.step}"
                            + (" (not compared: ranks fingerprint with different methods)"
                               if verdict.methods_differ else ""))
            return False
        if self.guarded and heals_in_place(verdict):
            self._heal_outliers(run, fp, rows, verdict)
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

    def vote_step(self, run: CheckedRun, loss_finite: bool | None, recomputed: bool, skip: bool) -> Do:
        """The step's all-reduced gradients are non-finite (on every rank alike): vote now, before
        anything is applied, and carry out what :func:`.nonfinite.decide` says of it, up to the
        retrain (the run's). Each rank's loss flag (None: the script ran its own backward) rides
        in the vote's all-gather, so the line can name the node whose loss went non-finite."""
        self.outcome = None
        fp = _fingerprint(run, self.ignored)
        flag = 2 if loss_finite is None else int(not loss_finite)
        rows = all_gather_vector([*fp.digests(), int(not fp.finite), flag], run.dist)
        losses = [r[-1] for r in rows]
        rows = [r[:-1] for r in rows]
        if self.shard_ranks:
            verdict = vote_by_class([r[:-1] for r in rows], [bool(r[-1]) for r in rows], self.classes(len(rows)))
        else:
            verdict = vote([r[:-1] for r in rows], [bool(r[-1]) for r in rows])
        do = decide(False, verdict, recomputed, skip)
        step, d = run.state.step + 1, run.dist
        if do is Do.STOP and verdict.diverged:
            self._diverged(run)
        elif do is Do.HEAL:
            self._heal_outliers(run, fp, rows, verdict)
        elif do is Do.ROLLBACK:
            mismatch = self._describe(run, fp, rows, verdict)
            self.outcome = (False, describe(mismatch))
            self._last = (run.state.step, rows)
            if self.on_mismatch is not None:
                self.on_mismatch(mismatch, d)
            self._return(run)
        else:  # every replica finite and agreeing: this state is the newest agreed one
            self._keep(run, fp)
            self.finite_at = run.state.step
            self.outcome = (True, f"the {len(rows)} replicas agree at step {run.state.step}")
            nodes = _nodes(d) if any(v == 1 for v in losses) else []
            names = [f"node {n} (rank {r})" for r, n in enumerate(nodes) if losses[r] == 1]
            whose = (f"the loss went non-finite on {', '.join(names)}" if names else
                     "no rank's loss was non-finite" if all(v == 0 for v in losses) else "the losses were not seen")
            if do is Do.RECOMPUTE:
                if d.is_main:
                    log.warning("[%s rank %d] step %d: non-finite gradients with every replica's state finite and "
                                "agreeing (%s): a transient fault in a node's compute; nothing was applied, the step is "
                                "computed again once", d.node, d.rank, step, whose)
            elif do is Do.SKIP:
                if d.is_main:
                    log.warning("[%s rank %d] step %d: its gradients are non-finite again after a recompute (%s); "
                                "its batch is skipped, as %s=1 asks: no update for it", d.node, d.rank, step, whose,
                                contract.SKIP_NONFINITE_ENV)
            else:
                self.stop_line = (f"training diverged at step {step}: its gradients are non-finite again after a "
                                  f"recompute, with every replica's state finite and agreeing ({whose}); every replica "
                                  f"stands at step {run.state.step}, the last finite agreed state, and the job stops "
                                  f"(resume with a lower learning rate or gradient clipping, or set {contract.SKIP_NONFINITE_ENV}=1 to "
                                  "skip such a batch)")
        return do

    # ------------------------------------------------------------------ internals

    def _heal_outliers(self, run: CheckedRun, fp: Fingerprint, rows: list[list[int]], verdict: Verdict) -> None:
        """Replicas holding a NaN or an Inf beside a finite majority: no non-finite gradient was
        applied (:mod:`.nonfinite`), so the majority's state is the one every replica would hold;
        each outlier is healed from a majority replica of its shard where it stands, and what
        they now hold is the newest agreed state. Named, counted and told to the agent as any
        outlier (a node named twice is kept out)."""
        mismatch = self._describe(run, fp, rows, verdict, healed=True)
        self.outcome = (False, describe(mismatch))
        if self.on_mismatch is not None:
            self.on_mismatch(mismatch, run.dist)
        run.snapshots.wait_capture()  # an asynchronous snapshot copy must not read half-loaded state
        d, classes, local = run.dist, self.classes(run.dist.world_size), bool(self.shard_ranks)
        for rank in verdict.suspects:
            src = next(r for r in verdict.majority if classes[r] == classes[rank])
            if d.rank == src:
                send_state(run.state.capture(local=local), rank, collective_device(d))
            elif d.rank == rank:
                run.state.load(recv_state(src, collective_device(d)), local=local)
                log.warning("[%s rank %d] healed step %d from rank %d: this replica held non-finite values",
                            d.node, d.rank, run.state.step, src)
        self._last = None
        self._keep(run)


    def _keep(self, run: CheckedRun, fp: Fingerprint | None = None) -> None:
        digests = (fp or _fingerprint(run, self.ignored)).digests()
        state = host_copy(run.state.capture(local=bool(self.shard_ranks)), self._buffers)
        self._buffers = iter_tensors(state)
        self.agreed = Agreed(run.state.step, state, run.plan.recent_state(), digests)

    def _diverged(self, run: CheckedRun) -> bool:
        """Every replica holds a NaN or an Inf: the training diverged (the loop's doing, not a
        fault of one node; no replica is named). Training on would only keep NaN, and the
        snapshots would soon hold nothing else: every replica returns to the last agreed
        state (kept only when finite) and the run stops with :attr:`stop_line`. True: the
        run went back."""
        names = nonfinite_entries(run.state.module, run.state.optimizer,
                                  run.state.user.capture() if len(run.state.user) else None)
        at = run.state.step
        agreed = self.agreed if self.agreed is not None and self.agreed.step <= at else None
        back = (f"every replica returns to step {agreed.step}, the last finite state all agreed on, and the job stops"
                if agreed is not None else "no finite agreed state is kept, and the job stops")
        line = (f"training diverged: every replica holds non-finite values at step {at} ("
                + ", ".join(names[:_NAMES_SHOWN]) + (" ..." if len(names) > _NAMES_SHOWN else "")
                + f"); not silent data corruption, so no replica is named; {back} (resume with a lower learning "
                "rate or gradient clipping)")
        self.outcome = (False, line)
        self.diverged_at = self.diverged_at or at
        self.stop_line = line
        self._last = None
        if agreed is None:
            return False
        self._return(run)
        return True

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

    def _describe(self, run: CheckedRun, fp: Fingerprint, rows: list[list[int]], verdict: Verdict,
                  healed: bool = False) -> Mismatch:
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
        back_to = self.agreed.step if self.agreed is not None and not healed else run.state.step
        return Mismatch(run.state.step, back_to, verdict, [g[0] for g in gathered],
                        {r: differing.get(r, []) for r in verdict.suspects},
                        {r: gathered[r][4] for r in verdict.nonfinite}, self.shard_ranks, healed)

    def _return(self, run: CheckedRun) -> None:
        agreed = self.agreed
        if agreed is None:  # only a check with every_steps > 0 runs, and a world always keeps a baseline
            raise RuntimeError("replicas disagree and no agreed state was kept")
        run.snapshots.wait_capture()  # an asynchronous snapshot copy must not read half-loaded state
        local = bool(self.shard_ranks)
        run.state.load(map_state(agreed.state, lambda t, _w: t.clone()), local=local)  # the copy stays untouched
        run.plan.load_recent(agreed.recent)
        run.returned_to(agreed.step)
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


def _nodes(d: DistInfo) -> list[str]:
    """Every rank's node name (the rare path: one line names a node)."""
    names: list[Any] = [None] * d.world_size
    dist.all_gather_object(names, d.node)
    return [str(n) for n in names]


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
    if m.healed:
        return (f"{head}; no non-finite gradient was applied, so the majority's state is the true one: "
                f"{'the outlier is' if len(v.suspects) == 1 else 'the outliers are'} healed from it at step {m.step} "
                "and training goes on (0 steps lost)")
    return (f"{head}; every replica returns to step {m.back_to}, the last state all agreed on, and retrains "
            f"{m.step - m.back_to} step(s)")


__all__ = ["Agreed", "DEFAULT_EVERY_STEPS", "Mismatch", "ReplicaCheck", "all_gather_vector", "describe",
           "differing_groups", "GROUPS"]
