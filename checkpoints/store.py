"""The snapshot store: atomic, durable, checksummed, one directory per step.

Write protocol (a snapshot without a valid manifest does not exist):
  1. write every file into ``.tmp-step-<step>-<host>-<pid>-<rand>/``, fsync each;
  2. write and fsync ``MANIFEST.json`` (sizes + sha256 of every file, plus its own checksum);
  3. fsync the temp dir, rename it to ``step-<step>/``, fsync the root.
Only then is it "newest"; only then are old snapshots pruned. A crash at any point leaves
either the previous state or a temp dir that later saves clean up. A snapshot whose
``extra_meta`` carries a ``fence`` token is renamed only while the directory's fence
(:mod:`.fence`) still stands at that token: a stale group's snapshot never becomes newest.

Recycling: pruning keeps the newest pruned snapshot as the spare ``.spare-step-.../``
instead of deleting it, and the next save claims it by renaming it to its temp dir (step
1) and writes over its files. Overwriting allocated blocks, whose pages are usually still
cached, skips block allocation and fresh page-cache pages: 1.2-1.3x the write
throughput here (docs/checkpoints.md). Nothing changes for readers: the spare stopped being a
snapshot when it was renamed, and only a whole new manifest makes it one again. Peak disk
use is unchanged (keep+1 snapshots during a save either way); between saves the spare
holds the +1.

Valid means one thing everywhere (:meth:`SnapshotStore.check`): the manifest can be trusted,
every file has its recorded size and sha256, and every file deserialises with the loader
resume uses. Resume, ``ls``/``verify``/``prune`` and a save meeting an existing step all ask
that question, so they cannot disagree about which snapshot a restart will use.

With a job key (:mod:`.signing`, by default from the rendezvous' environment variables) every
manifest written is signed, and a manifest without a valid signature cannot be trusted: it
fails even the quick check, so every one of those callers refuses it alike.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Mapping

from . import files, layout, signing
from .workers import DaemonPool
from .errors import (
    Problem,
    ProblemKind,
    SnapshotCorruptError,
    SnapshotDirError,
    SnapshotDiskFullError,
    SnapshotError,
    SnapshotExistsError,
    SnapshotKeyError,
)
from .fence import Fence, FenceToken
from .manifest import DCP_PREFIX, FileEntry, Manifest, ManifestError, is_dcp_key
from .reading import (  # noqa: F401  (SnapshotInfo, SnapshotStatus: their public import path)
    FileProblem,
    SnapshotInfo,
    SnapshotReader,
    SnapshotStatus,
    checked_dcp_file,
    checked_load,
    info_of as _info,
    signature_only as _signature_only,
)
from .tree import check_state

log = logging.getLogger(__name__)

# Temp dirs this process is writing right now; a temp dir carrying our own pid that is not
# in here was left by an earlier process that had the same pid (common in containers).
_ACTIVE_TEMPS: set[str] = set()
_ACTIVE_LOCK = threading.Lock()

# MANIFEST.json's (inode, mtime_ns, size): a rewritten snapshot has a new manifest file, so a
# verdict remembered under an old stamp is never applied to it.
_Stamp = tuple[int, int, int]


def _write_durably(fd: int, data: bytes) -> None:
    """All of ``data`` (os.write may write less than asked), then fsync."""
    off = 0
    while off < len(data):
        off += os.write(fd, data[off:])
    os.fsync(fd)


def _read_entry(path: Path, entry: FileEntry, *, map_location: Any, verify: bool) -> Any:
    """Read one snapshot file once, then check and load those very bytes (:func:`.reading.checked_load`).
    A file of DCP's (a sharded snapshot's) is hashed as it streams by and never loaded here."""
    if is_dcp_key(entry.key):
        try:
            size, sha = files.hash_file(path / entry.file)
        except FileNotFoundError:
            raise FileProblem(f"{entry.file}: missing") from None
        return checked_dcp_file(size, sha, entry, verify=verify, corrupted="corrupted on disk")
    try:
        data = files.read_bytes(path / entry.file)
    except FileNotFoundError:
        raise FileProblem(f"{entry.file}: missing") from None
    return checked_load(data, entry, map_location=map_location, verify=verify, corrupted="corrupted on disk")


@dataclass(frozen=True)
class TempDirStatus:
    path: Path
    step: int
    pid: int
    same_host: bool
    stale: bool


def checked_options(key: bytes | None | signing._FromEnv, keep: int, if_exists: str) -> bytes | None:
    """The options every snapshot store shares, checked once: the job key it signs with (from
    the environment by default, None for unsigned), how many to keep, what a second save of a
    step does. Raises ValueError naming the bad one."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    if if_exists not in ("skip", "error"):
        raise ValueError(f"if_exists must be 'skip' or 'error', got {if_exists!r}")
    if key is signing.FROM_ENV:
        return signing.load_key()[0]
    return None if key is None else signing.checked_key(key)


