"""``torch.distributed.checkpoint`` reads a sharded snapshot straight from the object store.

A sharded snapshot in ``s3://`` (:mod:`.s3parts`) is an ordinary DCP checkpoint under its
writer's prefix, so ``dcp.load`` needs only a storage reader that fetches bytes: each rank
fetches exactly the byte ranges its own shards need (one ranged GET per item), never the
whole snapshot. What it fetches is checked against the signed manifest first:

* ``.metadata`` is fetched whole and its sha256 compared with the manifest's before it is
  unpickled (DCP unpickles it; a forged one must never get that far);
* every shard file's ETag is the one the store's load bound when it verified the manifest
  (the third element of each ``DCP_FILES_KEY`` record, from one listing), and each ranged GET
  asks for it (``If-Match``), so a file replaced after that verification is refused rather
  than read, even before its first read; its items are loaded with
  ``torch.load(weights_only=True)``, as DCP's own reader does. A record of two elements (a
  caller's own ``(size, sha256)``) has no ETag bound: this reader binds the one its first
  read meets (a file replaced before that is not caught).

Give it what :meth:`.reading.SnapshotReader.load` returned: the directory
(``DCP_DIR_KEY``) and the manifest's record of each file (``DCP_FILES_KEY``). A refusal is a
:class:`.errors.SnapshotCorruptError`, which ``dcp.load`` wraps in its CheckpointException
(:func:`unwrapped` finds it); every rank of ``dcp.load`` raises it, whichever rank met it.
"""

from __future__ import annotations

import hashlib
import io
import pickle
from typing import Any, Mapping

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from . import dcp_private
from .errors import SnapshotCorruptError
from .location import LocationError, is_remote, parse_s3


class S3DcpReader(StorageReader):
    """``dcp.load(state, storage_reader=S3DcpReader(url, files))``; ``files``: name ->
    (size, sha256, etag) from the verified manifest, as the store's load returns it (or
    (size, sha256): the ETag of the first read is bound then)."""

    def __init__(self, url: str, files: Mapping[str, tuple[int, str] | tuple[int, str, str]],
                 **s3_options: Any) -> None:
        from .s3client import S3Objects

        super().__init__()
        self.url = str(url).rstrip("/")
        self.files = dict(files)
        self.objects = S3Objects(parse_s3(self.url), **s3_options)
        self.storage_data: dict[Any, Any] = {}
        # bound when the manifest was verified ("": missing, or another size, then)
        self._etags: dict[str, str] = {name: str(r[2]) for name, r in self.files.items() if len(r) > 2}

    # ------------------------------------------------------------------ DCP's contract

    def reset(self, checkpoint_id: Any = None) -> None:
        self.storage_data = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        name = dcp_private.METADATA_NAME
        data, _ = self._get_whole(name)
        metadata: Metadata = pickle.loads(data)  # its sha256 matched the signed manifest's
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = dict(metadata.storage_data or {})

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        from torch.distributed._shard._utils import narrow_tensor_by_index

        for item in plan.items:
            where = self.storage_data[item.storage_index]
            data = self._get_range(where.relative_path, int(where.offset), int(where.length))
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(data))
                continue
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
            target = planner.resolve_tensor(item).detach()
            if target.size() != tensor.size():
                raise SnapshotCorruptError(f"{self.url}: {item.storage_index.fqn} is {tuple(tensor.size())} in the "
                                           f"snapshot, {tuple(target.size())} here")
            target.copy_(tensor)
            planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @property
    def checkpoint_id(self) -> str:
        return self.url

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        try:
            return is_remote(str(checkpoint_id))  # the one parse of a location
        except LocationError:
            return False

    # ------------------------------------------------------------------ fetching, checked

    def _rel(self, name: str) -> str:
        return name  # the reader's location is the writer's prefix itself

    def _get_whole(self, name: str) -> tuple[bytes, str]:
        size, sha = self._record(name)
        try:
            data, etag = self.objects.get(self._rel(name))
        except FileNotFoundError:
            raise SnapshotCorruptError(f"{self.url}/{name}: missing") from None
        if len(data) != size or hashlib.sha256(data).hexdigest() != sha:
            raise SnapshotCorruptError(f"{self.url}/{name}: not the bytes the signed manifest names (size "
                                       f"{len(data)}, manifest says {size}); not read")
        return data, etag

    def _get_range(self, name: str, start: int, length: int) -> bytes:
        size, _ = self._record(name)
        if start < 0 or length < 0 or start + length > size:
            raise SnapshotCorruptError(f"{self.url}/{name}: an item at {start}+{length} lies outside its "
                                       f"{size} bytes")
        etag = self._etags.get(name)
        if etag is None:  # a caller's record without one: the first read's
            etag = self._etags[name] = self._head_etag(name, size)
        if not etag:
            raise SnapshotCorruptError(f"{self.url}/{name}: missing, or not the size the signed manifest says, "
                                       "when the snapshot was verified; not read")
        from .s3client import PreconditionFailed

        try:
            return self.objects.get_range(self._rel(name), start, length, if_match=etag)
        except PreconditionFailed:
            raise SnapshotCorruptError(f"{self.url}/{name}: replaced since the snapshot was verified; "
                                       "not read") from None
        except FileNotFoundError:
            raise SnapshotCorruptError(f"{self.url}/{name}: missing") from None

    def _head_etag(self, name: str, size: int) -> str:
        """The file's ETag, once (its size must be the manifest's)."""
        found = [o for o in self.objects.list(self._rel(name)) if o["Key"] == self._rel(name)]
        if not found:
            raise SnapshotCorruptError(f"{self.url}/{name}: missing")
        if int(found[0]["Size"]) != size:
            raise SnapshotCorruptError(f"{self.url}/{name}: {found[0]['Size']} bytes, the signed manifest says "
                                       f"{size}")
        return str(found[0]["ETag"])

    def _record(self, name: str) -> tuple[int, str]:
        if name not in self.files:
            raise SnapshotCorruptError(f"{self.url}: {name!r} is not in the snapshot's signed manifest; not read")
        size, sha = self.files[name][:2]
        return int(size), str(sha)


def unwrapped(exc: BaseException) -> SnapshotCorruptError | None:
    """The reader's refusal inside ``dcp.load``'s CheckpointException (None: another failure)."""
    failures = getattr(exc, "failures", None)
    if isinstance(exc, SnapshotCorruptError) or not isinstance(failures, dict):
        return exc if isinstance(exc, SnapshotCorruptError) else None
    found = [e for e, _ in failures.values() if isinstance(e, SnapshotCorruptError)]
    return found[0] if found else None


__all__ = ["S3DcpReader", "unwrapped"]
