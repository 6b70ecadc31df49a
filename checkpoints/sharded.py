"""Sharded snapshots: every rank writes its own shards, in DCP's layout, and rank 0 seals them.

A sharded model (FSDP2/HSDP) has no rank that holds the whole state, and gathering it to one
costs a full copy on that rank and the whole write on one disk. So every rank writes its own
shards, at once, into one temp dir of the snapshot directory (shared by every node, as for
any snapshot), and the snapshot is sealed exactly as a whole one is: a manifest over every
file, signed, renamed into ``step-<N>/`` under the fence (:mod:`.store`). Until that rename no
reader sees any shard of the step, so no reader can see some shards without the others.

The files are ``torch.distributed.checkpoint``'s own (``__<rank>_0.distcp`` and
``.metadata``), so a user can ``dcp.load`` a snapshot into their own FSDP2 model at any
shard and replica count, and the run resumes through the same ``dcp.load`` (resharding for
free). Their manifest keys start with :data:`DCP_PREFIX`: the store checks their size and
sha256 but never deserialises them itself; the rest of the state (sampler, progress, RNG,
the loop's registered state) are ordinary snapshot files written by rank 0.

The order of one snapshot (the rank side is :class:`DeferredDcpWriter`, the seal
:meth:`checkpoints.store.SnapshotStore.seal_parts`):

1. every rank, at the same step, inside ``dcp.save``: DCP plans who writes what (replicated
   chunks once, spread over the ranks), and this writer serialises this rank's items into
   memory; that copy is the whole stall;
2. every rank, in the background: its file into the temp dir, fsync'd, then a small
   ``part-<rank>.json`` (its file, size, sha256) written atomically;
3. rank 0, in the background: ``.metadata`` and the other files, then waits for every
   rank's part, then the manifest and the fenced rename. A rank that never delivers (lost
   meanwhile) leaves the temp dir unsealed: no snapshot, and a later save cleans it up.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from . import dcp_private
from .errors import SnapshotError
from .manifest import DCP_PREFIX, is_dcp_key

PART_PREFIX = "part-"


def part_name(rank: int) -> str:
    return f"{PART_PREFIX}{rank:05d}.json"


@dataclass(frozen=True)
class ShardTarget:
    """What the coordinator tells every rank in DCP's plan: its file prefix and the temp dir."""

    prefix: str
    temp: str


@dataclass
class Part:
    """One rank's serialised shards: its file name and bytes (empty: nothing fell to it)."""

    rank: int
    temp: str
    file: str
    data: io.BytesIO

    @property
    def size(self) -> int:
        return self.data.getbuffer().nbytes


class DeferredDcpWriter(FileSystemWriter):
    """``dcp.save``'s storage writer that copies this rank's items into memory during the call
    and leaves the disk to the background (:func:`write_part`): the call returns as soon as
    the copy is made, with the offsets DCP's metadata needs already known.

    ``temp_name`` (called on the coordinator only) names the temp dir every rank writes into.
    """

    def __init__(self, root: Path, temp_name: Callable[[], str]) -> None:
        super().__init__(root, single_file_per_rank=True, sync_files=True, overwrite=True)
        self._temp_name = temp_name
        self.part: Part | None = None
        self.metadata: bytes | None = None  # the coordinator's pickled ``.metadata``
        self._rank = 0

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self._rank = int(kwargs.get("rank") or 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan  # no directory yet: the background makes the temp dir

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        temp = self._temp_name()
        return [dataclasses.replace(plan, storage_data=ShardTarget(f"__{i}_", temp)) for i, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        target: ShardTarget = plan.storage_data
        file = f"{target.prefix}0{dcp_private.SUFFIX}"
        buf = io.BytesIO()
        results = []
        items = sorted(plan.items, key=lambda item: item.type != WriteItemType.BYTE_IO)  # as DCP orders them
        for item in items:
            data = planner.resolve_data(item)
            offset = buf.tell()
            if item.type == WriteItemType.BYTE_IO:
                buf.write(data.getbuffer())
            else:
                tensor = data.detach()
                if tensor.device.type != "cpu":
                    tensor = tensor.to("cpu")
                if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
                    tensor = tensor.clone()  # a view: save its elements, not its whole storage
                torch.save(tensor, buf)  # serialised now: the step may change the tensor after the call
            length = buf.tell() - offset
            results.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=dcp_private.storage_info(file, offset, length)))
        self.part = Part(self._rank, target.temp, file, buf)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """On the coordinator: the metadata as FileSystemWriter would write it, kept for the seal."""
        metadata.version = dcp_private.VERSION
        metadata.storage_data = {r.index: r.storage_data for rank_results in results for r in rank_results}
        metadata.storage_meta = self.storage_meta()
        self.metadata = pickle.dumps(metadata)


def write_part(root: Path, part: Part) -> None:
    """Step 2: this rank's file into the temp dir, fsync'd, then its ``part-<rank>.json``."""
    temp = root / part.temp
    temp.mkdir(exist_ok=True)
    view = part.data.getbuffer()
    size, sha = write_bytes(temp / part.file, view) if part.size else (0, "")
    record = {"rank": part.rank, "file": part.file if size else None, "size": size, "sha256": sha}
    tmp = temp / f".{part_name(part.rank)}.tmp"
    write_bytes(tmp, json.dumps(record).encode())
    os.rename(tmp, temp / part_name(part.rank))


def write_bytes(path: Path, data: Any) -> tuple[int, str]:
    """A new file holding ``data``, fsync'd; (size, sha256)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        view = memoryview(data)
        off = 0
        while off < len(view):
            off += os.write(fd, view[off:off + (64 << 20)])
        os.fsync(fd)
    finally:
        os.close(fd)
    return len(view), hashlib.sha256(view).hexdigest()


def wait_parts(temp: Path, ranks: int, deadline: float, abandoned: Callable[[], bool]) -> list[dict[str, Any]]:
    """Every rank's part record, once all ``ranks`` are there; SnapshotError naming the ranks
    missing when ``deadline`` (time.monotonic) passes or the snapshot is abandoned."""
    pause = 0.005
    while True:
        found = {}
        for rank in range(ranks):
            try:
                found[rank] = json.loads((temp / part_name(rank)).read_bytes())
            except (FileNotFoundError, ValueError):
                pass
        if len(found) == ranks:
            return [found[r] for r in range(ranks)]
        if abandoned() or time.monotonic() > deadline:
            missing = sorted(set(range(ranks)) - set(found))
            why = "the world changed" if abandoned() else "they did not arrive in time"
            raise SnapshotError(f"rank(s) {missing} never wrote their shards of {temp.name} ({why}); "
                                "it is not a snapshot, and the next one takes its place")
        time.sleep(pause)
        pause = min(pause * 2, 0.1)


__all__ = ["DCP_PREFIX", "DeferredDcpWriter", "Part", "ShardTarget", "is_dcp_key", "part_name", "wait_parts",
           "write_part"]
