"""Two tiers: a node-local directory first (fast resume on the same node), an object store second.

Location syntax: ``LOCAL_DIR,s3://bucket/prefix`` (``--snapshot-dir``, ``snapshot_dir=``,
``ELASTIC_SNAPSHOT_DIR``). Each snapshot is written to the local directory, then to the
object store, each with its own protocol (rename there, manifest last here), so each tier
holds only whole snapshots. The state is serialised once: the object store gets the local
tier's files, checked against the local manifest as they are read for upload. A snapshot
counts as saved once it is in the object store: a lost node's disk takes nothing the job
needs.

Resume takes the newest step that verifies in either tier, the local copy first when both
hold it: a job healed on another node (whose disk lacks it, or holds an older one) still
loads the newest remote one, and a newer local one is never passed over for an older remote
one. The fence is the object store's, the one every node sees.
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


class TieredStore:
    """The same calls as :class:`.store.SnapshotStore`: writes go to both tiers, reads to the
    newest valid snapshot of either; listing, checking and pruning are the object store's."""

    def __init__(self, local: SnapshotStore, remote: Any) -> None:
        self.local, self.remote = local, remote
        self.root = f"{local.root},{remote.root}"
        self.keep, self.if_exists = remote.keep, remote.if_exists
        self.stale_temp_grace_s, self.recycle = remote.stale_temp_grace_s, local.recycle
        self._key = remote._key

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

    def load_latest(self, *, map_location: Any = "cpu",
                    before: int | None = None) -> tuple[SnapshotInfo, dict[str, Any]] | None:
        """Newest step (below ``before``, if given) that loads with full verification from
        either tier; local first on a tie."""
        local_steps, remote_steps = set(self.local._steps()), set(self.remote._steps())
        for step in sorted((s for s in local_steps | remote_steps if before is None or s < before), reverse=True):
            for tier, steps in ((self.local, local_steps), (self.remote, remote_steps)):
                if step not in steps or tier.verify(step, full=False):
                    continue  # not there, or its manifest or sizes already say no
                try:
                    state = tier.load(step, map_location=map_location, verify=True)
                except SnapshotCorruptError as e:
                    log.warning("skipping invalid %s; trying the other tier or an older one", e)
                    continue
                info = tier._info_at(step)  # the shared read side (.reading)
                log.info("resuming from snapshot step %d in %s (the newest valid of both tiers)", step,
                         "the local tier" if tier is self.local else "the object store")
                return info, state
        return None

    def load(self, info_or_step: SnapshotInfo | int, *, map_location: Any = "cpu",
             verify: bool = True) -> dict[str, Any]:
        """The local copy when this node has a valid one, else the object store's."""
        step = info_or_step.step if isinstance(info_or_step, SnapshotInfo) else info_or_step
        try:
            return self.local.load(step, map_location=map_location, verify=verify)
        except SnapshotCorruptError:
            return self.remote.load(step, map_location=map_location, verify=verify)

    def __getattr__(self, name: str) -> Any:  # status, check, verify, prune, temp_dirs, ...: the object store's
        return getattr(self.remote, name)
