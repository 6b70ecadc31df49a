"""Two tiers: a node-local directory first (fast resume on the same node), an object store second.

Location syntax: ``LOCAL_DIR,s3://bucket/prefix`` (``--snapshot-dir``, ``snapshot_dir=``,
``ELASTIC_SNAPSHOT_DIR``). Each snapshot is written to the local directory, then to the
object store, each with its own protocol (rename there, manifest last here), so each tier
holds only whole snapshots. The state is serialised once: the object store gets the local
tier's files, checked against the local manifest as they are read for upload. A snapshot
counts as saved once it is in the object store: a lost node's disk takes nothing the job
needs.

Resume takes the newest step the object store holds whole (every rank of every node can load
it), read from the local copy when this node has a valid one written for this very object
store, else from the object store. A step only in a local tier (its upload never finished)
is not chosen: the ranks of other nodes could not load it. A local copy counts only for the
object store it was written for (:data:`TIER_KEY` in its manifest): two jobs sharing a
node-local directory, or a job given a new prefix, never resume each other's local steps,
and the local tier's prune deletes only copies written for its own object store: another
job's are neither counted among the ``keep`` newest nor deleted.
The fence is the object store's, the one every node sees.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from . import layout
from .errors import SnapshotCorruptError
from .location import split_tiers  # noqa: F401  (the syntax lives with the other location parsing)
from .manifest import ManifestError
from .store import SnapshotInfo, SnapshotStore

log = logging.getLogger(__name__)

# The local manifest's record of the object store its snapshot was written for (signed with
# the manifest): a local copy is this store's only if it names the same s3:// location.
TIER_KEY = "tier_of"


class TieredStore:
    """The same calls as :class:`.store.SnapshotStore`: writes go to both tiers, reads to the
    newest valid snapshot of either; listing, checking and pruning are the object store's."""

    def __init__(self, local: SnapshotStore, remote: Any) -> None:
        self.local, self.remote = local, remote
        self.root = f"{local.root},{remote.root}"
        self.keep, self.if_exists = remote.keep, remote.if_exists
        self.stale_temp_grace_s, self.recycle = remote.stale_temp_grace_s, local.recycle
        self._key = remote._key
        self.bound_to = str(remote.root)  # what this store's local copies record (TIER_KEY)
        local.owns = self.ours  # its prune deletes only this job's local copies (the directory may be shared)

    @property
    def fence(self) -> Any:
        return self.remote.fence

    @property
    def io_threads(self) -> int:
        return self.remote.io_threads

    @property
    def signed(self) -> bool:
        return bool(self.remote.signed)

    def __repr__(self) -> str:
        return f"TieredStore({self.local!r}, {self.remote!r})"

    def save(self, step: int, state: Mapping[str, Any], *, world_size: int,
             extra_meta: dict[str, Any] | None = None, housekeeping: bool = True) -> SnapshotInfo:
        """Serialise once, into the local tier; then upload those very files (checked against
        the local manifest) to the object store. Only when the local tier failed, or kept a
        snapshot it already had for this step, is ``state`` serialised for the object store."""
        final = self.local.root / layout.step_dirname(step)
        fresh = not final.exists()
        extra_meta = {**(extra_meta or {}), TIER_KEY: self.bound_to}
        try:
            info = self.local.save(step, state, world_size=world_size, extra_meta=extra_meta,
                                   housekeeping=housekeeping)
        except Exception as e:  # noqa: BLE001 - the local tier is a cache: the object store decides
            log.warning("snapshot step %d: the local tier %s failed (%s); writing it to the object store only",
                        step, self.local.root, e)
        else:
            if fresh and info.path == final:
                try:
                    manifest = self.local._read_manifest(final)
                    return self.remote.save_files(step, final, manifest, housekeeping=housekeeping)
                except (ManifestError, SnapshotCorruptError, OSError) as e:  # changed or gone under us
                    log.warning("snapshot step %d: the local copy in %s cannot be uploaded as it is (%s); "
                                "serialising it again for the object store", step, self.local.root, e)
        return self.remote.save(step, state, world_size=world_size, extra_meta=extra_meta,
                                housekeeping=housekeeping)

    def housekeep(self) -> None:
        self.local.housekeep()
        self.remote.housekeep()

    def ours(self, step: int) -> bool:
        """Whether this node's local copy of ``step`` was written for this store's object store
        (not another job's that shares the directory, nor this job's under another prefix)."""
        try:
            manifest = self.local._read_manifest(self.local.root / layout.step_dirname(step))
        except (ManifestError, SnapshotCorruptError, OSError):
            return False
        return manifest.extra_meta.get(TIER_KEY) == self.bound_to

    def load_latest(self, *, map_location: Any = "cpu",
                    before: int | None = None) -> tuple[SnapshotInfo, dict[str, Any]] | None:
        """Newest step (below ``before``, if given) whose object-store manifest is valid, so
        every rank can load it, loaded with full verification from this node's own local copy
        when it has one, else from the object store."""
        local_steps, remote_steps = set(self.local._steps()), set(self.remote._steps())
        newer_local = sorted(s for s in local_steps - remote_steps if (before is None or s < before) and self.ours(s))
        if newer_local and (not remote_steps or newer_local[-1] > max(remote_steps)):
            log.warning("snapshot step %d is only in this node's local tier %s (its upload never finished): other "
                        "nodes could not load it, so it is not resumed from", newer_local[-1], self.local.root)
        for step in sorted((s for s in remote_steps if before is None or s < before), reverse=True):
            if self.remote.verify(step, full=False):
                continue  # not whole in the object store: not every rank could load it
            tiers = (self.local, self.remote) if step in local_steps and self.ours(step) else (self.remote,)
            for tier in tiers:
                if tier is self.local and tier.verify(step, full=False):
                    continue  # its manifest or sizes already say no: the object store's copy
                try:
                    state = tier.load(step, map_location=map_location, verify=True)
                except SnapshotCorruptError as e:
                    log.warning("skipping invalid %s; trying the other tier or an older one", e)
                    continue
                info = tier._info_at(step)  # the shared read side (.reading)
                log.info("resuming from snapshot step %d in %s", step,
                         "the local tier" if tier is self.local else "the object store")
                return info, state
        return None

    def load(self, info_or_step: SnapshotInfo | int, *, map_location: Any = "cpu",
             verify: bool = True, verify_shards: bool = True) -> dict[str, Any]:
        """This node's local copy when it has a valid one written for this object store, else
        the object store's. ``verify_shards`` as for the stores (the ranks other than 0 pass it
        as they load the step rank 0 chose)."""
        step = info_or_step.step if isinstance(info_or_step, SnapshotInfo) else info_or_step
        if self.ours(step):
            try:
                return self.local.load(step, map_location=map_location, verify=verify, verify_shards=verify_shards)
            except SnapshotCorruptError:
                pass
        return self.remote.load(step, map_location=map_location, verify=verify, verify_shards=verify_shards)

    def __getattr__(self, name: str) -> Any:  # status, check, verify, prune, temp_dirs, ...: the object store's
        return getattr(self.remote, name)
