"""Sharded snapshots in an object store: every rank uploads its own shards, rank 0 commits.

The object store's side of :mod:`.sharded` (the same four calls as
:class:`.store.SnapshotStore`'s: :meth:`~S3ShardedParts.begin_parts`,
:meth:`~S3ShardedParts.write_part`, :meth:`~S3ShardedParts.seal_parts`,
:meth:`~S3ShardedParts.drop_parts`). No rank gathers another's shards, and no rename is
needed: a step's files exist for readers only once its manifest does (:mod:`.s3store`).

Layout, under one writer name that rank 0 chooses for the snapshot (its "temp dir")::

    step-<N>/<writer>/__<rank>_0.distcp   each rank's shards, uploaded by that rank
    step-<N>/<writer>/part-<rank>.json    ... then its record (size, sha256, where each item lies)
    step-<N>/<writer>/.metadata           DCP's metadata, completed by rank 0 from the records
    step-<N>/<writer>/NNN-key.pt          the rest of the state (rank 0's ordinary files)
    step-<N>/MANIFEST.json                the commit: rank 0's, fenced, If-None-Match

So ``step-<N>/<writer>/`` is an ordinary DCP checkpoint, which :mod:`.s3dcp` reads with
ranged GETs, each rank only its own part of it. A rank lost before its record arrives leaves
no manifest: the writer's files are orphans that prune removes, as any dead writer's.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from . import layout
from .manifest import DCP_PREFIX, FileEntry
from .reading import SnapshotInfo
from .tree import check_state

if TYPE_CHECKING:
    from .sharded import Part

# .sharded (torch.distributed.checkpoint) is imported by the calls that write a sharded snapshot, not
# with this module: the store's readers (elastic local's view, elastic check) never pay for it

log = logging.getLogger(__name__)

#: How often rank 0 lists the writer's prefix at most while it waits for the other ranks' records.
PART_POLL_S = 0.25


def writer_name() -> str:
    """A writer's own name in a step's prefix: its host tag and pid (prune tells a dead one
    by them, :mod:`.s3store`) and a random part."""
    return f"{layout.host_tag()}-{os.getpid()}-{secrets.token_hex(4)}"


class S3ShardedParts:
    """Mixed into :class:`.s3store.S3SnapshotStore`, whose upload, commit and clean-up it uses."""

    objects: Any
    root: Any
    spool_dir: str | None
    _writing: set[str]
    _lock: Any

    if TYPE_CHECKING:  # what the store provides
        def _handle_existing(self, step: int) -> SnapshotInfo | None: ...
        def _save(self, step: int, world_size: int, extra_meta: dict[str, Any], housekeeping: bool,
                  upload: Callable[[Path, str], list[FileEntry]], writer: str | None = None) -> SnapshotInfo: ...
        def _upload_files(self, state: Mapping[str, Any], spool: Path, where: str) -> list[FileEntry]: ...
        def _delete_quietly(self, what: list[str]) -> None: ...

    def begin_parts(self, step: int) -> str:
        """Rank 0, at the step: the snapshot's writer prefix, ``step-<N>/<writer>``, which
        every rank uploads into; this process's (prune leaves it alone) until the seal ends."""
        writer = writer_name()
        with self._lock:
            self._writing.add(writer)
        return f"{layout.step_dirname(layout.check_step(step))}/{writer}"

    def write_part(self, part: Part) -> None:
        """Every rank, in the background: its shards serialised to a local spool file (hashed
        as they are written), uploaded, then its part record (the seal waits for it)."""
        from .sharded import part_name, part_record_bytes, serialise_part

        spool = Path(tempfile.mkdtemp(prefix=".shard-spool-", dir=self.spool_dir))
        try:
            record = serialise_part(part, spool / part.file)
            if record["file"]:
                self.objects.upload_file(f"{part.temp}/{part.file}", str(spool / part.file))
            self.objects.put(f"{part.temp}/{part_name(part.rank)}", part_record_bytes(record))
        finally:
            shutil.rmtree(spool, ignore_errors=True)

    def seal_parts(self, step: int, temp_name: str, *, ranks: int, metadata: Any, state: Mapping[str, Any],
                   world_size: int, extra_meta: dict[str, Any] | None = None, deadline: float,
                   abandoned: Any = lambda: False, housekeeping: bool = True) -> SnapshotInfo:
        """Rank 0, in the background: the rest of the state uploaded, every rank's record
        awaited until ``deadline``, DCP's ``.metadata`` completed from them, then the manifest
        over every file committed as any snapshot's (fenced, never over another's). Nothing
        is committed on any failure, and the writer's files go."""
        from . import dcp_private
        from .sharded import metadata_bytes, part_name

        check_state(state)
        writer = temp_name.rsplit("/", 1)[-1]
        try:
            def upload(spool: Path, where: str) -> list[FileEntry]:
                entries = self._upload_files(state, spool, where)
                records = self._await_records(temp_name, ranks, deadline, abandoned)
                meta = metadata_bytes(metadata, records)
                meta_name = dcp_private.METADATA_NAME
                self.objects.put(f"{where}/{meta_name}", meta)
                entries.append(FileEntry(DCP_PREFIX + meta_name, f"{writer}/{meta_name}", len(meta),
                                         hashlib.sha256(meta).hexdigest()))
                entries += [FileEntry(DCP_PREFIX + r["file"], f"{writer}/{r['file']}", int(r["size"]), r["sha256"])
                            for r in records if r.get("file")]
                self.objects.delete([f"{where}/{part_name(r)}" for r in range(ranks)])  # said; the manifest says it now
                return entries

            # a step already committed: _save keeps it and drops this writer's uploads
            return self._save(step, world_size, dict(extra_meta or {}), housekeeping, upload, writer=writer)
        finally:
            with self._lock:
                self._writing.discard(writer)

    def drop_parts(self, temp_name: str) -> None:
        """A sharded snapshot given up before its commit: its writer's files go (best effort;
        prune removes what is left once the writer is gone)."""
        self._delete_quietly([temp_name.rstrip("/") + "/"])
        with self._lock:
            self._writing.discard(temp_name.rsplit("/", 1)[-1])

    def _await_records(self, temp_name: str, ranks: int, deadline: float,
                       abandoned: Callable[[], bool]) -> list[dict[str, Any]]:
        """Every rank's part record; one listing per look, so waiting costs few requests."""
        from .sharded import await_parts, part_name

        there: set[str] = set()
        last = [0.0]

        def read(rank: int) -> bytes | None:
            if time.monotonic() - last[0] >= PART_POLL_S / 5:  # about once per look over the missing ranks
                last[0] = time.monotonic()
                there.clear()
                there.update(o["Key"].rsplit("/", 1)[-1] for o in self.objects.list(f"{temp_name}/part-"))
            if part_name(rank) not in there:
                return None
            try:
                data, _ = self.objects.get(f"{temp_name}/{part_name(rank)}")
            except FileNotFoundError:
                return None
            return bytes(data)

        return await_parts(temp_name, ranks, read, deadline, abandoned, pause=0.02, most=PART_POLL_S)


__all__ = ["PART_POLL_S", "S3ShardedParts", "writer_name"]
