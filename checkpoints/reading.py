"""The read side both snapshot stores share: which steps are valid, the newest valid, load.

A directory (:class:`.store.SnapshotStore`) and an object store (:class:`.s3store.S3SnapshotStore`)
differ in how they list steps, read a manifest, size-check and fetch a file; what *valid*
means, which snapshot resume takes, what ``ls``/``verify`` show and what a load checks
before it unpickles must not differ, so it is written once here over those primitives.
"""

from __future__ import annotations

import builtins  # `list` in SnapshotReader's annotations after its list() method names the method
import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from . import files, layout
from .errors import ProblemKind, SnapshotCorruptError, kind_of
from .manifest import FileEntry, Manifest, ManifestError, is_dcp_key



@dataclass(frozen=True)
class SnapshotInfo:
    step: int
    path: Path
    world_size: int
    written_at: float
    size_bytes: int
    torch_version: str = field(default="", compare=False)
    extra_meta: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class SnapshotStatus:
    """One ``step-*`` dir as found on disk, valid or not (what ``ls``/``verify`` show)."""

    step: int
    path: Path
    info: SnapshotInfo | None
    problems: tuple[str, ...]
    signed: bool | None = None  # the manifest carries a signature (None: no readable manifest)

    @property
    def valid(self) -> bool:
        return not self.problems


class FileProblem(Exception):
    """One file is not what its manifest says or does not load; ``str()`` is the one-line reason."""


def signature_only(problems: list[str] | tuple[str, ...]) -> bool:
    """Refused for its signature alone (under a key), not for damage: such a snapshot may be
    the job's own from before it had a key, so it is reported once and never deleted for it."""
    return len(problems) == 1 and kind_of(problems[0]) is ProblemKind.SIGNATURE


def info_of(path: Any, m: Manifest) -> SnapshotInfo:
    return SnapshotInfo(step=m.step, path=path, world_size=m.world_size, written_at=m.written_at,
                        size_bytes=m.size_bytes, torch_version=m.torch_version, extra_meta=m.extra_meta)


@dataclass(frozen=True)
class DcpFile:
    """A sharded snapshot's DCP file, checked but not loaded (``torch.distributed.checkpoint`` reads it)."""

    file: str


def checked_dcp_file(size: int, sha256: str, entry: FileEntry, *, verify: bool, corrupted: str) -> DcpFile:
    """A DCP file's size (and sha256 with ``verify``) against its manifest entry; FileProblem if not."""
    if size != entry.size:
        raise FileProblem(f"{entry.file}: size {size} bytes, manifest says {entry.size} (truncated)")
    if verify and sha256 != entry.sha256:
        raise FileProblem(f"{entry.file}: sha256 mismatch ({corrupted})")
    return DcpFile(entry.file)


def checked_load(data: bytes | memoryview, entry: FileEntry, *, map_location: Any, verify: bool,
                 corrupted: str) -> Any:
    """Check those very bytes (size; sha256 with ``verify``) and deserialise them with the
    resume loader, so a check and a load cannot judge different bytes. FileProblem if not."""
    if len(data) != entry.size:
        raise FileProblem(f"{entry.file}: size {len(data)} bytes, manifest says {entry.size} (truncated)")
    if verify and hashlib.sha256(data).hexdigest() != entry.sha256:
        raise FileProblem(f"{entry.file}: sha256 mismatch ({corrupted})")
    if is_dcp_key(entry.key):
        return DcpFile(entry.file)
    try:
        return files.load_bytes(data if isinstance(data, bytes) else bytes(data), map_location)
    except Exception as e:  # noqa: BLE001 - any failure to deserialise is corruption to the user
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise FileProblem(f"{entry.file} does not load ({first})") from None


#: The key :meth:`SnapshotReader.load` puts a sharded snapshot's directory under: load it
#: with ``torch.distributed.checkpoint`` (``elastic.sharded.load_dcp``), never before the
#: load that returned it verified every file.
DCP_DIR_KEY = "dcp"
#: ... and each of its DCP files (relative to that directory) as the signed manifest records it,
#: ``name -> (size, sha256)``, with a third element in an object store: the ETag of the object
#: the load verified ("" if it was missing or of another size then), which every later ranged
#: read must match (:mod:`.s3dcp`), so an object replaced since is refused, not read.
DCP_FILES_KEY = "dcp_files"


