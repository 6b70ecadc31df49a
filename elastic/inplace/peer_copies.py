"""Every rank's state kept in a peer's host memory, on another node.

A model sharded across every node (FSDP2 on a 1-D mesh) has no replica: a lost node takes
its shards with it, and without a copy elsewhere the job goes back to its last snapshot.
After every ``K``-th committed step each rank here

1. copies its own state to host memory (its shards and their optimizer state, its
   buffers, whole, as FSDP2 leaves them, and the run's own state: step, sampler
   position, RNG, registered user state, the recent batches' record): its **own copy**;
2. sends it to its **buddy**, a rank on the next node (:mod:`.buddies`), and receives the
   copies of the ranks whose buddy it is, all at once (every send and receive posted
   before any is waited on: a ring of blocking sends would wait on itself).

A copy is tagged with its step and becomes current only when every byte of it arrived
(double-buffered): until then the previous complete one stays, so a buddy never holds a
torn copy. Host memory per rank: one own copy and one buddy copy, and during an exchange
the next of each (:func:`.buddies.memory_problem` states the bound; a node without it says
so in one line and the world runs without copies).

A step is committed only once every rank's copy of it is complete: the exchange ends with
one tiny all-reduce, and until it succeeds each rank keeps its previous own and buddy
copies too. An exchange that fails (a peer lost in it) is not raised here: the run reports
the step as not trained (whatever some ranks applied, a re-formation stands every rank on
one step that every rank's state exists for) and re-forms the world as for any lost peer.
The assignment is made again at every world.

Over the world's own group with gloo (host tensors). On NCCL the copies are off for now,
with one line: they would need a gloo group of their own beside it.
"""

from __future__ import annotations

import json
import logging
import os
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from checkpoints.wire import decode, encode

from ..collectives import first_line, is_collective_failure
from .. import contract
from ..distributed import DistInfo, ElasticRunError
from . import buddies
from .memory_copies import MemoryCopies, World
from .transfer import _padded, plan

log = logging.getLogger("elastic.trainer")

AUTO = -1  # ``on``: the fewest steps between copies that keep them within COST_GOAL of a step
COST_GOAL = 0.05  # of a step's time (issue 52)
PROBE_COPIES = 3  # copies after consecutive steps, timed, before AUTO settles on its K


def peer_copy_setting(given: int | None, mesh: Any, info: DistInfo, where: str) -> int:
    """Steps between copies: ``peer_copy_every=`` or ``ELASTIC_PEER_COPY_EVERY``; 0: off;
    ``on`` (or True): :data:`AUTO`, the fewest steps that keep the copies within
    :data:`COST_GOAL` of a step, measured. Off unless asked for (with them, FSDP across every
    node recovers in place: :mod:`.fsdp_in_place`); off with one line on a backend other than gloo."""
    raw: Any = given if given is not None else os.environ.get(contract.PEER_COPY_EVERY_ENV, "").strip()
    if raw == "" or raw is None or raw is False:
        return 0
    if raw is True or (isinstance(raw, str) and raw.lower() in ("on", "auto")):
        every = AUTO
    else:
        try:
            every = int(raw)
        except (TypeError, ValueError):
            every = -1
        if every < 0:
            raise ElasticRunError(f"peer copies every {raw!r} steps: give a whole number of steps >= 1, 0 for none, "
                                  f"or on (the fewest steps that keep them within {COST_GOAL:.0%} of a step) "
                                  f"(peer_copy_every= or {contract.PEER_COPY_EVERY_ENV})")
    if every and info.backend != "gloo":
        if info.is_main:
            log.warning("%s peer copies off: they go over gloo and this run's backend is %s", where, info.backend)
        return 0
    return every


def peer_copies_asked(given: int | None) -> bool:
    """Whether the run asks for peer copies (before its backend is known: a bad value is
    :func:`peer_copy_setting`'s to refuse, in one line)."""
    raw: Any = given if given is not None else os.environ.get(contract.PEER_COPY_EVERY_ENV, "").strip()
    return raw not in ("", None, False, 0, "0")


