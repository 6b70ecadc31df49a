"""Each rank's own peer copy also kept in its node's shared memory, where it outlives the worker.

A restarted worker (a crashed one, the restart path, a script the agent starts again) has
lost the host copy :mod:`.peer_copies` kept in its process. Its node agent outlives it, so
the agent gives its workers a directory in shared memory (``/dev/shm`` where it exists,
:data:`elastic.contract.MEMORY_COPY_DIR_ENV`), removed when the agent ends; each rank
writes its own copy there as it makes it, and a restarted world loads from there instead
of the snapshot directory or bucket when every rank holds a complete copy of the same step,
of the same run and world, no older than the newest snapshot (:func:`choose`).

A copy is written to a temp name and renamed when complete: a reader never sees a torn
one. Each local rank keeps at most two: before writing step ``s`` it drops all but its
newest, so a worker killed mid-write still holds the one before. That is enough for every
rank to share a step: a step is committed (reported trained) only once every rank's copy
of it is written (:mod:`.peer_copies` ends each copy with one tiny all-reduce, on one node
too), so the ranks' newest copies are never more than one copy apart, and the step every
rank holds is the last one reported trained.

The file is the peer exchange's header (tagged JSON, no pickle, :mod:`checkpoints.wire`)
with the run and world it was taken in, then the tensors' bytes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from checkpoints.wire import decode


log = logging.getLogger("elastic.trainer")

MAGIC = b"ELASTIC-MEMORY-COPY-1\n"
_LEN = struct.Struct("!Q")
_ALIGN = 64  # every tensor's bytes start at a multiple of it (a view needs its dtype's alignment)
SUFFIX = ".copy"

UNKNOWN_SNAPSHOT = -2  # the newest snapshot's step could not be read: memory is not known to be newer

# why a rank holds no usable copy (a row's first number in :func:`choose`)
USABLE, NONE, OTHER_RUN, OTHER_WORLD, UNREADABLE = 0, 1, 2, 3, 4
_WHY = {NONE: "no copy in memory", OTHER_RUN: "a copy of another run", OTHER_WORLD: "a copy of another world",
        UNREADABLE: "an unreadable copy"}


@dataclass(frozen=True)
class World:
    """The run and world a copy was taken in: a copy loads only into the same."""

    run_id: str
    world_size: int
    rank: int
    local_world_size: int
    mesh: tuple[int, ...] | None  # a sharded model's mesh shape: the cut of its shards

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["mesh"] = list(self.mesh) if self.mesh is not None else None
        return out


def _pad(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _name(local_rank: int, step: int) -> str:
    return f"rank-{local_rank}.step-{step:012d}{SUFFIX}"


class MemoryCopies:
    """One local rank's copies in ``directory`` (the agent's, in shared memory)."""

    def __init__(self, directory: Path, local_rank: int) -> None:
        self.directory, self.local_rank = Path(directory), local_rank
        self.off_reason: str | None = None
        self.last_bytes = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "MemoryCopies | None":
        """The agent's directory for this local rank (None: not given, as under plain torchrun)."""
        from ..worker_env import read

        env = read(environ)
        given = (env.node.memory_dir or "").strip()
        return cls(Path(given), env.me.local_rank) if given else None

    def steps(self) -> list[int]:
        """The steps of this local rank's complete copies, newest first."""
        prefix = f"rank-{self.local_rank}.step-"
        try:
            names = os.listdir(self.directory)
        except OSError:
            return []
        out = []
        for name in names:
            if name.startswith(prefix) and name.endswith(SUFFIX):
                digits = name[len(prefix):-len(SUFFIX)]
                if digits.isdigit():
                    out.append(int(digits))
        return sorted(out, reverse=True)

    def write(self, step: int, header: bytes, tensors: Sequence[torch.Tensor], world: World,
              round_: int = -1) -> None:
        """Keep the copy of ``step`` (its peer-exchange header and host tensors): all but
        the newest copy dropped first, then written to a temp name and renamed. A full or
        missing directory turns the memory copies off with one line (the job goes on)."""
        if self.off_reason is not None:
            return
        for old in self.steps()[1:]:
            self._drop(old)
        self._drop_torn()
        head = json.loads(header)
        head["world"], head["step"], head["round"] = world.as_json(), step, round_
        raw = json.dumps(head).encode()
        final = self.directory / _name(self.local_rank, step)
        tmp = self.directory / f".{final.name}.{os.getpid()}.tmp"
        sizes = [t.numel() * t.element_size() for t in tensors]
        need = len(MAGIC) + _LEN.size + len(raw) + _ALIGN + sum(_pad(s) for s in sizes)
        try:
            free = shutil.disk_usage(self.directory).free
            if need > free:
                self._off(f"a copy needs {need >> 20} MiB and {self.directory} has {free >> 20} MiB free")
                return
            with open(tmp, "wb") as f:
                f.write(MAGIC)
                f.write(_LEN.pack(len(raw)))
                f.write(raw)
                f.write(b"\0" * (_pad(f.tell()) - f.tell()))
                for t, size in zip(tensors, sizes):
                    if size:
                        f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
                    f.write(b"\0" * (_pad(size) - size))
            os.replace(tmp, final)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            self._off(f"{self.directory}: {exc.strerror or exc}")
            return
        self.last_bytes = need

    def _off(self, why: str) -> None:
        self.off_reason = why
        log.warning("[local rank %d] memory copies off: %s; a restart of this node's workers loads the newest "
                    "snapshot instead", self.local_rank, why)

    def _drop_torn(self) -> None:
        """Temp files this local rank's earlier worker left when it was killed mid-write."""
        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        for name in names:
            if name.startswith(f".rank-{self.local_rank}.step-") and name.endswith(".tmp"):
                (self.directory / name).unlink(missing_ok=True)

    def _drop(self, step: int) -> None:
        try:
            (self.directory / _name(self.local_rank, step)).unlink()
        except OSError:
            pass

    def _header(self, step: int) -> tuple[dict[str, Any], int]:
        with open(self.directory / _name(self.local_rank, step), "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                raise ValueError("not a memory copy")
            (n,) = _LEN.unpack(f.read(_LEN.size))
            head = json.loads(f.read(n))
            return head, _pad(len(MAGIC) + _LEN.size + n)

    def held(self, world: World) -> tuple[int, list[int]]:
        """(why code, the steps held) for this world: :data:`USABLE` and up to two steps, or
        the reason none is usable (the newest copy's)."""
        steps = self.steps()[:2]
        if not steps:
            return NONE, []
        usable, reasons = [], []
        for step in steps:
            try:
                head, _ = self._header(step)
            except (OSError, ValueError):
                reasons.append(UNREADABLE)
                continue
            if head.get("world", {}).get("run_id") != world.run_id:
                reasons.append(OTHER_RUN)
            elif head.get("world") != world.as_json() or head.get("step") != step:
                reasons.append(OTHER_WORLD)
            else:
                usable.append(step)
        return (USABLE, usable) if usable else (reasons[0], [])

    def in_place(self, run_id: str) -> list[tuple[int, int, int, int]]:
        """This local rank's copies of run ``run_id``, newest first, as (step, world size,
        rank, round) of the world each was taken in: a restarted worker of a world that
        re-forms in place claims its old position with them (:mod:`.fsdp_in_place`)."""
        out = []
        for step in self.steps()[:2]:
            try:
                head, _ = self._header(step)
            except (OSError, ValueError):
                continue
            world = head.get("world", {})
            if world.get("run_id") == run_id and head.get("step") == step:
                out.append((step, int(world["world_size"]), int(world["rank"]), int(head.get("round", -1))))
        return out

    def read(self, step: int) -> Any:
        """The payload of this rank's copy of ``step`` (its tensors in memory of their own)."""
        head, offset = self._header(step)
        path = self.directory / _name(self.local_rank, step)
        tensors = []
        with open(path, "rb") as f:  # each tensor read straight into memory of its own
            f.seek(offset)
            for dtype, shape in head["tensors"]:
                t = torch.empty(tuple(shape), dtype=getattr(torch, dtype))
                size = t.numel() * t.element_size()
                if size and f.readinto(t.reshape(-1).view(torch.uint8).numpy()) != size:
                    raise ValueError(f"{path.name}: shorter than its header says")
                f.seek(_pad(size) - size, os.SEEK_CUR)
                tensors.append(t)
        return decode(head["tree"], tensors)


def choose(rows: Sequence[Sequence[int]], snapshot_step: int) -> tuple[int | None, str]:
    """Whether a (re)started world loads from its nodes' memory: the step to load, or None
    and why not, in a few words. ``rows[r]``: rank ``r``'s why code then the steps of its
    usable copies (-1: none); ``snapshot_step``: the newest snapshot's (-1: none,
    :data:`UNKNOWN_SNAPSHOT`: unreadable). Memory
    only when every rank holds a copy of one same step, the newest such, no older than the
    snapshot: never a mix of sources, never a step behind the snapshot."""
    lacking: dict[int, list[int]] = {}
    for rank, (why, *_) in enumerate(rows):
        if why != USABLE:
            lacking.setdefault(why, []).append(rank)
    if lacking:
        return None, "; ".join(f"rank(s) {ranks} hold {_WHY.get(why, 'no copy')}" for why, ranks in sorted(lacking.items()))
    held = [{s for s in steps if s >= 0} for _, *steps in rows]
    common = set.intersection(*held) if held else set()
    if not common:
        return None, f"the ranks' copies are of different steps ({sorted(max(h) for h in held)})"
    step = max(common)
    if snapshot_step == UNKNOWN_SNAPSHOT:
        return None, "the snapshot directory could not be listed (the copies are not known to be newer)"
    if step < snapshot_step:
        return None, f"the memory copies (step {step}) are older than snapshot step {snapshot_step}"
    return step, ""


__all__ = ["MemoryCopies", "UNKNOWN_SNAPSHOT", "World", "choose"]
