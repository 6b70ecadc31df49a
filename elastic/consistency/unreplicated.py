"""Non-finite gradients in a model sharded with no replica (FSDP2 over a 1-D mesh).

No rank holds another's shards, so no vote can name an outlier or heal one (DDP and HSDP:
:meth:`.check.ReplicaCheck.vote_step`). What the ranks can still tell, in one small
all-gather on this rare path, is whether each one's shards of the state are finite and
whether its loss was: :func:`.nonfinite.decide_unreplicated` turns that into a recompute
of the step, a skipped batch, or the end of the job (one line, a non-zero exit).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from .. import contract
from ..distributed import DistInfo
from .fingerprint import nonfinite_entries
from .nonfinite import Do, decide_unreplicated

log = logging.getLogger(__name__)
_NAMES_SHOWN = 4


@dataclass(frozen=True)
class Answer:
    do: Do
    line: str | None = None  # the job stops with it (``Do.STOP``)
    state_nonfinite: bool = False  # a shard of the state holds a NaN or an Inf: nothing may be committed


def step_without_replica(run: Any, loss_finite: bool | None, recomputed: bool, skip: bool) -> Answer:
    """The step's gradients are non-finite on some rank (every rank knows it alike): what now.
    ``loss_finite``: this rank's loss (None: the script ran its own backward, unseen)."""
    from .check import all_gather_vector  # the check's one small all-gather helper

    d: DistInfo = run.dist
    user = run.state.user
    bad = nonfinite_entries(run.state.module, run.state.optimizer, user.capture() if len(user) else None)
    loss = 2 if loss_finite is None else int(not loss_finite)
    rows = all_gather_vector([int(bool(bad)), loss], d)
    do = decide_unreplicated(not any(r[0] for r in rows), recomputed, skip)
    step = run.state.step + 1
    names: list[Any] = []
    if any(r[0] or r[1] == 1 for r in rows):  # the rare path of a rare path: name the nodes
        import torch.distributed as dist

        names = [None] * d.world_size
        dist.all_gather_object(names, (d.node, bad[:_NAMES_SHOWN]))
    if any(r[0] for r in rows):
        where = "; ".join(f"node {names[r][0]} (rank {r}: {', '.join(names[r][1])})"
                          for r, row in enumerate(rows) if row[0])
        return Answer(do, f"step {step}: non-finite values in the model's shards on {where}, which no replica holds "
                          "(FSDP without a replicate dimension), so nothing can heal them; nothing non-finite was "
                          "applied or snapshotted, so the newest snapshot is the last finite state, and the job stops "
                          "(start it again: it resumes from that snapshot)", state_nonfinite=True)
    losses = [r[1] for r in rows]
    named = [f"node {names[r][0]} (rank {r})" for r, v in enumerate(losses) if v == 1]
    whose = (f"the loss went non-finite on {', '.join(named)}" if named else
             "no rank's loss was non-finite" if all(v == 0 for v in losses) else "the losses were not seen")
    if do is Do.RECOMPUTE:
        if d.is_main:
            log.warning("[%s rank %d] step %d: non-finite gradients with every shard of the state finite (%s): a "
                        "transient fault in a node's compute; nothing was applied, the step is computed again once",
                        d.node, d.rank, step, whose)
        return Answer(do)
    if do is Do.SKIP:
        if d.is_main:
            log.warning("[%s rank %d] step %d: its gradients are non-finite again after a recompute (%s); its batch "
                        "is skipped, as %s=1 asks: no update for it", d.node, d.rank, step, whose,
                        contract.SKIP_NONFINITE_ENV)
        return Answer(do)
    return Answer(do, f"training diverged at step {step}: its gradients are non-finite again after a recompute, "
                      f"with every shard of the state finite ({whose}); the model stands at step {run.state.step}, "
                      "the last finite state, and the job stops (resume with a lower learning rate or gradient "
                      f"clipping, or set {contract.SKIP_NONFINITE_ENV}=1 to skip such a batch)")


__all__ = ["Answer", "step_without_replica"]
