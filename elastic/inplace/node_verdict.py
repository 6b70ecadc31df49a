"""HSDP in place: a node applies each step on all of its ranks, or on none.

Under HSDP a rank holds only its own shards, and its node's other ranks hold the rest. The
step's last collectives (the verdict on the replicas' all-reduces, the buffers, the control
value, a sharded snapshot's gather) span the world, and a node frozen or killed in one can
let it complete on one rank and cut it on another. The first applies the step, then waits
for the second in the next forward's all-gather, inside its own node, while the second has
gone to form the next world: the first hangs until gloo's timeout and crashes, and the
shards of the second's local rank stand a step behind everywhere (seen once: the world went
back to a snapshot, 4 steps lost).

So a rank applies step ``k`` only when every rank of its node would. Each posts its outcome
of ``k`` (a record of its own in the node's control directory, rewritten in place with one
``pwrite`` and checked by a CRC, since a rename cost up to a millisecond per step on a
loaded overlay filesystem where this costs microseconds):
*applies*, once every collective of the step completed on it, or *abandons*, when one
failed. Posting never waits, so a rank that abandons leaves at once; a rank that would apply
waits for its node's others and applies only if all would, else it abandons too. Between
the ranks of one node, on one filesystem: nothing in it can be cut by another node. Nodes
then differ only as wholes, and a node that applied ``k`` holds every shard of it
(:func:`.agreement.pair_shards`).

What counts as a peer's outcome of ``(round, k)`` (:func:`outcome`): its post of it; a post
of a later step of the round (it could only get there by applying ``k``); a post of a later
round without one of ``k`` (it abandoned ``k`` and moved on), or its process gone (its agent
starts it again, holding nothing): abandons. Otherwise it has not decided yet. A peer frozen
on its own stops the wait as it stops any collective; the hang watchdog answers both.
"""

from __future__ import annotations

import os
import time
import zlib
from enum import Enum
from pathlib import Path
from typing import Sequence

from checkpoints.pids import pid_alive

from .. import contract

KEPT = 4  # posts each rank keeps: a peer can be at most two ahead of one that reads (see outcome)
RECORD = 256  # bytes of a rank's record: its posts, padded, then their CRC-32 in 8 hex digits
POLL_S = (0.0, 0.0002, 0.001, 0.005)  # the wait's sleeps, 50 of each, growing (0: a yield): the node's ranks finish a step together


class Outcome(str, Enum):
    APPLIES = "applies"
    ABANDONS = "abandons"


Post = tuple[int, int, Outcome]  # (round, step, outcome)


def outcome(posts: Sequence[Post], round_: int, step: int, alive: bool) -> Outcome | None:
    """A peer's outcome of ``step`` in ``round_`` from its posts, newest last (None: not yet)."""
    for r, s, said in posts:
        if (r, s) == (round_, step):
            return said
    if any(r == round_ and s > step for r, s, _ in posts):
        return Outcome.APPLIES
    if any(r > round_ for r, _, _ in posts) or not alive:
        return Outcome.ABANDONS
    return None


def encode(pid: int, posts: Sequence[Post]) -> bytes:
    """One fixed-size record: written over the last in place, so a reader never finds the file
    missing; a torn read fails its CRC and is read again."""
    body = "\n".join([str(pid)] + [f"{r} {s} {o.value}" for r, s, o in posts]).encode()
    if len(body) > RECORD - 8:
        raise ValueError(f"{len(body)} bytes of posts do not fit a {RECORD}-byte record")
    body = body.ljust(RECORD - 8)
    return body + b"%08x" % zlib.crc32(body)


def decode(data: bytes) -> tuple[int, list[Post]]:
    """(pid, posts); a record torn by a concurrent write, or not this module's, raises ValueError."""
    body, crc = data[:RECORD - 8], data[RECORD - 8:RECORD]
    if len(data) != RECORD or b"%08x" % zlib.crc32(body) != crc:
        raise ValueError("not a whole record")
    lines = body.rstrip().decode().splitlines()
    pid = int(lines[0])
    posts = []
    for line in lines[1:]:
        r, s, o = line.split()
        posts.append((int(r), int(s), Outcome(o)))
    return pid, posts


class NodeVerdict:
    """One rank's side: :meth:`agree` where it would apply a step, :meth:`abandon` where it does not."""

    def __init__(self, directory: Path, local_rank: int, local_world: int) -> None:
        self.directory, self.local_rank, self.local_world = directory, local_rank, local_world
        self.posts: list[Post] = []
        self._fd = os.open(self._file(local_rank), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        # This process's record, empty, before it can be in any world: a peer never reads the
        # posts of the process it replaced (dead, which would read as abandoning).
        os.pwrite(self._fd, encode(os.getpid(), []), 0)

    def _file(self, local_rank: int) -> Path:
        return self.directory / contract.NODE_VERDICT_FILE.format(local_rank=local_rank)

    def _post(self, round_: int, step: int, said: Outcome) -> None:
        self.posts = [p for p in self.posts if (p[0], p[1]) != (round_, step)][-(KEPT - 1):] + [(round_, step, said)]
        os.pwrite(self._fd, encode(os.getpid(), self.posts), 0)

    def abandon(self, round_: int, step: int) -> None:
        """This rank does not apply ``step``; its node's others will not either."""
        self._post(round_, step, Outcome.ABANDONS)

    def agree(self, round_: int, step: int) -> str | None:
        """This rank would apply ``step``: None when every rank of the node would too, else
        why not (then this rank abandons it as well)."""
        self._post(round_, step, Outcome.APPLIES)
        waiting = [r for r in range(self.local_world) if r != self.local_rank]
        polls = 0
        while waiting:
            for peer in list(waiting):
                said = self._read(peer, round_, step)
                if said is Outcome.ABANDONS:
                    self.abandon(round_, step)
                    return f"local rank {peer} of this node abandoned step {step}"
                if said is Outcome.APPLIES:
                    waiting.remove(peer)
            if waiting:
                time.sleep(POLL_S[min(polls // 50, len(POLL_S) - 1)])
                polls += 1
        return None

    def _read(self, peer: int, round_: int, step: int) -> Outcome | None:
        try:
            pid, posts = decode(self._file(peer).read_bytes())
        except (OSError, ValueError, IndexError):
            return None  # not posted yet (or a record being written)
        return outcome(posts, round_, step, pid_alive(pid))


def for_this_node(local_world: int) -> NodeVerdict | None:
    """The verdict of this worker's node, when it runs in place under the agent with more
    than one local rank (None otherwise: nothing to agree on)."""
    from .. import worker_env

    env = worker_env.read()
    if not env.node.control_dir or local_world <= 1:
        return None
    return NodeVerdict(Path(env.node.control_dir), env.me.local_rank, local_world)


__all__ = ["NodeVerdict", "Outcome", "for_this_node", "outcome"]
