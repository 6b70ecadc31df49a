"""FSDP across every node, in place: the script's 1-D mesh re-formed over each world, a lost
node's shards taken from its buddies' memory.

A model sharded over a 1-D mesh spanning every node has no replica: each rank's shards exist
once, plus the copy its buddy on the next node keeps (:mod:`.peer_copies`, asked for with
``peer_copy_every``). Under ``elastic agent`` the run then keeps its processes when a node is
lost, as it does for DDP and HSDP:

1. FSDP2's own all-gathers and reduce-scatters record a lost peer instead of raising out of
   the script's forward and backward (:mod:`.fsdp_guard`); the step is abandoned at its
   commit point and nothing of it is applied.
2. The world re-forms (:mod:`.in_place_world`). Every rank reports what it holds (its
   position in the world before, its live step, its copies: :func:`.peer_restore.holding`)
   and :func:`.copy_plan.by_position` picks the highest step every position of the world
   before can stand on, and who holds each.
3. Each rank gathers its rows of the new cut of every parameter and of its optimizer state
   from whichever rank holds them (:func:`.peer_restore.regather`), the script's mesh is
   rebuilt over the new world and the model cut anew over it (:func:`.fsdp_private.reshard`),
   and the rows are loaded. At the same size and place (nothing moved) the shards stay.
   Buffers (BatchNorm's running stats, each rank's own and whole) come whole from one
   position: a survivor keeps its own, a spare takes a lost rank's (:func:`.copy_plan.buffers_of`).
4. A position held nowhere (a node lost together with the node that kept its copies, or a
   second loss before the new world's first copy): the newest snapshot, with one line
   naming why (:func:`.copy_plan.lost_together_line`).

Copies of the world before are dropped at every formation: their positions are that world's.
What touches torch's private attributes is in :mod:`.fsdp_private`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import DistInfo
from . import buddies, fsdp_guard, fsdp_private
from .copy_plan import CopyPlan, by_position, lost_together_line
from .fence import SocketFence
from .peer_copies import Copy, PeerCopies
from .peer_restore import gather, holding, regather

log = logging.getLogger("elastic.trainer")


class FsdpInPlace:
    """The takeover of one FSDP2 model's 1-D mesh; see the module's doc."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, sync: Any, copies: PeerCopies,
                 fence: SocketFence | None = None) -> None:
        from torch.distributed.tensor import DTensor

        self.model, self.optimizer, self.sink, self.copies, self.fence = model, optimizer, sync, copies, fence
        mesh = next(p.device_mesh for p in model.parameters() if isinstance(p, DTensor))
        self.mesh, self.names = mesh, tuple(mesh.mesh_dim_names or ("shard",))
        self.device_type = mesh.device_type
        self.cut = (int(mesh.get_local_rank()), int(mesh.size()))  # (index, of how many) the shards are cut as
        self.position: int | None = None  # this rank's rank in the world it last stood in (None: holds nothing)
        self.before = 0  # that world's size

    # ------------------------------------------------------------------ every formation

    def decide(self, info: DistInfo, has_state: bool, step: int) -> tuple[CopyPlan | None, int]:
        """Every rank's holdings, and the plan over the world before (None: no rank holds
        state, the job's start); and that world's size. Collectives over the new world."""
        device = torch.device("cpu")
        position = self.position if has_state else None
        claim = self._memory_claims() if position is None else []
        copied_in = self.copies.own.round if position is not None and self.copies.own is not None else -1
        rows = _all_gather_ints([fsdp_private.group_count(), self.before if position is not None else 0, copied_in],
                                info.world_size, device)
        fsdp_private.set_group_count(max(r[0] for r in rows))  # every rank names the new groups alike
        before = max(r[1] for r in rows)
        if claim:
            position = self._claim(claim, before, max(r[2] for r in rows))
        live = step if position is not None and has_state else None
        reports = gather(holding(self.copies, info.rank, position, live), info.world_size, device)
        if before == 0 or not any(r.position is not None for r in reports):
            return None, 0
        return by_position(reports, before), before

    def _memory_claims(self) -> list[tuple[int, int, int, int]]:
        """A restarted worker's own copies in its node agent's memory (:mod:`.memory_copies`)."""
        memory, world_of = self.copies.memory, self.copies.world_of
        return memory.in_place(world_of().run_id) if memory is not None and world_of is not None else []

    def _claim(self, claims: list[tuple[int, int, int, int]], before: int, round_before: int) -> int | None:
        """The position a restarted worker held in the world before, when its agent's memory
        holds its own copies of that very world (its size and round, as the survivors report
        it): they become its own copies, and the plan takes its position's state from them,
        not over the network from its buddy. A copy of an older world is not claimed."""
        mine = [c for c in claims if c[1] == before and c[3] == round_before and round_before >= 0]
        if not mine or len({c[2] for c in mine}) != 1:
            return None
        memory = self.copies.memory
        assert memory is not None
        copies = [Copy(step, rank, round_, payload, 0) for step, _, rank, round_ in mine
                  for payload in (memory.read(step),)]
        self.copies.own = copies[0]
        self.copies.own_prev = copies[1] if len(copies) > 1 else None
        return mine[0][2]

    def lost_line(self, decided: CopyPlan, node_ranks: Mapping[str, Sequence[int]]) -> str:
        """Why the world cannot stand on a step from memory (:func:`lost_line`)."""
        return lost_line(decided.missing, node_ranks)

    def rebuild(self, info: DistInfo) -> None:
        """The script's mesh over the current world, its shards cut anew if their place or the
        world's size changed (then their values are **not** kept: the caller loads them)."""
        from torch.distributed.device_mesh import DeviceMesh

        world = info.world_size
        with self.fence.adding() if self.fence is not None else contextlib.nullcontext():
            group = dist.new_group(ranks=list(range(world)))  # spans nodes: on the world's socket fence
        fresh = DeviceMesh.from_group(group, self.device_type, mesh=torch.arange(world), mesh_dim_names=self.names)
        fsdp_private.swap_mesh(self.mesh, fresh)
        if self.cut == (info.rank, world):
            info_ = fsdp_private.shard_only(self.mesh, 0)
            for g in fsdp_private.param_groups(self.model):
                fsdp_private.point_at(g, info_)
        else:
            fsdp_private.reshard(self.model, self.mesh)
            # the optimizer's state of the old cut goes too: what loads next (memory, or the disk,
            # whose loader builds the state for the new cut afresh) brings the new cut's
            self.optimizer.state.clear()
            self.cut = (info.rank, world)
        self.sink.failure = None

    def restore(self, decided: CopyPlan, before: int, info: DistInfo, capture_live: Callable[[], Any],
                load: Callable[[dict[str, Any]], None], load_recent: Callable[[Any], None]) -> int:
        """Stand this rank on ``decided.step`` from memory, cut for the current world; returns
        the tensor bytes it received. Collectives over the new world."""
        from checkpoints.tree import iter_tensors

        names = [n for n, _ in self.model.named_parameters()]
        lengths = {n: int(p.shape[0]) for n, p in self.model.named_parameters()}
        started = time.perf_counter()
        state = regather(decided, self.copies, info.rank, list(range(info.world_size)), before, names, lengths,
                         capture_live)
        self.rebuild(info)
        recent = state.pop("recent", None)
        load(state)
        if recent is not None:
            load_recent(recent)
        moved = sum(t.numel() * t.element_size() for t in iter_tensors({"model": state["model"],
                                                                           "optimizer": state["optimizer"]}))
        log.debug("rank %d: from peer memory at step %d in %.3f s", info.rank, decided.step,
                  time.perf_counter() - started)
        return moved

    def formed(self, info: DistInfo) -> None:
        """The world formed and this rank holds its state: its position from now on. The
        copies of the world before are dropped (their positions are that world's)."""
        self.position, self.before = info.rank, info.world_size
        c = self.copies
        c.own = c.own_prev = None
        c.held, c.held_prev = {}, {}

    def guard(self) -> None:
        """FSDP2's collectives record a lost peer in the run's ``GradSync.failure`` (:mod:`.fsdp_guard`)."""
        fsdp_guard.guard(self.model, self.sink)


def lost_line(missing: Sequence[int], node_ranks: Mapping[str, Sequence[int]]) -> str:
    """Why the world cannot stand on a step from memory, in one line: ``missing``, the
    positions held nowhere; ``node_ranks``, the world before's ranks by node (its ring of
    buddies is computed again from them, as every rank computed it). Pure."""
    node_of = {r: node for node, ranks in node_ranks.items() for r in ranks}
    by_node = sorted((sorted(ranks) for ranks in node_ranks.values() if ranks), key=lambda rs: rs[0])
    return lost_together_line(missing, node_of, buddies.ring(by_node))


def _all_gather_ints(row: list[int], world: int, device: torch.device) -> list[list[int]]:
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    out = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(out, mine)
    return [t.tolist() for t in out]


__all__ = ["FsdpInPlace", "lost_line"]
