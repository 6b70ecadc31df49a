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
   chunks once, spread over the ranks), and this writer copies this rank's items to the
   CPU; that plan and that copy are the whole stall;
2. every rank, in the background: its items serialised into its file in the temp dir,
   fsync'd, then a small ``part-<rank>.json`` (its file, size, sha256, and where each item
   lies in it) written atomically;
3. rank 0, in the background: the other files, then waits for every rank's part, then
   DCP's ``.metadata`` (completed from the parts), the manifest and the fenced rename. A rank that never delivers (lost
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
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
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
    """One rank's share of a snapshot, copied at the step: each DCP item's index and its data
    (a tensor on the CPU, or bytes); none when nothing fell to this rank."""

    rank: int
    temp: str
    file: str
    items: list[tuple[MetadataIndex, torch.Tensor | bytes]]


class DeferredDcpWriter(FileSystemWriter):
    """``dcp.save``'s storage writer that copies this rank's items during the call and leaves
    serialising and the disk to the background (:func:`write_part`): the call returns as soon
    as the copy is made. Where each item lands in its file is known only once it is written,
    so each rank's part record carries it and rank 0 completes DCP's metadata at the seal
    (:func:`metadata_bytes`).

    ``temp_name`` (called on the coordinator only) names the temp dir every rank writes into.
    """

    def __init__(self, root: Path, temp_name: Callable[[], str],
                 stage: Callable[[MetadataIndex, torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__(root, single_file_per_rank=True, sync_files=True, overwrite=True)
        self._temp_name = temp_name
        self._stage = stage or _copy
        self.part: Part | None = None
        self.metadata: Metadata | None = None  # the coordinator's, without where each item lies yet
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
        items: list[tuple[MetadataIndex, torch.Tensor | bytes]] = []
        results = []
        for item in sorted(plan.items, key=lambda item: item.type != WriteItemType.BYTE_IO):  # as DCP orders them
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                items.append((item.index, data.getvalue()))
            else:  # a copy now: the step may change the tensor once the call returns
                items.append((item.index, self._stage(item.index, data.detach())))
            results.append(WriteResult(index=item.index, size_in_bytes=0,
                                       storage_data=dcp_private.storage_info(file, -1, -1)))  # rank 0 fills it in
        self.part = Part(self._rank, target.temp, file, items)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """On the coordinator: the metadata, kept for the seal (:func:`metadata_bytes`)."""
        metadata.version = dcp_private.VERSION
        metadata.storage_meta = self.storage_meta()
        self.metadata = metadata


def _copy(index: MetadataIndex, tensor: torch.Tensor) -> torch.Tensor:
    """A copy on the CPU (the default stage; the run's reuses pinned buffers for a GPU)."""
    return tensor.to("cpu") if tensor.device.type != "cpu" else tensor.clone()


def write_part(root: Path, part: Part) -> None:
    """Step 2: this rank's items serialised into its file in the temp dir, fsync'd, then its
    ``part-<rank>.json``: the file's size and sha256, and where each item lies in it."""
    temp = root / part.temp
    temp.mkdir(exist_ok=True)
    record = serialise_part(part, temp / part.file)
    tmp = temp / f".{part_name(part.rank)}.tmp"
    write_bytes(tmp, part_record_bytes(record))
    os.rename(tmp, temp / part_name(part.rank))


def part_record_bytes(record: dict[str, Any]) -> bytes:
    return json.dumps(record).encode()


def serialise_part(part: Part, path: Path) -> dict[str, Any]:
    """This rank's items serialised into the file ``path`` (none made when it has no item),
    fsync'd; returns its part record: the file, its size and sha256, where each item lies."""
    placed = []
    size, sha = 0, ""
    if part.items:
        digest = hashlib.sha256()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            for index, data in part.items:
                if isinstance(data, torch.Tensor):
                    buf = io.BytesIO()
                    torch.save(data if data.untyped_storage().nbytes() == data.numel() * data.element_size()
                               else data.clone(), buf)  # a view: its elements, not its whole storage
                    blob = buf.getbuffer()
                else:
                    blob = memoryview(data)
                _write_all(fd, blob)
                digest.update(blob)
                placed.append({"fqn": index.fqn, "offset": None if index.offset is None else list(index.offset),
                               "index": index.index, "at": size, "length": len(blob)})
                size += len(blob)
            os.fsync(fd)
        finally:
            os.close(fd)
        sha = digest.hexdigest()
    return {"rank": part.rank, "file": part.file if size else None, "size": size, "sha256": sha, "items": placed}


def metadata_bytes(metadata: Metadata, records: list[dict[str, Any]]) -> bytes:
    """DCP's ``.metadata``, pickled as FileSystemWriter writes it: the plan's metadata with
    where every rank's part record says each item lies."""
    storage = {}
    for record in records:
        for item in record.get("items", ()):
            index = MetadataIndex(item["fqn"], None if item["offset"] is None else torch.Size(item["offset"]),
                                  item["index"])
            storage[index] = dcp_private.storage_info(record["file"], int(item["at"]), int(item["length"]))
    metadata.storage_data = storage
    return pickle.dumps(metadata)


def _write_all(fd: int, data: Any) -> None:
    view = memoryview(data).cast("B")
    off = 0
    while off < len(view):
        off += os.write(fd, view[off:off + (64 << 20)])


def write_bytes(path: Path, data: Any) -> tuple[int, str]:
    """A new file holding ``data``, fsync'd; (size, sha256)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    view = memoryview(data).cast("B")
    return len(view), hashlib.sha256(view).hexdigest()


def wait_parts(temp: Path, ranks: int, deadline: float, abandoned: Callable[[], bool]) -> list[dict[str, Any]]:
    """Every rank's part record, once all ``ranks`` are there; SnapshotError naming the ranks
    missing when ``deadline`` (time.monotonic) passes or the snapshot is abandoned."""
    def read(rank: int) -> bytes | None:
        try:
            return (temp / part_name(rank)).read_bytes()
        except FileNotFoundError:
            return None

    return await_parts(temp.name, ranks, read, deadline, abandoned)


def await_parts(name: str, ranks: int, read: Callable[[int], bytes | None], deadline: float,
                abandoned: Callable[[], bool], pause: float = 0.005, most: float = 0.1) -> list[dict[str, Any]]:
    """:func:`wait_parts` over any storage: ``read(rank)`` gives a part record's bytes or None."""
    found: dict[int, dict[str, Any]] = {}
    while True:
        for rank in range(ranks):
            if rank in found:
                continue
            raw = read(rank)
            if raw is None:
                continue
            try:
                found[rank] = json.loads(raw)
            except ValueError:
                pass
        if len(found) == ranks:
            return [found[r] for r in range(ranks)]
        if abandoned() or time.monotonic() > deadline:
            missing = sorted(set(range(ranks)) - set(found))
            why = "the world changed" if abandoned() else "they did not arrive in time"
            raise SnapshotError(f"rank(s) {missing} never wrote their shards of {name} ({why}); "
                                "it is not a snapshot, and the next one takes its place")
        time.sleep(pause)
        pause = min(pause * 2, most)


__all__ = ["DCP_PREFIX", "DeferredDcpWriter", "Part", "ShardTarget", "await_parts", "is_dcp_key", "metadata_bytes",
           "part_name", "part_record_bytes", "serialise_part", "wait_parts", "write_part"]