@dataclass(frozen=True)
class Copy:
    """One complete copy of a rank's state, as of ``step`` (``nbytes``: its tensors' bytes)."""

    step: int
    rank: int  # the rank it is of, in the world it was taken in
    round: int  # that world's round (-1: not under elastic agent)
    payload: Any
    nbytes: int
    arena: Any = None  # its tensors' shared memory (checkpoints.arena.Arena), when made for a snapshot writer process
    tag: Any = None  # the caller's: which state it is of (elastic.trainer: the state's loads so far)


def _rebuild(value: Any, leaf: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with fresh containers and every tensor passed through ``leaf``, in order."""
    if isinstance(value, torch.Tensor):
        return leaf(value.detach())
    if isinstance(value, dict):
        return type(value)((k, _rebuild(v, leaf)) for k, v in value.items())
    if isinstance(value, list):
        return [_rebuild(v, leaf) for v in value]
    if isinstance(value, tuple):
        return tuple(_rebuild(v, leaf) for v in value)
    return value


def host_copy(tree: Any) -> tuple[Any, int]:
    """``tree`` with every tensor copied to host memory (pinned when CUDA is there), and the
    tensors' bytes. A copy, never a view: the live tensors change at the next step."""
    total = 0

    def leaf(value: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if value.device.type == "cpu":
            out = value.clone(memory_format=torch.contiguous_format)
        else:
            out = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            out.copy_(value, non_blocking=True)
        total += out.numel() * out.element_size()
        return out

    out = _rebuild(tree, leaf)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, total


def host_copy_shared(tree: Any) -> tuple[Any, int, Any]:
    """:func:`host_copy` into one :class:`checkpoints.arena.Arena`: shared memory that the
    snapshot writer process maps, so a snapshot of this step is written from these very
    bytes, not copied a second time. The tree, its tensors' bytes, the arena."""
    from checkpoints.arena import Arena
    from checkpoints.capture import copy_tensor

    sources: list[torch.Tensor] = []
    _rebuild(tree, sources.append)
    arena = Arena([(t.dtype, tuple(t.shape)) for t in sources])
    views = iter(arena.views)

    def leaf(value: torch.Tensor) -> torch.Tensor:
        out = next(views)
        if value.device.type == "cpu":
            copy_tensor(out, value)
        else:  # (not pinned: a plain device-to-host copy)
            out.copy_(value)
        return out

    out = _rebuild(tree, leaf)
    return out, sum(t.numel() * t.element_size() for t in sources), arena


def copy_for_snapshot(fed: Copy | None, step: int, tag: Any) -> Copy | None:
    """The host copy a snapshot of ``step`` is written from, or None (it captures its own):
    only a complete copy (:attr:`PeerCopies.fed` is set only then) of that very step, of
    the state as it stands (``tag``: the same loads since, so a step trained again after a
    rollback never takes the copy of its first try)."""
    if fed is None or fed.step != step or fed.tag != tag:
        return None
    return fed


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()


def swap(payload: Any, dst: int | None, srcs: list[int], group: Any = None) -> dict[int, Any]:
    """Send ``payload`` (host tensors) to ``dst`` and receive one from each of ``srcs``, every
    rank of the ring at once (:func:`exchange`)."""
    return exchange({dst: payload} if dst is not None else {}, srcs, group)


def _header(payload: Any) -> tuple[bytes, list[torch.Tensor]]:
    tensors: list[torch.Tensor] = []

    def index(t: torch.Tensor) -> int:
        tensors.append(t.detach())
        return len(tensors) - 1

    tree = encode(payload, index)
    return json.dumps({"tree": tree, "tensors": [[str(t.dtype).removeprefix("torch."), list(t.shape)]
                                                  for t in tensors]}).encode(), tensors


def exchange(sends: dict[int, Any], srcs: list[int], group: Any = None) -> dict[int, Any]:
    """Send each ``sends[dst]`` (host tensors) to ``dst`` and receive one payload from each of
    ``srcs``: each phase's receives and sends are posted before any is waited on, so every
    rank of a ring (or of any plan of moves) can do this at once. Returns src -> its payload,
    tensors in storage of their own."""
    outgoing = {dst: _header(payload) for dst, payload in sends.items()}
    # 1. the headers' lengths
    lengths = {src: torch.zeros(1, dtype=torch.int64) for src in srcs}
    works = [dist.irecv(lengths[src], src, group=group) for src in srcs]
    works += [dist.isend(torch.tensor([len(header)], dtype=torch.int64), dst, group=group)
              for dst, (header, _) in outgoing.items()]
    _wait(works)
    # 2. the headers
    raws = {src: torch.empty(int(lengths[src].item()), dtype=torch.uint8) for src in srcs}
    works = [dist.irecv(raws[src], src, group=group) for src in srcs]
    works += [dist.isend(torch.frombuffer(bytearray(header), dtype=torch.uint8), dst, group=group)
              for dst, (header, _) in outgoing.items()]
    _wait(works)
    # 3. the tensors: large ones as they are, small ones packed (transfer.plan, alike on both ends)
    incoming: dict[int, tuple[Any, list[torch.Tensor], list[int], list[list[int]], list[torch.Tensor]]] = {}
    works = []
    for src in srcs:
        head = json.loads(raws[src].numpy().tobytes())
        into = [torch.empty(tuple(shape), dtype=getattr(torch, dtype)) for dtype, shape in head["tensors"]]
        sizes = [t.numel() * t.element_size() for t in into]
        direct, buckets = plan(sizes)
        buffers = [torch.empty(sum(_padded(sizes[i]) for i in g), dtype=torch.uint8) for g in buckets]
        works += [dist.irecv(b, src, group=group) for b in buffers]
        works += [dist.irecv(into[i].reshape(-1), src, group=group) for i in direct]
        incoming[src] = (head["tree"], into, sizes, buckets, buffers)
    keep: list[torch.Tensor] = []  # alive until their sends complete
    for dst, (_, tensors) in outgoing.items():
        sizes = [t.numel() * t.element_size() for t in tensors]
        direct, buckets = plan(sizes)
        for g in buckets:
            buffer = torch.empty(sum(_padded(sizes[i]) for i in g), dtype=torch.uint8)
            offset = 0
            for i in g:
                buffer[offset:offset + sizes[i]].copy_(tensors[i].contiguous().reshape(-1).view(torch.uint8))
                offset += _padded(sizes[i])
            keep.append(buffer)
            works.append(dist.isend(buffer, dst, group=group))
        for i in direct:
            keep.append(tensors[i].contiguous().reshape(-1))
            works.append(dist.isend(keep[-1], dst, group=group))
    _wait(works)
    out = {}
    for src, (tree, into, sizes, buckets, buffers) in incoming.items():
        for buffer, g in zip(buffers, buckets):
            offset = 0
            for i in g:
                into[i].reshape(-1).view(torch.uint8).copy_(buffer[offset:offset + sizes[i]])
                offset += _padded(sizes[i])
        out[src] = decode(tree, into)
    return out


def _available_bytes() -> int | None:
    """MemAvailable of this host (None: unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def node_id(name: str) -> int:
    """A number for a node's name, alike on every rank (to group ranks by node)."""
    return zlib.crc32(name.encode())


class PeerCopies:
    """This rank's own copy and the copies it keeps for its buddies; see the module's doc.

    ``every``: steps between copies (0: off; :data:`AUTO`: after each of the first
    :data:`PROBE_COPIES` steps, timed, then the fewest that keep them within
    :data:`COST_GOAL` of a step, agreed by every rank). :meth:`world_formed` at every formation,
    :meth:`after_step` after every applied step; :attr:`failure` is a failed exchange's
    first line, for the run to fail its next step with."""

    def __init__(self, every: int, metrics: Any = None, available: Callable[[], int | None] = _available_bytes) -> None:
        self.auto = int(every) == AUTO
        self.every = 1 if self.auto else max(0, int(every))
        self._probe: list[tuple[float, float]] = []  # AUTO: (copy, step) seconds of the copies so far
        self.metrics = metrics
        self._available = available
        self.own: Copy | None = None
        self.held: dict[int, Copy] = {}  # rank (of the world the copy was taken in) -> its newest complete copy
        # the copies before those, kept while an exchange is not known complete on every rank
        self.own_prev: Copy | None = None
        self.held_prev: dict[int, Copy] = {}
        self.buddy: int | None = None  # who keeps this rank's copy in the current world
        self.keeps: list[int] = []  # whose copies this rank keeps in the current world
        self.failure: str | None = None
        self.off_reason: str | None = None  # said once; the world then runs without copies
        self._assigned = False
        self._round = -1
        self.last_seconds = 0.0
        self.last_bytes = 0
        # the own copy in the node's shared memory too, where it outlives this worker (set by the run)
        self.memory: MemoryCopies | None = None
        self.world_of: Callable[[], World] | None = None  # the run and world a copy is of
        # this rank's newest own copy, once complete, when a snapshot of its very step is due:
        # that snapshot is written from it (elastic.snapshots), not from a capture of its own
        self.fed: Copy | None = None

    @property
    def on(self) -> bool:
        return self.every > 0 and self.off_reason is None

    def held_bytes(self) -> int:
        copies = [self.own, self.own_prev, *self.held.values(), *self.held_prev.values()]
        return sum(c.nbytes for c in copies if c is not None)

    def world_formed(self, round_: int) -> None:
        """A new world: the ring is assigned again at its first copy (a collective, then)."""
        self._assigned, self._round, self.failure = False, round_, None

    def _assign(self, rank: int, world_size: int, node: str, local_world_size: int, state_bytes: int,
                device: torch.device) -> None:
        """The ring over this world's nodes, and whether every node has the memory (one all-gather)."""
        why = buddies.memory_problem(state_bytes, local_world_size, self._available())
        mine = torch.tensor([node_id(node), int(why is None)], dtype=torch.int64, device=device)
        rows = [torch.zeros_like(mine) for _ in range(world_size)]
        dist.all_gather(rows, mine)
        table = [r.tolist() for r in rows]
        if why is not None:  # this node says why, once: the world then runs without copies
            log.warning("[%s rank %d] peer copies off: %s; the job runs without them (a lost node then resumes from "
                        "the newest snapshot)", node, rank, why)
        short = sorted({r for r, (_, ok) in enumerate(table) if not ok})
        if short:
            self.off_reason = f"rank(s) {short} lack the host memory for them"
            self.own, self.held = None, {}
            return
        ring = buddies.ring(buddies.ranks_by_node([n for n, _ in table]))
        self.buddy = ring.get(rank)
        self.keeps = buddies.held_by(ring).get(rank, [])
        if self.buddy is None and rank == 0:
            log.info("[%s rank 0] peer copies: one node, no buddy on another node; none kept", node)
        self._assigned = True

    def due(self, step: int) -> bool:
        return self.on and step % self.every == 0

    def after_step(self, step: int, rank: int, world_size: int, node: str, local_world_size: int,
                   capture: Callable[[], Any], device: torch.device, step_seconds: float = 0.0,
                   force: bool = False, feed: bool = False, shared: bool = False, tag: Any = None) -> bool:
        """After applied step ``step``: copy and exchange when due (``force``: now, whatever
        ``K``: a world just formed, :meth:`elastic.trainer.ElasticRun._seed_copies`). False: the exchange failed
        (:attr:`failure` says how) and step ``step`` is not committed: its copies may be
        complete at some buddies and not at others, so the previous ones are kept.

        A copy is made current where it arrived whole; the previous one is dropped only once
        every rank's exchange is known complete (one tiny all-reduce). Until then a rank holds
        both: whichever step the ranks can all stand on after a loss, each still has it.

        ``feed``: a snapshot of this step is due, and is to be written from this copy: it is
        kept as :attr:`fed` once complete (until then, and without ``feed``, :attr:`fed` is
        None), with ``tag``; ``shared``: made in shared memory (:func:`host_copy_shared`), for
        the snapshot writer process to map."""
        if not (self.due(step) or (force and self.on)) or (world_size < 2 and self.memory is None):
            self._lag(step)
            return True
        started = time.perf_counter()
        self.fed = None  # a copy older than this step is never a snapshot's
        try:
            arena = None
            if shared and feed:
                payload, nbytes, arena = host_copy_shared(capture())
            else:
                payload, nbytes = host_copy(capture())
            made = Copy(step, rank, self._round, payload, nbytes, arena, tag)
            self._keep_in_memory(step, payload)
            if world_size < 2:
                self.fed = made if feed else None
                return True
            if not self._assigned:
                self._assign(rank, world_size, node, local_world_size, nbytes, device)
                if not self.on:
                    return True
            if self.buddy is not None or self.keeps:
                received = swap(payload, self.buddy, self.keeps)
                self.own_prev, self.own = self.own, made
                self.held_prev = {k: v for k, v in self.held.items() if k in self.keeps}
                self.held = {src: Copy(step, src, self._round, tree, _bytes(tree)) for src, tree in received.items()}
            elif self.memory is None:
                self.fed = made if feed else None
                return True
            # (one node: no buddy, but the step is committed only once every rank's memory copy is
            # complete, so a restart never finds a step trained whose copy some rank lacks)
            proposed = torch.tensor([self._propose(time.perf_counter() - started, step_seconds)], dtype=torch.int64,
                                    device=device)
            dist.all_reduce(proposed, op=dist.ReduceOp.MAX)  # fails if any rank's exchange did (it skips this)
        except RuntimeError as exc:
            if not is_collective_failure(exc):
                raise
            self.failure = first_line(exc)
            self._lag(step)
            return False
        self.own_prev, self.held_prev = None, {}
        self.fed = made if feed else None
        if int(proposed.item()) > 0:
            self._settle(int(proposed.item()), rank, node)
        self.last_seconds = time.perf_counter() - started
        self.last_bytes = nbytes + sum(c.nbytes for c in self.held.values())
        if self.metrics is not None:
            self.metrics.peer_copied(self.last_seconds, self.last_bytes, self.held_bytes())
        self._lag(step)
        return True

    def _keep_in_memory(self, step: int, payload: Any) -> None:
        """The own copy also in the node's shared memory, for a restarted worker (:mod:`.memory_copies`)."""
        if self.memory is None or self.world_of is None:
            return
        header, tensors = _header(payload)
        self.memory.write(step, header, tensors, self.world_of(), self._round)

    def _propose(self, copy_seconds: float, step_seconds: float) -> int:
        """AUTO: this rank's K once it timed :data:`PROBE_COPIES` copies (0: not yet, or not AUTO)."""
        if not self.auto or self.every != 1 or step_seconds <= 0:
            return 0
        self._probe.append((copy_seconds, step_seconds))
        if len(self._probe) < PROBE_COPIES:
            return 0
        copy = sorted(c for c, _ in self._probe)[len(self._probe) // 2]
        pace = sorted(s for _, s in self._probe)[len(self._probe) // 2]
        return buddies.every_k(copy, pace, COST_GOAL)

    def _settle(self, every: int, rank: int, node: str) -> None:
        """Every rank's K is the largest any rank proposed: the copies then cost every rank at most the goal."""
        copy = sorted(c for c, _ in self._probe)[len(self._probe) // 2] if self._probe else 0.0
        pace = sorted(s for _, s in self._probe)[len(self._probe) // 2] if self._probe else 0.0
        self.every, self._probe = every, []
        self.auto = False
        if rank == 0:
            log.info("[%s rank 0] peer copies every %d step(s): a copy takes %.1f ms here and a step %.1f ms, so "
                     "copies every %d keep within %.0f %% of a step (the steps a lost node rolls back: up to %d)",
                     node, every, copy * 1e3, pace * 1e3, every, COST_GOAL * 100, every - 1)

    def _lag(self, step: int) -> None:
        if self.metrics is not None and self.on and self.own is not None:
            self.metrics.peer_copy_lag(step - self.own.step)


def _bytes(tree: Any) -> int:
    from checkpoints.tree import iter_tensors

    return sum(t.numel() * t.element_size() for t in iter_tensors(tree))


__all__ = ["AUTO", "COST_GOAL", "Copy", "copy_for_snapshot", "exchange", "PeerCopies", "host_copy", "host_copy_shared", "node_id",
           "peer_copies_asked", "peer_copy_setting", "swap"]