class SnapshotStore(SnapshotReader):
    """Snapshots under ``root``; safe against crashes, torn writes, bit rot and full disks.

    ``if_exists`` decides what ``save`` does when ``step-<step>/`` already holds a valid
    snapshot (e.g. a resumed job reaching the step it resumed from): ``"skip"`` keeps the
    existing one and returns its info, ``"error"`` raises SnapshotExistsError. It is never
    overwritten in place. An existing *invalid* dir for that step is moved aside to
    ``.corrupt-step-...`` so the new snapshot can take its name (``.unsigned-step-...``, which
    nothing deletes, when its only fault is the signature).

    ``key``: the job key that signs every manifest written and without whose valid signature
    no snapshot is trusted. By default (:data:`signing.FROM_ENV`) it is read from
    ``ELASTIC_RDZV_HMAC_KEY_FILE`` / ``ELASTIC_RDZV_HMAC_KEY``, the rendezvous' job key; None
    turns signing off (signed snapshots still load, unchecked).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        keep: int = 3,
        *,
        if_exists: Literal["skip", "error"] = "skip",
        create: bool = True,
        io_threads: int = 2,
        stale_temp_grace_s: float = 600.0,
        propagate_nice: bool = True,
        recycle: bool = True,
        key: bytes | None | signing._FromEnv = signing.FROM_ENV,
    ) -> None:
        self._key: bytes | None = checked_options(key, keep, if_exists)
        self.root = Path(root)
        self.keep = keep
        self.if_exists = if_exists
        self.stale_temp_grace_s = stale_temp_grace_s
        self._io_threads = max(1, io_threads)
        # Pass the saving thread's niceness on to the pool threads; the writer process turns
        # this off because its priority is set, and raised, from outside.
        self._propagate_nice = propagate_nice
        # Keep the newest pruned snapshot as the spare the next save writes over.
        self.recycle = recycle
        # A directory other jobs write too (a node-local tier, :mod:`.tiered`): which steps are
        # this job's. None: every snapshot here is. Set, prune deletes only this job's snapshots
        # and leaves spares and quarantined dirs, which cannot be told apart, to their own job.
        self.owns: Callable[[int], bool] | None = None
        self._pools: tuple[DaemonPool, DaemonPool] | None = None
        self._pools_lock = threading.Lock()
        # step -> (manifest stamp, problems) for snapshots this store wrote or fully checked;
        # only prune(trust_own=True) consults it (see there).
        self._verdicts: dict[int, tuple[_Stamp, tuple[str, ...]]] = {}
        self._verdicts_lock = threading.Lock()
        if self.root.exists() and not self.root.is_dir():
            raise SnapshotDirError(f"snapshot directory {self.root} is not a directory; pass the directory snapshots live in")
        if create:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise SnapshotDirError(
                    f"cannot create snapshot directory {self.root}: {e.strerror or e}; "
                    "pass a directory you can write (or create it first)"
                ) from None
        if not self.root.is_dir():
            what = "does not exist" if not self.root.exists() else "is not a directory"
            raise SnapshotDirError(f"snapshot directory {self.root} {what}; pass the directory snapshots live in")
        if create and not os.access(self.root, os.W_OK | os.X_OK):
            raise SnapshotDirError(
                f"snapshot directory {self.root} is not writable (read-only filesystem or permissions); "
                "make it writable or pass another directory"
            )

    @property
    def io_threads(self) -> int:
        return self._io_threads

    @property
    def signed(self) -> bool:
        """Whether this store signs manifests and refuses any without a valid signature."""
        return self._key is not None

    def __repr__(self) -> str:
        return f"SnapshotStore({str(self.root)!r}, keep={self.keep})"

    # ------------------------------------------------------------------ write

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        world_size: int,
        extra_meta: dict[str, Any] | None = None,
        housekeeping: bool = True,
    ) -> SnapshotInfo:
        """Write ``state`` as snapshot ``step``; durable on return; prunes afterwards.

        ``housekeeping=False`` leaves pruning to a later :meth:`housekeep` call, which a
        background writer makes after reporting the new snapshot durable rather than before:
        pruning checks manifests (fully, once, any snapshot this store did not write) and may
        delete (~0.1 s of waiting per 300 MB here, when a spare is deleted rather than kept).
        """
        layout.check_step(step)
        check_state(state)
        final = self.root / layout.step_dirname(step)
        if final.exists():
            existing = self._handle_existing(step, final)
            if existing is not None:
                return existing
        tmp = self.root / layout.temp_dirname(step)
        with self._writing(tmp, step):
            info = self._write(step, state, world_size, extra_meta or {}, tmp, final)
        if info.path == final and housekeeping:  # else it lost a race with another writer of the step
            self.housekeep()
        return info

    # ------------------------------------------------------------------ write, sharded (.sharded)

    def begin_parts(self, step: int) -> str:
        """The temp dir every rank of a sharded snapshot of ``step`` writes into (its name only:
        the first rank to write makes it); this process's until :meth:`seal_parts` returns."""
        name = layout.temp_dirname(layout.check_step(step))
        with _ACTIVE_LOCK:
            _ACTIVE_TEMPS.add(name)
        return name

    def write_part(self, part: Any) -> None:
        """Every rank, in the background: its shards into the temp dir (:func:`.sharded.write_part`)."""
        from .sharded import write_part

        write_part(self.root, part)

    def seal_parts(self, step: int, temp_name: str, *, ranks: int, metadata: Any, state: Mapping[str, Any],
                   world_size: int, extra_meta: dict[str, Any] | None = None, deadline: float,
                   abandoned: Any = lambda: False, housekeeping: bool = True) -> SnapshotInfo:
        """Seal a sharded snapshot (:mod:`.sharded`): ``state`` (the unsharded rest) written
        here, every rank's part awaited until ``deadline`` (``time.monotonic``), DCP's
        ``.metadata`` (``metadata``: DCP's Metadata of the plan) completed from them, then
        sealed as :meth:`save` seals. The temp dir goes on any failure."""
        from . import dcp_private
        from .sharded import metadata_bytes, wait_parts, write_bytes

        check_state(state)
        final = self.root / layout.step_dirname(step)
        tmp = self.root / temp_name
        with self._writing(tmp, step):
            if final.exists():
                existing = self._handle_existing(step, final)
                if existing is not None:
                    shutil.rmtree(tmp, ignore_errors=True)
                    return existing
            tmp.mkdir(exist_ok=True)
            names = [layout.key_filename(i, k) for i, k in enumerate(state)]
            file_pool, hash_pool = self._get_pools()
            written = [files.write_file(tmp / name, value, hash_pool, None) for name, value in zip(names, state.values())]
            records = wait_parts(tmp, ranks, deadline, abandoned)
            meta_size, meta_sha = write_bytes(tmp / dcp_private.METADATA_NAME, metadata_bytes(metadata, records))
            entries = [FileEntry(key=k, file=n, size=size, sha256=sha)
                       for k, n, (size, sha) in zip(state.keys(), names, written)]
            entries.append(FileEntry(DCP_PREFIX + dcp_private.METADATA_NAME, dcp_private.METADATA_NAME, meta_size,
                                     meta_sha))
            entries += [FileEntry(DCP_PREFIX + r["file"], r["file"], int(r["size"]), r["sha256"])
                        for r in records if r.get("file")]
            for entry in os.scandir(tmp):  # the parts said what they had to; the manifest says it now
                if entry.name.startswith("part-") or entry.name.startswith(".part-"):
                    os.unlink(entry.path)
            info = self._seal(step, entries, world_size, dict(extra_meta or {}), tmp, final)
        if info.path == final and housekeeping:
            self.housekeep()
        return info

    def drop_parts(self, temp_name: str) -> None:
        """A sharded snapshot abandoned before its seal began: its temp dir goes."""
        shutil.rmtree(self.root / temp_name, ignore_errors=True)
        with _ACTIVE_LOCK:
            _ACTIVE_TEMPS.discard(temp_name)

    @contextlib.contextmanager
    def _writing(self, tmp: Path, step: int) -> Iterator[None]:
        """A write into temp dir ``tmp``: the name is this process's while it lasts (no
        clean-up takes it), the dir goes on any failure, and an OSError leaves as one line."""
        with _ACTIVE_LOCK:
            _ACTIVE_TEMPS.add(tmp.name)
        try:
            try:
                yield
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        except OSError as e:
            raise self._os_error(e, step) from None
        finally:
            with _ACTIVE_LOCK:
                _ACTIVE_TEMPS.discard(tmp.name)

    def housekeep(self) -> None:
        """Prune to ``keep`` and remove stale temp dirs; a failure is logged, not raised, because
        the snapshots are durable and the next save tries again."""
        try:
            self.prune(trust_own=True)
            self.clean_stale_temps()
        except (OSError, SnapshotError) as e:
            log.warning("pruning snapshots in %s failed (the newest snapshot is durable): %s", self.root, e)

    def _write(
        self,
        step: int,
        state: Mapping[str, Any],
        world_size: int,
        extra_meta: dict[str, Any],
        tmp: Path,
        final: Path,
    ) -> SnapshotInfo:
        names = [layout.key_filename(i, k) for i, k in enumerate(state)]
        reusable = self._claim_spare(tmp, will_write=names)
        if reusable is None:
            tmp.mkdir()
            reusable = frozenset()
        file_pool, hash_pool = self._get_pools()
        nice = layout.thread_nice() if self._propagate_nice else None
        futures = [
            file_pool.submit(files.write_file, tmp / name, value, hash_pool, nice, overwrite=name in reusable)
            for name, value in zip(names, state.values())
        ]
        results = []
        first_error: BaseException | None = None
        for fut in futures:  # wait for all before cleanup, so none writes into a removed dir
            try:
                results.append(fut.result())
            except BaseException as e:  # noqa: BLE001 - re-raised below
                first_error = first_error or e
        if first_error is not None:
            raise first_error
        entries = [FileEntry(key=k, file=n, size=size, sha256=sha)
                   for k, n, (size, sha) in zip(state.keys(), names, results)]
        return self._seal(step, entries, world_size, extra_meta, tmp, final)

    def _seal(self, step: int, entries: list[FileEntry], world_size: int, extra_meta: dict[str, Any], tmp: Path,
              final: Path) -> SnapshotInfo:
        """Steps 2 and 3: the manifest over ``entries`` (every file already fsync'd in ``tmp``),
        then the rename into place, under the fence the snapshot's ``extra_meta`` carries."""
        manifest = Manifest(
            step=step,
            world_size=int(world_size),
            written_at=time.time(),
            torch_version=files.torch_version(),
            files=tuple(entries),
            extra_meta=dict(extra_meta),
        )
        fd = os.open(tmp / layout.MANIFEST_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            key = self._key
            data = manifest.to_bytes(
                None if key is None else lambda body: signing.sign(key, final.name, step, body)
            )
            _write_durably(fd, data)
        finally:
            os.close(fd)
        layout.fsync_dir(tmp)
        token = FenceToken.from_meta(extra_meta.get("fence"))
        try:
            with Fence(self.root, key=self._key).holding(token) if token is not None else contextlib.nullcontext():
                os.rename(tmp, final)  # fails (ENOTEMPTY/EEXIST) rather than clobbering a snapshot
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            existing = self._handle_existing(step, final)
            if existing is None:
                raise SnapshotError(f"another writer raced us to {final}; retry the save") from None
            return existing
        layout.fsync_dir(self.root)
        self._remember(step, self._stamp(final), ())  # hashed as written; quick checks suffice
        return _info(final, manifest)

    def _claim_spare(self, tmp: Path, will_write: list[str]) -> frozenset[str] | None:
        """Rename the spare to ``tmp`` for this save and clear out what it will not overwrite.

        Returns the files left to overwrite, or None when there is no spare to claim (the
        caller then writes fresh). The rename is atomic, so two writers never share one.
        """
        if not self.recycle:
            return None
        for spare in reversed(self.spares()):  # newest first: the likeliest still cached
            try:
                os.rename(spare, tmp)
            except FileNotFoundError:  # another writer claimed it first
                continue
            except OSError as e:
                log.warning("cannot reuse spare %s (%s); writing the snapshot fresh", spare.name, e.strerror or e)
                return None
            os.utime(tmp)  # the temp dir's age is this write's (temp_dirs() judges staleness by it)
            reusable = set()
            for entry in os.scandir(tmp):
                if entry.name in will_write and entry.is_file(follow_symlinks=False):
                    reusable.add(entry.name)
                elif entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:  # the old manifest, files of keys this state lacks
                    os.unlink(entry.path)
            return frozenset(reusable)
        return None

    def _handle_existing(self, step: int, final: Path) -> SnapshotInfo | None:
        """Keep a valid ``step`` dir (or refuse, per ``if_exists``); move an invalid one aside.

        The full check matters: a bit-flipped dir passes the size check, and keeping it would
        leave every later restart skipping this step again. Rare (a resumed job reaching a step
        that exists, or a race), so its cost is paid rarely.
        """
        stamp = self._stamp(final)
        problems = self.check(step)
        self._remember(step, stamp, tuple(problems))
        if not problems:
            if self.if_exists == "error":
                raise SnapshotExistsError(
                    f"snapshot {final} already exists and is valid; snapshots are never overwritten "
                    "(delete it or use if_exists='skip')"
                )
            log.info("snapshot %s already exists and is valid; keeping it (if_exists='skip')", final)
            return self._info_of(final)
        if _signature_only(problems):  # never deleted: it may be this job's own, from before its key
            aside = self.root / layout.unsigned_dirname(step)
        else:
            aside = self.root / layout.quarantine_dirname(step)
        os.rename(final, aside)
        layout.fsync_dir(self.root)
        log.warning("moved invalid snapshot %s aside to %s (%s) before rewriting it", final, aside.name, problems[0])
        return None

    def _os_error(self, e: OSError, step: int) -> SnapshotError:
        reason = e.strerror or str(e)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return SnapshotDiskFullError(
                f"disk full writing snapshot step {step} to {self.root} ({reason}); "
                "free space or lower keep= - earlier snapshots are intact"
            )
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return SnapshotDirError(
                f"cannot write snapshot step {step} to {self.root} ({reason}); "
                "make the directory writable or pass another one"
            )
        return SnapshotError(
            f"writing snapshot step {step} to {self.root} failed ({reason}: {e.filename or ''}); "
            "earlier snapshots are intact; check the filesystem"
        )

    def _get_pools(self) -> tuple[DaemonPool, DaemonPool]:
        with self._pools_lock:
            if self._pools is None:
                self._pools = (
                    DaemonPool(self._io_threads, "snapshot-file"),
                    DaemonPool(self._io_threads, "snapshot-hash"),
                )
            return self._pools

    # ------------------------------------------------------------------ read

    def _steps(self) -> list[int]:
        try:
            names = os.listdir(self.root)
        except OSError as e:
            raise SnapshotDirError(f"cannot read snapshot directory {self.root}: {e.strerror or e}") from None
        return sorted(s for s in map(layout.parse_step_dirname, names) if s is not None)

    def _read_manifest(self, path: Path, *, authenticate: bool = True) -> Manifest:
        """Raise ManifestError (one line, names MANIFEST.json) if the manifest cannot be trusted.

        With a key that includes its signature (bound to ``path.name`` and the step), unless
        ``authenticate`` is off (only for showing what a refused manifest claims)."""
        try:
            data = (path / layout.MANIFEST_NAME).read_bytes()
        except FileNotFoundError:
            raise ManifestError(
                f"{layout.MANIFEST_NAME}: missing (the write never finished; this is not a snapshot)",
                ProblemKind.UNFINISHED) from None
        except OSError as e:
            raise ManifestError(f"{layout.MANIFEST_NAME}: unreadable ({e.strerror or e})") from None
        try:
            m = Manifest.from_bytes(data)
        except ManifestError as e:
            raise ManifestError(f"{layout.MANIFEST_NAME}: {e}") from None
        dir_step = layout.parse_step_dirname(path.name)
        if dir_step is not None and m.step != dir_step:
            raise ManifestError(f"{layout.MANIFEST_NAME}: records step {m.step} but the directory is {path.name}")
        if authenticate and self._key is not None:
            why = signing.problem(self._key, path.name, m.step, m.signed_bytes, m.signature)
            if why is not None:
                raise ManifestError(f"{layout.MANIFEST_NAME}: {why}", ProblemKind.SIGNATURE)
        return m

    def _info_of(self, path: Path) -> SnapshotInfo:
        return _info(path, self._read_manifest(path))

    # the read side (:class:`.reading.SnapshotReader`) over this directory

    def _manifest(self, step: int, *, authenticate: bool = True) -> Manifest:
        return self._read_manifest(self._path(step), authenticate=authenticate)

    def _read_file(self, step: int, entry: FileEntry, *, map_location: Any, verify: bool) -> Any:
        return _read_entry(self._path(step), entry, map_location=map_location, verify=verify)

    def _quick_check(self, step: int, scan: Any = None) -> tuple[Manifest | None, list[str]]:
        path = self._path(step)
        if not path.is_dir():
            return None, [Problem(f"{path.name}: no such snapshot", ProblemKind.ABSENT)]
        try:
            m = self._read_manifest(path)
        except ManifestError as e:
            return None, [e.problem()]
        problems = []
        for entry in m.files:
            try:
                size = (path / entry.file).stat().st_size
            except FileNotFoundError:
                problems.append(f"{entry.file}: missing (listed in {layout.MANIFEST_NAME})")
                continue
            if size != entry.size:
                problems.append(f"{entry.file}: size {size} bytes, manifest says {entry.size} (truncated or overwritten)")
        return m, problems

    def _check_exists(self, step: int) -> None:
        path = self._path(step)
        if not path.is_dir():
            raise SnapshotCorruptError(f"snapshot {path} does not exist; run 'python -m checkpoints ls {self.root}'")

    def _status_skip(self, step: int, problems: tuple[str, ...]) -> bool:
        return not self._path(step).is_dir()  # pruned by a live job while we read it: gone, not invalid

    def _before_load(self, step: int) -> _Stamp | None:
        return self._stamp(self._path(step))

    def _after_load(self, step: int, token: _Stamp | None) -> None:
        self._remember(step, token, ())

    # ------------------------------------------------------------------ verdicts

    def _stamp(self, path: Path) -> _Stamp | None:
        try:
            st = os.stat(path / layout.MANIFEST_NAME)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _remember(self, step: int, stamp: _Stamp | None, problems: tuple[str, ...]) -> None:
        if stamp is not None:
            with self._verdicts_lock:
                self._verdicts[step] = (stamp, problems)

    def _trusted_problems(self, step: int) -> list[str]:
        """Problems with ``step``, fully checking it only the first time this store sees it.

        A snapshot this store wrote (hashed as it was written) or already fully checked gets the
        quick check; an earlier invalid verdict stands while its manifest is unchanged (that can
        only make pruning keep more). Anything else gets :meth:`check` and is remembered.
        """
        path = self.root / layout.step_dirname(step)
        stamp = self._stamp(path)
        with self._verdicts_lock:
            known = self._verdicts.get(step)
        if stamp is not None and known is not None and known[0] == stamp:
            return list(known[1]) or self.verify(step, full=False)
        problems = self.check(step)
        self._remember(step, stamp, tuple(problems))
        return problems

    def _forget_missing(self, steps: list[int]) -> None:
        present = set(steps)
        with self._verdicts_lock:
            for step in [s for s in self._verdicts if s not in present]:
                del self._verdicts[step]

    # ------------------------------------------------------------------ housekeeping

    def prune(self, keep: int | None = None, *, trust_own: bool = False) -> list[int]:
        """Keep the newest ``keep`` valid snapshots; remove older ones. Returns the removed steps.

        Validity is :meth:`check`'s, walking from the newest down until ``keep`` pass, so the
        newest valid snapshot (the one resume uses) is always kept and, when none is valid, no
        snapshot is removed. Invalid snapshots newer than the oldest kept one are left for a
        human to see (every start logs them); anything older goes, as do quarantined
        ``.corrupt-step-*`` dirs, except a snapshot refused only for its signature: with a key,
        none of those is ever removed (it may be the job's own from before it had its key, or
        a store with another key must not wipe the job's snapshots); a person signs
        (``python -m checkpoints sign``) or deletes it. With ``recycle`` the newest snapshot removed becomes the one
        spare (older spares go); without it, spares go too.

        ``trust_own`` is for the writer's prune after each save, where fully checking every
        kept snapshot each time would cost more than the save: snapshots this store wrote
        (hashed as the bytes were written) or already fully checked get only the quick check;
        any other is fully checked once and its verdict remembered until its manifest changes.
        What is trusted is thus only what this process itself saw to be good; the one risk left
        is a same-size change inside such a snapshot since then (bit rot, a hand edit), which
        could let an older valid one be removed. Just after a save the newest snapshot is the
        one just written, so what resume uses is still kept. Leave it off for anything this
        store did not write itself (the CLI does).
        """
        keep = self.keep if keep is None else keep
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        steps = self._steps()
        if trust_own:
            self._forget_missing(steps)
        shared = self.owns is not None
        if self.owns is not None:  # another job's snapshots are neither kept for it nor deleted
            steps = [s for s in steps if self.owns(s)]
        problems_of = self._trusted_problems if trust_own else self.check
        kept = []
        for step in reversed(steps):
            if not problems_of(step):
                kept.append(step)
                if len(kept) == keep:
                    break
        if not kept:
            if not shared:
                self.drop_spares(keep=1 if self.recycle else 0)
            return []
        doomed = [s for s in steps if s < kept[-1]]
        if self._key is not None:  # refused for the signature alone: maybe ours from before the key
            doomed = [s for s in doomed if not _signature_only(self._quick_check(s)[1])]
        # The newest pruned one holding only the store's files becomes the spare, replacing an
        # older spare: at most one.
        spare = next((s for s in reversed(doomed) if not _foreign(self.root / layout.step_dirname(s))),
                     None) if self.recycle and not shared else None
        if spare is not None:
            self._retire_to_spare(self.root / layout.step_dirname(spare), spare)
        if not shared:
            self.drop_spares(keep=1 if self.recycle else 0)
        removed = [s for s in doomed if s == spare or self._remove(self.root / layout.step_dirname(s), s)]
        for name in os.listdir(self.root) if not shared else ():
            if layout.is_quarantine_dirname(name):
                _remove_own_tree(self.root / name)
        if removed:
            layout.fsync_dir(self.root)
            kept_as = f"; step {spare}'s files kept as the spare the next save writes over" if spare is not None else ""
            log.info("pruned snapshots %s from %s (keep=%d)%s", removed, self.root, keep, kept_as)
        return removed

    def _remove(self, path: Path, step: int) -> bool:
        """Remove snapshot dir ``path``; False if nothing of the store's was in it. A dir that
        also holds a user's files keeps them: only the store's own files go, manifest first."""
        if _foreign(path):
            return _remove_own_files(path)
        # Rename first (atomic), then delete: a crash mid-delete leaves a temp dir that
        # cleanup removes, never a half-deleted dir that still looks like a snapshot.
        doomed = self.root / layout.temp_dirname(step)
        os.rename(path, doomed)
        _remove_tree(doomed)
        return True

    def _retire_to_spare(self, path: Path, step: int) -> None:
        # The rename alone unmakes the snapshot: a spare's name never parses as a step.
        os.rename(path, self.root / layout.spare_dirname(step))

    def set_aside_unsigned(self) -> list[Path]:
        """``.unsigned-step-*`` dirs: snapshots refused for their signature alone and moved aside
        when their step was written again. Nothing here deletes them; a person does."""
        return sorted(self.root / n for n in os.listdir(self.root) if layout.parse_unsigned_dirname(n) is not None)

    def sign_unsigned(self, step: int) -> bool:
        """Sign snapshot ``step``'s manifest with this store's key, after fully checking its files
        against that very manifest (sha256 and the resume loader). False if already signed
        with this key. A person's decision to trust it (``python -m checkpoints sign``):
        the store never does this on its own. A snapshot that is invalid, or signed with
        another key, raises SnapshotCorruptError and is left as it is."""
        key = self._key
        if key is None:
            raise SnapshotKeyError(
                f"no job key to sign with; set {signing.KEY_FILE_ENV} or pass --key-file"
            )
        path = self.root / layout.step_dirname(step)
        if not path.is_dir():
            raise SnapshotCorruptError(f"snapshot {path} does not exist; run 'python -m checkpoints ls {self.root}'")
        try:
            m = self._read_manifest(path, authenticate=False)
        except ManifestError as e:
            raise SnapshotCorruptError(f"snapshot {path}: {e}") from None
        if m.signature is not None:
            why = signing.problem(key, path.name, m.step, m.signed_bytes, m.signature)
            if why is None:
                return False
            raise SnapshotCorruptError(
                f"snapshot {path}: {layout.MANIFEST_NAME}: {why} (signed with another key, or forged); not re-signed"
            )
        for entry in m.files:
            try:
                _read_entry(path, entry, map_location="cpu", verify=True)
            except FileProblem as e:
                raise SnapshotCorruptError(f"snapshot {path}: {e}; not signed") from None
        data = m.to_bytes(lambda body: signing.sign(key, path.name, m.step, body))
        tmp = path / f".{layout.MANIFEST_NAME}.signing-{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_durably(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, path / layout.MANIFEST_NAME)  # atomic: the old manifest or the signed one
        layout.fsync_dir(path)
        log.info("signed snapshot %s with the job key", path)
        return True

    def spares(self) -> list[Path]:
        """Spare dirs (pruned snapshots kept for the next save to write over), oldest first."""
        found = []
        for name in os.listdir(self.root):
            step = layout.parse_spare_dirname(name)
            if step is not None:
                found.append((step, name))
        return [self.root / name for _, name in sorted(found)]

    def drop_spares(self, keep: int = 0) -> list[Path]:
        """Delete all but the newest ``keep`` spares, freeing their space; returns those deleted."""
        found = self.spares()
        doomed = found[: max(0, len(found) - keep)]
        for path in doomed:
            _remove_tree(path)
        return [path for path in doomed if not os.path.lexists(path)]

    def temp_dirs(self) -> list[TempDirStatus]:
        newest = max(self._steps(), default=-1)
        me, host, now = os.getpid(), layout.host_tag(), time.time()
        out = []
        for name in sorted(os.listdir(self.root)):
            t = layout.parse_temp_dirname(name)
            if t is None:
                continue
            path = self.root / name
            try:
                age = now - path.stat().st_mtime
            except FileNotFoundError:
                continue
            same_host = t.host == host
            with _ACTIVE_LOCK:
                ours_active = name in _ACTIVE_TEMPS
            owner_gone = same_host and (
                not layout.pid_alive(t.pid) or (t.pid == me and not ours_active)
            )
            superseded = t.step < newest and age > self.stale_temp_grace_s and not ours_active
            out.append(TempDirStatus(path, t.step, t.pid, same_host, owner_gone or superseded))
        return out

    def clean_stale_temps(self) -> list[Path]:
        """Remove temp dirs left by crashed writers, never one a live writer is filling."""
        removed = []
        for t in self.temp_dirs():
            if t.stale:
                _remove_tree(t.path)
                if not os.path.lexists(t.path):  # say only what is gone
                    removed.append(t.path)
        if removed:
            log.info("removed %d stale temp dir(s) left by crashed writers in %s", len(removed), self.root)
        return removed


def _foreign(path: Path) -> list[str]:
    """Entries of a step (or quarantined) dir the store did not write: a user's files, a
    sub-directory, a link in a file's place. [] for a link in the dir's own place (it goes
    itself, :func:`_remove_tree`) or a dir gone meanwhile."""
    if path.is_symlink():
        return []
    try:
        entries = list(os.scandir(path))
    except OSError:
        return []
    return sorted(e.name for e in entries if not (layout.is_store_file(e.name) and e.is_file(follow_symlinks=False)))


def _remove_own_files(path: Path) -> bool:
    """Delete the store's own files of ``path``, manifest first, and leave the rest (said once,
    when something of the store's went); False if there was nothing of the store's."""
    own = sorted((e.name for e in os.scandir(path) if layout.is_store_file(e.name) and e.is_file(follow_symlinks=False)),
                 key=lambda name: name != layout.MANIFEST_NAME)  # the manifest first: then no snapshot
    for name in own:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path / name)
    if own:
        layout.fsync_dir(path)
        foreign = _foreign(path)
        log.warning("pruned %s but left %d file(s) there that this store did not write (e.g. %r); they are "
                    "yours to keep or delete", path, len(foreign), foreign[0] if foreign else "")
    return bool(own)


def _remove_own_tree(path: Path) -> None:
    """A quarantined dir: whole if it holds only the store's files, else only those."""
    if _foreign(path):
        _remove_own_files(path)
    else:
        _remove_tree(path)


def _remove_tree(path: Path) -> None:
    """Delete a directory of the store's; a symbolic link in its place (a user's step dir
    linked in) goes itself, and what it points to is never touched."""
    if path.is_symlink():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)