class SnapshotReader:
    """Listing, checking, the newest valid and loading, over five primitives a store gives:
    ``_steps``, ``_manifest``, ``_quick_check``, ``_read_file`` and ``_path``."""

    root: Any
    _key: bytes | None

    # ------------------------------------------------------------------ primitives

    def _steps(self) -> list[int]:
        raise NotImplementedError

    def _path(self, step: int) -> Any:
        return self.root / layout.step_dirname(step)

    def _manifest(self, step: int, *, authenticate: bool = True) -> Manifest:
        """The trusted manifest of ``step``; ManifestError (one line) if there is none."""
        raise NotImplementedError

    def _quick_check(self, step: int, scan: Any = None) -> tuple[Manifest | None, list[str]]:
        """The trusted manifest (None if there is none) and what its sizes say is wrong;
        ``scan`` is what :meth:`_scan` read once for a walk over many steps."""
        raise NotImplementedError

    def _read_file(self, step: int, entry: FileEntry, *, map_location: Any, verify: bool) -> Any:
        """One file read once, checked (:func:`checked_load`) and loaded; FileProblem if not."""
        raise NotImplementedError

    # ------------------------------------------------------------------ hooks (defaults: none)

    def _scan(self) -> Any:
        return None

    def _check_exists(self, step: int) -> None:
        """Raise SnapshotCorruptError when ``step`` is plainly not there (before its manifest)."""

    def _quiet_skip(self, problems: list[str] | tuple[str, ...]) -> bool:
        """Not worth a line when skipped (never a snapshot at all)."""
        return False

    def _status_skip(self, step: int, problems: tuple[str, ...]) -> bool:
        """Left out of :meth:`status` (gone while we looked, or never a snapshot)."""
        return False

    def _before_load(self, step: int) -> Any:
        return None

    def _bind(self, step: int, entries: list[FileEntry]) -> dict[str, str]:
        """Each DCP file's version as the load verifies it, for later reads to match (an
        object store's ETags; a directory's files are read once, whole: none)."""
        return {}

    def _after_load(self, step: int, token: Any) -> None:
        pass

    # ------------------------------------------------------------------ shared

    @property
    def _log(self) -> logging.Logger:
        return logging.getLogger(type(self).__module__)  # each store's lines keep their logger

    def _info_at(self, step: int) -> SnapshotInfo:
        return info_of(self._path(step), self._manifest(step))

    def verify(self, step: int, *, full: bool = True) -> list[str]:
        """Problems with snapshot ``step``; empty means valid. ``full`` is :meth:`check`; quick
        checks the manifest and file sizes only (a few ``stat``s, for hot paths)."""
        return self.check(step) if full else self._quick_check(step)[1]

    def check(self, step: int) -> list[str]:
        """Problems with snapshot ``step`` as resume would meet them; empty means valid.

        The one definition of valid: quick checks pass, then every file is read once, its
        sha256 compared and its bytes deserialised with the loader resume uses (on the CPU),
        exactly as :meth:`load` does. Hashes that match but bytes that do not load are invalid.
        """
        m, problems = self._quick_check(step)
        if m is None or problems:
            return problems
        for entry in m.files:
            try:
                self._read_file(step, entry, map_location="cpu", verify=True)
            except FileProblem as e:
                problems.append(str(e))
        return problems

    def status(self, *, full: bool = False) -> list[SnapshotStatus]:
        """Every step, valid or not, oldest first.

        Without ``full`` each is judged the way resume meets it: fully checked from the newest
        down until one passes (the one :meth:`load_latest` returns), older ones quick-checked
        only, so the newest valid row is always the snapshot a restart uses. ``full`` checks all.
        """
        out = []
        found_valid = False
        for step in reversed(self._steps()):
            problems = tuple(self.verify(step, full=full or not found_valid))
            if problems and self._status_skip(step, problems):
                continue
            found_valid = found_valid or not problems
            out.append(self._status_of(step, problems))
        return out[::-1]

    def _status_of(self, step: int, problems: tuple[str, ...]) -> SnapshotStatus:
        path = self._path(step)
        try:  # what the manifest claims, shown even when it is refused (problems say why)
            m: Manifest | None = self._manifest(step, authenticate=False)
        except ManifestError:
            m = None
        info = None if m is None else info_of(path, m)
        signed = None if m is None else m.signature is not None
        return SnapshotStatus(step=step, path=path, info=info, problems=problems, signed=signed)

    def list(self) -> list[SnapshotInfo]:
        """Snapshots with a trustworthy manifest, oldest first (files are not checked; see verify)."""
        out = []
        for step in self._steps():
            try:
                out.append(self._info_at(step))
            except ManifestError:
                continue
        return out

    def newest_valid(self, *, full: bool = True) -> SnapshotInfo | None:
        """Newest snapshot that verifies; logs one line for each newer invalid one it skips."""
        for step in reversed(self._steps()):
            problems = self.verify(step, full=full)
            if not problems:
                return self._info_at(step)
            self._log_skip(step, problems)
        return None

    def _log_skip(self, step: int, problems: builtins.list[str] | tuple[str, ...]) -> None:
        if self._quiet_skip(problems):
            return
        more = f"; and {len(problems) - 1} more problem(s)" if len(problems) > 1 else ""
        self._log.warning("skipping invalid snapshot %s: %s%s; falling back to an older one", self._path(step),
                    problems[0], more)

    def load(self, info_or_step: SnapshotInfo | int, *, map_location: Any = "cpu",
             verify: bool = True, verify_shards: bool = True) -> dict[str, Any]:
        """Load a snapshot into the nested structure that was saved.

        With ``verify`` every file's sha256 is checked on the very bytes that are then
        deserialised (read once, hashed, loaded), so a file cannot change in between.

        A sharded snapshot's DCP files are hashed (``verify_shards=False``: not read at all,
        for ranks whose rank 0 verified them just before) and not loaded: the result holds
        the snapshot's directory under :data:`DCP_DIR_KEY` instead of ``model``/``optimizer``.
        """
        step = info_or_step.step if isinstance(info_or_step, SnapshotInfo) else info_or_step
        path = self._path(step)
        self._check_exists(step)
        try:
            m = self._manifest(step)
        except ManifestError as e:
            raise SnapshotCorruptError(f"snapshot {path}: {e}") from None
        out: dict[str, Any] = {}
        bound = self._bind(step, [e for e in m.files if is_dcp_key(e.key)])  # before any is read: what was verified
        for entry in m.files:
            if is_dcp_key(entry.key):
                where, _, name = entry.file.rpartition("/")  # an object store's are under their writer's name
                out[DCP_DIR_KEY] = path / where if where else path
                record = (entry.size, entry.sha256) if entry.file not in bound else (
                    entry.size, entry.sha256, bound[entry.file])
                out.setdefault(DCP_FILES_KEY, {})[name] = record
                if not verify_shards:
                    continue
            try:
                value = self._read_file(step, entry, map_location=map_location, verify=verify)
            except FileProblem as e:
                raise SnapshotCorruptError(f"snapshot {path}: {e}") from None
            if not is_dcp_key(entry.key):
                out[entry.key] = value
        return out

    def load_latest(self, *, map_location: Any = "cpu",
                    before: int | None = None) -> tuple[SnapshotInfo, dict[str, Any]] | None:
        """Newest snapshot that loads with full verification, hashing each file exactly once.

        This is what a restarting worker should call: ``newest_valid()`` followed by
        ``load(verify=True)`` would hash the candidate twice. It applies :meth:`check`'s
        test, fused with the load, so ``ls`` names the step this returns. ``before``: only
        steps below it (a resume falling back past a snapshot whose shards were replaced
        after this load verified them).
        """
        unsigned = 0  # skipped for their signature alone: one line for all of them, at the end
        scan = self._scan()
        for step in reversed([s for s in self._steps() if before is None or s < before]):
            m, problems = self._quick_check(step, scan)
            if problems or m is None:
                if signature_only(problems):
                    unsigned += 1
                else:
                    self._log_skip(step, problems)
                continue
            token = self._before_load(step)
            try:
                state = self.load(step, map_location=map_location, verify=True)
            except SnapshotCorruptError as e:
                self._log.warning("skipping invalid %s; falling back to an older one", str(e))
                continue
            self._after_load(step, token)
            self._log_unsigned(unsigned, step)
            return info_of(self._path(step), m), state
        self._log_unsigned(unsigned, None)
        return None

    def _log_unsigned(self, count: int, resumed: int | None) -> None:
        if not count:
            return
        then = f"resuming from step {resumed}, the newest signed one" if resumed is not None else "starting from scratch"
        self._log.warning(
            "%d snapshot(s) in %s are not signed with the job key (written before the job had one, "
            "with another key, or forged) and are never resumed from; %s. If they are this job's "
            "own, sign them with 'python -m checkpoints sign %s' under the same key and restart "
            "(nothing was deleted)", count, self.root, then, self.root,
        )
